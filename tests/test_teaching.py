"""The README's Teaching section and the make targets it documents."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TIME = re.compile(r"\*\*Time\.\*\*\s+About\s+(\d+)\s+minutes")


def _teaching() -> str:
    readme = (ROOT / "README.md").read_text()
    assert "## Teaching" in readme, "the README has no Teaching section"
    return readme.split("## Teaching", 1)[1].split("\n## ", 1)[0]


def _stated_minutes(path: Path) -> int:
    first = "".join(json.loads(path.read_text())["cells"][0]["source"])
    match = TIME.search(first)
    assert match, f"{path.name}: the first cell states no '**Time.** About N minutes'"
    return int(match.group(1))


def test_teaching_times_are_the_notebooks_own_estimates_and_add_up():
    section = _teaching()
    listed = {name: int(m) for name, m in re.findall(r"^\| `(\d\d_\w+)` \| (\d+) min \|", section, re.MULTILINE)}
    assert listed == {p.stem: _stated_minutes(p) for p in NOTEBOOKS}, "update the README's Teaching table"
    total = re.search(r"\*\*total\*\* \| \*\*(\d+) min", section)
    assert total and int(total.group(1)) == sum(listed.values())


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
