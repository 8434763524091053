"""The placement audit of the take-away files' steps on real devices (`gpu_check` runs it on the GPUs,
in a child it can stop): where each op ran, for every variant of the data-parallel step that
train_multi_gpu.py can train, and for the pipelined step of train_pipelined.py (every schedule, with and without
recomputation).

    python -m tutorial_lib.gpu_audit --devices /GPU:0,/GPU:1 [--json PATH]

Exits 0 when every op and variable is with its owner, 1 when the audit finds one that is not or cannot
place an op of the run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str, examples: Path = EXAMPLES):
    """A take-away file as a module (they import no tutorial_lib, so they are loaded by path)."""
    spec = importlib.util.spec_from_file_location(name, examples / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Every variant of the step that train_multi_gpu.py's train() can run, by its command line's options.
DATA_PARALLEL_VARIANTS = {
    "sync BN, buckets": ["--bn", "sync"],
    "local BN, one all-reduce per gradient": ["--bn", "local", "--bucket-mb", "0"],
    "local BN, XLA": ["--bn", "local", "--jit"],
    "bfloat16, sync BN": ["--precision", "bfloat16", "--bn", "sync"],
    "float16, sync BN": ["--precision", "float16", "--bn", "sync"],
    "MirroredStrategy": ["--strategy", "mirrored"],
}


def data_parallel_reports(devices) -> dict:
    """{variant: the audit of one call of train_multi_gpu.py's step, as its build() makes it, run on `devices`}."""
    import multi_gpu_cli as cli  # noqa: I001 (the take-away's, on the path tutorial_lib sets)
    import numpy as np
    import tensorflow as tf
    import train_multi_gpu as program

    from . import placement

    rng = np.random.default_rng(0)
    x, y = rng.random((16 * len(devices), 8, 8, 1), dtype=np.float32), rng.integers(0, 10, 16 * len(devices))
    data = ((x, y.astype(np.int32)), (x, y.astype(np.int32)))
    reports = {}
    for name, options in DATA_PARALLEL_VARIANTS.items():
        args = cli.parse([*options, "--devices", ",".join(devices), "--batch", str(8 * len(devices))], "")
        program.plan(args, devices, data)
        with cli.precision(args.precision):
            run = program.build(args, devices, x.shape[1:])
        reports[name] = placement.audit(run.step, run.feed(*data[0]), 1, owners=run.owners, run=True)
        tf.keras.backend.clear_session()
    return reports


def pipeline_reports(devices, examples: Path = EXAMPLES) -> dict:
    """The audit of one step of train_pipelined.py on up to 3 of `devices`, for every schedule it runs, with and
    without recomputation (on the model without its dropout, which recomputation refuses): {name: report}."""
    import keras
    import numpy as np
    import tensorflow as tf

    from . import placement

    piped, on = load("train_pipelined", examples), list(devices[:3])
    with_dropout = piped.make_model
    without = lambda: [[x for x in b if not isinstance(x, keras.layers.Dropout)] for b in with_dropout()]  # noqa: E731
    x = tf.random.stateless_normal([8 * len(on), 8, 8, 1], [0, 2])
    y = tf.constant(np.arange(8 * len(on)) % 10, tf.int32)
    reports = {}
    for schedule in piped.ps.EVERY_SCHEDULE:
        for recompute in (False, True):
            piped.make_model = without if recompute else with_dropout
            argv = ["--schedule", schedule, "--micro-batches", str(2 * len(on)), "--batch", str(8 * len(on))]
            run = piped.build(piped.parse(argv + ["--recompute"] * recompute), on, (8, 8, 1))
            owners = {}
            for chunk, optimizer, device in zip(run.chunks, run.optimizers, run.devices, strict=True):
                owners.setdefault(device, []).extend([*chunk.variables, *optimizer.variables])
            name = f"pipelined step ({schedule}{', recomputed' * recompute})"
            reports[name] = placement.audit(run.steps, [x], [y], owners=owners, run=True)
    piped.make_model = with_dropout
    return reports


def devices_problem(devices) -> str | None:
    """What is wrong with --devices for this process: unknown, repeated, or only one; None if nothing."""
    import tensorflow as tf

    from .devices import normalize

    def canonical(name):
        try:
            return normalize(name)
        except ValueError:
            return None

    here = [normalize(d.name) for d in tf.config.list_logical_devices()]
    names = [canonical(d) for d in devices]
    if unknown := [d for d, name in zip(devices, names, strict=True) if name not in here]:
        return (f"--devices: no device {', '.join(map(repr, unknown))} here; this machine has {', '.join(here)}: "
                "name some of those")  # fmt: skip
    if len(set(names)) < len(names):
        return f"--devices {','.join(devices)}: a device named twice; name each once"
    if len(names) < 2:
        return (
            f"--devices {devices[0]}: give 2 or more devices; on one, every op is with its owner and nothing is checked"
        )
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tutorial_lib.gpu_audit", description=__doc__.split("\n")[0])
    parser.add_argument("--devices", required=True, help="comma-separated device names, e.g. /GPU:0,/GPU:1")
    parser.add_argument("--json", metavar="PATH", help="write the counts to PATH")
    args = parser.parse_args(argv)
    devices = [d.strip() for d in args.devices.split(",")]
    if problem := devices_problem(devices):  # exit 2 before any work: 1 says the audit found a misplaced op
        parser.error(problem)
    reports = {f"data-parallel step, {name}": r for name, r in data_parallel_reports(devices).items()}
    reports.update(pipeline_reports(devices))
    for name, report in reports.items():
        print(f"{name}: {report}")
    misplaced = sum(len(r.misplaced) for r in reports.values())
    counts = {"misplaced": misplaced, "ops_checked": sum(r.ops_checked for r in reports.values())}
    counts["variables_checked"] = sum(r.variables_checked for r in reports.values())
    counts["unresolved"] = sum(len(r.unresolved) for r in reports.values())  # ops the run could not place: a failure
    if args.json:
        Path(args.json).write_text(json.dumps(counts))
    return 0 if all(r.ok for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
