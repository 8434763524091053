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

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    shutil.copy(ROOT / "Makefile", tmp_path)
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
