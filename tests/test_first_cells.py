"""Every notebook's first code cell, run in a fresh kernel with none of the course's settings (a kernel
started by hand, a JupyterHub's), writes nothing to stderr: ipykernel shows what Python and TensorFlow's
C++ write there as a red block under the cell, and a student's first cell must not open with one.

The first cell imports tutorial_lib before TensorFlow: importing the package filters TensorFlow's start-up
lines from file descriptor 2 and sets TF_CPP_MIN_LOG_LEVEL=1 before TensorFlow reads it. A cell that
imports TensorFlow first shows them all (and, for the rest of the kernel, TensorFlow's INFO lines)."""

import ast
import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# What a kernel started by hand has not: the settings of the Makefile and of the tests, and pytest's
# PYTEST_CURRENT_TEST, under which ipykernel stops showing what is written to file descriptor 2
# (ipykernel/iostream.py, OutStream's watchfd), and which would hide exactly what this file checks.
PLAIN_KERNEL_LACKS = ("TF_CPP_MIN_LOG_LEVEL", "TUTORIAL_DEVICE", "PYTHONHASHSEED", "TUTORIAL_RAW_STDERR")
PLAIN_KERNEL_LACKS += ("PYTEST_CURRENT_TEST",)
CELL_TIMEOUT_S = 300  # a busy machine imports TensorFlow and starts core devices slowly


def first_code_cell(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return next("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def run_in_fresh_kernel(code: str, cwd: Path) -> dict:
    """Run `code` in a new python3 kernel with a plain environment; return its {'stdout', 'stderr', 'status'}
    as the notebook would show them, then shut the kernel down (its core-device workers die with it)."""
    from jupyter_client.manager import start_new_kernel

    env = {k: v for k, v in os.environ.items() if k not in PLAIN_KERNEL_LACKS} | {"PYTHONPATH": str(ROOT)}
    manager, client = start_new_kernel(kernel_name="python3", startup_timeout=120, env=env, cwd=str(cwd))
    shown = {"stdout": "", "stderr": ""}

    def collect(msg):
        if msg["msg_type"] == "stream":
            shown[msg["content"]["name"]] += msg["content"]["text"]
        elif msg["msg_type"] == "error":
            shown["stderr"] += "\n".join(msg["content"]["traceback"])

    try:
        reply = client.execute_interactive(code, timeout=CELL_TIMEOUT_S, output_hook=collect)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)
    return {**shown, "status": reply["content"]["status"]}


def imports_of(code: str) -> list[str]:
    """The top-level modules `code` imports, in order."""
    found = []
    for node in ast.parse(code).body:
        if isinstance(node, ast.Import):
            found += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "").split(".")[0])
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_first_cell_imports_tutorial_lib_before_tensorflow_or_keras(path):
    """The quick, static half of the check below: it names the cell to fix without starting a kernel."""
    imports = imports_of(first_code_cell(path))
    assert "tutorial_lib" in imports, f"{path.name}: its first code cell does not import tutorial_lib"
    first = imports.index("tutorial_lib")
    early = [name for name in imports[:first] if name in ("tensorflow", "keras")]
    assert not early, f"{path.name}: its first code cell imports {early} before tutorial_lib, so nothing filters it"


def test_the_static_check_catches_tensorflow_first():
    assert imports_of("import tensorflow as tf\nfrom tutorial_lib import devices\n") == ["tensorflow", "tutorial_lib"]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_first_cell_writes_nothing_to_stderr_in_a_fresh_plain_kernel(path):
    shown = run_in_fresh_kernel(first_code_cell(path), cwd=path.parent)
    assert shown["status"] == "ok", shown["stderr"][-3000:]
    lines = shown["stderr"].splitlines()
    assert lines == [], f"{path.name}: {len(lines)} line(s) on stderr in its first cell:\n" + "\n".join(lines[:20])
    assert "device(s)" in shown["stdout"], shown["stdout"]  # simulate's one line: the cell really ran


@pytest.mark.slow
def test_the_kernel_check_sees_tensorflow_started_first():
    """A cell that imports TensorFlow before tutorial_lib, in the same kind of kernel, shows lines on stderr
    (so the check above can fail): at least "All log messages before absl::InitializeLog()"."""
    shown = run_in_fresh_kernel("import tensorflow as tf\nfrom tutorial_lib import devices\n", cwd=ROOT)
    assert shown["status"] == "ok"
    assert "absl::InitializeLog()" in shown["stderr"], shown["stderr"]
