"""The course's benchmark: `python -m tutorial_lib.bench` measures every case on this machine.

Each case measures its variants in one run, on the same devices, in interleaved rounds
(`timing.interleaved`: round r times variant A once, B once, ...), and reports ratios
(efficiency, speedup) beside the times, with the range their spreads allow and a verdict
computed from them ("faster", "slower", "no significant difference"): only ratios carry
over from one machine, or one minute, to the next.

The devices are core devices by default (`devices.simulate(n, kind="cores")`: one
TensorFlow server process per device, each on its own core), because logical devices of one
process share its threads and cannot show parallelism; `--device-model logical` uses
devices of this process instead. Every row says which in `device_model`. A busy machine
(load average above the core count) is reported before measuring.

The data-parallel cases (weak and strong scaling) are in `bench_scaling`, TensorFlow's
multi-worker peer in `bench_worker`, the pipeline in `bench_pipeline`, and how a row is made
in `bench_rows`; this module has the other cases, the table and the command line.
"""

from __future__ import annotations

import functools
import itertools
import time

from . import timing
from .bench_pipeline import gap_parts, pipeline_vs_naive, sharing_rows, sharing_slowdown
from .bench_rows import checksums as _checksums
from .bench_rows import compared as _compared
from .bench_rows import device_model as _device_model
from .bench_rows import row as _row
from .bench_rows import synthetic_batch
from .bench_scaling import strong_scaling, weak_scaling


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

    one_by_one = tf.function(lambda b: _checksums(devs, allreduce.allreduce_grads(gradients(b), devices=devs)))
    bucketed = tf.function(
        lambda b: _checksums(devs, allreduce.packed_allreduce_grads(gradients(b), nbytes, devices=devs))
    )
    base = tf.constant(1.0)
    names = (f"{tensors} tensors, one all-reduce each", "packed into one bucket")
    timings = timing.interleaved(
        {names[0]: functools.partial(one_by_one, base), names[1]: functools.partial(bucketed, base)}, rounds=repeats
    )
    rows = [_row("packing", name, *timings[name], devices=len(devs), bytes=nbytes) for name in names]
    rows[1].update(_compared(timings[names[1]], timings[names[0]], "speedup"))
    return rows


# Tensor sizes (float32 elements) of the all-reduce case: from one element, where the time is
# the latency of the messages alone, to 4 MB, where it is bandwidth; the tiny ones pin down
# the fitted latency (alpha), which the large ones alone leave to the noise.
ALLREDUCE_SIZES = (1, 10, 100, 1_000, 10_000, 100_000, 1_000_000)


def allreduce_methods(devs, sizes=ALLREDUCE_SIZES, repeats=15):
    """Central, ring and (on devices of this process) TensorFlow's collective all-reduce across
    sizes, with bus bandwidth; then each method's fitted latency and bandwidth (alpha-beta)."""
    import tensorflow as tf

    from . import allreduce

    n, rows = len(devs), []
    methods = {
        "central": tf.function(lambda ts: _checksums(devs, allreduce.central_all_reduce(ts, devices=devs))),
        "ring": tf.function(lambda ts: _checksums(devs, allreduce.ring_all_reduce(ts, devices=devs))),
    }
    collective = _collective_all_reduce(devs)
    for size in sizes:
        tensors = []
        for i, d in enumerate(devs):
            with tf.device(d):
                tensors.append(tf.fill([size], float(i)))
        variants = {name: functools.partial(fn, tensors) for name, fn in methods.items()}
        if collective:
            variants["collective (MirroredStrategy)"] = functools.partial(collective, size)
        for name, t in timing.interleaved(variants, rounds=repeats).items():
            bus = 2 * (n - 1) / n * size * 4 / t.median / 1e9
            rows.append(_row("all-reduce", name, *t, devices=n, bytes=size * 4, bus_gb_per_s=bus))
    return rows + _alpha_beta_rows(rows, n)


def _collective_all_reduce(devs):
    """TensorFlow's collective all-reduce under MirroredStrategy, as a function of the size; None on
    core devices, where MirroredStrategy refuses devices of other processes."""
    import tensorflow as tf

    from .strategy import mirrored_strategy

    if _device_model() == "cores":
        return None
    strategy = mirrored_strategy(devs)

    @tf.function
    def collective(size):
        summed = strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("SUM", tf.ones([size])))
        return _checksums(devs, strategy.experimental_local_results(summed))

    return collective


def _alpha_beta_rows(rows, n):
    """Each method's latency per message (alpha) and link bandwidth (1/beta), fitted on its medians."""
    from . import costmodel

    fits = []
    for method, algorithm in (("central", "central"), ("ring", "ring"), ("collective (MirroredStrategy)", "ring")):
        mine = sorted((r["bytes"], r["ms"] / 1e3) for r in rows if r["variant"] == method)
        if len({b for b, _ in mine}) < 2:
            continue
        link = costmodel.fit_alpha_beta([b for b, _ in mine], [t for _, t in mine], n, algorithm)
        messages = 2 * (n - 1)
        fits.append(
            {
                "case": "all-reduce fit",
                "variant": f"{method} ({algorithm} model)",
                "ms": None,
                "spread_ms": None,
                "devices": n,
                "alpha_us": 1e6 * link.alpha,
                # The latency read directly off the smallest size, for comparison with the fit;
                # a fitted alpha of 0 means the fit clipped a negative intercept.
                "smallest_us_per_message": 1e6 * mine[0][1] / messages,
                "link_gb_per_s": 1 / link.beta / 1e9 if link.beta > 0 else None,
                "device_model": _device_model(),
            }
        )
    return fits


def input_pipeline(devs, batch=256, steps=20, read_ms=2.0, repeats=5):
    """A training step fed by tf.data whose reads wait `read_ms` per batch (an emulated disk or
    network): no prefetch, tf.data prefetch, and prefetch to the device where the device is in
    this process (a dataset cannot be sent to a core device's process)."""
    import tensorflow as tf
    from tensorflow.python.data.experimental.ops.testing import sleep  # tf.data's own test helper

    from . import models, towers

    x, y = synthetic_batch(batch * steps)
    base = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
    base = base.apply(sleep(int(read_ms * 1000)))  # waits without using a core, as a disk read does
    plain = tf.data.Options()
    plain.experimental_optimization.inject_prefetch = False  # or tf.data adds a prefetch by itself
    variants = {"no prefetch": base.with_options(plain), "tf.data prefetch": base.prefetch(2)}
    if _device_model() != "cores":  # prefetch_to_device cannot send a dataset to another process
        variants["prefetch to the device"] = base.apply(tf.data.experimental.prefetch_to_device(devs[0], 2))
    with tf.device(devs[0]):
        net = models.MLP(hidden=(512, 512))
    step = towers.make_train_step(net, devs[:1], 0.01)

    def epoch(ds):
        for xb, yb in ds:
            loss = step(xb, yb)
        return loss

    timings = timing.interleaved({name: functools.partial(epoch, ds) for name, ds in variants.items()}, rounds=repeats)
    rows = []
    for name, t in timings.items():
        row = _row("input pipeline", name, t.median / steps, t.spread / steps, devices=1, read_ms=read_ms)
        rows.append({**row, **_compared(t, timings["no prefetch"], "speedup")} if rows else row)
    return rows


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
                "device_model": _device_model(),
            }
        ]

    @tf.function
    def matmul(a):
        with tf.device(devs[0]):
            return tf.matmul(a, a)

    with tf.device(devs[0]):
        x = tf.random.normal([4096, 4096])
    variants = {}
    for dtype in (tf.float32, tf.float16):
        with tf.device(devs[0]):
            variants[f"matmul 4096 {dtype.name}"] = functools.partial(matmul, tf.cast(x, dtype))
    timings = timing.interleaved(variants, rounds=repeats)
    rows = [
        _row("mixed precision", name, *t, devices=1, tflops=2 * 4096**3 / t.median / 1e12)
        for name, t in timings.items()
    ]
    rows[1].update(_compared(timings["matmul 4096 float16"], timings["matmul 4096 float32"], "speedup"))
    return rows


CASES = {
    "weak": weak_scaling,
    "strong": strong_scaling,
    "packing": packing,
    "allreduce": allreduce_methods,
    "input": input_pipeline,
    "pipeline": pipeline_vs_naive,  # gap_parts(rows, variant) reads the parts of its gap
    "mixed": mixed_precision,
}


def _note(key, value) -> str:
    if isinstance(value, dict):
        return f"{key} {{{', '.join(_note(k, v) for k, v in value.items())}}}"
    if isinstance(value, float):
        return f"{key} {value:.3g}"
    if isinstance(value, list):
        return f"{key} [{', '.join(f'{v:.3g}' if isinstance(v, float) else str(v) for v in value)}]"
    return f"{key} {value}"


def format_table(rows) -> str:
    lines = [f"{'case':16s} {'variant':44s} {'devices':>7s} {'ms':>9s} {'spread':>8s}  notes"]
    for r in rows:
        notes = ", ".join(
            _note(k, v)
            for k, v in r.items()
            if k not in ("case", "variant", "ms", "spread_ms", "devices", "device_model")
        )
        ms = "-" if r["ms"] is None else f"{r['ms']:9.3f}"
        spread = "-" if r["spread_ms"] is None else f"{r['spread_ms']:8.3f}"
        lines.append(f"{r['case']:16s} {r['variant']:44s} {r.get('devices', '-')!s:>7s} {ms:>9s} {spread:>8s}  {notes}")
    return "\n".join(lines)


def summary(rows) -> list[str]:
    """The headline of each case measured, computed from its rows: one line each."""
    lines = [*_weak_summary(rows), *_pipeline_summary(rows)]
    for r in rows:
        if r["variant"] == "MultiWorkerMirroredStrategy":
            lines.append(
                f"hand towers vs MultiWorkerMirroredStrategy at {r['per_device']} per device: "
                f"{r['hand_towers_speedup']:.2f}x ({r['hand_towers_speedup_verdict']})"
            )
        elif r["case"] == "packing" and "speedup" in r:
            lines.append(f"packing into one bucket: {r['speedup']:.2f}x ({r['speedup_verdict']})")
        elif r["case"] == "all-reduce fit":
            lines.append(
                f"{r['variant']}: alpha {r['alpha_us']:.0f} us per message (smallest size: "
                f"{r['smallest_us_per_message']:.0f} us), link {_gb(r['link_gb_per_s'])}"
            )
    return lines


def _pipeline_summary(rows) -> list[str]:
    """GPipe and 1F1B at the largest M, and data parallelism, against the naive split; with the
    gap measurements, each schedule's gap to the ideal, its largest part and the residual."""
    mine = {r["variant"]: r for r in rows if r["case"] == "pipeline" and "speedup_vs_naive_verdict" in r}
    m = max((r.get("micro_batches", 0) for r in mine.values()), default=0)
    schedules = [v for v in (f"gpipe, M={m}", f"1f1b, M={m}") if v in mine]
    lines = []
    for variant in [*schedules, "data parallel, ring"]:
        if variant in mine:
            r = mine[variant]
            low, high = r["speedup_vs_naive_range"]
            lines.append(
                f"pipeline {variant}: {r['speedup_vs_naive']:.2f}x the naive split "
                f"(range {low:.2f}-{high:.2f}, {r['speedup_vs_naive_verdict']})"
            )
            if "bubble_parts" in r:
                parts = ", ".join(f"{k} {v:.3f}" for k, v in r["bubble_parts"].items())
                lines.append(
                    f"pipeline {variant}: bubble {r['bubble_measured']:.3f} (formula {r['bubble_theory']:.3f}): {parts}"
                )
    if any(r.get("part") == "stage alone" and r["m"] == m for r in rows):
        for variant in schedules:
            gap = gap_parts(rows, variant)
            parts = dict(list(gap.items())[3:])
            largest = max(parts, key=lambda k: abs(parts[k]))
            lines.append(
                f"pipeline {variant}: {gap['gap_ms']:.1f} ms above the ideal {gap['ideal_ms']:.1f} ms; "
                f"largest part: {largest} {parts[largest]:+.1f} ms"
            )
        together, slowest = sharing_rows(rows, m)
        word = timing.verdict(*(timing.Timing(r["ms"], r["spread_ms"]) for r in (together, slowest)))
        lines.append(
            f"pipeline stages together, M={m}: {sharing_slowdown(rows, m):+.0%} against the slowest stage alone "
            f"({word}; sharing the machine, no hand-offs)"
        )
    return lines


def _gb(value) -> str:
    return "unbounded (beta fitted as 0)" if value is None else f"{value:.3g} GB/s"


def _weak_summary(rows) -> list[str]:
    lines = []
    for (variant, k), mine in _groups(rows, "weak scaling").items():
        if k == 1 or "efficiency" not in mine[0]:
            continue
        mine.sort(key=lambda r: r["per_device"])
        figures = ", ".join(f"{r['efficiency']:.2f} at {r['per_device']}" for r in mine)
        best = max(mine, key=lambda r: r["efficiency"])
        rising = all(a["efficiency"] < b["efficiency"] for a, b in itertools.pairwise(mine))
        lines.append(
            f"{variant}, {k} devices, weak-scaling efficiency per per-device batch: {figures}; "
            f"best {best['efficiency']:.2f} at {best['per_device']}; rising with the batch: {'yes' if rising else 'no'}"
        )
    return lines


def _groups(rows, case) -> dict:
    groups = {}
    for r in rows:
        if r["case"] == case:
            groups.setdefault((r["variant"], r["devices"]), []).append(r)
    return groups


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
    parser.add_argument(
        "--device-model",
        choices=("cores", "logical"),
        default="cores",
        help="cores (default): one TensorFlow server process per device, each on its own core, which "
        "is right for speed; logical: devices of this process (real GPUs where there are enough)",
    )
    parser.add_argument("--hidden", type=int, default=256, help="width of the MLP's two hidden layers")
    parser.add_argument("--batch", type=int, default=256, help="examples per device (strong scaling, input)")
    parser.add_argument(
        "--per-device",
        default="64,256,1024,4096",
        help="per-device batches of the weak-scaling sweep, comma separated (default 64,256,1024,4096)",
    )
    parser.add_argument("--repeats", type=int, default=15, help="interleaved timed rounds per figure (median reported)")
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
    args.per_device = _per_device_sweep(parser, args.per_device)
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


def _per_device_sweep(parser, text: str) -> tuple[int, ...]:
    try:
        sweep = tuple(dict.fromkeys(int(v) for v in text.split(",") if v.strip()))
    except ValueError:
        sweep = ()
    if not sweep or min(sweep) < 1:
        parser.error(f"--per-device {text!r}: give whole numbers >= 1 separated by commas, such as 64,256,1024")
    return sweep


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
        "weak": dict(hidden=hidden, per_device=args.per_device, repeats=args.repeats),
        "strong": dict(hidden=hidden, global_batch=args.batch * args.devices, repeats=args.repeats),
        "packing": dict(repeats=args.repeats),
        "allreduce": dict(repeats=args.repeats),
        "input": dict(batch=args.batch, repeats=min(args.repeats, 5)),  # an epoch per round: fewer suffice
        "pipeline": dict(rounds=max(3, args.repeats // 3)),  # each round times every variant 5 times
        "mixed": dict(repeats=args.repeats),
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


def _warn_if_busy() -> float | None:
    """Say so before measuring when other programs already keep every core busy; return the load."""
    import os
    import sys

    if not hasattr(os, "getloadavg"):  # Windows: no load average to read
        return None
    load = os.getloadavg()[0]
    message = timing.busy_warning(load, os.cpu_count() or 1)
    if message:
        print(message, file=sys.stderr, flush=True)
    return load


def _warn_if_more_devices_than_cores(n: int, cores: int) -> None:
    import sys

    if n > cores:
        print(
            f"warning: {n} simulated devices on {cores} cores: at most {cores} run at once, so "
            "speedups beyond that show correctness, not speed (notebook 00).",
            file=sys.stderr,
        )


def main(argv=None) -> int:
    import json
    import os

    from . import devices

    args, cases = _parse(argv)
    cores = os.cpu_count() or 1
    _warn_if_more_devices_than_cores(args.devices, cores)
    load = _warn_if_busy()
    start = time.perf_counter()
    devs = devices.simulate(args.devices, kind="cores" if args.device_model == "cores" else "auto")
    rows = _run_cases(cases, devs, _case_options(args))
    print(format_table(rows))
    print("\n".join(summary(rows)))
    seconds = time.perf_counter() - start
    print(f"{len(rows)} figures on {args.devices} {_device_model()} device(s) in {seconds:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            about = {"devices": devs, "device_model": _device_model(), "cores": cores, "load_average": load}
            about["seconds"] = seconds
            json.dump({**about, "summary": summary(rows), "options": vars(args), "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
