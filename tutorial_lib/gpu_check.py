"""Run the course's two take-away files on your GPUs, and print a report to paste into an issue.

    python -m tutorial_lib.gpu_check        (or: make gpu-check)

The course is built and tested on CPUs. On a machine with 2 or more GPUs this runs the files as a
reader would, 20 steps each, every one in a child process stopped after `--timeout` seconds (NCCL
can hang): `examples/train_multi_gpu.py --check` (NCCL all-reduce; then `--strategy mirrored`; then `--jit`,
each replica's step compiled by XLA, skipped with the reason where XLA cannot compile on the GPUs; then
bfloat16 and float16), a timed run of `train_multi_gpu.py` (on GPUs it ends with its efficiency against a
plain one-GPU step),
`examples/train_pipelined.py --check` (1F1B, ZB-H1, interleaved, in float64) on up to 3 GPUs, the placement audit of
both files' steps (every pipeline schedule, with and without recomputation)
(`tutorial_lib.gpu_audit`: where each op ran), and the pipeline's training with the
hand-off wait on and off, timed. It exits 1 when a run fails, errs or times out. With one GPU it
runs nothing and says what the files would need; with none, it says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import processes

CHECK_TIMEOUT_S = 300.0
WHERE_TO_PASTE = "a new issue in the course's repository, titled 'gpu-check: <your GPUs>'"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOT_FAILURES = ("pass", "skip", "missing", "measured")
ONE_GPU = ("need 2 or more GPUs: their --simulate carves CPU devices only; one GPU would need it to carve logical "
           "GPUs, where the replicated path takes the ring (NCCL refuses two ranks on one GPU)")  # fmt: skip


@dataclass(frozen=True)
class Result:
    name: str
    status: str  # "pass", "fail", "error", "timeout", "skip", "missing" (a file) or "measured" (a timing)
    detail: str


# --- the take-away files, run as a reader runs them ------------------------------------


@dataclass(frozen=True)
class FileRun:
    name: str
    file: str  # in examples/, or AUDIT: the placement audit of their steps (tutorial_lib.gpu_audit)
    args: tuple[str, ...]


AUDIT = "tutorial_lib.gpu_audit"


def file_runs(gpus: int) -> list[FileRun]:
    """The take-away files' runs on `gpus` GPUs (the pipeline on at most 3), 20 steps each; the global
    batch 32 per GPU, which any GPU count divides (the file's default, 128, is refused on 3)."""
    every, stages = (",".join(f"/GPU:{i}" for i in range(k)) for k in (gpus, min(gpus, 3)))
    multi = ("--steps", "20", "--devices", every, "--batch", str(32 * gpus), "--check")
    pipe = ("--steps", "20", "--devices", stages, "--batch", "96")  # M = 6 micro-batches of 16
    runs = [FileRun("train_multi_gpu.py --check", "train_multi_gpu.py", multi)]
    for extra in (("--strategy", "mirrored"), ("--jit", "--bn", "local"), ("--precision", "bfloat16"),
                  ("--precision", "float16")):  # fmt: skip
        runs += [FileRun(f"{runs[0].name} {' '.join(extra)}", "train_multi_gpu.py", (*multi, *extra))]
    timed = ("--steps", "60", "--devices", every, "--batch", str(64 * gpus))  # 64 a GPU, as on one: its efficiency
    runs += [FileRun("train_multi_gpu.py timed on every GPU and on one", "train_multi_gpu.py", timed)]
    for schedule in ("1f1b", "zb_h1", "interleaved"):  # float64 against one GPU; interleaved: 2 chunks a GPU
        runs += [FileRun(f"train_pipelined.py --check --schedule {schedule}", "train_pipelined.py",
                         (*pipe, "--check", "--schedule", schedule))]  # fmt: skip
    for wait in ("on", "off"):  # timed; the last two runs, read by handoff_verdict
        runs += [
            FileRun(f"train_pipelined.py --handoff-wait {wait}", "train_pipelined.py", (*pipe, "--handoff-wait", wait))
        ]
    return runs


def run_file(run: FileRun, folder: Path, timeout: float, examples: Path = EXAMPLES) -> tuple[Result, dict]:
    """Run one take-away file in a child with `--json`; its result, and the metrics it wrote."""
    path, out = examples / run.file, folder / f"{len(list(folder.iterdir()))}.json"
    if run.file != AUDIT and not path.exists():
        return Result(run.name, "missing", f"{path} is not there: this copy of the course lacks it"), {}
    program = ["-m", AUDIT] if run.file == AUDIT else [str(path)]
    env = {k: v for k, v in os.environ.items() if k != "TUTORIAL_DEVICE"}
    env["NVIDIA_TF32_OVERRIDE"] = "0"  # float32 checks: no TF32 in cuBLAS and cuDNN
    child = processes.spawn([sys.executable, *program, *run.args, "--json", str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        _, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        processes.stop([child])
        child.communicate()
        return Result(run.name, "timeout", f"no result within {timeout:.0f} s; stopped"), {}
    metrics = read_metrics(out)
    if child.returncode in (0, 1) and {"largest_relative_difference", "step_ms", "misplaced"} & set(metrics):
        return finished(run.name, child.returncode, metrics), metrics
    last = (err.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
    return Result(run.name, "error", f"exited with status {child.returncode}: {last}"), metrics


def read_metrics(path: Path) -> dict:
    """The metrics a run wrote; {} if it wrote none, or no JSON object (the run then counts as an error)."""
    try:
        metrics = json.loads(path.read_text()) if path.exists() else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return metrics if isinstance(metrics, dict) else {}


def finished(name: str, code: int, metrics: dict) -> Result:
    """A run that exited 0 or 1 with its metrics: a check passes on exit 0 with a finite difference, and
    fails on a difference that is not a finite number (NaN, or null where the file wrote NaN as null),
    whatever its exit status (`nan > 1e-5` is False: a NaN would pass a threshold)."""
    if "misplaced" in metrics:
        counts = f"{metrics['ops_checked']} ops and {metrics['variables_checked']} variables checked"
        return Result(name, "pass" if code == 0 else "fail", f"{counts}, {metrics['misplaced']} misplaced")
    if "efficiency" in metrics:  # interleaved timings of the step on every GPU and of a plain step on one
        low, high = metrics.get("efficiency_range", [math.nan, math.nan])
        return Result(name, "measured", f"{metrics['step_ms']:.1f} ms a step while training; weak-scaling efficiency "
                      f"{metrics['efficiency']:.0%} (range {low:.0%}-{high:.0%}) against a plain one-GPU step of "
                      f"{metrics['baseline_step_ms']:.1f} ms")  # fmt: skip
    if "largest_relative_difference" not in metrics:
        return Result(name, "pass" if code == 0 else "fail", f"step {metrics['step_ms']:.1f} ms (one run of 20 steps)")
    difference = metrics["largest_relative_difference"]
    if isinstance(difference, dict):  # train_multi_gpu.py: float64, and the 16-bit precision's own step
        passed = (
            code == 0
            and metrics.get("verdict") == "ok"
            and all(isinstance(d, int | float) and math.isfinite(d) for d in difference.values())
        )
        said = ", ".join(f"{p} {d:.1e}" if isinstance(d, int | float) else f"{p} {d}" for p, d in difference.items())
        return Result(name, "pass" if passed else "fail", f"largest relative difference: {said}")
    if isinstance(difference, bool) or not isinstance(difference, int | float) or not math.isfinite(difference):
        return Result(name, "fail", f"largest relative difference {difference}: not finite")
    return Result(name, "pass" if code == 0 else "fail", f"largest relative difference {difference:.1e}")


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
    """Every take-away run on `gpus` GPUs, then the hand-off verdict; one skip below 2 GPUs, saying why."""
    if gpus < 2:
        return [Result("the take-away files", "skip", ONE_GPU)]
    runs, results, metrics = file_runs(gpus), [], []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as folder:
        for run in runs:
            print(f"running: {run.name} ...", file=sys.stderr, flush=True)
            if "--jit" in run.args and (problem := xla_gpu_problem(timeout)):  # not a failure of the file
                results.append(Result(run.name, "skip", f"XLA cannot compile on /GPU:0 here: {problem}"))
                metrics.append({})
                continue
            result, written = run_file(run, Path(folder), timeout, examples)
            results.append(result)
            metrics.append(written)
    return [*results, handoff_verdict(metrics[-2], metrics[-1])]


XLA_PROBE = """
import tensorflow as tf
with tf.device("/GPU:0"):
    print(float(tf.function(lambda: tf.reduce_sum(tf.ones([4])) + 1.0, jit_compile=True)()))
"""


def xla_gpu_problem(timeout: float) -> str | None:
    """Why XLA cannot compile a tiny function on /GPU:0, or None if it can: in a child, since a parent that ran on
    the GPU would hold its memory while the runs need it."""
    try:
        done = subprocess.run([sys.executable, "-c", XLA_PROBE], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"a tiny compiled function gave no result within {timeout:.0f} s"
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["no output"])[-1][:200]


def run_audit(gpus: int, timeout: float) -> list[Result]:
    """The placement audit of both files' steps on every GPU, in a child (NCCL can hang)."""
    if gpus < 2:
        return []
    run = FileRun("placement audit of both steps (where each op ran)", AUDIT, ("--devices", all_gpus(gpus)))
    print(f"running: {run.name} ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as folder:
        return [run_file(run, Path(folder), timeout)[0]]


def all_gpus(gpus: int) -> str:
    return ",".join(f"/GPU:{i}" for i in range(gpus))


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


def report(info: dict[str, str], gpus: list[str], results: list[Result]) -> str:
    """The text to paste into an issue: versions, GPUs, one line per run, and the verdict."""
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
        lines += ["", "the take-away files, float32 (TF32 off), each in a child process with a deadline:"]
        width = max(len(r.name) for r in results)
        lines += [f"{r.status.upper():8s} {r.name:{width}s}  {r.detail}" for r in results]
        lines += ["", f"verdict: {verdict(results)}"]
    lines += ["```"]
    return "\n".join(lines)


def verdict(results: list[Result]) -> str:
    """FAILED k of n runs; all passed of n runs; or nothing ran, when every result is a skip."""
    failed = [r for r in results if r.status not in NOT_FAILURES]
    if failed:
        return f"FAILED {len(failed)} of {len(results)} runs"
    ran = [r for r in results if r.status != "skip"]
    return f"all passed of {len(results)} runs" if ran else "nothing ran (see SKIP above)"


def exit_status(results: list[Result]) -> int:
    """1 when any check failed, erred or timed out; 0 otherwise (skipped, missing, measured: not failures)."""
    return 1 if any(r.status not in NOT_FAILURES for r in results) else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tutorial_lib.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=CHECK_TIMEOUT_S, help="seconds per run (default %(default)s)")
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error(f"--timeout {args.timeout}: give the seconds a run may take, > 0 (default {CHECK_TIMEOUT_S:.0f})")
    gpus = gpu_names()
    results = [*run_files(len(gpus), args.timeout), *run_audit(len(gpus), args.timeout)] if gpus else []
    print(report(versions(), gpus, results))
    if gpus:
        print(f"\nPaste the report above into {WHERE_TO_PASTE}.")
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
