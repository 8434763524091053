"""Children started with `processes.spawn` never outlive the process that started them."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tutorial_lib import processes

ROOT = Path(__file__).resolve().parents[1]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG")


def alive(pid: int) -> bool:
    """Whether `pid` still runs. A zombie counts as dead: in a container, PID 1 may never
    reap the orphans it inherits, and a zombie runs nothing and holds no port."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def all_dead(pids, within: float = 10.0) -> bool:
    """Poll until every pid is dead; False if one still runs after `within` seconds."""
    deadline = time.monotonic() + within
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kill_leftovers(pids) -> None:
    """Clean up after a failing test: a child and its process group."""
    for pid in pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def env_with_root() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


SLEEPER = python("import time; time.sleep(300)")
STUBBORN = python(
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(300)"
)


def test_spawn_and_stop():
    child = processes.spawn(SLEEPER)
    try:
        assert child.poll() is None
        processes.stop([child], grace=5.0)
        assert child.returncode == -signal.SIGTERM
    finally:
        kill_leftovers([child.pid])


def test_stop_kills_what_ignores_sigterm_even_from_a_generator():
    child = processes.spawn(STUBBORN, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"ready"
        processes.stop((p for p in [child]), grace=0.2)  # a generator: both passes must see the child
        assert child.returncode == -signal.SIGKILL
    finally:
        kill_leftovers([child.pid])
        child.stdout.close()


@linux_only
def test_stop_reaches_the_childs_whole_process_group():
    code = (
        "import subprocess, sys, time; "
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
        "print(g.pid, flush=True); time.sleep(300)"
    )
    child = processes.spawn(python(code), stdout=subprocess.PIPE)
    grandchild = int(child.stdout.readline())
    try:
        processes.stop([child], grace=5.0)
        assert all_dead([grandchild])
    finally:
        kill_leftovers([child.pid, grandchild])
        child.stdout.close()


PARENT = """
import os, signal, sys, time
from tutorial_lib import processes
signal.signal(signal.SIGHUP, signal.SIG_DFL)  # not ignored because the test runs under nohup
child = processes.spawn([sys.executable, "-c", "import time; time.sleep(300)"])
print(child.pid, flush=True)
if sys.argv[1] == "returns":
    sys.exit(0)
time.sleep(300)  # until the test's signal
"""


@linux_only
@pytest.mark.parametrize(
    "ending",
    ["returns", signal.SIGTERM, signal.SIGHUP, signal.SIGKILL],
    ids=["returns", "SIGTERM", "SIGHUP", "SIGKILL"],
)
def test_a_child_dies_with_its_parent(tmp_path, ending):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    how = ending if isinstance(ending, str) else "waits"
    parent = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, env=env_with_root())
    child = int(parent.stdout.readline())
    try:
        if not isinstance(ending, str):
            parent.send_signal(ending)
        parent.wait(timeout=60)  # a parent that survives its signal fails the test, it does not hang it
        assert all_dead([child]), f"child {child} outlived its parent ({ending})"
    finally:
        kill_leftovers([child])
        parent.kill()
        parent.wait()
        parent.stdout.close()
