"""Check the course's GPU code on your GPUs, and print a report to paste into an issue.

    python -m tutorial_lib.gpu_check        (or: make gpu-check)

The course is built and tested on CPUs only. On a machine with 2 or more GPUs this runs, on
all of them: NCCL all-reduce against the ring, one replicated training step with
`allreduce_grads(method="nccl")` (and "ring") against the single-device reference, and one
`MirroredStrategy` step per `cross_device_ops` choice against the same reference. Then it runs
the course's two take-away files as a reader would: `examples/train_multi_gpu.py --check` (both
strategies) and `examples/train_pipelined.py --check`, 20 steps each, and the pipeline's training
with the hand-off wait on and off, timed: the report decides that default on GPUs. With one GPU
it runs what logical GPUs carved out of it allow and says what it cannot check (NCCL, the files);
with none it says so and exits 0. It exits 1 when any check fails, errs or times out.

Each check runs in a child process (one device layout per process; NCCL can hang): a child that
outlives `--timeout` seconds is stopped and reported as timed out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import processes

CHECK_TIMEOUT_S = 300.0
ALLREDUCE_TOLERANCE = 1e-6  # NCCL's sum against the ring's: float32 sums of a few numbers
TRAIN_TOLERANCE = 1e-5  # weights after one step against the single-device reference
CROSS_DEVICE_OPS = ("NcclAllReduce", "HierarchicalCopyAllReduce", "ReductionToOneDevice", "default")
WHERE_TO_PASTE = "a new issue in the course's repository, titled 'gpu-check: <your GPUs>'"
_RESULT_TAG = "GPU_CHECK_RESULT "  # the line a child prints its result on
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOT_FAILURES = ("pass", "skip", "missing", "measured")


@dataclass(frozen=True)
class Check:
    """One check: `what` is 'all_reduce', 'train_step' or 'mirrored'; `how` the method or cross_device_ops."""

    what: str
    how: str
    tolerance: float

    @property
    def name(self) -> str:
        labels = {
            "all_reduce": f"all-reduce, {self.how} vs ring",
            "train_step": f"train step, allreduce_grads {self.how} vs reference",
            "mirrored": f"MirroredStrategy {self.how} vs reference",
        }
        return labels[self.what]


@dataclass(frozen=True)
class Result:
    name: str
    status: str  # "pass", "fail", "error", "timeout", "skip", "missing" (a file) or "measured" (a timing)
    detail: str


def plan_checks(gpus: int) -> tuple[int, list[Check], list[Result]]:
    """For a machine with `gpus` GPUs: how many devices to check on, the checks, and the skipped ones."""
    if gpus == 0:
        return 0, [], []
    nccl = [Check("all_reduce", "nccl", ALLREDUCE_TOLERANCE), Check("train_step", "nccl", TRAIN_TOLERANCE)]
    others = [Check("train_step", "ring", TRAIN_TOLERANCE)]
    mirrored = [Check("mirrored", name, TRAIN_TOLERANCE) for name in CROSS_DEVICE_OPS]
    if gpus >= 2:
        return gpus, nccl + others + mirrored, []
    # One GPU: two logical GPUs carved out of it. NCCL refuses two ranks on one GPU.
    why = "needs 2 or more GPUs: NCCL refuses two ranks on one GPU ('Duplicate GPU detected')"
    skipped = [c for c in nccl + mirrored if c.how in ("nccl", "NcclAllReduce")]
    return 2, [c for c in nccl + others + mirrored if c not in skipped], [Result(c.name, "skip", why) for c in skipped]


def verdict(check: Check, difference: float) -> Result:
    """Pass when the largest absolute difference is within the check's tolerance."""
    ok = difference <= check.tolerance  # a NaN difference fails
    return Result(
        check.name, "pass" if ok else "fail", f"max |difference| {difference:.1e} (tolerance {check.tolerance:.0e})"
    )


# --- the checks, run inside a child process with its devices -------------------------


def _batch(n: int, seed: int = 0):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(8 * n, 64)).astype(np.float32)
    y = rng.integers(0, 10, size=8 * n).astype(np.int32)
    return tf.constant(x), tf.constant(y)


def _model():
    from . import models

    return models.MLP(in_features=64, hidden=(32,), num_classes=10, seed=0)


def _reference_weights(x, y, learning_rate: float, device: str):
    """The weights after one plain SGD step of one model on the whole batch, on one device."""
    import tensorflow as tf

    from . import reference

    with tf.device(device):
        net = _model()
        reference.sgd_step(net, x, y, learning_rate)
    return [v.numpy() for v in net.trainable_variables]


def _max_difference(weights, expected) -> float:
    import numpy as np

    return max(float(np.max(np.abs(np.asarray(w) - e))) for w, e in zip(weights, expected, strict=True))


def all_reduce_difference(devices, method: str) -> float:
    """Largest difference between `method`'s all-reduce and the ring's, on every device."""
    import numpy as np
    import tensorflow as tf

    from . import allreduce

    rng = np.random.default_rng(1)
    tensors = []
    for d in devices:
        with tf.device(d):
            tensors.append(tf.constant(rng.normal(size=(1000,)).astype(np.float32)))
    got = allreduce.all_reduce(tensors, method=method, devices=devices)
    ring = allreduce.all_reduce(tensors, method="ring", devices=devices)
    return _max_difference([g.numpy() for g in got], [r.numpy() for r in ring])


def train_step_difference(devices, method: str, learning_rate: float = 0.1) -> float:
    """Largest difference between every replica's weights after one replicated step and the reference's."""
    from . import replicated

    x, y = _batch(len(devices))
    expected = _reference_weights(x, y, learning_rate, devices[0])
    replicas = replicated.make_replicas(_model, devices)
    replicated.make_train_step(replicas, devices, learning_rate=learning_rate, method=method)(x, y)
    return max(_max_difference([v.numpy() for v in net.trainable_variables], expected) for net in replicas)


def mirrored_difference(devices, cross_device_ops: str, learning_rate: float = 0.1) -> float:
    """Largest difference between every replica's weights after one `MirroredStrategy` step and the reference's."""
    import tensorflow as tf

    from .strategy import mirrored_strategy, mirrored_train_step

    x, y = _batch(len(devices))
    expected = _reference_weights(x, y, learning_rate, devices[0])
    ops = None if cross_device_ops == "default" else getattr(tf.distribute, cross_device_ops)()
    strategy = mirrored_strategy(devices, cross_device_ops=ops)
    with strategy.scope():
        net, sgd = _model(), tf.keras.optimizers.SGD(learning_rate)
    k = len(devices)
    shards = strategy.experimental_distribute_values_from_function(
        lambda ctx: (tf.split(x, k)[ctx.replica_id_in_sync_group], tf.split(y, k)[ctx.replica_id_in_sync_group])
    )
    mirrored_train_step(strategy, net, sgd)(*shards)
    per_replica = [[r.numpy() for r in strategy.experimental_local_results(v)] for v in net.trainable_variables]
    return max(_max_difference([v[r] for v in per_replica], expected) for r in range(k))


_DIFFERENCES = {
    "all_reduce": all_reduce_difference,
    "train_step": train_step_difference,
    "mirrored": mirrored_difference,
}


def run_check(check: Check, devices) -> Result:
    """Run one check on `devices` in this process; an exception is an 'error' result that says what it was."""
    try:
        return verdict(check, _DIFFERENCES[check.what](devices, check.how))
    except Exception as err:  # reported, not raised: the report must list every check
        first_line = (str(err).splitlines() or [""])[0]
        return Result(check.name, "error", f"{type(err).__name__}: {first_line}")


def _child(check: Check, n: int, kind: str) -> None:
    """The child's side: make n devices, run one check, print its result as one tagged JSON line."""
    from . import devices

    names = devices.simulate(n, kind=kind)
    import tensorflow as tf

    # Ampere and newer GPUs run float32 matmuls in TF32 by default (10-bit mantissa); the
    # tolerances assume float32, as on the CPUs where the course is tested.
    tf.config.experimental.enable_tensor_float_32_execution(False)
    result = run_check(check, names)
    print(_RESULT_TAG + json.dumps(result.__dict__), flush=True)


def run_in_child(check: Check, n: int, kind: str = "gpu", timeout: float = CHECK_TIMEOUT_S) -> Result:
    """Run one check in a child process with n devices of `kind`; stop it after `timeout` seconds."""
    command = [sys.executable, "-m", "tutorial_lib.gpu_check", "--child", check.what, check.how, str(check.tolerance)]
    command += ["--devices", str(n), "--kind", kind]
    env = {k: v for k, v in os.environ.items() if k != "TUTORIAL_DEVICE"}  # it would force CPUs
    child = processes.spawn(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        processes.stop([child])
        child.communicate()
        return Result(check.name, "timeout", f"no result within {timeout:.0f} s (NCCL can hang); stopped")
    return _parse_child(check, child.returncode, out.decode(errors="replace"), err.decode(errors="replace"))


def _parse_child(check: Check, returncode: int, out: str, err: str) -> Result:
    lines = [line for line in out.splitlines() if line.startswith(_RESULT_TAG)]
    if lines:
        return Result(**json.loads(lines[-1].removeprefix(_RESULT_TAG)))
    last = (err.strip().splitlines() or ["no output"])[-1]
    return Result(check.name, "error", f"the child exited with status {returncode} without a result: {last}")


# --- the take-away files, run as a reader runs them ------------------------------------


@dataclass(frozen=True)
class FileRun:
    name: str
    file: str  # in examples/
    args: tuple[str, ...]


def file_runs(gpus: int) -> list[FileRun]:
    """The take-away files' runs on `gpus` GPUs (the pipeline on at most 3), 20 steps each."""
    every, stages = (",".join(f"/GPU:{i}" for i in range(k)) for k in (gpus, min(gpus, 3)))
    multi, pipe = ("--steps", "20", "--devices", every, "--check"), ("--steps", "20", "--devices", stages)
    runs = [FileRun("train_multi_gpu.py --check", "train_multi_gpu.py", multi)]
    runs += [FileRun(f"{runs[0].name} --strategy mirrored", "train_multi_gpu.py", (*multi, "--strategy", "mirrored"))]
    runs += [FileRun("train_pipelined.py --check", "train_pipelined.py", (*pipe, "--check"))]
    for wait in ("on", "off"):  # timed; the last two runs, read by handoff_verdict
        runs += [
            FileRun(f"train_pipelined.py --handoff-wait {wait}", "train_pipelined.py", (*pipe, "--handoff-wait", wait))
        ]
    return runs


def run_file(run: FileRun, folder: Path, timeout: float, examples: Path = EXAMPLES) -> tuple[Result, dict]:
    """Run one take-away file in a child with `--json`; its result, and the metrics it wrote."""
    path, out = examples / run.file, folder / f"{len(list(folder.iterdir()))}.json"
    if not path.exists():
        return Result(run.name, "missing", f"{path} is not there: this copy of the course lacks it"), {}
    env = {k: v for k, v in os.environ.items() if k != "TUTORIAL_DEVICE"}
    env["NVIDIA_TF32_OVERRIDE"] = "0"  # float32 checks: no TF32 in cuBLAS and cuDNN
    child = processes.spawn([sys.executable, str(path), *run.args, "--json", str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        _, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        processes.stop([child])
        child.communicate()
        return Result(run.name, "timeout", f"no result within {timeout:.0f} s; stopped"), {}
    metrics = json.loads(out.read_text()) if out.exists() else {}
    difference = metrics.get("largest_relative_difference")
    if child.returncode in (0, 1) and (difference is not None or "step_ms" in metrics):
        detail = f"largest relative difference {difference:.1e}" if difference is not None else ""
        detail = detail or f"step {metrics['step_ms']:.1f} ms (one run of 20 steps)"
        return Result(run.name, "pass" if child.returncode == 0 else "fail", detail), metrics
    last = (err.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
    return Result(run.name, "error", f"exited with status {child.returncode}: {last}"), metrics


def handoff_verdict(on: dict, off: dict) -> Result:
    """The hand-off wait's cost on these GPUs, from the two timed pipeline runs."""
    name = "pipeline hand-off wait, on vs off"
    if "step_ms" not in on or "step_ms" not in off:
        return Result(name, "skip", "one of the two timed runs gave no step time")
    ratio = on["step_ms"] / off["step_ms"]
    faster = "off" if ratio > 1 else "on"
    return Result(name, "measured", f"on {on['step_ms']:.1f} ms, off {off['step_ms']:.1f} ms: {faster} is "
                  f"faster by {max(ratio, 1 / ratio):.2f}x (medians of one run each)")  # fmt: skip


def run_files(gpus: int, timeout: float, examples: Path = EXAMPLES) -> list[Result]:
    """Every take-away run on `gpus` GPUs, then the hand-off verdict; skipped below 2 GPUs."""
    runs = file_runs(gpus)
    if gpus < 2:
        return [Result(r.name, "skip", "needs 2 or more GPUs") for r in runs]
    results, metrics = [], []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as folder:
        for run in runs:
            print(f"running: {run.name} ...", file=sys.stderr, flush=True)
            result, written = run_file(run, Path(folder), timeout, examples)
            results.append(result)
            metrics.append(written)
    return [*results, handoff_verdict(metrics[-2], metrics[-1])]


# --- the report ------------------------------------------------------------------------


def versions() -> dict[str, str]:
    """TensorFlow, Keras, Python, the platform, the CUDA and cuDNN TensorFlow was built with, and NCCL."""
    import keras
    import tensorflow as tf

    from .allreduce import nccl_version

    build = tf.sysconfig.get_build_info()
    nccl = nccl_version()
    return {
        "TensorFlow": tf.__version__,
        "Keras": keras.__version__,
        "Python": platform.python_version(),
        "platform": platform.platform(),
        "CUDA (built with)": str(build.get("cuda_version", "none")),
        "cuDNN (built with)": str(build.get("cudnn_version", "none")),
        "NCCL": nccl.version or f"none ({nccl.reason})",
    }


def gpu_names() -> list[str]:
    """The physical GPUs TensorFlow sees, with their names where TensorFlow knows them."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    return [f"{g.name}: {tf.config.experimental.get_device_details(g).get('device_name', '?')}" for g in gpus]


def report(info: dict[str, str], gpus: list[str], n: int, results: list[Result]) -> str:
    """The text to paste into an issue: versions, GPUs, one line per check, and the verdict."""
    lines = ["## tutorial_lib.gpu_check report", "", "```"]
    lines += [f"{k:20s} {v}" for k, v in info.items()]
    lines += [f"{'GPUs':20s} {len(gpus)}"] + [f"  {g}" for g in gpus]
    if not gpus:
        lines += [
            "",
            "No GPU found: nothing to check here. The course's CPU tests (make test) cover the rest.",
            "If this machine has a GPU, TensorFlow cannot see it: install its CUDA build",
            '(.venv/bin/pip install -e ".[gpu]") and check that nvidia-smi lists the GPU.',
        ]
    else:
        how = f"{n} real GPUs" if len(gpus) >= 2 else "2 logical GPUs carved out of the one GPU"
        lines += ["", f"checks on {how}, float32 (TF32 off), each in a child process with a deadline:"]
        width = max(len(r.name) for r in results)
        lines += [f"{r.status.upper():8s} {r.name:{width}s}  {r.detail}" for r in results]
        failed = [r for r in results if r.status not in NOT_FAILURES]
        lines += ["", f"verdict: {'FAILED ' + str(len(failed)) if failed else 'all passed'} of {len(results)} checks"]
    lines += ["```"]
    return "\n".join(lines)


def exit_status(results: list[Result]) -> int:
    """1 when any check failed, erred or timed out; 0 otherwise (skipped, missing, measured: not failures)."""
    return 1 if any(r.status not in NOT_FAILURES for r in results) else 0


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error(
            f"--timeout {args.timeout}: give the seconds a check may take, > 0 (default {CHECK_TIMEOUT_S:.0f})"
        )
    if args.child:
        what, how, tolerance = args.child
        _child(Check(what, how, float(tolerance)), args.devices, args.kind)
        return 0
    gpus = gpu_names()
    n, checks, skipped = plan_checks(len(gpus))
    results = []
    for check in checks:
        print(f"running: {check.name} ...", file=sys.stderr, flush=True)
        results.append(run_in_child(check, n, "gpu", args.timeout))
    results += skipped + (run_files(len(gpus), args.timeout) if gpus else [])
    print(report(versions(), gpus, n, results))
    if gpus:
        print(f"\nPaste the report above into {WHERE_TO_PASTE}.")
    return exit_status(results)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tutorial_lib.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--timeout", type=float, default=CHECK_TIMEOUT_S, help="seconds per check (default %(default)s)"
    )
    parser.add_argument("--child", nargs=3, metavar=("WHAT", "HOW", "TOLERANCE"), help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="gpu", help=argparse.SUPPRESS)
    return parser


if __name__ == "__main__":
    sys.exit(main())
