"""How long each notebook's core path takes a first-time student: reading plus running, measured.

    jupyter nbconvert --to notebook --execute --output-dir OUT notebooks/*.ipynb   (keeps cell timings)
    python tools/core_path_times.py OUT          one line per notebook, then the sessions of the plan

A student reads the prose and the printed outputs (READ_WORDS_PER_MINUTE), reads the code before
running it (CODE_LINES_PER_MINUTE), runs each code cell (CELL_SECONDS to get to it and start it, then
its run time, from the execution timestamps nbconvert records in the executed copy) and looks at each
figure (FIGURE_SECONDS). The core path ends at the notebook's first deep dive or its exercises
(tools/teaching_plan.py's rule); the deep dives run from there to the exercises. Rates are stated, run
times measured: say on which machine, and how busy it was, when quoting them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import teaching_plan  # noqa: E402

READ_WORDS_PER_MINUTE = teaching_plan.WORDS_PER_MINUTE  # prose and outputs, as the Teaching plan reads them
CODE_LINES_PER_MINUTE = 20  # code read closely enough to edit it: 3 seconds a line
FIGURE_SECONDS = 30  # one look at a plot or a timeline
CELL_SECONDS = 5  # to reach a code cell, start it and see that it finished
CORE_ENDS = re.compile(r"^## (?:.*\(deep dive\)|Exercises)\s*$", re.MULTILINE)
DEEP_ENDS = re.compile(r"^## Exercises\s*$", re.MULTILINE)


def _seconds(cell: dict) -> float:
    """The cell's run time, from the timestamps nbconvert records (0 where there are none)."""
    stamps = cell.get("metadata", {}).get("execution", {})
    start, end = stamps.get("iopub.execute_input"), stamps.get("shell.execute_reply")
    if not (start and end):
        return 0.0
    parse = datetime.datetime.fromisoformat
    return (parse(end.replace("Z", "+00:00")) - parse(start.replace("Z", "+00:00"))).total_seconds()


def _cells_until(cells: list[dict], end: re.Pattern) -> tuple[list[dict], list[dict]]:
    """(the cells before the first markdown heading that `end` finds, the cells from it on); a cell that
    holds the heading is cut there."""
    for i, cell in enumerate(cells):
        text = "".join(cell.get("source", []))
        found = end.search(text) if cell["cell_type"] == "markdown" else None
        if found:
            before, after = {**cell, "source": [text[: found.start()]]}, {**cell, "source": [text[found.start() :]]}
            return cells[:i] + [before], [after] + cells[i + 1 :]
    return cells, []


def core_cells(cells: list[dict]) -> list[dict]:
    """The cells of the core path: up to the first deep dive or the exercises."""
    return _cells_until(cells, CORE_ENDS)[0]


def deep_dive_cells(cells: list[dict]) -> list[dict]:
    """The cells of the deep dives: from the first one up to the exercises (none where there are none)."""
    rest = _cells_until(cells, CORE_ENDS)[1]
    return _cells_until(rest, DEEP_ENDS)[0] if rest and not DEEP_ENDS.match("".join(rest[0]["source"])) else []


def measure(cells: list[dict]) -> dict:
    """Words of prose, lines of code, words printed, figures and run seconds of `cells`, and the minutes
    each part takes a first-time student."""
    figures = seconds = prose = code = printed = code_cells = 0
    for cell in cells:
        text = "".join(cell.get("source", []))
        if cell["cell_type"] == "markdown":
            prose += len(text.split())
            continue
        code_cells += 1
        code += sum(1 for line in text.splitlines() if line.strip() and not line.strip().startswith("#"))
        seconds += _seconds(cell)
        for out in cell.get("outputs", []):
            printed += len("".join(out.get("text", "")).split())
            figures += "image/png" in out.get("data", {})
    minutes = {
        "reading prose": prose / READ_WORDS_PER_MINUTE,
        "reading code": code / CODE_LINES_PER_MINUTE,
        "reading outputs": printed / READ_WORDS_PER_MINUTE,
        "figures": figures * FIGURE_SECONDS / 60,
        "starting cells": code_cells * CELL_SECONDS / 60,
        "running": seconds / 60,
    }
    return {"words": prose, "code lines": code, "printed words": printed, "figures": figures, "minutes": minutes}


def reading_minutes(cells: list[dict]) -> float:
    """Everything but the run time: what a stored copy of the notebook says without running it."""
    return sum(v for k, v in measure(cells)["minutes"].items() if k != "running")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("executed", type=Path, help="a folder of notebooks executed with their cell timings")
    args = parser.parse_args(argv)
    print(f"rates: prose and outputs {READ_WORDS_PER_MINUTE} words/min, code {CODE_LINES_PER_MINUTE} lines/min,")
    print(f"       {CELL_SECONDS} s to start a cell, {FIGURE_SECONDS} s a figure; run times from {args.executed}\n")
    print(f"{'notebook':22s} {'words':>6s} {'code':>5s} {'out':>5s} {'figs':>4s} {'read':>5s} {'run':>5s} "
          f"{'core':>5s} {'stated':>6s} {'deep':>5s} {'stated':>6s}")  # fmt: skip
    taken = {}
    for path in sorted(args.executed.glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        core, deep = measure(core_cells(cells)), measure(deep_dive_cells(cells))
        stated = teaching_plan.notebook_times(path)
        read, run = reading_minutes(core_cells(cells)), core["minutes"]["running"]
        taken[path.stem] = read + run
        print(f"{path.stem:22s} {core['words']:6d} {core['code lines']:5d} {core['printed words']:5d} "
              f"{core['figures']:4d} {read:5.1f} {run:5.1f} {read + run:5.1f} {stated['core']:6d} "
              f"{sum(deep['minutes'].values()):5.1f} {stated['deep']:6d}")  # fmt: skip
    times = [teaching_plan.notebook_times(p) for p in sorted((teaching_plan.ROOT / "notebooks").glob("*.ipynb"))]
    print(f"\nsessions of the plan ({teaching_plan.SESSION_MINUTES} min each): stated core, measured core, margin")
    for number, session in enumerate(teaching_plan.sessions(times), start=1):
        measured = sum(taken.get(t["name"], float("nan")) for t in session)
        names = " + ".join(t["name"][:2] for t in session)
        print(f"  {number}: {names:12s} {sum(t['core'] for t in session):4d} min {measured:6.1f} min "
              f"{teaching_plan.SESSION_MINUTES - measured:6.1f} min")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
