"""`make lab` really serves the course: start it headless, list the notebooks, stop it.
And the set-up it shares with `make test` picks the Python that was asked for, or says why not."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_make_lab_serves_the_notebooks(tmp_path):
    port, token = _free_port(), "course-test"
    args = f"--no-browser --ip=127.0.0.1 --port={port} --IdentityProvider.token={token} --ServerApp.port_retries=0"
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path), "JUPYTER_CONFIG_DIR": str(tmp_path)}
    proc = subprocess.Popen(
        ["make", "-s", "lab", f"LAB_ARGS={args}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/api/contents?token={token}"
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as reply:
                    listing = json.load(reply)
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
                assert time.monotonic() < deadline, "JupyterLab did not answer within 90 s"
                time.sleep(0.5)
        served = {item["name"] for item in listing["content"]}
        expected = {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}
        assert expected and expected <= served
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/lab?token={token}", timeout=10) as page:
            assert page.status == 200
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """Stop make and the JupyterLab it started (they share a process group)."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


# --- which Python make sets .venv up with ------------------------------------------------
# These run the Makefile in a scratch directory with fake interpreters that report a chosen
# version, so no real virtual environment is built.


def _fake_python(path: Path, version: str) -> str:
    """An executable that runs `-c CODE ARGS` under this interpreter, claiming to be `version`."""
    major, minor = version.split(".")
    prelude = f"import sys; code = sys.argv.pop(1); sys.version_info = ({major}, {minor}, 0, 'final', 0); exec(code)"
    path.write_text(f'#!/bin/sh\n[ "$1" = -c ] || exit 97\nshift\nexec "{sys.executable}" -c "{prelude}" "$@"\n')
    path.chmod(0o755)
    return str(path)


def _scratch_project(tmp_path: Path, venv_version: str | None) -> Path:
    for name in ("Makefile", "course.mk"):
        shutil.copy(ROOT / name, tmp_path)
    (tmp_path / "pyproject.toml").write_text("")
    if venv_version:  # a .venv that is installed and up to date
        (tmp_path / ".venv" / "bin").mkdir(parents=True)
        _fake_python(tmp_path / ".venv" / "bin" / "python", venv_version)
        (tmp_path / ".venv" / ".installed").write_text("")
        os.utime(tmp_path / "pyproject.toml", (0, 0))
    return tmp_path


def _make(project: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "MAKEFLAGS", "MAKELEVEL")}
    return subprocess.run(["make", *args], cwd=project, env=env, capture_output=True, text=True)


def test_make_stops_when_python_names_another_version_than_the_venv(tmp_path):
    project = _scratch_project(tmp_path, venv_version="3.11")
    python312 = _fake_python(tmp_path / "python3.12", "3.12")
    result = _make(project, "install", f"PYTHON={python312}")
    assert result.returncode != 0, "make silently kept the Python 3.11 .venv"
    assert ".venv runs Python 3.11 but" in result.stderr and "is Python 3.12" in result.stderr
    assert f"make clean, then make PYTHON={python312} install" in result.stderr


def test_make_keeps_the_venv_when_python_is_not_given_or_matches(tmp_path):
    project = _scratch_project(tmp_path, venv_version="3.11")
    python311 = _fake_python(tmp_path / "python3.11", "3.11")
    for args in (["install"], ["install", f"PYTHON={python311}"]):
        result = _make(project, *args)
        assert result.returncode == 0, result.stderr
        assert "venv" not in result.stdout  # nothing rebuilt or reinstalled


def test_make_refuses_a_python_tensorflow_has_no_wheels_for(tmp_path):
    project = _scratch_project(tmp_path, venv_version=None)
    for version in ("3.9", "3.14"):
        result = _make(project, "install", f"PYTHON={_fake_python(tmp_path / f'python{version}', version)}")
        assert result.returncode != 0
        assert f"Python {version} cannot run the course" in result.stderr
        assert "stable wheels for Python 3.10 to 3.13" in result.stderr
        assert not (project / ".venv").exists()


# What a kernel started by hand has: none of the settings of the Makefile or of the tests.
_COURSE_SETTINGS = ("TF_CPP_MIN_LOG_LEVEL", "TUTORIAL_DEVICE", "PYTHONHASHSEED", "TUTORIAL_RAW_STDERR")


def _plain_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _COURSE_SETTINGS}
    return {**env, "PYTHONPATH": str(ROOT)}


@pytest.mark.slow
def test_the_first_import_and_simulate_print_one_line_in_a_plain_python():
    code = "import tutorial_lib\nfrom tutorial_lib import devices\ndevices.simulate(2)\n"
    result = subprocess.run(
        [sys.executable, "-c", code], env=_plain_env(), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", f"start-up noise on stderr: {result.stderr}"
    assert len(result.stdout.splitlines()) == 1 and "device" in result.stdout, result.stdout


# Every notebook's first cell in a kernel with a plain environment: tests/test_first_cells.py.


def test_the_filter_drops_only_start_up_noise_and_gives_stderr_back():
    """Without TensorFlow: noise lines written to descriptor 2 vanish, others pass unchanged (a
    partial line at once), and after stop_filtering_stderr() everything passes."""
    code = (
        "import os, tutorial_lib\n"
        "os.write(2, b'WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n')\n"
        "os.write(2, b'E0000 00:00:1796194778.447699   21888 cuda_platform.cc:52] failed call to cuInit: x\\n')\n"
        "os.write(2, b'a real warning\\nprompt> ')\n"
        "tutorial_lib.stop_filtering_stderr()\n"
        "os.write(2, b'E0000 00:00:1.1 1 cuda_platform.cc:52] failed call to cuInit: shown raw\\n')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=_plain_env(), cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    assert (
        result.stderr
        == "a real warning\nprompt> E0000 00:00:1.1 1 cuda_platform.cc:52] failed call to cuInit: shown raw\n"
    )


def test_the_lab_asks_no_news_question_and_checks_no_updates():
    # make install copies tools/lab_overrides.json where JupyterLab reads its defaults
    # (<prefix>/share/jupyter/lab/settings/overrides.json); each value must be one the schema allows.
    overrides = json.loads((ROOT / "tools" / "lab_overrides.json").read_text())
    schemas = Path(sys.prefix) / "share" / "jupyter" / "lab" / "schemas"
    for plugin, settings in overrides.items():
        package, name = plugin.rsplit(":", 1)
        schema = json.loads((schemas / package / f"{name}.json").read_text())["properties"]
        for key, value in settings.items():
            allowed = [c["const"] for c in schema[key].get("oneOf", [])] or [True, False]
            assert value in allowed, (plugin, key, value)
    assert overrides["@jupyterlab/apputils-extension:notification"] == {"checkForUpdates": False, "fetchNews": "false"}
    plan = subprocess.run(["make", "-n", "-B", "install"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "tools/lab_overrides.json" in plan and "share/jupyter/lab/settings/overrides.json" in plan


# --- the plain route: pip install, then the README's switch for the news pop-up -----------------
ANNOUNCEMENTS = "@jupyterlab/apputils-extension:announcements"  # the plugin that asks about news (JupyterLab docs)


def _news_switch() -> str:
    """The line both READMEs give on their pip route to turn the news plugin off."""
    sys.path.insert(0, str(ROOT / "tools"))
    import student_copies

    lines = {
        line.strip()
        for text in ((ROOT / "README.md").read_text(), student_copies.student_readme())
        for line in text.splitlines()
        if line.strip().startswith("jupyter labextension disable")
    }
    assert len(lines) == 1, f"the two READMEs should give the same switch once each: {lines}"
    return lines.pop()


def _fresh_environment(path: Path) -> Path:
    """A new virtual environment holding what `pip install -e ".[lab]"` puts there, without the network:
    this environment's packages (through a .pth file), its jupyter commands (rewritten for the new
    Python) and JupyterLab's data files, but not the settings `make lab` adds. Returns its bin folder."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    code = "import sys; print(sys.prefix, *__import__('site').getsitepackages(), sep='\\n')"
    prefix, *site_dirs = subprocess.run(
        [path / "bin" / "python", "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    course = "; ".join(f"site.addsitedir({d!r})" for d in __import__("site").getsitepackages())
    Path(site_dirs[0], "course.pth").write_text(f"import site; {course}\n")
    here = Path(sys.executable).parent
    for name in ("jupyter", "jupyter-lab", "jupyter-labextension"):
        body = (here / name).read_text().split("\n", 1)[1]
        (path / "bin" / name).write_text(f"#!{path / 'bin' / 'python'}\n{body}")
        (path / "bin" / name).chmod(0o755)
    shared = Path(sys.prefix) / "share" / "jupyter"
    for part in ("lab/static", "lab/schemas", "lab/themes", "labextensions"):
        (Path(prefix) / "share" / "jupyter" / part).parent.mkdir(parents=True, exist_ok=True)
        (Path(prefix) / "share" / "jupyter" / part).symlink_to(shared / part)
    return path / "bin"


def _served_page_config(bin_dir: Path, env: dict) -> dict:
    """The page configuration `jupyter lab notebooks/` serves to the browser (the plugins it turns off)."""
    port, token = _free_port(), "course-test"
    args = ["--no-browser", "--ip=127.0.0.1", f"--port={port}", f"--IdentityProvider.token={token}"]
    args += ["--ServerApp.port_retries=0", *(["--allow-root"] if os.getuid() == 0 else [])]
    proc = subprocess.Popen(
        [bin_dir / "jupyter", "lab", "notebooks/", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/lab?token={token}", timeout=5) as reply:
                    page = reply.read().decode()
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
                assert time.monotonic() < deadline, "JupyterLab did not answer within 90 s"
                time.sleep(0.5)
    finally:
        _stop(proc)
    data = page.split('id="jupyter-config-data" type="application/json">', 1)[1].split("</script>", 1)[0]
    return json.loads(data)


@pytest.mark.slow
def test_the_plain_route_turns_the_news_plugin_off_in_its_own_environment(tmp_path):
    switch = _news_switch()
    assert f'"{ANNOUNCEMENTS}"' in switch, switch
    bin_dir = _fresh_environment(tmp_path / "env")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER")}
    env |= {"PATH": f"{bin_dir}{os.pathsep}{env['PATH']}"}
    env |= {f"JUPYTER_{k}_DIR": str(tmp_path / k.lower()) for k in ("CONFIG", "DATA", "RUNTIME")}
    before = _served_page_config(bin_dir, env)
    assert ANNOUNCEMENTS not in before.get("disabledExtensions", []), "the imitation already had the plugin off"
    shared = Path(sys.prefix) / "etc" / "jupyter" / "labconfig" / "page_config.json"
    shared_before = shared.read_bytes() if shared.exists() else None
    result = subprocess.run(["bash", "-c", switch], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    after = _served_page_config(bin_dir, env)
    assert ANNOUNCEMENTS in after["disabledExtensions"], after.get("disabledExtensions")
    written = json.loads((tmp_path / "env" / "etc" / "jupyter" / "labconfig" / "page_config.json").read_text())
    assert written["disabledExtensions"] == {ANNOUNCEMENTS: True}, written  # in the environment, not the user's
    assert (shared.read_bytes() if shared.exists() else None) == shared_before, "it changed another environment"
