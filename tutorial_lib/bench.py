"""The course's benchmark: `python -m tutorial_lib.bench` measures every case on this machine.

Each case measures its variants in one run, on the same devices at the same moment, and
reports ratios (efficiency, speedup) beside the times: only ratios carry over from one
machine, or one minute, to the next. The timing tools themselves are in `timing`.
"""

from __future__ import annotations

import time

from .timing import measure


def _row(case, variant, seconds, spread, **extra):
    return {"case": case, "variant": variant, "ms": 1e3 * seconds, "spread_ms": 1e3 * spread, **extra}


def synthetic_batch(examples, seed=0):
    """Random 8x8 images and labels: for timing, where the values do not matter."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    x = tf.constant(rng.random((examples, 8, 8, 1), dtype=np.float32))
    return x, tf.constant(rng.integers(0, 10, examples, dtype=np.int32))


def weak_scaling(devs, hidden=(256, 256), per_device=256, repeats=15):
    """Same batch per device, 1..N devices: hand towers, ring with replicas, MirroredStrategy."""
    import tensorflow as tf

    from . import models, towers

    rows = []
    x, y = synthetic_batch(per_device * len(devs))
    for k in range(1, len(devs) + 1):
        xk, yk = x[: per_device * k], y[: per_device * k]
        with tf.device(devs[0]):
            net = models.MLP(hidden=hidden)
        t, s = measure(towers.make_train_step(net, devs[:k], 0.01), xk, yk, repeats=repeats)
        rows.append(_row("weak scaling", "hand towers", t, s, devices=k, examples_per_s=per_device * k / t))
        replicas = []
        for d in devs[:k]:
            with tf.device(d):
                replicas.append(models.MLP(hidden=hidden))
        t, s = measure(_ring_step(replicas, devs[:k]), xk, yk, repeats=repeats)
        rows.append(_row("weak scaling", "ring, replicated", t, s, devices=k, examples_per_s=per_device * k / t))
        t, s = _mirrored(devs[:k], hidden, xk, yk, repeats)
        rows.append(_row("weak scaling", "MirroredStrategy", t, s, devices=k, examples_per_s=per_device * k / t))
    for row in rows:
        one = next(r for r in rows if r["variant"] == row["variant"] and r["devices"] == 1)
        row["efficiency"] = row["examples_per_s"] / (row["devices"] * one["examples_per_s"])
    return rows


def _ring_step(replicas, devs):
    import tensorflow as tf

    from . import allreduce, models, towers

    @tf.function
    def step(x, y):
        grads = []
        for d, net, xs, ys in zip(devs, replicas, tf.split(x, len(devs)), tf.split(y, len(devs)), strict=True):
            with tf.device(d):
                with tf.GradientTape() as tape:
                    loss = models.cross_entropy(net(xs), ys)
                grads.append(tape.gradient(loss, net.trainable_variables))
        for net, g in zip(replicas, allreduce.allreduce_grads(grads, method="ring"), strict=True):
            towers.apply_sgd(net.trainable_variables, g, 0.01)

    return step


def _mirrored(devs, hidden, x, y, repeats):
    import tensorflow as tf

    from . import models
    from .strategy import mirrored_strategy, mirrored_train_step

    strategy = mirrored_strategy(devs)
    with strategy.scope():
        net, sgd = models.MLP(hidden=hidden), tf.keras.optimizers.SGD(0.01)
    k, batch = len(devs), int(x.shape[0])
    step = mirrored_train_step(strategy, net, sgd, batch)
    dist = strategy.experimental_distribute_values_from_function(
        lambda ctx: (tf.split(x, k)[ctx.replica_id_in_sync_group], tf.split(y, k)[ctx.replica_id_in_sync_group])
    )
    return measure(step, *dist, repeats=repeats)


def strong_scaling(devs, hidden=(256, 256), global_batch=512, repeats=15):
    """Same global batch, 1..N devices: each device's share shrinks."""
    import tensorflow as tf

    from . import models, towers

    rows = []
    x, y = synthetic_batch(global_batch)
    for k in range(1, len(devs) + 1):
        if global_batch % k:
            continue
        with tf.device(devs[0]):
            net = models.MLP(hidden=hidden)
        t, s = measure(towers.make_train_step(net, devs[:k], 0.01), x, y, repeats=repeats)
        rows.append(_row("strong scaling", "hand towers", t, s, devices=k, examples_per_s=global_batch / t))
    for row in rows:
        row["efficiency"] = row["examples_per_s"] / (row["devices"] * rows[0]["examples_per_s"])
    return rows


def packing(devs, tensors=100, elements=1000, repeats=15):
    """All-reduce of many small tensors, one call each, against the same bytes in one bucket."""
    import tensorflow as tf

    from . import allreduce

    nbytes = tensors * elements * 4

    def gradients(base):
        # Made inside the measured function from one scalar argument: 200 tensor arguments
        # would cost more than the all-reduce, and constants would be folded away.
        grads = []
        for i, d in enumerate(devs):
            with tf.device(d):
                grads.append([tf.fill([elements], base + float(i + j)) for j in range(tensors)])
        return grads

    one_by_one = tf.function(lambda b: allreduce.allreduce_grads(gradients(b), devices=devs))
    bucketed = tf.function(lambda b: allreduce.packed_allreduce_grads(gradients(b), nbytes, devices=devs))
    rows = []
    for variant, fn in ((f"{tensors} tensors, one all-reduce each", one_by_one), ("packed into one bucket", bucketed)):
        t, s = measure(fn, tf.constant(1.0), repeats=repeats)
        rows.append(_row("packing", variant, t, s, devices=len(devs), bytes=nbytes))
    rows[1]["speedup"] = rows[0]["ms"] / rows[1]["ms"]
    return rows


def allreduce_methods(devs, sizes=(1_000, 100_000, 1_000_000), repeats=15):
    """Central, ring and TensorFlow's collective all-reduce across sizes, with bus bandwidth."""
    import tensorflow as tf

    from . import allreduce
    from .strategy import mirrored_strategy

    n, rows = len(devs), []
    strategy = mirrored_strategy(devs)
    for size in sizes:
        tensors = []
        for i, d in enumerate(devs):
            with tf.device(d):
                tensors.append(tf.fill([size], float(i)))
        methods = {
            "central": tf.function(lambda ts: allreduce.central_all_reduce(ts, devices=devs)),
            "ring": tf.function(lambda ts: allreduce.ring_all_reduce(ts, devices=devs)),
        }
        collective = tf.function(
            lambda size=size: strategy.run(
                lambda: tf.distribute.get_replica_context().all_reduce("SUM", tf.ones([size]))
            )
        )
        nbytes = size * 4
        for name, fn in methods.items():
            t, s = measure(fn, tensors, repeats=repeats)
            rows.append(
                _row("all-reduce", name, t, s, devices=n, bytes=nbytes, bus_gb_per_s=2 * (n - 1) / n * nbytes / t / 1e9)
            )
        t, s = measure(collective, repeats=repeats)
        rows.append(
            _row(
                "all-reduce",
                "collective (MirroredStrategy)",
                t,
                s,
                devices=n,
                bytes=nbytes,
                bus_gb_per_s=2 * (n - 1) / n * nbytes / t / 1e9,
            )
        )
    return rows


def input_pipeline(devs, batch=256, steps=20, read_ms=2.0, repeats=5):
    """A training step fed by tf.data whose reads wait `read_ms` per batch (an emulated disk or
    network): no prefetch, tf.data prefetch, prefetch to the device."""
    import tensorflow as tf
    from tensorflow.python.data.experimental.ops.testing import sleep  # tf.data's own test helper

    from . import models, towers

    x, y = synthetic_batch(batch * steps)
    base = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
    base = base.apply(sleep(int(read_ms * 1000)))  # waits without using a core, as a disk read does
    plain = tf.data.Options()
    plain.experimental_optimization.inject_prefetch = False  # or tf.data adds a prefetch by itself
    variants = {
        "no prefetch": base.with_options(plain),
        "tf.data prefetch": base.prefetch(2),
        "prefetch to the device": base.apply(tf.data.experimental.prefetch_to_device(devs[0], 2)),
    }
    with tf.device(devs[0]):
        net = models.MLP(hidden=(512, 512))
    step = towers.make_train_step(net, devs[:1], 0.01)
    rows = []
    for name, ds in variants.items():

        def epoch(ds=ds):
            for xb, yb in ds:
                loss = step(xb, yb)
            return loss

        t, s = measure(epoch, repeats=repeats)
        rows.append(_row("input pipeline", name, t / steps, s / steps, devices=1, read_ms=read_ms))
    return rows


def pipeline_vs_naive(devs, width=512, batch=2048, micro_batches=8, repeats=5, rounds=3, steps=4):
    """A balanced 2-stage MLP: the naive split against the one-graph GPipe and 1F1B steps.

    Variants are interleaved in `rounds` (each round measures every variant once) so that a
    busy machine slows them alike. The bubble is read from the times: with S stages busy all
    the time a step would take t_naive / S, so the idle share is 1 - t_naive / (S t).
    GPipe is also measured at M = 1, 2, 4 to compare that share with (S-1)/(M+S-1), with
    recomputation (the time it costs), and over `steps` batches fed from this process with
    and without `StagedInput`.
    """
    import tensorflow as tf

    from . import pipeline

    pair, S = devs[:2], 2
    stages = _balanced_stages(pair, width)
    x, y = _dense_batch(batch, width)
    variants = {"naive split": (_naive_step(stages, pair), None)}
    for kind, m in [("gpipe", micro_batches), ("1f1b", micro_batches), *(("gpipe", m) for m in (1, 2, 4))]:
        if m <= micro_batches and batch % m == 0 and f"{kind}, M={m}" not in variants:
            pipe = pipeline.Pipeline(stages, pair, m, learning_rate=0.0, schedule=kind)
            variants[f"{kind}, M={m}"] = (pipe.train_step, {"schedule": kind, "micro_batches": m})
    recompute = pipeline.Pipeline(stages, pair, micro_batches, learning_rate=0.0, schedule="gpipe", recompute=True)
    info = {"schedule": "gpipe", "micro_batches": micro_batches}
    variants[f"gpipe, M={micro_batches}, recompute"] = (recompute.train_step, {**info, "recompute": True})
    pipe = pipeline.Pipeline(stages, pair, micro_batches, learning_rate=0.0, schedule="gpipe")
    staged = pipeline.StagedInput(pipe)
    batches = [(tf.identity(x), tf.identity(y)) for _ in range(steps)]  # in this process, not on the devices
    feeds = {
        f"gpipe, M={micro_batches}, {steps} steps fed from here": lambda *_: [pipe.train_step(*b) for b in batches],
        f"gpipe, M={micro_batches}, {steps} steps, StagedInput": lambda *_: staged.run(batches),
    }
    for name, fn in feeds.items():
        variants[name] = (fn, {**info, "steps": steps})
    rows = _interleaved("pipeline", variants, (x, y), rounds, repeats, devices=S)
    naive_ms = rows[0]["ms"]
    for row in rows:  # every figure is the time of one step
        row["ms"], row["spread_ms"] = row["ms"] / row.get("steps", 1), row["spread_ms"] / row.get("steps", 1)
        row["speedup_vs_naive"] = naive_ms / row["ms"]
        if row.get("micro_batches"):
            row["bubble_measured"] = 1 - naive_ms / (S * row["ms"])
            row["bubble_theory"] = pipeline.bubble_fraction(S, row["micro_batches"])
    return rows


def _balanced_stages(devs, width):
    """Two stages of three width x width ReLU layers (the second adds the logits), one per device."""
    import tensorflow as tf

    from . import models

    stages = []
    for s, d in enumerate(devs):
        with tf.device(d):
            layers = [models.Dense(width, width, relu=True, seed=10 * s + i) for i in range(3)]
            stages.append(models.Sequential(layers + ([models.Dense(width, 10)] if s else [])))
    return stages


def _dense_batch(batch, width, seed=0):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=(batch, width)).astype(np.float32))
    return x, tf.constant(rng.integers(0, 10, batch).astype(np.int32))


def _naive_step(stages, devs):
    """The naive split (notebook 01) as one tf.function: one device busy at a time."""
    import tensorflow as tf

    from . import pipeline

    variables = [v for stage in stages for v in stage.trainable_variables]

    @tf.function
    def naive(x, y):  # the update keeps the backward pass: unused gradients would be pruned
        loss, grads = pipeline.sequential_gradients(stages, devs, x, y)
        for v, g in zip(variables, grads, strict=True):
            with tf.device(v.device):
                v.assign_sub(0.0 * g)
        return loss

    return naive


def _interleaved(case, variants, args, rounds, repeats, **extra):
    """One row per variant: the median over `rounds` of its median time, every variant once per
    round, so that a slow minute slows them all; the spread is the range of the round medians."""
    import statistics

    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (fn, _) in variants.items():
            times[name].append(measure(fn, *args, repeats=repeats)[0])
    return [
        _row(case, name, statistics.median(times[name]), max(times[name]) - min(times[name]), **extra, **(info or {}))
        for name, (_, info) in variants.items()
    ]


def mixed_precision(devs, repeats=10):
    """float32 against mixed float16 on the first device, only where it is a GPU with tensor
    cores (compute capability >= 7)."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    capability = tf.config.experimental.get_device_details(gpus[0]).get("compute_capability") if gpus else None
    if "GPU" not in devs[0] or not capability or capability < (7, 0):
        return [
            {
                "case": "mixed precision",
                "variant": "skipped",
                "ms": None,
                "spread_ms": None,
                "reason": "no GPU with tensor cores (compute capability 7.0+); CPUs gain nothing from float16",
            }
        ]

    @tf.function
    def matmul(a):
        with tf.device(devs[0]):
            return tf.matmul(a, a)

    with tf.device(devs[0]):
        x = tf.random.normal([4096, 4096])
    rows = []
    for dtype in (tf.float32, tf.float16):
        with tf.device(devs[0]):
            a = tf.cast(x, dtype)
        t, s = measure(matmul, a, repeats=repeats)
        rows.append(
            _row("mixed precision", f"matmul 4096 {dtype.name}", t, s, devices=1, tflops=2 * 4096**3 / t / 1e12)
        )
    return rows


CASES = {
    "weak": weak_scaling,
    "strong": strong_scaling,
    "packing": packing,
    "allreduce": allreduce_methods,
    "input": input_pipeline,
    "pipeline": pipeline_vs_naive,
    "mixed": mixed_precision,
}


def format_table(rows) -> str:
    lines = [f"{'case':16s} {'variant':38s} {'devices':>7s} {'ms':>9s} {'spread':>8s}  notes"]
    for r in rows:
        notes = ", ".join(
            f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
            for k, v in r.items()
            if k not in ("case", "variant", "ms", "spread_ms", "devices")
        )
        ms = "-" if r["ms"] is None else f"{r['ms']:9.3f}"
        spread = "-" if r["spread_ms"] is None else f"{r['spread_ms']:8.3f}"
        lines.append(f"{r['case']:16s} {r['variant']:38s} {r.get('devices', '-')!s:>7s} {ms:>9s} {spread:>8s}  {notes}")
    return "\n".join(lines)


# Cases that need two devices, with the reason printed when they are skipped on one.
_NEEDS_TWO_DEVICES = {
    "packing": "an all-reduce needs 2 or more devices",
    "allreduce": "an all-reduce needs 2 or more devices",
    "pipeline": "a 2-stage pipeline needs 2 devices",
}


def _parser():
    import argparse
    import os

    parser = argparse.ArgumentParser(
        prog="python -m tutorial_lib.bench", description="Measure the course's cases on this machine's devices."
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="devices to use (default: 2, or the number of cores if fewer)",
    )
    parser.add_argument("--hidden", type=int, default=256, help="width of the MLP's two hidden layers")
    parser.add_argument("--batch", type=int, default=256, help="examples per device")
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per figure (median reported)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to the file PATH")
    return parser


def _parse(argv):
    """(options, cases), all checked before anything is measured: a typo must not cost a long run."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.devices < 1:
        parser.error(f"--devices must be >= 1, got {args.devices}")
    if args.hidden < 1 or args.batch < 1 or args.repeats < 1:
        parser.error("--hidden, --batch and --repeats must be >= 1")
    cases = _selected_cases(parser, args.cases)
    if args.json:
        _check_json_path(parser, args.json)
    return args, cases


def _selected_cases(parser, text: str) -> list[str]:
    cases = list(dict.fromkeys(c.strip() for c in text.split(",") if c.strip()))  # each once, in order
    if not cases:
        parser.error(f"--cases {text!r} names no case; give one or more of {','.join(CASES)}, separated by commas")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {','.join(CASES)}")
    return cases


def _check_json_path(parser, path: str) -> None:
    import os

    if os.path.isdir(path):
        parser.error(f"--json {path} is a folder; give a file name in it, such as {os.path.join(path, 'bench.json')}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        parser.error(f"cannot write --json {path}: {folder} is not a writable folder")


def _case_options(args) -> dict[str, dict]:
    hidden = (args.hidden, args.hidden)
    return {
        "weak": dict(hidden=hidden, per_device=args.batch, repeats=args.repeats),
        "strong": dict(hidden=hidden, global_batch=args.batch * args.devices, repeats=args.repeats),
        "packing": dict(repeats=args.repeats),
        "allreduce": dict(repeats=args.repeats),
        "input": dict(batch=args.batch),
        "pipeline": {},
        "mixed": {},
    }


def _run_cases(cases, devs, options) -> list[dict]:
    """Every case in turn, with its progress printed as it goes (a case can take minutes)."""
    rows = []
    for name in cases:
        if name in _NEEDS_TWO_DEVICES and len(devs) < 2:
            print(f"[{name}] skipped: {_NEEDS_TWO_DEVICES[name]}", flush=True)
            continue
        start = time.perf_counter()
        print(f"[{name}] running ...", flush=True)
        new = CASES[name](devs, **options[name])
        print(f"[{name}] {len(new)} figures in {time.perf_counter() - start:.1f} s", flush=True)
        rows += new
    return rows


def main(argv=None) -> int:
    import json
    import os
    import sys

    args, cases = _parse(argv)
    cores = os.cpu_count() or 1
    if args.devices > cores:
        print(
            f"warning: {args.devices} simulated devices on {cores} cores: at most {cores} run at once, so "
            "speedups beyond that show correctness, not speed (notebook 00).",
            file=sys.stderr,
        )

    from . import devices

    devs = devices.simulate(args.devices)
    rows = _run_cases(cases, devs, _case_options(args))
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"devices": devs, "cores": cores, "options": vars(args), "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
