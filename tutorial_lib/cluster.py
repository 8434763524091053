"""A local multi-worker cluster: `Cluster(script, n)` runs n worker processes on loopback, each with
its `TF_CONFIG` and log file, and stops them all however the cell ends. The logs stay readable
after the `with` block and go with the `Cluster` object (or, left by a killed kernel, with the next).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

from . import checks, processes


class ClusterError(RuntimeError):
    """A worker failed, hung, or could not start; the message carries its log tail."""


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports that were free a moment ago (held together while chosen)."""
    n = checks.whole_number(n, "the number of ports")
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(ports, index: int) -> dict:
    """The `TF_CONFIG` of worker `index` in a cluster of workers on the given loopback ports."""
    if not 0 <= index < len(ports):
        raise ValueError(f"worker index {index} is outside a cluster of {len(ports)} workers.")
    return {"cluster": {"worker": [f"localhost:{p}" for p in ports]}, "task": {"type": "worker", "index": index}}


def log_root() -> Path:
    """The folder that holds the log folders of the clusters created without `log_dir`."""
    return Path(tempfile.gettempdir()) / f"tutorial_lib_cluster_logs_{os.getuid()}"


def _owner_alive(folder: Path) -> bool:
    """Whether the process that created a log folder (named '<pid>_...') may still run."""
    pid = folder.name.split("_")[0]
    if not pid.isdigit():  # not one of ours: leave it alone
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        pass
    return True


def sweep_logs() -> None:
    """Remove the log folders under `log_root()` whose process has died (a killed kernel)."""
    root = log_root()
    if root.is_dir():
        for folder in root.iterdir():
            if not _owner_alive(folder):
                shutil.rmtree(folder, ignore_errors=True)


def _remove_log_dir(folder: Path) -> None:
    """Remove a cluster's log folder, and `log_root()` with it once no other cluster's is left."""
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):  # while another cluster's folder is in it, it stays
        folder.parent.rmdir()


def new_log_dir() -> Path:
    """A fresh log folder under `log_root()`, after removing those whose process has died."""
    sweep_logs()
    log_root().mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}_", dir=log_root()))


class Cluster:
    """Start `script` (a .py file, or ['-m', 'module']) once per worker; stop them all on exit."""

    def __init__(self, script, workers: int, args=(), env=None):
        workers = checks.whole_number(workers, "workers")
        command = list(script) if isinstance(script, (list, tuple)) else [str(script)]
        if command[0] != "-m" and not Path(command[0]).is_file():
            raise FileNotFoundError(f"no training script at {command[0]!r}; give the path of a .py file.")
        if isinstance(args, str):
            raise TypeError(f"args must be a list of arguments, got the string {args!r}; write {args.split()!r}.")
        self.command = [sys.executable, *command, *map(str, args)]
        self.workers = workers
        self.ports = free_ports(workers)
        self.env = {**os.environ, **(env or {})}
        self.log_dir = new_log_dir()
        weakref.finalize(self, _remove_log_dir, self.log_dir)  # removed with this object
        self.processes: list[subprocess.Popen] = []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def log_path(self, index: int) -> Path:
        return self.log_dir / f"worker{index}.log"

    def log(self, index: int) -> str:
        path = self.log_path(index)
        return path.read_text(errors="replace") if path.exists() else ""

    def tail(self, index: int) -> str:
        """The last lines of a worker's log, without TensorFlow's start-up INFO lines."""
        return processes.log_tail(self.log_path(index))

    def start(self):
        """Start every worker (again, after `stop` or `wait`: the logs then start afresh)."""
        if self.running():
            raise ClusterError("this cluster is already running; stop() it before starting again.")
        self.processes = []
        for index in range(self.workers):
            env = {**self.env, "TF_CONFIG": json.dumps(tf_config(self.ports, index))}
            with open(self.log_path(index), "w") as log:
                self.processes.append(processes.spawn(self.command, env=env, stdout=log, stderr=subprocess.STDOUT))
        return self

    def wait(self, timeout: float = 120.0) -> list[int]:
        """Wait for every worker; return their exit codes (all 0). Stops them all on timeout or failure."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                codes = [p.poll() for p in self.processes]
                failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
                if failed:
                    raise ClusterError(
                        f"worker {failed[0]} exited with status {codes[failed[0]]}; stopped the others. "
                        f"Log tail of worker {failed[0]}:\n{self.tail(failed[0])}"
                    )
                if None not in codes:
                    return codes
                if time.monotonic() > deadline:
                    hung = [i for i, code in enumerate(codes) if code is None]
                    raise ClusterError(
                        f"worker(s) {hung} still running after {timeout:.0f} s; stopped them all. "
                        f"Log tail of worker {hung[0]}:\n{self.tail(hung[0])}"
                    )
                time.sleep(0.1)
        except BaseException:  # a failure, a timeout, or Ctrl-C / Kernel > Interrupt
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every worker still running: SIGTERM, then SIGKILL after 5 s. Safe to call twice."""
        processes.stop(self.processes, grace=5.0)

    def running(self) -> list[int]:
        """Indices of the workers still running."""
        return [i for i, p in enumerate(self.processes) if p.poll() is None]
