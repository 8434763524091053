"""The GPU check: its plan and report for any number of GPUs, its CPU path, and its check code
driven on 4 logical CPUs (ring and central where NCCL would run), where it can pass and fail."""

import math
import subprocess
import sys

import pytest
import tensorflow as tf

from tutorial_lib import allreduce, gpu_check
from tutorial_lib.gpu_check import Check, Result


def test_no_gpu_plans_no_check():
    assert gpu_check.plan_checks(0) == (0, [], [])


def test_two_or_more_gpus_check_everything_on_all_of_them():
    for gpus in (2, 4):
        n, checks, skipped = gpu_check.plan_checks(gpus)
        assert n == gpus and skipped == []
        assert {(c.what, c.how) for c in checks} == {
            ("all_reduce", "nccl"),
            ("train_step", "nccl"),
            ("train_step", "ring"),
            *(("mirrored", name) for name in gpu_check.CROSS_DEVICE_OPS),
        }


def test_one_gpu_skips_nccl_and_says_why():
    n, checks, skipped = gpu_check.plan_checks(1)
    assert n == 2  # two logical GPUs carved out of it
    assert not [c for c in checks if c.how in ("nccl", "NcclAllReduce")]
    assert {r.name for r in skipped} == {
        "all-reduce, nccl vs ring",
        "train step, allreduce_grads nccl vs reference",
        "MirroredStrategy NcclAllReduce vs reference",
    }
    assert all(r.status == "skip" and "Duplicate GPU detected" in r.detail for r in skipped)


@pytest.mark.parametrize("difference, status", [(0.0, "pass"), (1e-6, "pass"), (2e-6, "fail"), (math.nan, "fail")])
def test_verdict(difference, status):
    assert gpu_check.verdict(Check("all_reduce", "nccl", 1e-6), difference).status == status


INFO = {"TensorFlow": "2.21.0", "NCCL": "2.32.3"}


def test_report_without_gpu_says_so():
    text = gpu_check.report(INFO, [], 0, [])
    assert "No GPU found: nothing to check here" in text
    assert "TensorFlow           2.21.0" in text and text.startswith("## tutorial_lib.gpu_check report")


def test_report_lists_every_check_and_the_verdict():
    results = [
        Result("all-reduce, nccl vs ring", "pass", "max |difference| 0.0e+00 (tolerance 1e-06)"),
        Result("MirroredStrategy NcclAllReduce vs reference", "timeout", "no result within 300 s"),
        Result("train step, allreduce_grads nccl vs reference", "skip", "needs 2 or more GPUs"),
    ]
    text = gpu_check.report(INFO, ["/physical_device:GPU:0: NVIDIA GeForce GTX 1080 Ti"], 2, results)
    lines = text.splitlines()
    assert "GPUs                 1" in lines and "  /physical_device:GPU:0: NVIDIA GeForce GTX 1080 Ti" in lines
    assert any(line.startswith("checks on 2 logical GPUs carved out of the one GPU, float32") for line in lines)
    for r in results:
        assert any(line.startswith(r.status.upper()) and r.name in line and r.detail in line for line in lines)
    assert "verdict: FAILED 1 of 3 checks" in lines
    assert text.endswith("```")


@pytest.mark.parametrize(
    "statuses, code",
    [(["pass", "skip", "missing", "measured"], 0), ([], 0), (["pass", "fail"], 1), (["error"], 1), (["timeout"], 1)],
)
def test_exit_status(statuses, code):
    assert gpu_check.exit_status([Result("x", s, "") for s in statuses]) == code


@pytest.mark.slow
def test_the_cpu_path_says_there_is_no_gpu_and_exits_0():
    run = subprocess.run([sys.executable, "-m", "tutorial_lib.gpu_check"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "No GPU found: nothing to check here" in run.stdout
    for name in ("TensorFlow", "Keras", "Python", "CUDA (built with)", "cuDNN (built with)", "NCCL"):
        assert f"\n{name:20s} " in run.stdout


# --- the check code on 4 logical CPUs: ring and central stand in for NCCL -----------


@pytest.mark.parametrize(
    "check",
    [
        Check("all_reduce", "central", gpu_check.ALLREDUCE_TOLERANCE),
        Check("train_step", "ring", gpu_check.TRAIN_TOLERANCE),
        Check("train_step", "central", gpu_check.TRAIN_TOLERANCE),
        Check("mirrored", "ReductionToOneDevice", gpu_check.TRAIN_TOLERANCE),
        Check("mirrored", "HierarchicalCopyAllReduce", gpu_check.TRAIN_TOLERANCE),
        Check("mirrored", "default", gpu_check.TRAIN_TOLERANCE),
    ],
)
def test_checks_pass_on_cpus(devs, check):
    result = gpu_check.run_check(check, devs)
    assert result.status == "pass", result


def _off_by(amount):
    def broken(tensors, devices):
        return [t + amount for t in allreduce.ring_all_reduce(tensors, devices)]

    return broken


@pytest.mark.parametrize("what", ["all_reduce", "train_step"])
def test_checks_fail_when_the_all_reduce_is_wrong(devs, monkeypatch, what):
    monkeypatch.setitem(allreduce.ALL_SUMS, "central", _off_by(1e-3))
    result = gpu_check.run_check(Check(what, "central", gpu_check.TRAIN_TOLERANCE), devs)
    assert result.status == "fail" and "max |difference|" in result.detail, result


def test_mirrored_check_fails_when_the_strategy_trains_differently(devs, monkeypatch):
    reference = gpu_check._reference_weights  # a reference with twice the learning rate: not what the strategy did
    monkeypatch.setattr(gpu_check, "_reference_weights", lambda x, y, lr, device: reference(x, y, 2 * lr, device))
    result = gpu_check.run_check(Check("mirrored", "ReductionToOneDevice", gpu_check.TRAIN_TOLERANCE), devs)
    assert result.status == "fail", result


def test_nccl_on_cpus_is_an_error_result_not_a_crash(devs):
    result = gpu_check.run_check(Check("all_reduce", "nccl", gpu_check.ALLREDUCE_TOLERANCE), devs)
    assert result.status == "error" and "NCCL runs on GPUs only" in result.detail


# --- the child processes ----------------------------------------------------------------


@pytest.mark.slow
def test_a_check_runs_in_a_child_with_its_own_devices():
    result = gpu_check.run_in_child(Check("train_step", "ring", gpu_check.TRAIN_TOLERANCE), 2, kind="cpu", timeout=300)
    assert result.status == "pass", result


def test_a_child_past_its_deadline_is_stopped_and_reported():
    result = gpu_check.run_in_child(Check("train_step", "ring", gpu_check.TRAIN_TOLERANCE), 2, kind="cpu", timeout=0.5)
    assert result.status == "timeout" and "no result within" in result.detail


def test_a_child_without_a_result_is_an_error():
    check = Check("all_reduce", "nccl", 1e-6)
    result = gpu_check._parse_child(check, 1, "some output\n", "Traceback ...\nImportError: no module\n")
    assert result == Result(
        check.name, "error", "the child exited with status 1 without a result: ImportError: no module"
    )


def test_tf_is_on_cpus_here(devs):
    assert not tf.config.list_logical_devices("GPU") and len(devs) == 4


def test_make_gpu_check_runs_the_venvs_python_without_forcing_cpus(tmp_path):
    import os
    import shutil
    from pathlib import Path

    shutil.copy(Path(__file__).parents[1] / "Makefile", tmp_path)
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / ".installed").write_text("")  # newer than pyproject.toml: no install
    os.utime(tmp_path / "pyproject.toml", (0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "TUTORIAL_DEVICE")}
    plan = subprocess.run(
        ["make", "--no-print-directory", "-n", "gpu-check"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert plan.stdout.strip() == ".venv/bin/python -m tutorial_lib.gpu_check"


@pytest.mark.parametrize("gpus, code", [(2, 1), (1, 0)])
def test_main_runs_every_planned_check_and_exits_1_on_a_failure(monkeypatch, capsys, gpus, code):
    """The orchestration with the GPUs and the children faked: on 2 GPUs the NCCL step 'fails'."""
    ran = []

    def fake_child(check, n, kind, timeout):
        ran.append((check.name, n, kind, timeout))
        return Result(check.name, "fail" if check.what == "train_step" and check.how == "nccl" else "pass", "fake")

    monkeypatch.setattr(gpu_check, "gpu_names", lambda: [f"/physical_device:GPU:{i}: fake" for i in range(gpus)])
    monkeypatch.setattr(gpu_check, "run_in_child", fake_child)
    monkeypatch.setattr(gpu_check, "versions", lambda: INFO)
    files = []
    monkeypatch.setattr(gpu_check, "run_files", lambda g, t: files.append((g, t)) or [Result("a file", "missing", "")])
    assert gpu_check.main(["--timeout", "7"]) == code
    assert files == [(gpus, 7.0)]  # the take-away files too, on every GPU
    n, checks, skipped = gpu_check.plan_checks(gpus)
    assert ran == [(c.name, n, "gpu", 7.0) for c in checks]
    out = capsys.readouterr().out
    assert all(c.name in out for c in checks) and all(r.name in out and "SKIP" in out for r in skipped)
    assert "Paste the report above into" in out


# --- the take-away files, with fake files in their place --------------------------------

FAKE = """
import json, os, sys, time
out = sys.argv[sys.argv.index("--json") + 1]
mode = {mode!r}
if mode == "sleep":
    open(out + ".pid", "w").write(str(os.getpid()))
    time.sleep(60)
if mode == "bad-argument":
    sys.exit("train: error: --devices: no such device")
metrics = {{"step_ms": 12.5}} if "--handoff-wait" in sys.argv else {{"largest_relative_difference": {difference}}}
json.dump(metrics, open(out, "w"))
sys.exit({code})
"""


def _fake_examples(tmp_path, mode="ok", difference=1e-9, code=0):
    folder = tmp_path / "examples"
    folder.mkdir()
    for name in ("train_multi_gpu.py", "train_pipelined.py"):
        (folder / name).write_text(FAKE.format(mode=mode, difference=difference, code=code))
    return folder


def test_file_runs_check_every_gpu_and_the_pipeline_on_at_most_three():
    runs = gpu_check.file_runs(4)
    assert [r.file for r in runs] == ["train_multi_gpu.py"] * 2 + ["train_pipelined.py"] * 3
    assert all("--check" in r.args and "/GPU:3" in r.args[r.args.index("--devices") + 1] for r in runs[:2])
    assert all(r.args[r.args.index("--devices") + 1] == "/GPU:0,/GPU:1,/GPU:2" for r in runs[2:])
    assert [r.args[-1] for r in runs[3:]] == ["on", "off"] and all(r.args[1] == "20" for r in runs)


def test_files_are_skipped_below_two_gpus(tmp_path):
    assert {r.status for r in gpu_check.run_files(1, 5, _fake_examples(tmp_path))} == {"skip"}


@pytest.mark.parametrize(
    "mode, difference, code, status, detail",
    [
        ("ok", 1e-9, 0, "pass", "largest relative difference 1.0e-09"),
        ("ok", 0.3, 1, "fail", "largest relative difference 3.0e-01"),
        ("bad-argument", 0, 1, "error", "exited with status 1: train: error: --devices: no such device"),
    ],
)
def test_a_file_run_passes_fails_or_errs_as_its_exit_and_json_say(tmp_path, mode, difference, code, status, detail):
    run = gpu_check.file_runs(2)[0]
    (tmp_path / "out").mkdir()
    result, _ = gpu_check.run_file(run, tmp_path / "out", 30, _fake_examples(tmp_path, mode, difference, code))
    assert (result.status, result.detail) == (status, detail)


def test_a_missing_file_is_missing_and_the_others_still_run(tmp_path):
    examples = _fake_examples(tmp_path)
    (examples / "train_multi_gpu.py").unlink()
    results = gpu_check.run_files(2, 30, examples)
    assert [r.status for r in results] == ["missing", "missing", "pass", "pass", "pass", "measured"]
    assert "train_multi_gpu.py is not there" in results[0].detail
    assert results[-1].detail.startswith("on 12.5 ms, off 12.5 ms")
    assert gpu_check.exit_status(results) == 0


def test_a_file_past_its_deadline_is_stopped_and_nothing_is_left(tmp_path):
    import os

    (tmp_path / "out").mkdir()
    result, _ = gpu_check.run_file(gpu_check.file_runs(2)[0], tmp_path / "out", 3, _fake_examples(tmp_path, "sleep"))
    assert result.status == "timeout" and "no result within 3 s" in result.detail
    [pid_file] = (tmp_path / "out").glob("*.pid")
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)  # the child is gone, not left sleeping


def test_the_handoff_verdict_is_the_ratio_of_the_two_step_times():
    result = gpu_check.handoff_verdict({"step_ms": 30.0}, {"step_ms": 20.0})
    assert result.status == "measured" and "off is faster by 1.50x" in result.detail
    assert "on is faster by 2.00x" in gpu_check.handoff_verdict({"step_ms": 10.0}, {"step_ms": 20.0}).detail
    assert gpu_check.handoff_verdict({}, {"step_ms": 20.0}).status == "skip"


@pytest.mark.parametrize("timeout", ["-5", "0", "nan"])
def test_a_timeout_that_is_not_positive_is_refused(timeout, capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--timeout", timeout])
    assert stop.value.code == 2 and "give the seconds a check may take, > 0" in capsys.readouterr().err
