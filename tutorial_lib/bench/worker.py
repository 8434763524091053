"""TensorFlow's own data parallelism on core devices: `MultiWorkerMirroredStrategy`, one worker per core.

`MirroredStrategy` refuses devices of other processes in eager mode, so on core devices the
peer of the hand-built step is `MultiWorkerMirroredStrategy`: one process per device, each
pinned to its core and limited to one intra-op thread as a core device is, started by
`cluster.Cluster` (which gives each its `TF_CONFIG`). The workers time their own steps in
interleaved rounds and the chief prints the timings as one JSON line; `peer_rows` sets them
beside the hand towers. They run by themselves, not in the bench's rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

RESULT = "MWMS_TIMINGS"  # the chief's output line: RESULT {per-device batch: [median, spread, samples]}
_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds this checkout's tutorial_lib


def time_mwms(workers: int, hidden, per_device, rounds: int, warmup: int = 2, timeout: float = 600.0) -> dict:
    """{per-device batch: `Timing`} of a `MultiWorkerMirroredStrategy` step, on `workers` cores."""
    from .. import core_devices
    from ..cluster import Cluster
    from ..timing import Timing

    cores = core_devices.cores_for(workers, core_devices.available_cores())
    args = ["--cores", _csv(cores), "--hidden", _csv(hidden), "--per-device", _csv(per_device)]
    args += ["--rounds", rounds, "--warmup", warmup]
    env = {
        # The workers import this checkout's package, whatever is installed; a core device is a CPU.
        "PYTHONPATH": os.pathsep.join(p for p in (str(_ROOT), os.environ.get("PYTHONPATH")) if p),
        "CUDA_VISIBLE_DEVICES": "",
    }
    with Cluster(["-m", "tutorial_lib.bench.worker"], workers, args=args, env=env) as job:
        job.wait(timeout=timeout)
        lines = [line for line in job.log(0).splitlines() if line.startswith(RESULT + " ")]
        if not lines:
            raise RuntimeError(f"the chief finished without printing its timings. Its log:\n{job.tail(0)}")
    timings = json.loads(lines[-1].split(" ", 1)[1])
    return {int(b): Timing(*t) for b, t in timings.items()}


def peer_rows(rows, devs, hidden, per_device, repeats) -> list[dict]:
    """`MultiWorkerMirroredStrategy` on as many cores as `devs`, with the hand towers' speedup over it."""
    from .rows import compared, row, timing_of

    k = len(devs)
    print(f"[weak] MultiWorkerMirroredStrategy: {k} worker processes, one per core ...", flush=True)
    new = []
    for b, t in time_mwms(k, hidden, per_device, rounds=repeats).items():
        hand = next(r for r in rows if (r["variant"], r["devices"], r["per_device"]) == ("hand towers", k, b))
        mwms = row("weak scaling", "MultiWorkerMirroredStrategy", t, devices=k, per_device=b)
        mwms["examples_per_s"] = b * k / t.median
        mwms["timed"] = "in its own processes, after the other variants: not interleaved with them"
        new.append(mwms | compared(timing_of(hand), t, "hand_towers_speedup"))
    return new


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

    from ..core_worker import INTER_OP_THREADS

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

    from .. import models, timing
    from ..strategy import mirrored_train_step
    from .rows import synthetic_batch

    variants = {}
    for b in args.per_device:
        with strategy.scope():
            net, sgd = models.MLP(hidden=args.hidden), tf.keras.optimizers.SGD(0.01)
        step = mirrored_train_step(strategy, net, sgd)
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
