"""A timing cell on a busy machine prints the course's stored quiet run beside the student's own, labelled
as such, with how to get a quiet measurement; the stored runs are the notebooks' own stored outputs."""

import importlib.util
import json
from pathlib import Path

import pytest

from tutorial_lib import stored_runs

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("stored_runs_tool", ROOT / "tools" / "stored_runs.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

RUN = {
    "notebook": "06_scaling",
    "state": "quiet machine: other programs kept 0.02 of 2 cores busy",
    "lines": ["20 all-reduces of 4 kB: 10.929 ms; one of 80 kB: 5.174 ms", "packing: 2.1x [1.7, 2.8], faster"],
    "machine": "AMD EPYC, 2 cores, TensorFlow 2.21.0",
    "date": "2026-12-06",
}


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "stored_runs.json"
    path.write_text(json.dumps({"runs": {"06 packing": RUN}}))
    return path


# --- what the student reads ----------------------------------------------------------------------


def test_a_busy_run_gets_the_stored_run_labelled_with_its_machine_date_and_verdict(store, capsys):
    assert stored_runs.beside("06 packing", True, store) is None  # a cell that ends with it shows no value
    shown = capsys.readouterr().out
    assert "the course's stored run of this cell, NOT yours: 06_scaling, measured on a quiet machine" in shown
    assert "machine: AMD EPYC, 2 cores, TensorFlow 2.21.0; date: 2026-12-06" in shown
    assert "load then: quiet machine: other programs kept 0.02 of 2 cores busy" in shown
    assert shown.count("0.02 of 2 cores") == 1
    assert "    | packing: 2.1x [1.7, 2.8], faster" in shown  # the verdict, marked as the stored run's
    assert "run this cell again when nothing else runs" in shown and "in turns" in shown
    assert "course's web site" in shown


def test_a_load_line_that_is_one_of_the_stored_lines_is_said_once(tmp_path, capsys):
    state = "cores free for this notebook: 1.8 of 2 -> quiet enough to measure"
    run = {**RUN, "notebook": "00_devices", "state": state, "lines": [state, "2 device(s): throughput 1.86x"]}
    (tmp_path / "s.json").write_text(json.dumps({"runs": {"00 throughput": run}}))
    stored_runs.beside("00 throughput", True, tmp_path / "s.json")
    assert capsys.readouterr().out.count("1.8 of 2") == 1


def test_a_quiet_run_prints_nothing_beside_its_own_verdicts(store, capsys):
    stored_runs.beside("06 packing", False, store)
    assert capsys.readouterr().out == ""


def test_a_cell_without_a_stored_run_still_says_how_to_get_a_quiet_measurement(tmp_path, capsys):
    stored_runs.beside("06 packing", True, tmp_path / "none.json")  # e.g. a copy of the notebook without the file
    shown = capsys.readouterr().out
    assert "No stored run of this cell ('06 packing')" in shown and "run this cell again" in shown


@pytest.mark.parametrize("busy", [(True, "busy machine: ..."), "yes", None, 2])
def test_busy_must_be_the_flag_not_the_pair_machine_state_returns(busy, store):
    with pytest.raises(ValueError, match=r"busy must be True or False \(the first item of timing.machine_state"):
        stored_runs.beside("06 packing", busy, store)


@pytest.mark.parametrize("key", ["", "  ", None, 6])
def test_the_key_must_name_the_cell(key, store):
    with pytest.raises(ValueError, match="key names the timing cell"):
        stored_runs.beside(key, True, store)


# --- the stored runs are the notebooks' stored outputs ---------------------------------------------


def test_the_package_stored_runs_are_the_notebooks_stored_outputs():
    assert tool.problems() == [], "re-run the notebook on a quiet machine, then python tools/stored_runs.py --write"


def test_every_stored_run_is_a_quiet_one_with_a_machine_and_a_date():
    runs = stored_runs.load()
    assert {key.split()[0] for key in runs} >= {"00", "06"}
    for key, run in runs.items():
        assert run["lines"] and not any("busy machine" in line for line in run["lines"]), key
        assert run["machine"] and len(run["date"]) == 10 and not run["state"].startswith("busy"), key


def _notebook(path: Path, cells: list[tuple[str, list[str]]]) -> Path:
    """A notebook of code cells (source, printed lines)."""
    code = [
        {"cell_type": "code", "source": [source], "outputs": [{"output_type": "stream", "name": "stdout", "text": out}]}
        for source, out in cells
    ]
    path.write_text(json.dumps({"cells": code}))
    return path


def test_the_tool_copies_a_cells_lines_and_the_load_line_above_it(tmp_path):
    path = _notebook(
        tmp_path / "06_x.ipynb",
        [
            ("print(state)", ["quiet machine: other programs kept 0.02 of 2 cores busy\n"]),
            ('stored_runs.beside("06 packing", busy)', ["[packing] on 2 devices ...\n", "packing: 2.1x, faster\n"]),
        ],
    )
    assert tool.extract(path) == {
        "06 packing": {
            "notebook": "06_x",
            "state": "quiet machine: other programs kept 0.02 of 2 cores busy",
            "lines": ["packing: 2.1x, faster"],  # the progress line left out
        }
    }


@pytest.mark.parametrize(
    ("cells", "message"),
    [
        ([('stored_runs.beside("06 a", busy)', [])], "no printed lines"),
        ([('stored_runs.beside("05 a", busy)', ["quiet machine: x\n"])], "starts with its notebook's number"),
        ([('stored_runs.beside("06 a", b)\nstored_runs.beside("06 a", b)', ["quiet machine: x\n"])], "used twice"),
    ],
)
def test_the_tool_refuses_a_malformed_key_or_a_cell_not_run(tmp_path, cells, message):
    with pytest.raises(tool.StoredRunError, match=message):
        tool.extract(_notebook(tmp_path / "06_x.ipynb", cells))


BUSY_STATE = "busy machine: other programs kept 1.1 of 2 cores busy\n"


@pytest.mark.parametrize(
    "cells",
    [
        [('stored_runs.beside("06 a", busy)', [BUSY_STATE, "a: 0.9x, busy machine\n"])],
        [("print(state)", [BUSY_STATE]), ('stored_runs.beside("06 a", busy)', ["a: 0.9x\n"])],
    ],
)
def test_a_busy_stored_output_is_no_reference_the_last_quiet_run_is_kept(tmp_path, cells):
    folder, store = tmp_path / "notebooks", tmp_path / "stored_runs.json"
    folder.mkdir()
    path = _notebook(folder / "06_x.ipynb", cells)
    assert tool.extract(path) == {"06 a": None}
    with pytest.raises(tool.StoredRunError, match="busy run and no quiet run is stored"):
        tool.write([path], store)
    quiet = {"notebook": "06_x", "state": "quiet machine: x", "lines": ["a: 1.5x, faster"], "machine": "m", "date": "d"}
    store.write_text(json.dumps({"runs": {"06 a": quiet}}))
    assert tool.write([path], store) == {"06 a": quiet}
    assert tool.problems(folder, store) == []  # the file holds a quiet run for every cell
    assert tool.busy_cells(folder) == [
        f"06_x.ipynb: cell {len(cells) - 1} ('06 a') stored a busy run: re-run 06_x.ipynb on a quiet machine"
    ]


def test_write_dates_only_the_runs_whose_lines_changed_and_check_sees_drift(tmp_path):
    folder, store = tmp_path / "notebooks", tmp_path / "stored_runs.json"
    folder.mkdir()
    state = "quiet machine: other programs kept 0.02 of 2 cores busy\n"
    cells = [("print(state)", [state]), ('stored_runs.beside("06 a", busy)', ["a: 1.5x, faster\n"])]
    cells.append(('stored_runs.beside("06 b", busy)', ["b: 1.1x, no significant difference\n"]))
    path = _notebook(folder / "06_x.ipynb", cells)
    tool.write([path], store, machine="old machine", date="2026-01-01")
    assert tool.problems(folder, store) == []
    cells[1] = ('stored_runs.beside("06 a", busy)', ["a: 1.4x, faster\n"])  # a re-run changed a's timings only
    _notebook(path, cells)
    assert tool.problems(folder, store) == [
        "06_x.ipynb: '06 a' differs from its stored output; run tools/stored_runs.py --write"
    ]
    runs = tool.write([path], store, machine="new machine", date="2026-02-02")
    assert (runs["06 a"]["machine"], runs["06 a"]["date"]) == ("new machine", "2026-02-02")
    assert (runs["06 b"]["machine"], runs["06 b"]["date"]) == ("old machine", "2026-01-01")
    _notebook(path, cells[:2])  # the cell of b is gone
    assert tool.problems(folder, store) == ["'06 b': stored, but no cell of 06_x calls it"]


# --- a busy machine, faked, in the notebooks themselves ---------------------------------------------


def _run_with_a_busy_machine(path: Path, cells: list[int], fake_load: str, monkeypatch) -> list[str]:
    """The stdout of `cells` of the notebook, run in order in a fresh kernel in which `fake_load` (code run
    right after the setup cell) replaces the load reading; nothing else is changed."""
    nbclient = pytest.importorskip("nbclient")
    import nbformat

    nb = nbformat.read(path, as_version=4)
    setup = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    picked = [nb.cells[setup], nbformat.v4.new_code_cell(fake_load)] + [nb.cells[i] for i in cells]
    nb.cells = picked
    for key, value in {"PYTHONPATH": str(ROOT), "TUTORIAL_DEVICE": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}.items():
        monkeypatch.setenv(key, value)  # the kernel imports this checkout's tutorial_lib, as the tests run
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    return ["".join(o.get("text", "") for o in c.outputs if o.get("name") == "stdout") for c in nb.cells[2:]]


@pytest.mark.slow
def test_notebook_00_on_a_busy_machine_prints_the_stored_throughputs_beside_its_own(monkeypatch):
    path = ROOT / "notebooks" / "00_devices.ipynb"
    cells = [i for i, c in enumerate(json.loads(path.read_text())["cells"]) if c["cell_type"] == "code"]
    section_5 = [i for i in cells if 26 <= i <= 31]  # make_work, the check, the throughput, the trace
    fake = "from tutorial_lib import timing\ntiming.cores_used = lambda *args, **kwargs: 0.9  # 1.1 of 2 cores taken"
    printed = _run_with_a_busy_machine(path, section_5, fake, monkeypatch)
    throughput = next(p for p in printed if "throughput 1.00x of one device" in p)
    assert "cores free for this notebook: 0.9 of" in throughput and "busy machine" in throughput
    stored = stored_runs.load()["00 throughput of k devices"]
    assert "NOT yours" in throughput and f"date: {stored['date']}" in throughput
    assert all(f"    | {line}" in throughput for line in stored["lines"])
    assert throughput.index("4 device(s):") < throughput.index("NOT yours")  # the student's own lines first
    trace = next(p for p in printed if "mean number of busy devices" in p)
    assert "    | " + stored_runs.load()["00 trace against throughput"]["lines"][0] in trace


@pytest.mark.slow
def test_notebook_06_on_a_busy_machine_prints_the_stored_packing_verdict_beside_its_own(monkeypatch):
    path = ROOT / "notebooks" / "06_scaling.ipynb"
    source = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]]
    constants = next(i for i, s in enumerate(source) if s.startswith("HIDDEN = "))
    packing = next(i for i, s in enumerate(source) if 'stored_runs.beside("06 packing"' in s)
    fake = (
        "from tutorial_lib import timing\n"
        "timing.cores_taken = lambda seconds=1.0: 1.1  # other programs keep 1.1 cores busy\n"
        "busy, state = timing.machine_state(timing.cores_taken(), CORES)\nprint(state)"
    )
    printed = _run_with_a_busy_machine(path, [constants, packing], fake, monkeypatch)
    said = printed[-1]
    assert "packing: " in said and ", busy machine" in said  # the student's own figure, without a verdict
    for line in stored_runs.load()["06 packing"]["lines"]:
        assert f"    | {line}" in said
    assert "run this cell again when nothing else runs" in said
