"""A local multi-worker cluster: N worker processes on loopback, configured by `TF_CONFIG`.

`Cluster(script, n)` picks free ports, starts one process per worker with its own
`TF_CONFIG`, writes each worker's output to a log file, waits with a timeout and stops
every process it started: on success, on failure, on timeout, when the notebook cell is
interrupted, and when the `with` block ends. Nothing is left running.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# TensorFlow's C++ INFO lines at start-up ("I0000 00:00:... port.cc:153] oneDNN ..."), printed
# before its logging is configured, so TF_CPP_MIN_LOG_LEVEL cannot silence them. Warnings
# and errors are kept.
_NOISE = re.compile(r"^(I\d{4} \d\d:\d\d:|WARNING: All log messages before absl::InitializeLog)")


class ClusterError(RuntimeError):
    """A worker failed, hung, or could not start; the message carries its log tail."""


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports that were free a moment ago (held together while chosen)."""
    if n < 1:
        raise ValueError(f"need at least one port, got {n}.")
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


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def tf_config(ports, index: int) -> dict:
    """The `TF_CONFIG` of worker `index` in a cluster of workers on the given loopback ports."""
    if not 0 <= index < len(ports):
        raise ValueError(f"worker index {index} is outside a cluster of {len(ports)} workers.")
    return {"cluster": {"worker": [f"localhost:{p}" for p in ports]}, "task": {"type": "worker", "index": index}}


class Cluster:
    """Start `script` (a .py file, or ['-m', 'module']) once per worker; stop them all on exit."""

    def __init__(self, script, workers: int, args=(), ports=None, env=None, log_dir=None):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"a cluster needs a whole number of workers >= 1, got {workers!r}.")
        command = list(script) if isinstance(script, (list, tuple)) else [str(script)]
        if command[0] != "-m" and not Path(command[0]).is_file():
            raise FileNotFoundError(f"no training script at {command[0]!r}; give the path of a .py file.")
        if ports is not None:
            if len(ports) != workers:
                raise ValueError(f"{workers} workers need {workers} ports, got {len(ports)}.")
            busy = [p for p in ports if not port_is_free(p)]
            if busy:
                raise ClusterError(f"port(s) {busy} already in use on 127.0.0.1: stop what holds them, "
                                   "or leave ports=None to pick free ones.")
        self.command = [sys.executable, *command, *map(str, args)]
        self.workers, self.ports = workers, list(ports) if ports else free_ports(workers)
        self.env = {**os.environ, **(env or {})}
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="cluster_logs_"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
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

    def tail(self, index: int, lines: int = 15) -> str:
        """The last lines of a worker's log, without TensorFlow's start-up INFO lines."""
        kept = [line for line in self.log(index).splitlines() if not _NOISE.match(line)]
        return "\n".join(kept[-lines:])

    def start(self):
        if self.processes:
            raise ClusterError("this cluster is already running; stop() it before starting again.")
        for index in range(self.workers):
            env = {**self.env, "TF_CONFIG": json.dumps(tf_config(self.ports, index))}
            with open(self.log_path(index), "w") as log:
                self.processes.append(subprocess.Popen(
                    self.command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        return self

    def wait(self, timeout: float = 120.0, check: bool = True) -> list[int]:
        """Wait for every worker; return their exit codes. Stops them all on timeout or failure."""
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in self.processes):
                failed = [i for i, p in enumerate(self.processes) if p.poll() not in (None, 0)]
                if check and failed:
                    raise self._failure(failed[0])
                if time.monotonic() > deadline:
                    hung = [i for i, p in enumerate(self.processes) if p.poll() is None]
                    raise ClusterError(f"worker(s) {hung} still running after {timeout:.0f} s; stopped them all. "
                                       f"Log tail of worker {hung[0]}:\n{self.tail(hung[0])}")
                time.sleep(0.1)
        except BaseException:  # a failure, a timeout, or Ctrl-C / Kernel > Interrupt
            self.stop()
            raise
        codes = [p.returncode for p in self.processes]
        failed = [i for i, c in enumerate(codes) if c != 0]
        if check and failed:
            raise self._failure(failed[0])
        return codes

    def _failure(self, index: int) -> ClusterError:
        code = self.processes[index].poll()
        self.stop()
        return ClusterError(f"worker {index} exited with status {code}; stopped the others. "
                            f"Log tail of worker {index}:\n{self.tail(index)}")

    def kill(self, index: int) -> None:
        """Kill one worker at once (SIGKILL), as a crash would."""
        process = self.processes[index]
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def stop(self) -> None:
        """Stop every worker still running: SIGTERM, then SIGKILL after 5 s. Safe to call twice."""
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            alive = [p for p in self.processes if p.poll() is None]
            for p in alive:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + grace
            while any(p.poll() is None for p in alive) and time.monotonic() < end:
                time.sleep(0.05)

    def running(self) -> list[int]:
        """Indices of the workers still running."""
        return [i for i, p in enumerate(self.processes) if p.poll() is None]
