"""The course's own quiet run of a timing cell, printed beside a student's busy one.

On a busy machine a timing cell draws no verdict (other programs took cores while it measured:
`timing.machine_state`), which leaves a student with nothing to read. `beside(key, busy)`, the last
line of such a cell, then prints what the same cell printed in the course's run on a quiet machine,
labelled as that run (its machine, its date, the machine's load then), and how to get a quiet
measurement of one's own. On a quiet machine it prints nothing.

The stored lines are the notebook's own stored output, the source of truth that the course's site
shows: `make notebooks` re-runs the notebooks on a quiet machine and then copies each such cell's
printed lines into `stored_runs.json` beside this module (tools/stored_runs.py, which a test keeps in
step with the notebooks). The file ships with the package, so the students' hand-out, whose notebooks
have no outputs, has the stored runs too.
"""

from __future__ import annotations

import json
from pathlib import Path

STORE = Path(__file__).with_name("stored_runs.json")
INDENT = "    | "  # marks each stored line, so that it cannot be taken for the student's own
NO_VERDICT = "Your figures above were measured while other programs held cores, so no verdict is drawn from them."
HOW_TO_MEASURE = (
    "For a quiet measurement of your own, run this cell again when nothing else runs on the machine (on a "
    "shared server: in turns, one student at a time), or read this cell's stored run, with its plots, on "
    "the course's web site."
)


def load(store: Path | str = STORE) -> dict[str, dict]:
    """{key: stored run} from `store`: each run has 'notebook', 'machine', 'date', 'state' and 'lines'.
    An empty dict when there is no such file."""
    try:
        text = Path(store).read_text()
    except FileNotFoundError:
        return {}
    return json.loads(text)["runs"]


def describe(key: str, run: dict | None) -> str:
    """The block `beside` prints for the stored run `run` of the cell `key` (None: none is stored)."""
    if run is None:
        return (
            f"{NO_VERDICT} No stored run of this cell ({key!r}) is at hand here to set beside yours. {HOW_TO_MEASURE}"
        )
    load = "" if run["state"] in run["lines"] else f"; load then: {run['state']}"  # said once
    head = [
        f"--- the course's stored run of this cell, NOT yours: {run['notebook']}, measured on a quiet machine ---",
        f"machine: {run['machine']}; date: {run['date']}{load}",
    ]
    tail = ["--- end of the stored run ---", f"{NO_VERDICT} {HOW_TO_MEASURE}"]
    return "\n".join(head + [INDENT + line for line in run["lines"]] + tail)


def beside(key: str, busy: bool, store: Path | str | None = None) -> None:
    """Print the stored quiet run of the timing cell `key` when `busy` (the machine was busy while this
    run measured, so it draws no verdict); print nothing otherwise. Returns nothing, so that a cell that
    ends with it shows no value."""
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"key names the timing cell, e.g. '05 pipelines against the naive split'; got {key!r}.")
    if busy not in (True, False):  # also refuses machine_state's whole (busy, sentence) pair
        raise ValueError(
            f"busy must be True or False (the first item of timing.machine_state(...)), got {busy!r}: "
            "e.g. busy, said = timing.machine_state(timing.cores_taken(), cores), then beside(key, busy)."
        )
    if busy:
        print(describe(key, load(STORE if store is None else store).get(key)))
