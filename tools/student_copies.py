"""Write the students' hand-out: the course with every exercise solution emptied and every output cleared.

    python tools/student_copies.py notebooks student      (or: make student)

writes student/ and student.zip with the same content: the package, the set-up files and
the README, and student/notebooks/ with the student copies. Students unpack it and run
`make lab`; a teacher serves student/notebooks on a shared server with `make student-lab`.
Each solution cell becomes a numbered placeholder ("# Exercise 2: your solution here"),
matched to the notebook's numbered list under "## Exercises". Left out: the tests (they
run the solutions), tools/, and teacher/ (the questionnaire answers).
"""

import argparse
import json
import re
import shutil
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What students need besides the notebooks to run `make lab` on their own machine.
COURSE_FILES = ["README.md", "LICENSE", "Makefile", "pyproject.toml", "environment.yml", "tutorial_lib"]
MARKER = ".student-copy"  # marks a folder this tool wrote, so a rerun may replace it
PLACEHOLDER = "# Exercise {number}: your solution here\n"


class HandoutError(ValueError):
    """A notebook or folder the hand-out cannot be made from, with what to change."""


def exercise_count(notebook: dict) -> int:
    """The number of items in the numbered list under the notebook's '## Exercises' heading."""
    for cell in notebook["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and "## Exercises" in text:
            section = re.split(r"^## ", text.split("## Exercises", 1)[1], flags=re.MULTILINE)[0]
            return len(re.findall(r"^\d+\. ", section, flags=re.MULTILINE))
    return 0


def _is_solution(cell: dict) -> bool:
    return cell["cell_type"] == "code" and "solution" in cell.get("metadata", {}).get("tags", [])


def student_copy(notebook: dict, name: str = "notebook") -> dict:
    """The notebook with solution cells replaced by numbered placeholders and all outputs cleared."""
    solutions = sum(_is_solution(c) for c in notebook["cells"])
    exercises = exercise_count(notebook)
    if solutions != exercises:
        raise HandoutError(
            f"{name}: {solutions} cells tagged 'solution' but {exercises} numbered exercises under "
            "'## Exercises'; give each exercise exactly one solution cell, in order, so placeholders "
            "can be numbered by exercise"
        )
    cells, number = [], 0
    for cell in notebook["cells"]:
        cell = dict(cell)
        if _is_solution(cell):
            number += 1
            cell["source"] = [PLACEHOLDER.format(number=number)]
            # The course notebook hides its solutions' source; an empty placeholder must show.
            cell["metadata"] = {k: v for k, v in cell["metadata"].items() if k != "jupyter"}
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
        cells.append(cell)
    return {**notebook, "cells": cells}


def _prepare(target: Path) -> None:
    """Empty `target` if this tool wrote it; refuse any other existing folder."""
    if target.exists():
        if not (target / MARKER).exists():
            raise HandoutError(f"{target} exists and was not written by this tool; choose another folder")
        shutil.rmtree(target)
    (target / "notebooks").mkdir(parents=True)
    (target / MARKER).write_text("written by tools/student_copies.py; replaced on every run\n")


def _copy_course(target: Path) -> None:
    for name in COURSE_FILES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, target / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(source, target / name)


def _archive(folder: Path, archive: Path) -> None:
    """Zip `folder` so that it unpacks into a folder of the same name."""
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and path.name != MARKER:
                zf.write(path, Path(folder.name) / path.relative_to(folder))


def write_handout(source: Path, target: Path, archive: Path) -> list[Path]:
    """Write the hand-out folder and its archive; return the student notebooks written."""
    paths = sorted(source.glob("*.ipynb"))
    if not paths:
        raise HandoutError(f"no notebooks in {str(source)!r}")
    copies = {p.name: student_copy(json.loads(p.read_text()), p.name) for p in paths}  # all checked first
    _prepare(target)
    _copy_course(target)
    written = []
    for name, copy in copies.items():
        out = target / "notebooks" / name
        out.write_text(json.dumps(copy, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
        written.append(out)
    _archive(target, archive)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="folder of the course notebooks (notebooks)")
    parser.add_argument("target", type=Path, help="folder to write the hand-out to (student)")
    parser.add_argument("--archive", type=Path, help="zip file to write (default: TARGET.zip)")
    args = parser.parse_args(argv)
    archive = args.archive or args.target.with_suffix(".zip")
    try:
        written = write_handout(args.source, args.target, archive)
    except HandoutError as err:
        sys.exit(f"student_copies: {err}")
    print(f"wrote {len(written)} student notebooks to {args.target}/notebooks/ and the hand-out {archive}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
