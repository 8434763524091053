"""The students' hand-out: solutions emptied into numbered placeholders, outputs cleared, no solution
text anywhere in the folder or the archive, and a student copy that runs top to bottom."""

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORIGINALS = sorted((ROOT / "notebooks").glob("*.ipynb"))

sys.path.insert(0, str(ROOT / "tools"))
import handout_refs  # noqa: E402
import notebook_format  # noqa: E402

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
            if _is_solution(before):
                number += 1
                assert after["cell_type"] == "code" and not _is_solution(after)
                assert "".join(after["source"]).startswith(f"# Exercise {number}: your solution here")
                assert "jupyter" not in after["metadata"], "a placeholder must not be hidden"
            else:
                assert after["source"] == before["source"]
            if after["cell_type"] == "code":
                assert after["outputs"] == [] and after["execution_count"] is None
        headings = sum("".join(c["source"]).startswith("### Exercise ") for c in source["cells"])
        assert number == headings > 0, original.name


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
    shown = "\n".join(elsewhere)  # a solution line inside a longer lesson line is no leak either
    return {line for line in solution - elsewhere if line not in shown}


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
    course_tools = [name for name in names if name.split("/")[1] in ("teacher", "tests", "tools")]
    assert course_tools == ["student/tools/lab_overrides.json"], "only JupyterLab's settings, which make install needs"
    assert "student/Makefile" in names and "student/tutorial_lib/devices.py" in names
    for name, text in texts.items():
        leaked = [line for line in lines if line in text]
        assert not leaked, f"{name} contains solution code: {leaked[:3]}"


def _course_dir() -> str:
    """The folder `make lab` opens JupyterLab in (course.mk's COURSE_DIR)."""
    return re.search(r"^COURSE_DIR \?= (\S+)$", (ROOT / "course.mk").read_text(), re.MULTILINE).group(1)


def test_the_student_readme_names_the_first_notebook_as_jupyterlab_shows_it():
    """make lab and `jupyter lab notebooks/` open in the notebooks folder: the README says so, and names
    the first notebook by the name its file browser shows, not by a path from the hand-out's root."""
    readme, course_dir = student_copies.student_readme(), _course_dir()
    assert course_dir == "notebooks" and "jupyter lab notebooks/" in readme
    assert f"`{course_dir}/00_devices.ipynb`" not in readme
    start = readme.split("## Start", 1)[1].split("\n## ", 1)[0]
    assert start.count("opens JupyterLab in the\n  `notebooks/` folder: open `00_devices.ipynb` there") == 1
    assert "JupyterLab opens in `notebooks/`: start with `00_devices.ipynb`" in start  # the pip route


def test_the_teacher_readme_lists_what_the_handout_takes_from_tools():
    """The hand-out ships tools/lab_overrides.json (make install needs it): the teacher's README says so."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### The hand-out", 1)[1].split("\n### ", 1)[0]
    shipped = [name for name in student_copies.COURSE_FILES if name.startswith("tools/")]
    assert shipped == ["tools/lab_overrides.json"]
    assert all(f"`{name}`" in section for name in shipped), section
    assert "no tools," not in " ".join(section.split())


def _notebook_00():
    return json.loads((ROOT / "notebooks" / "00_devices.ipynb").read_text())


def _first_solution(notebook):
    return next(i for i, c in enumerate(notebook["cells"]) if _is_solution(c))


def test_a_lost_solution_tag_is_refused_even_when_a_lesson_cell_took_it():
    notebook = _notebook_00()
    first = _first_solution(notebook)
    notebook["cells"][first]["metadata"]["tags"] = ["solutoin"]  # misspelled: the answer would ship
    notebook["cells"][2]["metadata"]["tags"] = ["solution"]  # and the count still matches
    with pytest.raises(student_copies.HandoutError, match=rf"cell {first - 1} .* not followed .*cell 2 is tagged"):
        student_copies.student_copy(notebook, "00_devices.ipynb")


def test_a_markdown_solution_becomes_a_placeholder_and_leaves_no_text():
    notebook = _notebook_00()
    first = _first_solution(notebook)
    notebook["cells"][first] = {
        "cell_type": "markdown",
        "metadata": {"tags": ["solution"]},
        "source": ["The answer: the name was formatted twice, '/device:CPU:0' inside another.\n"],
    }
    copy = student_copies.student_copy(notebook, "00_devices.ipynb")
    assert "formatted twice" not in json.dumps(copy)
    assert copy["cells"][first]["cell_type"] == "code"


@pytest.mark.parametrize(
    "text, message",
    [('{"cells": [', "05_broken.ipynb: not a readable notebook"), ('{"cells": [{"cell_type": "code"}]}', "cell 0")],
)
def test_a_broken_notebook_is_named_and_nothing_is_written(tmp_path, text, message):
    source = tmp_path / "notebooks"
    source.mkdir()
    (source / "05_broken.ipynb").write_text(text)
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "student_copies.py"), str(source), str(tmp_path / "student")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and message in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notebooks"], "nothing half-written"


def _make_targets(makefile: str) -> dict[str, str]:
    """Each target of a Makefile with its recipe."""
    targets, current = {}, None
    for line in makefile.splitlines():
        match = re.match(r"^([\w-]+):(?!=)", line)
        if match:
            current = match.group(1)
            targets[current] = ""
        elif line.startswith("\t") and current:
            targets[current] += line + "\n"
        elif line.strip() and not line.startswith("#"):
            current = None
    return targets


def test_the_handout_names_only_files_sections_targets_and_solutions_it_holds(handout):
    """Its README, Makefile, environment.yml and notebooks (tools/handout_refs.py): every path
    exists in the hand-out, every `make x` runs without the teacher's files, every README section
    named is in its README, no solution is promised, no stored output spoken of."""
    folder, _ = handout
    readme = (folder / "README.md").read_text()
    assert "teacher/" not in readme and "make test" not in readme
    found = handout_refs.unheld(handout_refs.handout_texts(folder), folder, readme, outputs_kept=False)
    assert found == [], "\n".join(found)


def test_the_handout_makefile_is_the_students(handout):
    """lab, kernel, bench, gpu-check and clean; it installs the lab extra, not the test tools."""
    folder, _ = handout
    makefile = (folder / "Makefile").read_text()
    assert set(_make_targets(makefile)) == {"install", "lab", "kernel", "bench", "gpu-check", "clean", "check-python"}
    assert makefile.startswith("# Set up the course and open it: make lab.")
    plan = subprocess.run(["make", "-n", "-B", "lab"], cwd=folder, capture_output=True, text=True)
    assert plan.returncode == 0, plan.stderr
    assert 'pip install --quiet -e ".[lab]"' in plan.stdout and "lab,test" not in plan.stdout
    assert plan.stdout.index('echo "Setting up the course') < plan.stdout.index("pip install")
    for target in ("kernel", "bench", "gpu-check", "clean"):
        plan = subprocess.run(["make", "-n", "-B", target], cwd=folder, capture_output=True, text=True)
        assert plan.returncode == 0, plan.stderr


def test_an_existing_folder_the_tool_did_not_write_is_not_replaced(tmp_path):
    (tmp_path / "notebooks").mkdir()
    shutil.copy(ROOT / "notebooks" / "06_scaling.ipynb", tmp_path / "notebooks")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(student_copies.HandoutError, match="was not written by this tool"):
        student_copies.write_handout(tmp_path / "notebooks", tmp_path / "mine", tmp_path / "mine.zip")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
def test_a_student_copy_runs_top_to_bottom_up_to_its_exercises(handout, monkeypatch):
    """Notebook 08 (the quickest to run; nbval runs them all): every cell runs, the placeholders
    included; only the cells the course tags 'raises-exception' may raise."""
    nbclient = pytest.importorskip("nbclient")
    import nbformat

    folder, _ = handout
    path = folder / "notebooks" / "08_sharding.ipynb"
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
    assert "stages 0-3 == Keras Adam within 1e-5" in printed


def test_placeholders_keep_their_solution_cells_ids_so_nbformat_does_not_warn():
    import warnings

    import nbformat

    notebook = _notebook_00()
    copy = student_copies.student_copy(notebook, "00_devices.ipynb")
    assert [c.get("id") for c in copy["cells"]] == [c["id"] for c in notebook["cells"]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # MissingIDFieldWarning: "will become a hard error"
        nbformat.validate(nbformat.from_dict(copy))


def test_a_cell_or_notebook_with_null_metadata_is_read_as_one_without(tmp_path):
    notebook = _notebook_00()
    notebook["metadata"], notebook["cells"][2]["metadata"] = None, None  # as a hand edit may leave them
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "00_devices.ipynb").write_text(json.dumps(notebook))
    student_copies.write_handout(tmp_path / "notebooks", tmp_path / "student", tmp_path / "student.zip")
    copy = json.loads((tmp_path / "student" / "notebooks" / "00_devices.ipynb").read_text())
    assert copy["metadata"] == {} and copy["cells"][2]["metadata"] == {}
    notebook["cells"][2]["metadata"] = ["tags"]
    (tmp_path / "notebooks" / "00_devices.ipynb").write_text(json.dumps(notebook))
    with pytest.raises(notebook_format.NotebookError, match=r"cell 2 has metadata \['tags'\], not an object"):
        notebook_format.read_notebook(tmp_path / "notebooks" / "00_devices.ipynb")


def test_an_archive_path_that_is_a_folder_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "notebooks").mkdir()
    shutil.copy(ROOT / "notebooks" / "06_scaling.ipynb", tmp_path / "notebooks")
    (tmp_path / "zips").mkdir()
    with pytest.raises(student_copies.HandoutError, match="is a folder; give the zip file's path"):
        student_copies.write_handout(tmp_path / "notebooks", tmp_path / "student", tmp_path / "zips")
    assert not (tmp_path / "student").exists() and not any((tmp_path / "zips").iterdir())
