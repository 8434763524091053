"""Colab's route, imitated: a kernel in which the course is not installed runs the README's Colab
cell on the hand-out's archive; then the kernel, and the Python processes it starts as notebooks
00 and 07 do (a child Python with a core device, `python -m tutorial_lib.multi_worker`), import
`tutorial_lib` from the unpacked hand-out.

The imitation: /content is a temporary folder, and every Python of the test loses this checkout's
installed `tutorial_lib` (its editable-install finder and path entries) through a sitecustomize on
PYTHONPATH, as on Colab, where nothing but the hand-out holds the package.
"""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import student_copies  # noqa: E402

HIDE_INSTALLED = """\
import os
import sys
from pathlib import Path

_kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path[:] = [p for p in sys.path if p in _kept or not (Path(p or ".") / "tutorial_lib").is_dir()]
"""
CHILDREN = """\
import json
import subprocess
import sys

import tutorial_lib

child = "from tutorial_lib import devices; devices.simulate(1, kind='cores'); print(devices.__file__)"
core = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
worker = [sys.executable, "-m", "tutorial_lib.multi_worker", "--help"]
worker = subprocess.run(worker, capture_output=True, text=True, timeout=120)
print(json.dumps({"kernel": tutorial_lib.__file__, "core": [core.returncode, core.stdout, core.stderr[-1500:]],
                  "worker": [worker.returncode, worker.stdout[:200], worker.stderr[-1500:]]}))
"""


def _cells(content: Path) -> list[str]:
    colab = student_copies.COLAB_CELL.replace("/content", str(content))
    return [
        "import importlib.util\nprint(json.dumps(importlib.util.find_spec('tutorial_lib') is None))",
        colab,
        CHILDREN,
    ]


def test_the_readmes_carry_the_same_colab_cell():
    assert student_copies.COLAB_CELL in (ROOT / "README.md").read_text()
    assert student_copies.COLAB_CELL in student_copies.student_readme()


def _imitate_colab(tmp_path: Path, monkeypatch) -> Path:
    """/content with the hand-out's archive in it, and Pythons that do not see the installed course.
    Returns the /content stand-in: the kernel's working folder, as on Colab."""
    content, shim = tmp_path / "content", tmp_path / "shim"
    content.mkdir(), shim.mkdir()
    (shim / "sitecustomize.py").write_text(HIDE_INSTALLED)
    student_copies.write_handout(ROOT / "notebooks", tmp_path / "student", content / "student.zip")
    for key, value in {"PYTHONPATH": str(shim), "TUTORIAL_DEVICE": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}.items():
        monkeypatch.setenv(key, value)
    return content


def _run_in_colab(nb, content: Path, timeout: int):
    """Runs the notebook in a kernel started in `content`, after a cell that says whether the kernel finds
    tutorial_lib before the Colab cell (it must not: else the imitation failed) and the Colab cell itself.
    Returns the notebook, run; a cell that fails raises nbclient's CellExecutionError."""
    nbclient = pytest.importorskip("nbclient")
    import nbformat

    probe, colab = _cells(content)[:2]
    nb.cells[:0] = [nbformat.v4.new_code_cell(f"import json\n{probe}"), nbformat.v4.new_code_cell(colab)]
    nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(content)}}
    ).execute()
    hidden = json.loads(nb.cells[0].outputs[0]["text"].strip())
    assert hidden, "the imitation failed: the kernel found the installed tutorial_lib before the Colab cell"
    return nb


@pytest.mark.slow
def test_the_colab_cell_serves_the_kernel_and_the_pythons_it_starts(tmp_path, monkeypatch):
    import nbformat

    content = _imitate_colab(tmp_path, monkeypatch)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CHILDREN)])
    nb = _run_in_colab(nb, content, timeout=400)
    report = json.loads(nb.cells[-1].outputs[-1]["text"].strip().splitlines()[-1])
    handout = str(content / "student" / "tutorial_lib")
    assert report["kernel"].startswith(handout), report
    assert report["core"][0] == 0 and report["core"][1].strip().splitlines()[-1].startswith(handout), report["core"]
    assert report["worker"][0] == 0 and "--steps" in report["worker"][1], report["worker"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["00_devices", "07_multi_worker"])
def test_the_students_notebook_runs_to_the_end_in_colab(name, tmp_path, monkeypatch):
    """The students' copy (tools/student_copies.py), uploaded on its own as on Colab, under the README's
    Colab cell: every cell runs, the child Python of 00 and the workers of 07 included."""
    import nbformat

    content = _imitate_colab(tmp_path, monkeypatch)
    nb = nbformat.read(tmp_path / "student" / "notebooks" / f"{name}.ipynb", as_version=4)
    nb = _run_in_colab(nb, content, timeout=300)  # a failing cell raises CellExecutionError
    skipped = [cell.source[:80] for cell in nb.cells if cell.cell_type == "code" and cell.execution_count is None]
    assert not skipped, f"cells that did not run: {skipped}"
