"""Core devices: one TensorFlow server process (`core_worker`) per device, each pinned to its own
CPU core, started by `devices.simulate(n, kind="cores")` and watched so that no op waits forever
on a frozen or dead worker.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from . import core_worker, processes
from .cluster import free_ports, new_log_dir

START_TIMEOUT_S = 120.0  # a worker imports TensorFlow; on a busy machine that takes a while
LOCAL_JOB = "localhost"  # this process's own job: its CPU is not one of the devices
FROZEN_LIMIT_S = 3.0  # a worker stopped this long is killed, so that nothing waits on it forever
WATCH_EVERY_S = 0.25
RESTART = "restart the kernel (Kernel > Restart) and call simulate again to start fresh core devices"


@dataclass(frozen=True)
class Worker:
    """One started core device; `profiler` is the address `timeline.trace` asks for the ops it ran."""

    task: int
    core: int
    address: str
    log: Path
    process: subprocess.Popen
    profiler: str

    def ready(self) -> bool:
        return self.log.exists() and core_worker.READY in self.log.read_text(errors="replace")

    def tail(self) -> str:
        return processes.log_tail(self.log) or "(empty)"

    def describe(self) -> str:
        return f"core device {self.task} (pid {self.process.pid}, core {self.core})"


workers: list[Worker] = []  # the core devices this process started and is connected to


def device_name(task: int) -> str:
    """The full name of core device `task`, for `tf.device`."""
    return f"/job:worker/replica:0/task:{task}/device:CPU:0"


def cores_for(n: int, available) -> list[int]:
    """The core of each of n devices: one each while there are enough, then shared, with a warning."""
    available = sorted(available)
    if n > len(available):
        warnings.warn(
            f"{n} core devices on {len(available)} core(s): several devices share a core, so speed "
            "figures no longer mean one core per device (devices on one core slow each other down). "
            f"Results stay correct; for speed lessons use at most {len(available)} devices.",
            stacklevel=2,
        )
    return [available[k % len(available)] for k in range(n)]


def start(n: int) -> list[str]:
    """Start n core devices, connect this process to them and return their names."""
    # The cores this process may run on (all of them where that cannot be asked).
    cores = cores_for(n, os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1))
    ports = free_ports(2 * n)  # a server port and a profiler port for each worker, all distinct
    addresses = [f"localhost:{port}" for port in ports[:n]]
    profilers = [f"localhost:{port}" for port in ports[n:]]
    # Under cluster.log_root(): removed at exit, or swept by a later run if this one was killed.
    log_dir = new_log_dir()
    atexit.register(shutil.rmtree, log_dir, ignore_errors=True)
    started = [_spawn(task, core, addresses, profilers[task], log_dir) for task, core in enumerate(cores)]
    try:
        import tensorflow as tf  # imported here while the workers start

        _wait_until_ready(started, START_TIMEOUT_S)
        # Read by TensorFlow at each remote call: fail at once when a worker is unreachable
        # instead of waiting for it, and send ops as single calls (that honour fail-fast), not
        # on the stream that `tf.experimental.async_scope` turns on (it waits for a dead worker).
        os.environ.setdefault("GRPC_FAIL_FAST", "true")
        os.environ.setdefault("TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE", "false")
        tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec({"worker": addresses}), job_name=LOCAL_JOB)
        tf.config.list_logical_devices()  # contacts every worker now, not at the first op placed
    except BaseException:  # a failure, a timeout, or Ctrl-C: leave nothing running
        processes.stop([w.process for w in started], grace=2.0)
        raise
    workers.extend(started)
    atexit.register(_no_remote_removals_at_exit)  # runs before the workers stop: registered after
    pids = ",".join(str(w.process.pid) for w in started)
    watcher = [sys.executable, core_worker.__file__, "--watch", pids, str(log_dir), str(FROZEN_LIMIT_S)]
    processes.spawn(watcher, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    threading.Thread(target=_report_exits, args=(list(started),), name="core-device-exits", daemon=True).start()
    return [device_name(task) for task in range(n)]


def _no_remote_removals_at_exit() -> None:
    """Let the exit pass without asking stopped workers to forget this process's functions.

    When Python deletes a `tf.function`, TensorFlow asks every connected worker to remove it
    (`EagerContext::RemoveFunction`). At exit most are deleted after the atexit handlers, so after
    `processes` stopped the workers, and each request logs four lines "Failed to remove function
    remotely ... Connection refused" (notebook 05's kernel: 179 lines). TensorFlow skips the request
    once its table of function references is None, as it is while its modules are torn down
    (`atomic_function.AtomicFunction.__del__`); set it so now, when no step runs again.
    """
    try:
        from tensorflow.python.eager.polymorphic_function import atomic_function
    except ImportError:  # another TensorFlow layout: the lines may come back, nothing breaks
        return
    if hasattr(atomic_function, "RUNTIME_FUNCTION_REFS"):
        atomic_function.RUNTIME_FUNCTION_REFS = None


def check_workers() -> None:
    """Raise a RuntimeError naming every core device whose worker is gone, and what to do."""
    for worker in workers:
        if worker.log.with_suffix(".frozen").exists():  # killed: its sockets close before it is reaped
            worker.process.wait(timeout=10)
    dead = [w for w in workers if w.process.poll() is not None]
    if dead:
        said = "; ".join(f"{w.describe()} {_fault(w)}" for w in dead)
        raise RuntimeError(f"{said}. Its ops can no longer run: {RESTART}. Log: {dead[0].log}")


def _fault(worker: Worker) -> str:
    if worker.log.with_suffix(".frozen").exists():  # written by the watcher process
        return f"was frozen (stopped) for {FROZEN_LIMIT_S:g} s and was killed"
    return f"exited with status {worker.process.returncode}"


def _report_exits(watched: list[Worker]) -> None:
    """Say at once, by name, which core device's worker exited (a thread: when Python runs)."""
    while watched:
        time.sleep(WATCH_EVERY_S)
        for worker in [w for w in watched if w.process.poll() is not None]:
            watched.remove(worker)
            print(f"\n{worker.describe()} {_fault(worker)}: {RESTART}.", file=sys.stderr, flush=True)


def _worker_command(task: int, core: int, addresses: list[str]) -> list[str]:
    flags = f"--task {task} --core {core} --cluster {','.join(addresses)}"
    return [sys.executable, core_worker.__file__, *flags.split()]


def _spawn(task: int, core: int, addresses: list[str], profiler: str, log_dir: Path) -> Worker:
    log = log_dir / f"worker{task}.log"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # a core device is a CPU: leave any GPU alone
    command = [*_worker_command(task, core, addresses), "--profiler-port", profiler.rpartition(":")[2]]
    with open(log, "w") as out:
        process = processes.spawn(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Worker(task, core, addresses[task], log, process, profiler)


def _wait_until_ready(started: list[Worker], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    waiting = list(started)
    while True:
        waiting = [w for w in waiting if not w.ready()]
        if not waiting:
            return
        exited = [w for w in waiting if w.process.poll() is not None]
        if exited:
            raise RuntimeError(_exited_message(exited[0]))
        if time.monotonic() > deadline:
            raise RuntimeError(_late_message(waiting, timeout))
        time.sleep(0.05)


def _exited_message(worker: Worker) -> str:
    return (
        f"core device {worker.task} did not start: its worker (a TensorFlow server for {worker.address} "
        f"on core {worker.core}) exited with status {worker.process.poll()}, and the other workers were "
        "stopped. Call simulate again to retry on other ports; if it fails again, its log says why. "
        f"Last lines of {worker.log}:\n{worker.tail()}"
    )


def _late_message(waiting: list[Worker], timeout: float) -> str:
    first = waiting[0]
    return (
        f"core device(s) {[w.task for w in waiting]} not ready after {timeout:.0f} s, so every worker "
        "was stopped. A busy machine starts TensorFlow slowly: raise "
        "tutorial_lib.core_devices.START_TIMEOUT_S and call simulate again. "
        f"Last lines of {first.log}:\n{first.tail()}"
    )
