"""Child processes that die with the process that started them, however it ends: on Linux by
`PR_SET_PDEATHSIG` (even when the parent is killed), at a normal exit by `atexit`, elsewhere on
SIGTERM and SIGHUP. Each child has a session of its own: a Ctrl-C in the notebook does not reach
it, and `stop` signals its whole process group.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# TensorFlow's C++ INFO lines at start-up ("I0000 00:00:... port.cc:153] oneDNN ..."), printed
# before its logging is configured, so TF_CPP_MIN_LOG_LEVEL cannot silence them. Warnings
# and errors are kept.
STARTUP_NOISE = re.compile(r"^(I\d{4} \d\d:\d\d:|WARNING: All log messages before absl::InitializeLog)")
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_children: list[subprocess.Popen] = []
_lock = threading.Lock()


def _die_with(parent: int):
    # Looked up here, in the parent: the child of a multi-threaded process (TensorFlow) must
    # not load libraries between fork and exec, where a lock another thread held stays held.
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:  # runs in the child, between fork and exec
        # The signal fires when the *thread* that started the child ends: start children from
        # a thread that lives as long as they should (the main one).
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: nobody would tell us
            os._exit(1)

    return preexec


def spawn(command, *, env=None, stdout=None, stderr=None) -> subprocess.Popen:
    """Start `command` (a list) as a child that is stopped when this process ends."""
    _install_handlers()
    preexec = _die_with(os.getpid()) if sys.platform.startswith("linux") else None
    process = subprocess.Popen(
        command, env=env, stdout=stdout, stderr=stderr, start_new_session=True, preexec_fn=preexec
    )
    with _lock:
        _children[:] = [p for p in _children if p.poll() is None]
        _children.append(process)
    return process


def stop(processes, grace: float = 5.0) -> None:
    """Stop processes and their groups: SIGTERM, then SIGKILL after `grace` seconds."""
    processes = list(processes)  # read twice, once per signal: a generator would be empty the second time
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in processes if p.poll() is None]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
        end = time.monotonic() + grace
        while any(p.poll() is None for p in alive) and time.monotonic() < end:
            time.sleep(0.05)


def log_tail(path, lines: int = 15) -> str:
    """The last lines of a child's log file, without TensorFlow's start-up INFO lines ('' if none)."""
    path = Path(path)
    text = path.read_text(errors="replace") if path.exists() else ""
    kept = [line for line in text.splitlines() if not STARTUP_NOISE.match(line)]
    return "\n".join(kept[-lines:])


def _stop_all() -> None:
    with _lock:
        children = list(_children)
    stop(children, grace=2.0)


def _exit_on_signal(signum, _frame) -> None:
    _stop_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # end as the signal would have ended us


@functools.cache  # once per process
def _install_handlers() -> None:
    atexit.register(_stop_all)
    # On Linux PR_SET_PDEATHSIG already stops the children when a signal ends this process.
    if sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) in (signal.SIG_DFL, None):  # keep handlers someone else set
            signal.signal(signum, _exit_on_signal)
