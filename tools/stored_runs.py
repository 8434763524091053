"""Copy the quiet runs of the notebooks' timing cells into tutorial_lib/stored_runs.json, or check it.

    python tools/stored_runs.py                      list where the file and the notebooks disagree (exit 1 if so)
    python tools/stored_runs.py --write [NB ...]     copy the stored lines of NB (default: every notebook)

A timing cell names its stored run in its last line, `stored_runs.beside("06 packing", busy)`: on a busy
machine it prints the lines that this cell printed in the course's quiet run, which are the notebook's own
stored output (tutorial_lib/stored_runs.py). This tool copies them: for each such cell, its printed lines
(progress lines, which end in "...", left out), the machine's load line (the cell's own or the last one
above it) and where it ran. `make notebooks` runs it right after re-running the notebooks, so an entry
whose lines changed gets this machine and today's date; one whose lines did not keeps its own.

A busy run is no reference: where a cell's stored output says "busy machine", its entry keeps the last
quiet run, and the tool names the cell to re-run on a quiet machine (exit 1 without --write). A cell that
has no quiet run at all, stored or kept, is an error. tests/test_stored_runs.py fails while the file and
the notebooks' quiet stored outputs disagree.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORE = ROOT / "tutorial_lib" / "stored_runs.json"
CALL = re.compile(r"\bstored_runs\.beside\(\s*([\"'])(.+?)\1")
# The lines that say how busy the machine was: timing.machine_state's, and notebook 00's own readings.
STATE = re.compile(r"^(?:quiet machine: |busy machine: |cores free for this notebook: |cores one logical device kept)")
BUSY = re.compile(r"\bbusy machine\b")
PROGRESS = re.compile(r"\.\.\.$")


class StoredRunError(ValueError):
    """A notebook whose stored runs cannot be copied, with what to do."""


def printed_lines(cell: dict) -> list[str]:
    """The non-blank lines a code cell printed to stdout in its stored outputs."""
    text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []) if o.get("name") == "stdout")
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def cells_with_calls(path: Path) -> list[tuple[str, int]]:
    """(key, cell index) of every `stored_runs.beside("key", ...)` in the notebook's code cells."""
    found = []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] == "code":
            found += [(m.group(2), i) for m in CALL.finditer("".join(cell["source"]))]
    return found


def extract(path: Path) -> dict[str, dict | None]:
    """{key: {'notebook', 'state', 'lines'}} from the notebook's stored outputs, None for a cell whose stored
    output is a busy run; StoredRunError for a key that is malformed or used twice, or a cell not run."""
    cells = json.loads(path.read_text())["cells"]
    runs = {}
    for key, i in cells_with_calls(path):
        where = f"{path.name}, cell {i} ({key!r})"
        if not key.startswith(path.stem[:2] + " "):
            raise StoredRunError(f"{where}: a key starts with its notebook's number, e.g. {path.stem[:2]} packing")
        if key in runs:
            raise StoredRunError(f"{where}: the key is used twice; give each timing cell its own")
        lines = [line for line in printed_lines(cells[i]) if not PROGRESS.search(line)]
        states = [line for c in cells[: i + 1] if c["cell_type"] == "code" for line in printed_lines(c)]
        state = next((line for line in reversed(states) if STATE.match(line)), "not printed by that run")
        if not lines:
            raise StoredRunError(f"{where}: no printed lines stored; run the notebook (make notebooks)")
        busy = BUSY.search(state) or any(BUSY.search(line) for line in lines)
        runs[key] = None if busy else {"notebook": path.stem, "state": state, "lines": lines}
    return runs


def busy_cells(folder: Path = ROOT / "notebooks") -> list[str]:
    """The timing cells whose stored output is a busy run: re-run their notebooks on a quiet machine."""
    return [
        f"{path.name}: cell {i} ({key!r}) stored a busy run: re-run {path.name} on a quiet machine"
        for path in sorted(folder.glob("*.ipynb"))
        for (key, i), run in zip(cells_with_calls(path), extract(path).values(), strict=True)
        if run is None
    ]


def this_machine() -> str:
    """The CPU model, the cores this process may use and the TensorFlow version: where a run happened."""
    model = "CPU model unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores, TensorFlow {importlib.metadata.version('tensorflow')}"


def merged(old: dict, new: dict, machine: str, date: str) -> dict:
    """`new` runs, each with the machine and date of its `old` entry where its lines are unchanged, else
    `machine` and `date` (a new run's lines always differ: they are timings). A busy run (None) keeps its
    old entry; StoredRunError where there is none."""
    out = {}
    for key, run in new.items():
        kept = old.get(key)
        if run is None:
            if kept is None:
                raise StoredRunError(f"{key!r}: its stored output is a busy run and no quiet run is stored for it")
            out[key] = kept
            continue
        same = kept is not None and (kept["lines"], kept["state"]) == (run["lines"], run["state"])
        out[key] = {**run, "machine": kept["machine"] if same else machine, "date": kept["date"] if same else date}
    return out


def write(notebooks: list[Path], store: Path = STORE, machine: str | None = None, date: str | None = None) -> dict:
    """Copy the stored runs of `notebooks` into `store`, keeping every other notebook's entries."""
    old = json.loads(store.read_text())["runs"] if store.exists() else {}
    new = {key: run for path in notebooks for key, run in extract(path).items()}
    names = {path.stem for path in notebooks}
    runs = {key: run for key, run in old.items() if run["notebook"] not in names}
    runs |= merged(old, new, machine or this_machine(), date or datetime.date.today().isoformat())
    text = json.dumps({"runs": dict(sorted(runs.items()))}, indent=1, ensure_ascii=False) + "\n"
    store.write_text(text)
    return runs


def problems(folder: Path = ROOT / "notebooks", store: Path = STORE) -> list[str]:
    """Where `store` and the stored outputs of the notebooks in `folder` disagree."""
    stored = json.loads(store.read_text())["runs"] if store.exists() else {}
    found, seen = [], set()
    for path in sorted(folder.glob("*.ipynb")):
        try:
            runs = extract(path)
        except StoredRunError as err:
            found.append(str(err))
            runs = {key: None for key, _ in cells_with_calls(path)}
        for key, run in runs.items():
            seen.add(key)
            if key not in stored:
                found.append(f"{path.name}: {key!r} has no quiet run stored; run the notebook on a quiet machine")
            elif run is not None and {k: stored[key][k] for k in run} != run:
                found.append(f"{path.name}: {key!r} differs from its stored output; run tools/stored_runs.py --write")
    found += [
        f"{key!r}: stored, but no cell of {run['notebook']} calls it" for key, run in stored.items() if key not in seen
    ]
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebook")
    parser.add_argument("--write", action="store_true", help="copy the notebooks' stored runs into the file")
    parser.add_argument("--machine", help="where the changed runs ran, if not here (default: this machine)")
    parser.add_argument("--date", help="when they ran, YYYY-MM-DD, if not today")
    args = parser.parse_args(argv)
    if args.write:
        if args.date:
            datetime.date.fromisoformat(args.date)  # a ValueError that names the bad date
        try:
            runs = write(args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb")), STORE, args.machine, args.date)
        except StoredRunError as err:
            sys.exit(f"stored_runs: {err}")
        print(f"stored_runs: {len(runs)} stored run(s) in {STORE.relative_to(ROOT)}")
        for line in busy_cells():
            print(f"stored_runs: {line} (its last quiet run is kept)")
        return 0
    found, busy = problems(), busy_cells()
    print("\n".join(found + [f"{len(found)} disagreement(s) between {STORE.name} and the notebooks"]))
    print("\n".join(busy + [f"{len(busy)} timing cell(s) whose stored output is a busy run"]))
    return 1 if found or busy else 0


if __name__ == "__main__":
    sys.exit(main())
