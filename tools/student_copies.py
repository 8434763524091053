"""Write the students' hand-out: the course with every exercise solution emptied and every output cleared.

    python tools/student_copies.py notebooks student      (or: make student)

writes student/ and student.zip with the same content: the package, the examples, the set-up
files (course.mk as the Makefile: lab, kernel, bench, gpu-check, clean; it installs the lab extra
only), a README written for students (which the site also shows), and student/notebooks/ with the
student copies. Students unpack it and run `make lab`; a teacher serves student/notebooks on a
shared server with `make student-lab`.
Each solution cell (of any type) becomes a numbered placeholder ("# Exercise 2: your solution
here"), after the check that the site shares (tools/notebook_format.py): every `### Exercise k`
has exactly one solution cell under it, and no solution text or output survives in the copy.
A notebook that breaks it is refused, named with its cell, before anything is written; the
folder is written beside the target and then moved into place. Left out: the tests (they
run the solutions), tools/, teacher/ (the questionnaire answers) and the teacher's README.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from notebook_format import NotebookError, check_exercises, check_no_leaks, read_notebook, tags  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# What students need besides the notebooks to run `make lab` on their own machine.
COURSE_FILES = ["LICENSE", "pyproject.toml", "environment.yml", "tutorial_lib", "examples"]
COURSE_FILES += ["tools/lab_overrides.json"]  # make install puts it where JupyterLab reads its defaults
RENAMED = {"course.mk": "Makefile"}  # the set-up part of the teacher's Makefile, without its teacher targets
HANDOUT = "/content/student"  # where the Colab cell unpacks the hand-out
# The README's Colab cell, also in the teacher's README (tested): the unpacked hand-out on this
# kernel's sys.path and, through PYTHONPATH, on that of the Pythons it starts (notebooks 00, 05, 07).
COLAB_CELL = f"""\
import importlib.util
import os
import sys

if importlib.util.find_spec("tutorial_lib") is None:  # Colab already has TensorFlow and the rest
    !unzip -q -o /content/student.zip -d /content
    sys.path.insert(0, "{HANDOUT}")  # this notebook's Python
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, ["{HANDOUT}", os.environ.get("PYTHONPATH")]))
"""
README = """\
# Multi-device training with TensorFlow: the students' copy of the course

Each notebook answers one question that someone asked about training on several devices,
by measuring it on the machine it runs on. Work through them in order, `00` to the last.
The hand-out (`student.zip`) holds the notebooks, with an empty cell for each exercise's
solution and no outputs, the package they import, and the files that set them up.

## The notebooks

{course_table}

## Start

Unpack the hand-out (`student.zip`) and open a terminal in its folder, `student/`. You need
Python 3.10 to 3.13 (TensorFlow has no stable wheels for newer ones yet); no GPU.

- **With make** (Linux, macOS, WSL): `make lab`. The first run says what it sets up, installs
  the course into `.venv` (a few minutes, mostly TensorFlow), then opens JupyterLab in the
  `notebooks/` folder: open `00_devices.ipynb` there. `make clean` removes `.venv`.
- **With pip only**: in a virtual environment of your own,

  ```bash
  python3 -m venv .venv
  source .venv/bin/activate        # Windows: .venv\\Scripts\\activate
  pip install -e ".[lab]"
  jupyter labextension disable "@jupyterlab/apputils-extension:announcements"
  jupyter lab notebooks/
  ```

  The fourth line, once, keeps JupyterLab in this environment from asking whether it should
  fetch Jupyter's news. JupyterLab opens in `notebooks/`: start with `00_devices.ipynb`.
- **With conda**: `conda env create -f environment.yml`, `conda activate tf-multi-device`,
  the `jupyter labextension disable` line above once, then `jupyter lab notebooks/`.
- **On a shared JupyterHub or JupyterLab**: see *Shared servers* below.
- **On Colab**: see *Colab* below.

## What is where

- `notebooks/`: the course. Every notebook says at the top which sections are the core path
  and which are deep dives (for later), and how long each takes.
- `tutorial_lib/`: the plumbing the notebooks import (devices, timing, plots), and tested
  copies of the code the notebooks teach.
- `examples/`: the answers to take away, one file each, to copy into your own project.
- `make bench` runs the course's benchmark on your machine; `make gpu-check`, on a machine
  with GPUs, checks the take-away files on them and prints a report.

## Exercises

Each exercise sits under a heading `### Exercise k · title`, with an empty cell
`# Exercise k: your solution here` under it. Write your solution there and run it; where the
exercise says what to check, check it with an `assert`.

## Shared servers

- **A JupyterHub or shared JupyterLab** that runs from another environment: in a terminal on
  it, in this folder, run `make kernel` once. It sets up `.venv` as on your own machine and
  registers it as the kernel "Python (tf-multi-device course)"; choose that kernel in the
  notebook's *Kernel, Change Kernel* menu.
- **Timing cells in turns.** The cells that time something use the machine's CPU cores as
  devices. On a shared server without a set of cores for each student, everyone's devices
  land on the same cores and the times mean little: run those cells in turns, or on your own
  machine.

## Colab

Colab has TensorFlow. Upload `student.zip` with Colab's file browser (into `/content`), open a
notebook of the hand-out, and put this cell first, above `devices.simulate(...)`:

```python
{colab_cell}```

It unpacks the hand-out into `{handout}` and lets this notebook, and the Python processes it
starts, import `tutorial_lib` from it. Leave `TUTORIAL_DEVICE` unset there.

## Help

Ask your teacher. When a cell fails, read the message first: the course's errors say what is
wrong and how to fix it. Restarting the kernel (Kernel, Restart) and running from the top
fixes most state problems.
"""
MARKER = ".student-copy"  # marks a folder this tool wrote, so a rerun may replace it
PLACEHOLDER = "# Exercise {number}: your solution here\n"


class HandoutError(ValueError):
    """A notebook or folder the hand-out cannot be made from, with what to change."""


def _placeholder(cell: dict, number: int) -> dict:
    """An empty code cell for exercise `number`, shown (the course hides its solutions), with the
    solution cell's id where it has one (nbformat 4.5 wants one on every cell)."""
    metadata = {k: v for k, v in (cell.get("metadata") or {}).items() if k not in ("jupyter", "tags")}
    metadata["tags"] = [t for t in tags(cell) if t != "solution"]
    kept = {"id": cell["id"]} if "id" in cell else {}
    return {"cell_type": "code", **kept, "metadata": metadata, "source": [PLACEHOLDER.format(number=number)]}


def student_copy(notebook: dict, name: str = "notebook") -> dict:
    """The notebook with solution cells replaced by numbered placeholders and all outputs cleared."""
    try:
        check_exercises(notebook, name)
    except NotebookError as err:
        raise HandoutError(str(err)) from None
    cells, number = [], 0
    for cell in notebook["cells"]:
        cell = dict(cell)
        if "solution" in tags(cell):
            number += 1
            cell = _placeholder(cell, number)
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
        cells.append(cell)
    copy = {**notebook, "cells": cells}
    try:
        check_no_leaks(notebook, copy, name)
    except NotebookError as err:
        raise HandoutError(str(err)) from None
    return copy


def _refuse_foreign(target: Path) -> None:
    """Refuse an existing `target` this tool did not write."""
    if target.exists() and not (target / MARKER).exists():
        raise HandoutError(f"{target} exists and was not written by this tool; choose another folder")


def course_table() -> str:
    """The teacher's README's table of the notebooks and their questions."""
    section = (ROOT / "README.md").read_text().split("\n## The course\n", 1)[1].split("\n## ", 1)[0]
    return "\n".join(line for line in section.strip().split("\n\n")[0].splitlines() if line.startswith("|"))


def student_readme() -> str:
    """The hand-out's README, which the site also shows as its front page."""
    return README.format(course_table=course_table(), colab_cell=COLAB_CELL, handout=HANDOUT)


def _copy_course(target: Path) -> None:
    (target / "notebooks").mkdir(parents=True)
    (target / MARKER).write_text("written by tools/student_copies.py; replaced on every run\n")
    (target / "README.md").write_text(student_readme())
    for source, name in RENAMED.items():
        shutil.copy2(ROOT / source, target / name)
    for name in COURSE_FILES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, target / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            (target / name).parent.mkdir(parents=True, exist_ok=True)
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
    try:
        copies = {p.name: student_copy(read_notebook(p), p.name) for p in paths}  # all checked first
    except NotebookError as err:
        raise HandoutError(str(err)) from None
    _refuse_foreign(target)
    if archive.is_dir():
        raise HandoutError(f"--archive {archive} is a folder; give the zip file's path, e.g. {archive / 'student.zip'}")
    target.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.")) / target.name
    try:
        _copy_course(building)
        for name, copy in copies.items():
            text = json.dumps(copy, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
            (building / "notebooks" / name).write_text(text)
        _archive(building, building.parent / archive.name)
        if target.exists():
            shutil.rmtree(target)
        os.replace(building, target)
        shutil.move(building.parent / archive.name, archive)  # archive may be on another disk
    finally:
        shutil.rmtree(building.parent, ignore_errors=True)
    return [target / "notebooks" / name for name in copies]


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
