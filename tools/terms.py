"""Terms before their meaning: each term of TERMS, where the course first uses it, is defined there
(written in italics, the course's mark of a definition: "*NCCL* is NVIDIA's library ...") or points
to where it is (a "notebook NN" or "section N" in the same sentence).

    python tools/terms.py      list the first uses that do neither (exit 1 if any)

tests/test_teaching.py runs it on the course's notebooks.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The course's words that a newcomer may not know, in the form the prose uses.
TERMS = (
    "NCCL", "intra-op threads", "ranks", "all-reduce", "reduce-scatter", "all-gather", "latency",
    "micro-batches", "bubble", "1F1B", "GPipe", "replica context", "tf_cnn_benchmarks", "PipeDream",
    "Megatron-LM", "ZeRO", "P_os", "Psi", "oneDNN", "Eigen", "weak scaling", "strong scaling", "DTensor",
)  # fmt: skip
POINTER = re.compile(r"\bnotebook \d\d\b|\bsection \d+\b|\(notebook|\(section|\]\(\d\d_\w+\.ipynb\)", re.IGNORECASE)


def markdown_cells(folder: Path = ROOT / "notebooks"):
    """(notebook name, markdown text) of every markdown cell but each notebook's first, in course order:
    the first cell's objectives name what the notebook goes on to define."""
    for path in sorted(folder.glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"][1:]:
            if cell.get("cell_type") == "markdown":
                yield path.stem, "".join(cell.get("source", []))


def sentence_around(text: str, start: int, end: int) -> str:
    """The sentence of `text` that holds text[start:end]."""
    left = max(text.rfind(". ", 0, start), text.rfind("\n\n", 0, start))
    right = min((i for i in (text.find(". ", end), text.find("\n\n", end)) if i != -1), default=len(text))
    return text[left + 1 : right]


def undefined_first_uses(folder: Path = ROOT / "notebooks") -> list[str]:
    """'notebook: term: sentence' for each term whose first use is neither a definition nor a pointer."""
    found, problems = set(), []
    for name, text in markdown_cells(folder):
        for term in TERMS:
            if term in found:
                continue
            first = f"(?i:{re.escape(term[0])})"  # a sentence may capitalize it; NCCL and ZeRO keep their case
            match = re.search(rf"(?<![\w-]){first}{re.escape(term[1:])}(?![\w-])", text)
            if not match:
                continue
            found.add(term)
            sentence = sentence_around(text, match.start(), match.end())
            italic = re.search(rf"\*{re.escape(term)}\*", sentence, re.IGNORECASE)
            if not italic and not POINTER.search(sentence):
                problems.append(f"{name}: {term}: {' '.join(sentence.split())[:160]}")
    return problems


def main() -> int:
    problems = undefined_first_uses()
    for line in problems:
        print(line)
    print(f"{len(problems)} term(s) used before their meaning")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
