"""TensorFlow's own data parallelism on core devices: `MultiWorkerMirroredStrategy`, one worker per core.

On in-process logical devices the peer of the hand-built data-parallel step is
`MirroredStrategy`. On core devices it cannot be: `MirroredStrategy` refuses devices of other
processes in eager mode ("In-graph multi-worker training with `MirroredStrategy` is not
supported in eager mode"). TensorFlow's route across processes is
`MultiWorkerMirroredStrategy`: one process per device, each running the same program, the
gradients summed by collective all-reduce ops. So this module starts one such worker per
core with `cluster.Cluster` (which gives each its `TF_CONFIG`), each pinned to its own core
before TensorFlow is imported, with one intra-op thread, as a core device is; the workers
train the bench's model on the bench's batches and time their steps themselves, in
interleaved rounds, and the chief prints its timings as one JSON line.

`time_mwms(workers, hidden, per_device, rounds)` does all of that from the bench's process
and returns {per-device batch: Timing}. The workers run by themselves, so their rounds cannot
be interleaved with the bench's own variants: compare them as ratios with their spreads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

RESULT = "MWMS_TIMINGS"  # the chief's output line: RESULT {per-device batch: [median, spread]}
INTER_OP_THREADS = 2  # as a core device's server (core_worker.INTER_OP_THREADS)
_ROOT = Path(__file__).resolve().parents[1]  # the folder that holds this checkout's tutorial_lib


def time_mwms(workers: int, hidden, per_device, rounds: int, warmup: int = 2, timeout: float = 600.0) -> dict:
    """Median and spread of a `MultiWorkerMirroredStrategy` step per per-device batch, on `workers` cores."""
    from . import core_devices
    from .cluster import Cluster
    from .timing import Timing

    cores = core_devices.cores_for(workers, core_devices.available_cores())
    args = ["--cores", _csv(cores), "--hidden", _csv(hidden), "--per-device", _csv(per_device)]
    args += ["--rounds", rounds, "--warmup", warmup]
    env = {
        # The workers import this checkout's package, whatever is installed; a core device is a CPU.
        "PYTHONPATH": os.pathsep.join(p for p in (str(_ROOT), os.environ.get("PYTHONPATH")) if p),
        "CUDA_VISIBLE_DEVICES": "",
    }
    with Cluster(["-m", "tutorial_lib.bench_worker"], workers, args=args, env=env) as job:
        job.wait(timeout=timeout)
        lines = [line for line in job.log(0).splitlines() if line.startswith(RESULT + " ")]
        if not lines:
            raise RuntimeError(f"the chief finished without printing its timings. Its log:\n{job.tail(0)}")
    timings = json.loads(lines[-1].split(" ", 1)[1])
    return {int(b): Timing(*t) for b, t in timings.items()}


def _csv(values) -> str:
    return ",".join(str(v) for v in values)


def _task_index() -> int:
    return json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)


def main(argv=None) -> int:
    args = _arguments(argv)
    index = _task_index()
    if hasattr(os, "sched_setaffinity"):  # before TensorFlow sizes its thread pools
        os.sched_setaffinity(0, {args.cores[index % len(args.cores)]})
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(INTER_OP_THREADS)
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=args.collective_timeout)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    timings = _time_steps(strategy, index, args)
    if index == 0:
        print(RESULT, json.dumps({b: list(t) for b, t in timings.items()}), flush=True)
    return 0


def _time_steps(strategy, index: int, args) -> dict:
    """Every per-device batch's step, timed in interleaved rounds (every worker makes the same calls)."""
    import functools

    import tensorflow as tf

    from . import models, timing
    from .bench_rows import synthetic_batch
    from .strategy import mirrored_train_step

    variants = {}
    for b in args.per_device:
        with strategy.scope():
            net, sgd = models.MLP(hidden=args.hidden), tf.keras.optimizers.SGD(0.01)
        step = mirrored_train_step(strategy, net, sgd, b * strategy.num_replicas_in_sync)
        x, y = synthetic_batch(b, seed=index)  # this worker's share of the global batch
        variants[b] = functools.partial(step, x, y)  # returns the summed loss: the timing waits for it
    return timing.interleaved(variants, rounds=args.rounds, warmup=args.warmup)


def _numbers(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def _arguments(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="One MultiWorkerMirroredStrategy worker of the bench, on one core.")
    parser.add_argument("--cores", type=_numbers, required=True, help="the core of each worker, comma separated")
    parser.add_argument("--hidden", type=_numbers, required=True, help="the MLP's hidden widths, comma separated")
    parser.add_argument("--per-device", type=_numbers, required=True, help="per-device batches, comma separated")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--collective-timeout", type=float, default=120.0, help="seconds to wait for a peer")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
