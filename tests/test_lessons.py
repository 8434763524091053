"""The package's and the examples' copies of the notebooks' lesson code are the notebooks' code.

A notebook defines its key code in cells a student can edit; `tutorial_lib` and `examples/`
keep copies marked `# lesson: NN_name` (tools/lessons.py). These tests need no TensorFlow:
they compare syntax trees, so drift is caught in seconds.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("lessons", ROOT / "tools" / "lessons.py")
lessons = sys.modules["lessons"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(lessons)


def test_every_copy_is_its_notebooks_definition():
    drifted = [f"{c.path.relative_to(ROOT)}:{c.first} {c.definition.name}" for c, _ in lessons.drifted()]
    assert not drifted, f"copies that differ from their notebook (run make lessons to rewrite them): {drifted}"


def _course(tmp_path, cell_source: str, copy_source: str) -> Path:
    """A course folder with one notebook holding `cell_source` and a package file holding `copy_source`."""
    (tmp_path / "notebooks").mkdir(parents=True)
    (tmp_path / "tutorial_lib").mkdir()
    (tmp_path / "examples").mkdir()
    code = {"cell_type": "code", "source": [cell_source], "metadata": {}, "outputs": [], "execution_count": 1}
    cells = [{"cell_type": "markdown", "source": ["# a lesson"], "metadata": {}}, code]
    (tmp_path / "notebooks" / "01_demo.ipynb").write_text(json.dumps({"cells": cells}))
    (tmp_path / "tutorial_lib" / "demo.py").write_text(copy_source)
    return tmp_path


NOTEBOOK_CELL = """import math


def area(r):
    \"\"\"A circle's area.\"\"\"
    return math.pi * r**2


print(area(1))
"""


def test_a_copy_that_differs_from_its_cell_is_found_and_rewritten(tmp_path):
    copy = NOTEBOOK_CELL.replace("def area", "# lesson: 01_demo\ndef area").replace("math.pi", "3.14")
    copy = copy.replace("print(area(1))", "X = 1")
    root = _course(tmp_path, NOTEBOOK_CELL, copy)
    (pair,) = lessons.drifted(root)
    assert pair[0].definition.name == "area"
    lessons.write([pair])
    assert lessons.drifted(root) == []
    text = (root / "tutorial_lib" / "demo.py").read_text()
    assert "math.pi * r**2" in text and text.endswith("\n\nX = 1\n") and "# lesson: 01_demo\ndef area" in text


def test_comments_and_formatting_may_differ_but_not_the_docstring(tmp_path):
    same = NOTEBOOK_CELL.replace("def area(r):", "# lesson: 01_demo\ndef area(r):  # a comment").replace(
        "r**2", "(r ** 2)"
    )
    assert lessons.drifted(_course(tmp_path / "a", NOTEBOOK_CELL, same)) == []
    other_doc = same.replace("A circle's area.", "Another docstring.")
    assert len(lessons.drifted(_course(tmp_path / "b", NOTEBOOK_CELL, other_doc))) == 1


@pytest.mark.parametrize(
    ("copy", "message"),
    [
        ("# lesson: 01_demo\n\ndef area(r):\n    return r\n", "just above"),
        ("# lesson: 02_missing\ndef area(r):\n    return r\n", "does not exist"),
        ("# lesson: 01_demo\ndef volume(r):\n    return r\n", "exactly one code cell"),
    ],
)
def test_a_marker_that_points_nowhere_is_refused(tmp_path, copy, message):
    root = _course(tmp_path, NOTEBOOK_CELL, copy)
    with pytest.raises(lessons.LessonError, match=message):
        lessons.drifted(root)


def test_a_name_defined_in_two_cells_is_ambiguous(tmp_path):
    root = _course(tmp_path, NOTEBOOK_CELL, "# lesson: 01_demo\ndef area(r):\n    return r\n")
    path = root / "notebooks" / "01_demo.ipynb"
    notebook = json.loads(path.read_text())
    notebook["cells"].append(dict(notebook["cells"][1]))
    path.write_text(json.dumps(notebook))
    with pytest.raises(lessons.LessonError, match="in 2"):
        lessons.drifted(root)
