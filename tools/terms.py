"""Terms before their meaning: each term of TERMS, where the course first uses it, is defined there
(written in italics, the course's mark of a definition: "*NCCL* is NVIDIA's library ...") or points
to where it is (a "notebook NN" or "section N" in the same sentence).

    python tools/terms.py      list the first uses that do neither (exit 1 if any)

Read in course order, as a student meets them: the prose of the markdown cells and what the code
cells printed (their stored outputs: a timing line's "spread" is met there). A term first met in a
printed output counts as defined when the markdown cell just above or just below that code cell
defines it or points to it. Each notebook's first cell may name terms before their meaning (its
objectives name what the notebook goes on to define), and a definition there counts.

Class covers the core paths only: the sections before a notebook's first deep dive or its
exercises. A term defined only in a deep dive (homework) is checked again where a later core path
first uses it, which must then define it or point to it.

tests/test_teaching.py runs it on the course's notebooks.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
# The course's words that a newcomer may not know, in the form the prose uses.
TERMS = (
    "NCCL", "intra-op threads", "ranks", "all-reduce", "reduce-scatter", "all-gather", "latency",
    "micro-batches", "bubble", "1F1B", "GPipe", "replica context", "tf_cnn_benchmarks", "PipeDream",
    "Megatron-LM", "ZeRO", "P_os", "Psi", "oneDNN", "Eigen", "weak scaling", "strong scaling", "DTensor",
    "spread", "core devices", "logical devices", "soft placement", "naive split", "tower", "controller",
    "data parallelism", "tensorpack", "collectives", "replica", "broadcast", "PipeDream-Flush", "ZB-H1",
    "scaling efficiency", "bus bandwidth", "alpha", "packing", "parameter server", "Horovod",
    "mixed precision", "tensor cores", "chief", "sharding", "optimizer state", "tensor parallelism",
    "mesh", "verdict", "hand-off", "recomputation", "XLA", "wave", "chunks", "bubble rate", "fusion", "buckets",
    "NVLink", "PCIe", "InfiniBand", "global batch", "synchronized batch norm", "executor", "loss scaling",
    "two-level",
)  # fmt: skip
# Where a term's bare word also has its everyday meaning, the pattern that finds only the term.
PATTERNS = {
    "spread": r"(?<![\w-])spreads?(?! over)(?![\w-])",  # "the spread of the timings", not "spread over 2 GPUs"
    "core devices": r"(?<![\w-])[Cc]ore devices?(?![\w-])",
    "logical devices": r"(?<![\w-])[Ll]ogical (?:devices?|CPUs?|GPUs?)(?![\w-])",
    "tower": r"(?<![\w-])[Tt]owers?(?![\w-])",
    "replica": r"(?<![\w-])[Rr]eplicas?(?![\w:-])(?! \d)",  # not the part of a device name, "replica 0"
    "collectives": r"(?<![\w-])[Cc]ollectives?(?![\w-])(?! ?(?:all-reduce|ops?\b|keys?\b))",
    "packing": r"(?<![\w-])(?:gradient )?packing(?![\w-])",
    "mesh": r"(?<![\w-])[Mm]esh(?:es)?(?![\w-])",
    "verdict": r"(?<![\w-])[Vv]erdicts?(?![\w-])",
    "alpha": r"(?<![\w-])alpha(?![\w-])",
    "hand-off": r"(?<![\w-])[Hh]and-offs?(?![\w-])",
    "chief": r"(?<![\w-])chief(?![\w-])",
}
POINTER = re.compile(r"\bnotebook \d\d\b|\bsection \d+\b|\(notebook|\(section|\]\(\d\d_\w+\.ipynb\)", re.IGNORECASE)
CORE_ENDS = re.compile(r"^## (?:.*\(deep dive\)|Exercises)\s*$", re.MULTILINE)


class Cell(NamedTuple):
    notebook: str
    index: int
    kind: str  # "head" (the notebook's first cell), "markdown" or "output" (what a code cell printed)
    text: str
    core: bool  # before the notebook's first deep dive and its exercises


def course_cells(folder: Path = ROOT / "notebooks"):
    """Every cell a student reads, in course order: markdown as written, code cells as what they printed."""
    for path in sorted(folder.glob("*.ipynb")):
        core = True
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            text = "".join(cell.get("source", []))
            if cell.get("cell_type") == "markdown":
                end = CORE_ENDS.search(text) if core else None
                if end:  # the core path ends at this heading: the prose above it is still read in class
                    yield Cell(path.stem, i, "head" if i == 0 else "markdown", text[: end.start()], True)
                    text, core = text[end.start() :], False
                yield Cell(path.stem, i, "head" if i == 0 else "markdown", text, core)
            elif cell.get("cell_type") == "code":
                printed = "".join(
                    "".join(o.get("text", "")) for o in cell.get("outputs", []) if o.get("name") == "stdout"
                )
                yield Cell(path.stem, i, "output", printed, core)


def markdown_cells(folder: Path = ROOT / "notebooks"):
    """(notebook name, markdown text) of every markdown cell but each notebook's first, in course order."""
    return ((c.notebook, c.text) for c in course_cells(folder) if c.kind == "markdown")


# Where a sentence ends: a full stop, a blank line, or the start of a list item (items are sentences of their own).
SENTENCE_END = re.compile(r"\. |\n\n|\n\s*(?:[-*]|\d+\.) ")


def sentence_around(text: str, start: int, end: int) -> str:
    """The sentence of `text` that holds text[start:end]."""
    left = max((m.end() for m in SENTENCE_END.finditer(text, 0, start)), default=0)
    right = next((m.start() for m in SENTENCE_END.finditer(text, end)), len(text))
    return text[left:right]


CODE_SPAN = re.compile(r"`[^`\n]*`")


def find(term: str, text: str) -> re.Match | None:
    """The first use of `term` in the prose of `text`, outside `code` (a name such as `/job:x/replica:0` is
    no use of the word); a sentence may capitalize it (NCCL and ZeRO keep their case)."""
    prose = CODE_SPAN.sub(lambda m: " " * len(m.group()), text)  # the same positions, without the code
    if term in PATTERNS:
        return re.search(PATTERNS[term], prose)
    first = f"(?i:{re.escape(term[0])})"
    return re.search(rf"(?<![\w-]){first}{re.escape(term[1:])}(?![\w-])", prose)


def defines(term: str, text: str) -> bool:
    """Whether the sentence of `text` that first uses `term` defines it (in italics) or points to it. A
    section's heading may name the term that its section defines: then the rest of the cell must."""
    match = find(term, text)
    if not match:
        return False
    line_start = text.rfind("\n", 0, match.start()) + 1
    if text.startswith("#", line_start):
        rest = text[text.find("\n", match.end()) + 1 :] if "\n" in text[match.end() :] else ""
        return defines(term, rest)
    sentence = sentence_around(text, match.start(), match.end())
    italic = re.search(rf"\*{PATTERNS.get(term, re.escape(term))}\*", sentence, re.IGNORECASE)
    return bool(italic or POINTER.search(sentence))


def _around(cells: list[Cell], pos: int) -> list[Cell]:
    """The markdown cells just above and just below cells[pos], in the same notebook."""
    found = []
    for step in (-1, 1):
        i = pos + step
        while 0 <= i < len(cells) and cells[i].notebook == cells[pos].notebook and cells[i].kind == "output":
            i += step
        if 0 <= i < len(cells) and cells[i].notebook == cells[pos].notebook:
            found.append(cells[i])
    return found


def _problem(cell: Cell, term: str, known_elsewhere: bool) -> str:
    match = find(term, cell.text)
    where = "printed" if cell.kind == "output" else "prose"
    said = " ".join(sentence_around(cell.text, match.start(), match.end()).split())[:140]
    note = " (defined before only in a deep dive, not read in class)" if known_elsewhere else ""
    return f"{cell.notebook}: {term}: cell {cell.index} ({where}){note}: {said}"


def undefined_first_uses(folder: Path = ROOT / "notebooks") -> list[str]:
    """'notebook: term: cell N (...): sentence' for each first use that is neither a definition nor a pointer:
    the first use in the course, and the first use on a core path where only a deep dive defined it."""
    cells = list(course_cells(folder))
    known = {"core": set(), "any": set()}
    problems = []
    for pos, cell in enumerate(cells):
        for term in TERMS:
            if term in known["core" if cell.core else "any"] or not find(term, cell.text):
                continue
            if cell.kind == "output":
                ok = any(defines(term, c.text) for c in _around(cells, pos))
            else:
                ok = defines(term, cell.text)
            if cell.kind == "head" and not ok:
                continue  # the objectives may name it: the notebook goes on to define it
            if not ok:
                problems.append(_problem(cell, term, term in known["any"]))
            known["any"].add(term)
            if cell.core:
                known["core"].add(term)
    return problems


def main() -> int:
    problems = undefined_first_uses()
    for line in problems:
        print(line)
    print(f"{len(problems)} term(s) used before their meaning, of {len(TERMS)} checked")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
