"""One core device: a TensorFlow server process that runs on one CPU core only.

It pins itself to its core *before* importing TensorFlow (which sizes its thread pools from
the cores it may use), prints a `READY` line and serves until stopped; with `--profiler-port`
it also serves TensorFlow's profiler for `timeline.trace`. Run by file path, importing only
the standard library at the top, so that it does not depend on how the parent found the
package: ``python core_worker.py --task 0 --core 0 --cluster localhost:2222,localhost:2223``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

READY = "READY"
INTER_OP_THREADS = 2  # a few ops of one device may wait on transfers while another computes


def watch(pids: list[int], log_dir: str, frozen_limit: float) -> None:
    """Kill each worker stopped (SIGSTOP, Ctrl-Z) for `frozen_limit` seconds, noting it in
    `log_dir`/worker<task>.frozen, until every worker has exited.

    A process of its own, not a thread of the notebook's: a thread waits for the Python lock,
    which a notebook blocked in a call to the frozen worker may hold.
    """
    frozen_since: dict[int, float] = {}
    while True:
        states = {task: _state(pid) for task, pid in enumerate(pids)}
        if all(state in (None, "Z") for state in states.values()):
            return
        for task, state in states.items():
            if state != "T":
                frozen_since.pop(task, None)
            elif time.monotonic() - frozen_since.setdefault(task, time.monotonic()) > frozen_limit:
                Path(log_dir, f"worker{task}.frozen").write_text(f"{frozen_limit:g}\n")
                os.kill(pids[task], signal.SIGKILL)
        time.sleep(0.25)


def _state(pid: int) -> str | None:
    """A process's state letter from Linux's /proc ('T' stopped, 'Z' exited), None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def skip_plotting_imports() -> None:
    """Make `import matplotlib` and `import IPython` fail in this process, which never plots.

    Keras, which `import tensorflow` loads, imports both whenever they are installed (each in a
    try/except ImportError): about 1 s of CPU at every worker start. None in sys.modules makes
    an import raise ImportError.
    """
    sys.modules.update(dict.fromkeys(("matplotlib", "IPython")))


def main(argv=None) -> None:
    if argv and argv[0] == "--watch":  # --watch PIDS LOG_DIR FROZEN_LIMIT_S
        watch([int(p) for p in argv[1].split(",")], argv[2], float(argv[3]))
        return
    args = _arguments(argv)
    addresses = args.cluster.split(",")
    if hasattr(os, "sched_setaffinity"):  # Linux; elsewhere the device is not pinned
        os.sched_setaffinity(0, {args.core})
    skip_plotting_imports()
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=INTER_OP_THREADS)
    try:
        server = tf.distribute.Server(
            tf.train.ClusterSpec({"worker": addresses}),
            job_name="worker",
            task_index=args.task,
            protocol="grpc",
            config=config,
            start=True,
        )
    except tf.errors.OpError as err:  # most often: another program took the port since it was picked
        sys.exit(f"core worker {args.task} cannot serve {addresses[args.task]} (is the port taken?): {err}")
    if args.profiler_port:
        # On demand, `timeline.trace` asks this server for a trace of the ops this worker ran.
        tf.profiler.experimental.server.start(args.profiler_port)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "any"
    print(
        f"{READY}: task {args.task} (pid {os.getpid()}) serving {addresses[args.task]} on core(s) {cores}, "
        f"intra-op threads 1, inter-op threads {INTER_OP_THREADS}",
        flush=True,
    )
    server.join()


def _arguments(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="One TensorFlow server pinned to one CPU core.")
    parser.add_argument("--task", type=int, required=True, help="this worker's index in the cluster")
    parser.add_argument("--core", type=int, required=True, help="the CPU core to run on")
    parser.add_argument("--cluster", required=True, help="every worker's host:port, comma separated")
    parser.add_argument("--profiler-port", type=int, default=0, help="serve profiler traces on this port (0: none)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
