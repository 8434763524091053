"""The README's Teaching section and the make targets it documents."""

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
_spec = importlib.util.spec_from_file_location("teaching_plan", ROOT / "tools" / "teaching_plan.py")
teaching_plan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(teaching_plan)


def _teaching() -> str:
    readme = (ROOT / "README.md").read_text()
    assert "## Teaching" in readme, "the README has no Teaching section"
    return readme.split("## Teaching", 1)[1].split("\n## ", 1)[0]


def test_the_readme_plan_is_the_one_built_from_the_notebooks_time_lines():
    assert teaching_plan.readme_plan(_teaching()) == teaching_plan.plan_table(), (
        "run python tools/teaching_plan.py --write"
    )


def test_sessions_pack_consecutive_core_paths_within_the_limit():
    times = [{"core": c} for c in (20, 25, 30, 60, 35, 45, 100, 30)]
    packed = [[t["core"] for t in s] for s in teaching_plan.sessions(times, limit=90)]
    assert packed == [[20, 25, 30], [60], [35, 45], [100], [30]]


def test_the_plan_reads_each_notebooks_core_path_and_deep_dives(tmp_path):
    first = "**Time.** About 40 minutes on the core path (sections 1-6), "
    first += "plus about 15 minutes of deep dives (sections 7-9)."
    (tmp_path / "05_x.ipynb").write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": [first]}]}))
    table = teaching_plan.plan_table(tmp_path)
    assert "| 1 (40 min) | `05_x` | sections 1-6 | 40 min | sections 7-9, 15 min |" in table
    (tmp_path / "06_y.ipynb").write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": ["# 06"]}]}))
    with pytest.raises(teaching_plan.PlanError, match="06_y.ipynb"):
        teaching_plan.plan_table(tmp_path)


_spec = importlib.util.spec_from_file_location("core_path_times", ROOT / "tools" / "core_path_times.py")
core_path_times = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(core_path_times)
# Notebook 05 is being rewritten by others: its core path reads in about 48 minutes against 40 stated.
TOO_LONG = {"05_staging_pipeline"}


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, marks=pytest.mark.xfail(strict=True, reason="its Time line states less than it takes"))
        if p.stem in TOO_LONG
        else p
        for p in NOTEBOOKS
    ],
    ids=lambda p: p.stem,
)
def test_each_core_path_can_be_read_and_its_cells_started_in_its_stated_time(path):
    """Prose, code, printed outputs and figures, at tools/core_path_times.py's stated rates, without the
    cells' run times (teacher/sessions.md adds those, measured): they must fit in the stated minutes."""
    stated = teaching_plan.notebook_times(path)["core"]
    cells = json.loads(path.read_text())["cells"]
    minutes = core_path_times.reading_minutes(core_path_times.core_cells(cells))
    assert minutes <= stated, f"{path.name}: {minutes:.1f} minutes to read a {stated}-minute core path"


def test_reading_time_counts_prose_code_outputs_figures_and_cells_up_to_the_first_deep_dive():
    printed = {"output_type": "stream", "name": "stdout", "text": ["word " * 150]}
    figure = {"output_type": "display_data", "data": {"image/png": "", "text/plain": ""}}
    cells = [
        {"cell_type": "markdown", "source": ["word " * 300 + "\n## 2. Why? (deep dive)\n" + "word " * 999]},
        {"cell_type": "code", "source": ["x = 1\n" * 20], "outputs": [printed, figure]},
    ]
    core = core_path_times.core_cells(cells)
    assert len(core) == 1 and core_path_times.reading_minutes(core) == 2  # 300 words at 150 a minute
    assert core_path_times.reading_minutes(cells[1:]) == 1 + 1 + 0.5 + 5 / 60  # code, output, figure, start


def test_the_teachers_session_notes_follow_the_plan():
    notes = (ROOT / "teacher" / "sessions.md").read_text()
    times = [teaching_plan.notebook_times(p) for p in NOTEBOOKS]
    for number, session in enumerate(teaching_plan.sessions(times), start=1):
        assert f"\n## Session {number} " in notes, f"teacher/sessions.md has no '## Session {number}'"
        section = notes.split(f"\n## Session {number} ", 1)[1].split("\n## ", 1)[0]
        for t in session:
            assert f"`{t['name']}`" in section, f"session {number} of the plan holds {t['name']}"
            assert f"{t['core']} min" in section, f"session {number}: {t['name']}'s stated {t['core']} minutes"


def test_the_module_table_lists_exactly_the_package_modules():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("| module | what it holds |", 1)[1].split("\n\n", 1)[0]
    listed = set()
    for cell in re.findall(r"^\| ([^|]+) \|", table, re.MULTILINE):
        listed |= {name.rstrip("/") for name in re.findall(r"`([\w/]+)`", cell)}
    package = ROOT / "tutorial_lib"
    modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    modules |= {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    assert listed == modules


@pytest.mark.parametrize(
    "words",
    ["make student", "student.zip", "make student-lab", "make site", "make kernel", "LAB_ARGS", "jupyter server stop",
     "make unit", "make clean", "python3-venv", "macOS", "Windows", "Colab", "teacher/answers.md"],
)  # fmt: skip
def test_teaching_section_covers(words):
    assert words in _teaching()


def _dry_run(*args: str) -> list[str]:
    """The jupyter / ipykernel lines `make -n` would run (nothing is run, no .venv is made)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    result = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if "jupyter lab" in line or "ipykernel" in line]


@pytest.mark.parametrize(
    ("args", "root"),
    [
        ((), "notebooks"),
        (("COURSE_DIR=student/notebooks",), "student/notebooks"),
        (("LAB_ARGS=--ServerApp.root_dir=student --no-browser",), "student"),  # JupyterLab refuses two
    ],
)
def test_make_lab_passes_exactly_one_root_dir(args, root):
    (line,) = _dry_run("lab", *args)
    assert re.findall(r"--ServerApp\.root_dir=(\S+)", line) == [root], line


def test_make_kernel_registers_the_environment_for_this_user():
    (line,) = _dry_run("kernel")
    assert re.search(r"\.venv/bin/python -m ipykernel install --user --name tf-multi-device", line), line


def test_ci_installs_chromium_for_the_browser_test_before_running_the_tests():
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("apt-get install") < ci.index("\nmake test")
    assert "chromium" in ci


def _terms():
    spec = importlib.util.spec_from_file_location("terms", ROOT / "tools" / "terms.py")
    terms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(terms)
    return terms


# First uses in notebook 05 that others are rewriting: each must go from this list when its
# notebook defines the term (the test fails on a term listed here that is defined now, and on any other).
PENDING = {
    ("05_staging_pipeline", "PipeDream-Flush"), ("05_staging_pipeline", "loss scaling"),
    ("05_staging_pipeline", "executor"), ("05_staging_pipeline", "recomputation"),
    ("05_staging_pipeline", "optimizer state"),
}  # fmt: skip


def test_every_term_is_defined_or_pointed_to_where_the_course_first_uses_it():
    found = {tuple(part.strip() for part in line.split(":")[:2]) for line in _terms().undefined_first_uses()}
    assert found - PENDING == set(), "a term used before its meaning: define it there or point to where it is"
    assert PENDING - found == set(), "defined now: remove it from PENDING"


def _course(folder: Path, notebooks: dict[str, list]) -> Path:
    """Notebooks of markdown cells (text) and code cells ((source, printed text))."""
    for name, cells in notebooks.items():
        out = []
        for cell in cells:
            if isinstance(cell, str):
                out.append({"cell_type": "markdown", "source": [cell]})
            else:
                printed = [{"output_type": "stream", "name": "stdout", "text": [cell[1]]}]
                out.append({"cell_type": "code", "source": [cell[0]], "outputs": printed})
        (folder / f"{name}.ipynb").write_text(json.dumps({"cells": out}))
    return folder


def _flagged(folder: Path) -> list[str]:
    return [line.split(":")[1].strip() for line in _terms().undefined_first_uses(folder)]


def test_terms_are_checked_in_prose_in_course_order_and_the_objectives_may_name_them(tmp_path):
    cells = [
        "# 00 · objectives may name NCCL before it is defined",
        "NCCL sums tensors across GPUs.",
        "*Bubble* is the idle share. ZeRO shards the state (notebook 08).",
        "A name such as `/job:w/replica:0` or `ranks = 2` is code, not prose.",
    ]
    assert _flagged(_course(tmp_path, {"00_x": cells})) == ["NCCL"]


def test_a_term_first_printed_is_defined_by_the_prose_around_its_cell(tmp_path):
    timing = ("print(t)", "split 1.2x (spread 0.1 ms)\n")
    _course(tmp_path, {"00_x": ["# 00", "## 1. How fast?", timing, "Read the ratio."]})
    assert _flagged(tmp_path) == ["spread"]
    _course(tmp_path, {"00_x": ["# 00", "## 1. How fast?", timing, "The *spread* is the noise of a time."]})
    assert _flagged(tmp_path) == []


def test_a_term_defined_only_in_a_deep_dive_is_checked_again_on_a_later_core_path(tmp_path):
    deep = "## 6. What is a core device? (deep dive)\n\n*Core devices* are processes."
    _course(tmp_path, {"00_x": ["# 00", "## 1. Devices?", deep], "01_y": ["# 01", "Use two core devices here."]})
    problems = _terms().undefined_first_uses(tmp_path)
    assert [line.split(":")[1].strip() for line in problems] == ["core devices"]
    assert "defined before only in a deep dive" in problems[0]
    _course(tmp_path, {"01_y": ["# 01", "Use two core devices (notebook 00, section 6) here."]})
    assert _flagged(tmp_path) == []


def test_a_heading_may_name_the_term_its_section_defines(tmp_path):
    heading = "## 5. How does tensor parallelism split one layer?\n\n*Tensor parallelism* splits the layer."
    assert _flagged(_course(tmp_path, {"08_x": ["# 08", heading]})) == []
    bare = "## 5. How does tensor parallelism split one layer?\n\nIt splits the layer."
    assert _flagged(_course(tmp_path, {"08_x": ["# 08", bare]})) == ["tensor parallelism"]
