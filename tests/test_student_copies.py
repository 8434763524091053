"""The students' hand-out: solutions emptied into numbered placeholders, outputs cleared, no solution
text anywhere in the folder or the archive, and a student copy that runs top to bottom."""

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORIGINALS = sorted((ROOT / "notebooks").glob("*.ipynb"))

_spec = importlib.util.spec_from_file_location("student_copies", ROOT / "tools" / "student_copies.py")
student_copies = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(student_copies)


@pytest.fixture(scope="module")
def handout(tmp_path_factory):
    """Run the tool as `make student` does; return the hand-out folder and its archive."""
    out = tmp_path_factory.mktemp("handout")
    result = subprocess.run(
        [sys.executable, "tools/student_copies.py", "notebooks", str(out / "student")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return out / "student", out / "student.zip"


def _is_solution(cell):
    return "solution" in cell["metadata"].get("tags", [])


def test_copies_empty_solutions_into_numbered_placeholders_and_clear_outputs(handout):
    folder, _ = handout
    assert sorted(p.name for p in (folder / "notebooks").glob("*.ipynb")) == [p.name for p in ORIGINALS]
    for original in ORIGINALS:
        source = json.loads(original.read_text())
        copy = json.loads((folder / "notebooks" / original.name).read_text())
        number = 0
        for before, after in zip(source["cells"], copy["cells"], strict=True):
            if after["cell_type"] != "code":
                assert after["source"] == before["source"]
                continue
            assert after["outputs"] == [] and after["execution_count"] is None
            if _is_solution(before):
                number += 1
                assert "".join(after["source"]).startswith(f"# Exercise {number}: your solution here")
                assert "jupyter" not in after["metadata"], "a placeholder must not be hidden"
            else:
                assert after["source"] == before["source"]
        assert number == student_copies.exercise_count(source) > 0, original.name


def _solution_lines() -> set[str]:
    """Lines that only solutions contain: long enough to be their own (not `plt.show()`), and found
    neither in the notebooks' other cells nor in the package that the hand-out includes."""
    solution, elsewhere = set(), set()
    for path in ORIGINALS:
        for cell in json.loads(path.read_text())["cells"]:
            lines = {line.strip() for line in cell["source"]}
            if cell["cell_type"] == "code" and _is_solution(cell):
                solution |= {line for line in lines if len(line) >= 25}
            else:
                elsewhere |= lines
    for path in (ROOT / "tutorial_lib").glob("*.py"):
        elsewhere |= {line.strip() for line in path.read_text().splitlines()}
    return solution - elsewhere


def test_the_handout_holds_no_solution_text_and_no_teacher_files(handout):
    folder, archive = handout
    lines = _solution_lines()
    assert len(lines) > 20, "the check needs the solutions' lines"
    with zipfile.ZipFile(archive) as zf:
        names = zf.namelist()
        texts = {name: zf.read(name).decode() for name in names if name.endswith((".ipynb", ".md", ".py"))}
    assert sorted(names) == sorted(
        str(Path("student") / p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and p.name != ".student-copy"
    ), "the archive and the folder must hold the same files"
    assert not any(name.split("/")[1] in ("teacher", "tests", "tools") for name in names)
    assert "student/Makefile" in names and "student/tutorial_lib/devices.py" in names
    for name, text in texts.items():
        leaked = [line for line in lines if line in text]
        assert not leaked, f"{name} contains solution code: {leaked[:3]}"


def test_a_solution_count_that_does_not_match_the_exercises_is_refused():
    notebook = json.loads((ROOT / "notebooks" / "00_devices.ipynb").read_text())
    first = next(i for i, c in enumerate(notebook["cells"]) if c["cell_type"] == "code" and _is_solution(c))
    del notebook["cells"][first]
    with pytest.raises(student_copies.HandoutError, match="2 cells tagged 'solution' but 3 numbered exercises"):
        student_copies.student_copy(notebook, "00_devices.ipynb")


def test_an_existing_folder_the_tool_did_not_write_is_not_replaced(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(student_copies.HandoutError, match="was not written by this tool"):
        student_copies.write_handout(ROOT / "notebooks", tmp_path / "mine", tmp_path / "mine.zip")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_a_student_copy_runs_top_to_bottom_up_to_its_exercises(handout, monkeypatch):
    """Notebook 00 (under a minute): every cell runs, the placeholders included; only the cells the
    course tags 'raises-exception' may raise."""
    nbclient = pytest.importorskip("nbclient")
    import nbformat

    folder, _ = handout
    path = folder / "notebooks" / "00_devices.ipynb"
    nb = nbformat.read(path, as_version=4)
    # The kernel imports this checkout's tutorial_lib, with the settings of the tests.
    for key, value in {"PYTHONPATH": str(ROOT), "TUTORIAL_DEVICE": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}.items():
        monkeypatch.setenv(key, value)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), "a cell did not run"
    for cell in code:
        errors = [o for o in cell.outputs if o.output_type == "error"]
        assert not errors or "raises-exception" in cell.metadata.get("tags", []), errors[0]["evalue"]
    printed = "".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
    assert "devices agree with the single-device result" in printed
