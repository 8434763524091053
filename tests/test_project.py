"""The project's promises: set-up files that agree, a README with the two commands,
CI that runs the README's command, and notebooks stored clean and run."""

import json
import re
from pathlib import Path

import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_installs_what_pyproject_declares():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"]}
    for extra in ("lab", "test"):
        declared |= {_name(r) for r in project["optional-dependencies"][extra]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    listed = set()
    for dep in env["dependencies"]:
        for item in dep["pip"] if isinstance(dep, dict) else [dep]:
            if not item.startswith("-e"):
                listed.add(_name(item))
    assert listed - {"python", "pip"} == declared
    assert any(isinstance(d, dict) and "-e ." in d["pip"] for d in env["dependencies"])


def test_readme_shows_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.MULTILINE)


def test_course_map_in_readme_lists_every_notebook():
    readme = (ROOT / "README.md").read_text()
    for path in NOTEBOOKS:
        assert path.stem in readme, f"{path.name} is missing from the README's course map"


def test_notebooks_are_stored_run_and_clean():
    assert NOTEBOOKS, "no notebooks found"
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        code = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
        counts = [c["execution_count"] for c in code]
        assert all(counts), f"{path.name}: a code cell was never run"
        assert counts == sorted(counts), f"{path.name}: cells ran out of order; re-run top to bottom"
        for cell in code:
            assert "execution" not in cell["metadata"], f"{path.name}: per-run timing metadata"
            for out in cell["outputs"]:
                if out["output_type"] == "error":
                    assert "raises-exception" in cell["metadata"].get("tags", []), (
                        f"{path.name}: unexpected stored error {out['ename']}")


def test_every_notebook_starts_by_simulating_devices_and_follows_the_template():
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        first_code = next(c for c in nb["cells"] if c["cell_type"] == "code")
        assert "simulate(" in "".join(first_code["source"]), path.name
        text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        for heading in ("Learning objectives", "Exercises", "Summary"):
            assert heading in text, f"{path.name} has no '{heading}' section"
        tags = [t for c in nb["cells"] for t in c["metadata"].get("tags", [])]
        assert "solution" in tags, f"{path.name} has no solution cells"
