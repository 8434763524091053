"""Write student copies of the notebooks: solution cells emptied, every output cleared.

    python tools/student_copies.py notebooks student      (or: make student)

Teachers hand out the copies; the originals, with solutions that run under the tests,
stay the reference.
"""

import json
import sys
from pathlib import Path

PLACEHOLDER = "# Your solution here. (The course notebook has one that runs.)\n"


def student_copy(notebook: dict) -> dict:
    cells = []
    for cell in notebook["cells"]:
        cell = dict(cell)
        if cell["cell_type"] == "code":
            if "solution" in cell.get("metadata", {}).get("tags", []):
                cell["source"] = [PLACEHOLDER]
                cell["metadata"] = {k: v for k, v in cell["metadata"].items() if k != "jupyter"}
            cell["outputs"], cell["execution_count"] = [], None
        cells.append(cell)
    return {**notebook, "cells": cells}


def main(source: str, target: str) -> int:
    out = Path(target)
    out.mkdir(parents=True, exist_ok=True)
    paths = sorted(Path(source).glob("*.ipynb"))
    if not paths:
        sys.exit(f"no notebooks in {source!r}")
    for path in paths:
        copy = student_copy(json.loads(path.read_text()))
        (out / path.name).write_text(json.dumps(copy, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(paths)} student notebooks to {out}/")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python tools/student_copies.py NOTEBOOK_DIR OUTPUT_DIR")
    sys.exit(main(sys.argv[1], sys.argv[2]))
