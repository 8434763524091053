"""The project's promises: set-up files that agree, a README with the two commands,
CI that runs the README's command, and notebooks stored clean and run."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
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
                        f"{path.name}: unexpected stored error {out['ename']}"
                    )


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


# --- install hygiene: supported Pythons, license ---------------------------------------


def _allows(spec: str, version: tuple[int, int]) -> bool:
    """Whether a version specifier such as '>=3.10,<3.14' admits Python `version`."""
    checks = {
        ">=": tuple.__ge__,
        ">": tuple.__gt__,
        "<=": tuple.__le__,
        "<": tuple.__lt__,
        "==": tuple.__eq__,
        "!=": tuple.__ne__,
    }
    for clause in spec.split(","):
        op, number = re.fullmatch(r"\s*(>=|<=|==|!=|>|<)\s*([\d.]+)\s*", clause).groups()
        if not checks[op](version, tuple(int(p) for p in number.split("."))[:2]):
            return False
    return True


def _makefile_range() -> tuple[tuple[int, int], tuple[int, int]]:
    makefile = (ROOT / "course.mk").read_text()  # the Makefile includes it
    oldest, newest = (
        re.search(rf"^{name} := (\d+)\.(\d+)$", makefile, re.MULTILINE).groups() for name in ("PY_OLDEST", "PY_NEWEST")
    )
    return tuple(map(int, oldest)), tuple(map(int, newest))


def test_supported_pythons_are_310_to_313_everywhere():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda_python = next(d for d in env["dependencies"] if isinstance(d, str) and _name(d) == "python")
    oldest, newest = _makefile_range()
    assert (oldest, newest) == ((3, 10), (3, 13))
    for where, spec in (
        ("pyproject.toml", project["requires-python"]),
        ("environment.yml", conda_python[len("python") :]),
    ):
        # TensorFlow has no stable wheels above 3.13: pip would pick a release candidate.
        assert not _allows(spec, (3, 14)), f"{where} lets Python 3.14 in: {spec!r}"
        assert not _allows(spec, (3, 9)), f"{where} lets Python 3.9 in: {spec!r}"
        for minor in range(oldest[1], newest[1] + 1):
            assert _allows(spec, (3, minor)), f"{where} refuses Python 3.{minor}: {spec!r}"
    versions = "Programming Language :: Python :: 3."
    listed = {c.rsplit(" ", 1)[-1] for c in project["classifiers"] if c.startswith(versions)}
    assert listed == {f"3.{minor}" for minor in range(oldest[1], newest[1] + 1)}


def test_license_file_exists_and_pyproject_names_it():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License")
    assert "seeds" in text, "LICENSE should say that the seed questions are not covered"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT"
    assert project["license-files"] == ["LICENSE"]
    assert project["authors"] and project["keywords"]
    # An SPDX license string needs setuptools 77 or newer to build.
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert any(re.fullmatch(r"setuptools>=(\d+)", r) and int(r.split(">=")[1]) >= 77 for r in build)


# --- stored outputs: no start-up noise, no local paths, the kernel ipykernel installs ----


def _clean_tool():
    spec = importlib.util.spec_from_file_location("clean_notebooks", ROOT / "tools" / "clean_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _text(value) -> str:
    return value if isinstance(value, str) else "".join(value)


def _output_texts(output: dict):
    """Every text an output shows: stream text, traceback, error value, text/* data."""
    if output["output_type"] == "stream":
        yield _text(output["text"])
    elif output["output_type"] == "error":
        yield output["evalue"]
        yield from output["traceback"]
    else:
        yield from (_text(v) for k, v in output.get("data", {}).items() if k.startswith("text/"))


def _outputs(nb: dict):
    for cell in nb["cells"]:
        yield from cell.get("outputs", [])


def test_stored_stderr_has_no_tensorflow_startup_noise():
    noise = _clean_tool().NOISE
    for path in NOTEBOOKS:
        for output in _outputs(json.loads(path.read_text())):
            if output["output_type"] == "stream" and output["name"] == "stderr":
                text = _text(output["text"])
                assert "absl::InitializeLog" not in text and "oneDNN custom operations" not in text, path.name
                lines = [line for line in text.splitlines() if noise.fullmatch(line)]
                assert not lines, f"{path.name}: start-up noise stored; run tools/clean_notebooks.py: {lines}"


def test_stored_outputs_show_no_local_paths():
    local = re.compile(r"/(?:work|home|root|Users)/|(?<!\.\.\.)/site-packages/")
    for path in NOTEBOOKS:
        for output in _outputs(json.loads(path.read_text())):
            for text in _output_texts(output):
                found = local.search(text)
                assert not found, f"{path.name}: local path in an output: ...{text[found.start() :][:80]!r}"


def test_notebooks_name_the_kernel_that_ipykernel_installs():
    for path in NOTEBOOKS:
        spec = json.loads(path.read_text())["metadata"]["kernelspec"]
        assert spec == {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}, path.name


def _synthetic_notebook() -> dict:
    red = "\x1b[32m"
    traceback = [
        "\x1b[31mValueError\x1b[39m  Traceback (most recent call last)",
        f"\x1b[36mFile \x1b[39m{red}/home/ann/course/.venv/lib/python3.12/site-packages/tensorflow/x.py:3\x1b[39m",
        f"\x1b[36mFile \x1b[39m{red}/home/ann/course/tutorial_lib/devices.py:89\x1b[39m, in simulate",
        f"\x1b[36mFile \x1b[39m{red}/usr/lib/python3.12/json/decoder.py:1\x1b[39m",
    ]
    startup = [
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
        "I0000 00:00:1796030814.734006    4212 port.cc:153] oneDNN custom operations are on. "
        "You may see slightly different numerical results.\n",
        "I0000 00:00:1796030814.734940    4212 cudart_stub.cc:31] Could not find cuda drivers on your machine, "
        "GPU will not be used.\n",
    ]
    real = "W0000 00:00:1796030814.9    4212 allocator.cc:1] Allocation of 4000000 exceeds 10% of free memory.\n"
    outputs = [
        {"output_type": "stream", "name": "stderr", "text": startup},
        {"output_type": "stream", "name": "stderr", "text": "".join(startup) + real},
        {"output_type": "stream", "name": "stdout", "text": ["saved to /home/ann/course/out.txt\n"]},
        {"output_type": "error", "ename": "ValueError", "evalue": "bad", "traceback": traceback},
    ]
    return {
        "cells": [
            {"cell_type": "code", "source": ["x = 1\n"], "metadata": {}, "execution_count": 1, "outputs": outputs},
            {"cell_type": "markdown", "source": ["/home/ann stays in prose\n"], "metadata": {}},
        ],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def test_clean_notebooks_drops_noise_shortens_paths_and_names_the_kernel():
    tool = _clean_tool()
    before = _synthetic_notebook()
    after = tool.clean(before, "/home/ann/course")
    outputs = after["cells"][0]["outputs"]
    # The all-noise output is gone; the real warning stays, alone.
    assert [o.get("name") for o in outputs] == ["stderr", "stdout", None]
    assert _text(outputs[0]["text"]) == before["cells"][0]["outputs"][1]["text"].splitlines(True)[-1]
    assert isinstance(outputs[0]["text"], str)  # a field keeps its form (str or list of lines)
    # stdout is compared by nbval: left alone (the test above flags paths there instead).
    assert outputs[1] == before["cells"][0]["outputs"][2]
    traceback = outputs[2]["traceback"]
    assert traceback[0] == before["cells"][0]["outputs"][3]["traceback"][0]
    assert "\x1b[32m.../site-packages/tensorflow/x.py:3\x1b[39m" in traceback[1]
    assert "\x1b[32m./tutorial_lib/devices.py:89\x1b[39m" in traceback[2]
    assert "\x1b[32m.../python3.12/json/decoder.py:1\x1b[39m" in traceback[3]
    assert after["cells"][1] == before["cells"][1]
    assert after["metadata"]["kernelspec"] == {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    assert before == _synthetic_notebook(), "clean() must not change its argument"
    assert tool.clean(after, "/home/ann/course") == after, "cleaning twice changes nothing"


def test_clean_notebooks_rewrites_only_what_changed(tmp_path):
    tool = _clean_tool()
    dirty, tidy = tmp_path / "dirty.ipynb", tmp_path / "tidy.ipynb"
    dirty.write_text(tool.dumps(_synthetic_notebook()))
    tidy.write_text(tool.dumps(tool.clean(_synthetic_notebook(), "/home/ann/course")))
    stamp = tidy.stat().st_mtime_ns
    assert tool.main(["--root", "/home/ann/course", str(dirty), str(tidy)]) == 0
    assert dirty.read_text() == tidy.read_text()
    assert tidy.stat().st_mtime_ns == stamp
    for path in NOTEBOOKS:  # the stored notebooks are already clean, byte for byte
        text = path.read_text()
        assert tool.dumps(tool.clean(json.loads(text), str(ROOT))) == text, path.name


def _makefile_without_install(folder):
    """The course's Makefile in `folder`, with a .venv stamp newer than pyproject.toml: make plans no install."""
    for name in ("Makefile", "course.mk"):
        shutil.copy(ROOT / name, folder)
    (folder / "pyproject.toml").write_text("")
    (folder / ".venv").mkdir()
    (folder / ".venv" / ".installed").write_text("")
    os.utime(folder / "pyproject.toml", (0, 0))


def test_make_notebooks_cleans_what_it_executed(tmp_path):
    _makefile_without_install(tmp_path)
    plan = subprocess.run(
        ["make", "-n", "notebooks"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHON"},
        check=True,
    ).stdout
    execute, clean = plan.index("nbconvert"), plan.index("tools/clean_notebooks.py")
    assert execute < clean


# --- TensorFlow's log level, set before TensorFlow starts ------------------------------


def _log_level_after_import(**env) -> str:
    base = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    code = "import os, sys, tutorial_lib; print(os.environ.get('TF_CPP_MIN_LOG_LEVEL'), 'tensorflow' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**base, **env}, capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


def test_importing_tutorial_lib_hides_tensorflow_info_logs_but_not_warnings():
    # Level 1 hides INFO lines and keeps warnings and errors; tensorflow is not imported yet.
    assert _log_level_after_import() == "1 False"


def test_a_log_level_set_by_the_user_or_the_makefile_wins():
    assert _log_level_after_import(TF_CPP_MIN_LOG_LEVEL="3") == "3 False"
    assert _log_level_after_import(TF_CPP_MIN_LOG_LEVEL="0") == "0 False"


# --- make test runs the notebooks once more under the other math library ----------------------


def _make_test_plan(tmp_path, *args) -> str:
    tmp_path = tmp_path / "_".join(("plan", *args))
    tmp_path.mkdir()
    _makefile_without_install(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "MAKEFLAGS", "MAKELEVEL")}
    return subprocess.run(
        ["make", "-n", "test", *args], cwd=tmp_path, capture_output=True, text=True, env=env, check=True
    ).stdout


def test_make_test_runs_the_notebooks_again_with_onednn_switched(tmp_path):
    plan = _make_test_plan(tmp_path)
    first, flip = plan.index("pytest"), plan.index("tools/onednn_flip.py")
    assert first < flip
    second = plan[flip:]
    assert "TF_ENABLE_ONEDNN_OPTS=$flip .venv/bin/python -m pytest" in second and "--nbval" in second
    assert " tests " not in second  # the notebooks only: the unit tests ran once
    assert "onednn_flip.py" not in _make_test_plan(tmp_path, "FLIP_ONEDNN=0")


def _onednn_flip_tool():
    spec = importlib.util.spec_from_file_location("onednn_flip", ROOT / "tools" / "onednn_flip.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.mark.parametrize("default_on", [False, True])
def test_onednn_flip_prints_the_value_that_switches_this_runs_onednn(monkeypatch, capsys, default_on):
    tool = _onednn_flip_tool()
    # TensorFlow's rule, without starting it: the machine's default unless the variable says 0 or 1.
    monkeypatch.setattr(
        tool, "onednn_on", lambda env: {"0": False, "1": True}.get(env.get("TF_ENABLE_ONEDNN_OPTS"), default_on)
    )
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    tool.main()
    assert capsys.readouterr().out == ("0\n" if default_on else "1\n")
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0" if default_on else "1")  # a run that already flipped it
    tool.main()
    assert capsys.readouterr().out == ("1\n" if default_on else "0\n")


def test_onednn_flip_prints_nothing_and_says_why_where_tensorflow_cannot_switch(monkeypatch, capsys):
    tool = _onednn_flip_tool()
    monkeypatch.setattr(tool, "onednn_on", lambda _env: False)  # a TensorFlow built without oneDNN
    tool.main()
    out, err = capsys.readouterr()
    assert out == "" and "cannot switch it" in err


@pytest.mark.slow
def test_onednn_flip_asks_this_tensorflow():
    # The tool checks in a child that its value switches oneDNN, or prints nothing and says why.
    result = subprocess.run(
        [sys.executable, "tools/onednn_flip.py"], cwd=ROOT, capture_output=True, text=True, timeout=600, check=True
    )
    assert result.stdout in ("0\n", "1\n") or (result.stdout == "" and "cannot switch it" in result.stderr), result
