"""The notebooks' format (tools/notebook_format.py): every course notebook follows it, and the
checker finds each kind of defect in a small notebook that otherwise follows it. No kernel."""

import copy
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TEXT_FILES = [ROOT / "README.md", *sorted((ROOT / "teacher").glob("*.md"))]

sys.path.insert(0, str(ROOT / "tools"))
_spec = importlib.util.spec_from_file_location("notebook_format", ROOT / "tools" / "notebook_format.py")
notebook_format = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(notebook_format)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_follows_the_format(path):
    problems = notebook_format.notebook_problems(path)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", TEXT_FILES, ids=lambda p: p.name)
def test_readme_and_teacher_files_say_no_seed_and_name_only_what_exists(path):
    problems = notebook_format.text_file_problems(path)
    assert not problems, "\n".join(problems)


def _md(text, **metadata):
    return {"cell_type": "markdown", "metadata": metadata, "source": text}


def _code(text, tags=()):
    return {"cell_type": "code", "metadata": {"tags": list(tags)}, "source": text, "outputs": [], "execution_count": 1}


GOOD = {
    "cells": [
        _md(
            "# 05 · A title\n\n**The question this notebook answers.** Why?\n\n"
            "**Take it away.** `examples/train_pipelined.py` holds it.\n\n"
            "**Learning objectives.** After this notebook you can\n\n- do a thing.\n\n"
            "**Prerequisites.** [00 · Devices](00_devices.ipynb).\n\n"
            "**Time.** About 20 minutes on the core path (sections 1-1), "
            "plus about 5 minutes of deep dives (sections 2-2).\n"
        ),
        _md("## Setup"),
        _code("from tutorial_lib import devices, schedules\n\nDEVICES = devices.simulate(2)\n"),
        _md("## 1. Does it work?\n\nUse `schedules.bubble_fraction` and `tutorial_lib.bench.scaling`."),
        _code("assert schedules.bubble_fraction(2, 4) > 0\n"),
        _md("## 2. How far does it go? (deep dive)\n\nWith a random seed, see `tests/test_schedules.py`."),
        _md("## Exercises"),
        _md("### Exercise 1 · A thing\n\nDo it."),
        {
            **_code("assert 1 + 1 == 2\n", tags=["solution"]),
            "metadata": {"tags": ["solution"], "jupyter": {"source_hidden": True}},
        },
        _md("## Summary\n\n- It works.\n\n**Next:** [06 · Scaling](06_scaling.ipynb) goes on."),
        _md("## Questionnaire\n\n1. Why?\n2. How?\n"),
    ],
    "metadata": {},
    "nbformat": 4,
    "nbformat_minor": 5,
}


def _problems(notebook, tmp_path, name="05_x.ipynb"):
    path = tmp_path / name
    path.write_text(notebook_format.json.dumps(notebook))
    return notebook_format.notebook_problems(path)


def test_a_notebook_in_the_format_passes(tmp_path):
    assert _problems(GOOD, tmp_path) == []


def _edited(cell, text):
    notebook = copy.deepcopy(GOOD)
    notebook["cells"][cell]["source"] = text
    return notebook


@pytest.mark.parametrize(
    "cell, text, expected",
    [
        (0, GOOD["cells"][0]["source"].replace("About 20 minutes on", "About 20 min on"), "no line '**Time.**"),
        (0, GOOD["cells"][0]["source"].replace("**Take it away.**", "**Take away.**"), "Take it away"),
        (0, GOOD["cells"][0]["source"].replace("**The question", "The question"), "The question this notebook"),
        (0, GOOD["cells"][0]["source"].replace("(sections 2-2)", "(sections 2-3)"), "do not cover sections 1-2"),
        (
            2,
            "import tensorflow as tf\ntf.constant(1)\nfrom tutorial_lib import devices\ndevices.simulate(2)\n",
            "first call",
        ),
        (3, "## 1. It works\n", "not a question"),
        (3, "## 1. Does it work? (deep dive)\n", "section 1 is core"),
        (5, "## 3. How far does it go? (deep dive)\n", "expected section 2"),
        (3, "## 1. Does it work?\n\nThe seed's bug.", "says 'seed'"),
        (3, "## 1. Does it work?\n\nSee `tutorial_lib.bench_scaling`.", "tutorial_lib.bench_scaling"),
        (3, "## 1. Does it work?\n\nSee `schedules.replicated_optimizers`.", "schedules.replicated_optimizers"),
        (3, "## 1. Does it work?\n\nSee tests/test_notebook03_code.py.", "tests/test_notebook03_code.py"),
        (3, "## 1. Does it work?\n\nSee [03](03_allreduce_gone.ipynb).", "03_allreduce_gone.ipynb"),
        (7, "### Exercise 2 · A thing\n", "expected exercise 1"),
        (8, "print(1 + 1)\n", "asserts something"),
        (9, "## Summary\n\n- It works.\n", "**Next:**"),
        (10, "## Questionnaire\n\nWhy?\n", "numbered questions"),
    ],
)
def test_the_checker_finds_each_defect(tmp_path, cell, text, expected):
    problems = _problems(_edited(cell, text), tmp_path)
    assert any(expected in p for p in problems), problems


def test_exercise_solutions_lost_doubled_or_misplaced_are_named_with_their_cells():
    lost = copy.deepcopy(GOOD)
    lost["cells"][8]["metadata"]["tags"] = []
    lost["cells"][4]["metadata"]["tags"] = ["solution"]  # a lesson cell tagged by mistake
    problems = notebook_format.exercise_problems(lost, "x.ipynb")
    assert any("cell 7" in p and "not followed" in p for p in problems), problems
    assert any("cell 4 is tagged 'solution'" in p for p in problems), problems
    doubled = copy.deepcopy(GOOD)
    doubled["cells"].insert(9, _md("The answer is 2.", tags=["solution"]))
    assert any("both solutions" in p for p in notebook_format.exercise_problems(doubled, "x.ipynb"))


def test_leak_check_finds_solution_text_and_outputs_in_a_copy():
    public = copy.deepcopy(GOOD)
    public["cells"][8]["source"] = "# Exercise 1: your solution here\n"
    assert notebook_format.leaks(GOOD, public, "x.ipynb") == []
    public["cells"][9]["source"] = "assert 1 + 1 == 2\n"  # the answer moved to another cell
    assert any("cell 9" in p for p in notebook_format.leaks(GOOD, public, "x.ipynb"))
    original = copy.deepcopy(GOOD)
    original["cells"][8]["outputs"] = [
        {"output_type": "stream", "name": "stdout", "text": "the answer is 42 exactly\n"}
    ]
    public = copy.deepcopy(original)
    public["cells"][8]["source"] = ""
    assert any("keeps its outputs" in p for p in notebook_format.leaks(original, public, "x.ipynb"))


@pytest.mark.parametrize("text", ["{not json", '{"cells": [{"cell_type": "code"}]}'])
def test_an_unreadable_notebook_is_named_with_its_cell(tmp_path, text):
    path = tmp_path / "05_broken.ipynb"
    path.write_text(text)
    with pytest.raises(notebook_format.NotebookError, match="05_broken.ipynb"):
        notebook_format.read_notebook(path)


_clean_spec = importlib.util.spec_from_file_location("clean_notebooks", ROOT / "tools" / "clean_notebooks.py")
clean_notebooks = importlib.util.module_from_spec(_clean_spec)
_clean_spec.loader.exec_module(clean_notebooks)


def test_a_shown_solution_is_a_problem_and_clean_notebooks_hides_it(tmp_path):
    shown = copy.deepcopy(GOOD)
    solution = shown["cells"][8]
    solution["metadata"] = {"tags": ["solution"]}
    solution["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "the answer\n"}]
    solution["execution_count"] = 7
    assert any("shows its code or its outputs" in p for p in _problems(shown, tmp_path))
    cleaned = clean_notebooks.clean(shown, "/nowhere")["cells"][8]
    assert cleaned["metadata"]["jupyter"]["source_hidden"] is True and cleaned["outputs"] == []
    assert "nbval-ignore-output" in cleaned["metadata"]["tags"] and cleaned["execution_count"] == 7
    assert _problems(clean_notebooks.clean(shown, "/nowhere"), tmp_path) == []


def test_clean_notebooks_names_a_broken_file_and_leaves_no_temporary_file(tmp_path):
    broken, good = tmp_path / "03_broken.ipynb", tmp_path / "05_x.ipynb"
    broken.write_text('{"cells": [')
    good.write_text(clean_notebooks.dumps(GOOD))
    with pytest.raises(SystemExit, match="03_broken.ipynb: not a readable notebook"):
        clean_notebooks.main([str(good), str(broken)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["03_broken.ipynb", "05_x.ipynb"]


@pytest.mark.parametrize(
    "cell, text",
    [
        (0, GOOD["cells"][0]["source"].replace("(sections 2-2)", "(section 2)")),
        (2, "import tensorflow as tf\nfrom tutorial_lib import devices\n\n"
            "n = len(tf.config.list_physical_devices('GPU'))\nDEVICES = devices.simulate(n if n >= 2 else 4)\n"),
    ],
)  # fmt: skip
def test_one_deep_dive_section_and_counting_gpus_before_simulate_pass(tmp_path, cell, text):
    assert _problems(_edited(cell, text), tmp_path) == []
