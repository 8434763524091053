"""The command line: `python -m tutorial_lib.bench [--cases ...] [--json PATH]` (see --help)."""

from __future__ import annotations

import argparse
import os
import sys
import time

from .. import timing
from . import cases, pipeline, rows, scaling

# What one device costs in memory: a core device's server process, measured at about 830 MB
# (8 of them peaked at 6.6 GB with the default sweep); the bench's own process about as much.
DEVICE_BYTES = 830e6


# Each case as a function of (devices, options), and the reason it is skipped on one device.
CASES = {
    "weak": (
        lambda d, a: scaling.weak_scaling(d, (a.hidden, a.hidden), a.per_device, repeats=a.repeats),
        None,
    ),
    "strong": (
        lambda d, a: scaling.strong_scaling(d, (a.hidden, a.hidden), a.batch * len(d), repeats=a.repeats),
        None,
    ),
    "packing": (lambda d, a: cases.packing(d, repeats=a.repeats), "an all-reduce needs 2 or more devices"),
    "allreduce": (lambda d, a: cases.allreduce_methods(d, repeats=a.repeats), "an all-reduce needs 2 or more devices"),
    "input": (lambda d, a: cases.input_pipeline(d, batch=a.batch, repeats=min(a.repeats, 5)), None),
    "pipeline": (lambda d, a: pipeline.pipeline_vs_naive(d, repeats=a.repeats), "a 2-stage pipeline needs 2 devices"),
    "mixed": (lambda d, a: cases.mixed_precision(d, repeats=a.repeats), None),
}
SUMMARIES = [scaling.summary, cases.summary, pipeline.summary]


def summary(found) -> list[str]:
    """The headline of each case measured, computed from its rows: one line each."""
    return [line for lines in SUMMARIES for line in lines(found)]


def _parser():
    parser = argparse.ArgumentParser(
        prog="python -m tutorial_lib.bench", description="Measure the course's cases on this machine's devices."
    )
    parser.add_argument(
        "--devices", type=int, default=min(2, os.cpu_count() or 1), help="devices (default 2, or the cores if fewer)"
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
        "--per-device", default="64,256,1024,4096", help="per-device batches of the weak-scaling sweep, comma separated"
    )
    parser.add_argument("--repeats", type=int, default=15, help="interleaved timed rounds per figure (at least 3)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to the file PATH")
    return parser


def _parse(argv):
    """(options, cases), all checked before anything is measured: a typo must not cost a long run."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.hidden < 1 or args.batch < 1:
        parser.error("--hidden and --batch must be >= 1")
    if args.repeats < timing.MIN_SAMPLES:
        parser.error(
            f"--repeats {args.repeats}: a verdict needs at least {timing.MIN_SAMPLES} samples of each variant "
            f"(fewer give no spread); pass --repeats {timing.MIN_SAMPLES} or more"
        )
    problem = _devices_problem(args.devices, _available_memory())
    if problem:
        parser.error(problem)
    args.per_device = _per_device_sweep(parser, args.per_device)
    selected = _selected_cases(parser, args.cases)
    if args.json is not None and (problem := rows.json_path_problem(args.json)):
        parser.error(problem)
    return args, selected


def _available_memory() -> float | None:
    """Bytes new processes can take (Linux's MemAvailable, page cache included), else the machine's
    total (macOS), else None (Windows)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _devices_problem(n: int, memory: float | None) -> str | None:
    if n < 1:
        return f"--devices must be >= 1, got {n}"
    most = None if memory is None else max(1, int(memory // DEVICE_BYTES) - 1)  # one share for this process
    if most is not None and n > most:
        return (
            f"--devices {n}: each device takes about {DEVICE_BYTES / 1e6:.0f} MB (a core device's server "
            f"process), and this machine has {memory / 1e9:.1f} GB available: pass --devices {most} or fewer"
        )
    return None


def _selected_cases(parser, text: str) -> list[str]:
    chosen = list(dict.fromkeys(c.strip() for c in text.split(",") if c.strip()))  # each once, in order
    if not chosen:
        parser.error(f"--cases {text!r} names no case; give one or more of {','.join(CASES)}, separated by commas")
    unknown = sorted(set(chosen) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {','.join(CASES)}")
    return chosen


def _per_device_sweep(parser, text: str) -> tuple[int, ...]:
    try:
        sweep = tuple(dict.fromkeys(int(v) for v in text.split(",") if v.strip()))
    except ValueError:
        sweep = ()
    if not sweep or min(sweep) < 1:
        parser.error(f"--per-device {text!r}: give whole numbers >= 1 separated by commas, such as 64,256,1024")
    return sweep


def _run_cases(selected, devs, args) -> list[dict]:
    """Every case in turn, its progress printed as it goes (a case can take minutes)."""
    found = []
    for name in selected:
        run, needs_two = CASES[name]
        if needs_two and len(devs) < 2:
            print(f"[{name}] skipped: {needs_two}", flush=True)
            continue
        start = time.perf_counter()
        print(f"[{name}] running ...", flush=True)
        new = run(devs, args)
        print(f"[{name}] {len(new)} figures in {time.perf_counter() - start:.1f} s", flush=True)
        found += new
    return found


def _warnings(n: int) -> float | None:
    """Say so before measuring when devices outnumber cores or other programs keep every core
    busy; return the load average (None where there is none, as on Windows)."""
    cores = os.cpu_count() or 1
    if n > cores:
        print(
            f"warning: {n} simulated devices on {cores} cores: at most {cores} run at once, so "
            "speedups beyond that show correctness, not speed (notebook 00).",
            file=sys.stderr,
        )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    message = load is not None and timing.busy_warning(load, cores)
    if message:
        print(message, file=sys.stderr, flush=True)
    return load


def main(argv=None) -> int:
    from .. import devices

    args, selected = _parse(argv)
    load = _warnings(args.devices)
    start = time.perf_counter()
    devs = devices.simulate(args.devices, kind="cores" if args.device_model == "cores" else "auto")
    found = _run_cases(selected, devs, args)
    print(rows.format_table(found))
    print("\n".join(summary(found)))
    seconds = time.perf_counter() - start
    model = {"cores": "core"}.get(rows.device_model(), rows.device_model())
    print(f"{len(found)} figures on {args.devices} {model} device(s) in {seconds:.0f} s")
    if args.json is not None:
        about = {"devices": devs, "device_model": rows.device_model(), "cores": os.cpu_count(), "load_average": load}
        about |= {"seconds": seconds, "summary": summary(found), "options": vars(args), "rows": found}
        rows.write_json(args.json, about)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
