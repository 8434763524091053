"""The GPU check: its report for any number of GPUs, its CPU path, and the take-away files' runs,
with fake files that pass, fail, err and sleep past the deadline."""

import json
import subprocess

import pytest

from tutorial_lib import gpu_check
from tutorial_lib.gpu_check import Result

INFO = {"TensorFlow": "2.21.0", "NCCL": "2.32.3"}


def test_report_without_gpu_says_so():
    text = gpu_check.report(INFO, [], [])
    assert "No GPU found: nothing to check here" in text
    assert "TensorFlow           2.21.0" in text and text.startswith("## tutorial_lib.gpu_check report")


def test_report_lists_every_run_and_the_verdict():
    results = [
        Result("train_multi_gpu.py --check", "pass", "largest relative difference 2.0e-15"),
        Result("train_pipelined.py --check", "timeout", "no result within 300 s"),
        Result("train_pipelined.py --handoff-wait on", "skip", "needs 2 or more GPUs"),
    ]
    text = gpu_check.report(INFO, ["/physical_device:GPU:0: NVIDIA GeForce GTX 1080 Ti"], results)
    lines = text.splitlines()
    assert "GPUs                 1" in lines and "  /physical_device:GPU:0: NVIDIA GeForce GTX 1080 Ti" in lines
    for r in results:
        assert any(line.startswith(r.status.upper()) and r.name in line and r.detail in line for line in lines)
    assert "verdict: FAILED 1 of 3 runs" in lines
    assert text.endswith("```")


@pytest.mark.parametrize(
    "statuses, code",
    [(["pass", "skip", "missing", "measured"], 0), ([], 0), (["pass", "fail"], 1), (["error"], 1), (["timeout"], 1)],
)
def test_exit_status(statuses, code):
    assert gpu_check.exit_status([Result("x", s, "") for s in statuses]) == code


def test_the_cpu_path_says_there_is_no_gpu_and_exits_0(capsys):
    assert gpu_check.main([]) == 0
    out = capsys.readouterr().out
    assert "No GPU found: nothing to check here" in out
    for name in ("TensorFlow", "Keras", "Python", "CUDA (built with)", "cuDNN (built with)", "NCCL"):
        assert f"\n{name:20s} " in out


def test_make_gpu_check_runs_the_venvs_python_without_forcing_cpus(tmp_path):
    import os
    import shutil
    from pathlib import Path

    for name in ("Makefile", "course.mk"):
        shutil.copy(Path(__file__).parents[1] / name, tmp_path)
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
def test_main_runs_the_files_on_every_gpu_and_exits_1_on_a_failure(monkeypatch, capsys, gpus, code):
    """The orchestration with the GPUs and the runs faked: on 2 GPUs a run 'fails'; on 1 all are skipped."""
    asked = []

    def fake_runs(g, timeout):
        asked.append((g, timeout))
        return [Result("a file", "fail" if g >= 2 else "skip", "fake")]

    monkeypatch.setattr(gpu_check, "gpu_names", lambda: [f"/physical_device:GPU:{i}: fake" for i in range(gpus)])
    monkeypatch.setattr(gpu_check, "versions", lambda: INFO)
    monkeypatch.setattr(gpu_check, "run_files", fake_runs)
    monkeypatch.setattr(gpu_check, "run_audit", lambda *_: [])
    assert gpu_check.main(["--timeout", "7"]) == code
    assert asked == [(gpus, 7.0)]
    out = capsys.readouterr().out
    assert "a file" in out and "Paste the report above into" in out


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
if "--check" not in sys.argv and "--handoff-wait" not in sys.argv:  # the timed run: its efficiency on GPUs
    metrics = {{"step_ms": 12.5, "baseline_step_ms": 20.0, "efficiency": 0.8, "efficiency_range": [0.7, 0.9]}}
json.dump(metrics, open(out, "w"))
sys.exit({code})
"""


def _fake_examples(tmp_path, mode="ok", difference=1e-9, code=0):
    folder = tmp_path / "examples"
    folder.mkdir()
    for name in ("train_multi_gpu.py", "train_pipelined.py"):
        (folder / name).write_text(FAKE.format(mode=mode, difference=difference, code=code))
    return folder


@pytest.mark.parametrize("gpus", [3, 5, 6, 7])
def test_every_gpu_count_gets_a_batch_it_divides(gpus):
    for run in gpu_check.file_runs(gpus)[:3]:
        batch = int(run.args[run.args.index("--batch") + 1])
        assert batch % gpus == 0 and batch // gpus >= 16, run


def test_file_runs_check_every_gpu_and_the_pipeline_on_at_most_three():
    runs = gpu_check.file_runs(4)
    assert [r.file for r in runs] == ["train_multi_gpu.py"] * 6 + ["train_pipelined.py"] * 5
    assert all("--check" in r.args and "/GPU:3" in r.args[r.args.index("--devices") + 1] for r in runs[:5])
    assert runs[2].args[-3:] == ("--jit", "--bn", "local")  # XLA compiles no sync BN: local
    assert [r.args[-1] for r in runs[3:5]] == ["bfloat16", "float16"]
    assert "--check" not in runs[5].args and "/GPU:3" in runs[5].args[runs[5].args.index("--devices") + 1]
    assert [r.args[r.args.index("--schedule") + 1] for r in runs[6:9]] == ["1f1b", "zb_h1", "interleaved"]
    assert all(r.args[r.args.index("--devices") + 1] == "/GPU:0,/GPU:1,/GPU:2" for r in runs[6:])
    assert [r.args[-1] for r in runs[9:]] == ["on", "off"] and all(r.args[1] == "20" for r in runs[6:])


@pytest.mark.parametrize("gpus", [0, 1])
def test_below_two_gpus_nothing_runs_and_the_skip_says_what_would_be_needed(tmp_path, gpus):
    [result] = gpu_check.run_files(gpus, 5, _fake_examples(tmp_path, "sleep"))
    assert result.status == "skip" and "need 2 or more GPUs" in result.detail and "logical GPUs" in result.detail
    assert gpu_check.exit_status([result]) == 0
    assert "verdict: nothing ran (see SKIP above)" in gpu_check.report(INFO, ["GPU:0"], [result])


@pytest.mark.parametrize(
    "mode, difference, code, status, detail",
    [
        ("ok", 1e-9, 0, "pass", "largest relative difference 1.0e-09"),
        ("ok", 0.3, 1, "fail", "largest relative difference 3.0e-01"),
        ("bad-argument", 0, 1, "error", "exited with status 1: train: error: --devices: no such device"),
        ("ok", "float('nan')", 0, "fail", "largest relative difference nan: not finite"),  # an older file's NaN
        ("ok", "None", 1, "fail", "largest relative difference None: not finite"),  # JSON's null for NaN
        (
            "ok",
            '{"float64": 1e-9, "float16": 2e-3}, "verdict": "ok"',
            0,
            "pass",
            "largest relative difference: float64 1.0e-09, float16 2.0e-03",
        ),
        ("ok", '{"float64": None}, "verdict": "they differ"', 1, "fail", "largest relative difference: float64 None"),
    ],
)
def test_a_file_run_passes_fails_or_errs_as_its_exit_and_json_say(tmp_path, mode, difference, code, status, detail):
    run = gpu_check.file_runs(2)[0]
    (tmp_path / "out").mkdir()
    result, _ = gpu_check.run_file(run, tmp_path / "out", 30, _fake_examples(tmp_path, mode, difference, code))
    assert (result.status, result.detail) == (status, detail)


def test_the_timed_run_reports_its_weak_scaling_efficiency(tmp_path):
    (tmp_path / "out").mkdir()
    run = gpu_check.file_runs(2)[5]
    result, _ = gpu_check.run_file(run, tmp_path / "out", 30, _fake_examples(tmp_path))
    assert result.status == "measured" and "weak-scaling efficiency 80% (range 70%-90%)" in result.detail, result


def test_a_missing_file_is_missing_the_others_still_run_and_the_temporary_folder_goes(tmp_path, monkeypatch):
    import tempfile

    examples = _fake_examples(tmp_path)
    (examples / "train_multi_gpu.py").unlink()
    (tmp_path / "temp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))
    monkeypatch.setattr(gpu_check, "xla_gpu_problem", lambda _timeout: None)
    results = gpu_check.run_files(2, 30, examples)
    assert list((tmp_path / "temp").iterdir()) == []  # the runs' JSON files went with their folder
    assert [r.status for r in results] == ["missing"] * 6 + ["pass"] * 5 + ["measured"]
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


@pytest.mark.parametrize("probe", ["import sys; sys.exit('XlaRuntimeError: no XLA compiler for CUDA')", "pass"])
def test_the_jit_run_is_skipped_with_the_reason_where_xla_cannot_compile_on_the_gpu(tmp_path, monkeypatch, probe):
    monkeypatch.setattr(gpu_check, "XLA_PROBE", probe)  # the child that compiles a tiny function on /GPU:0
    results = gpu_check.run_files(2, 30, _fake_examples(tmp_path))
    [jit] = [r for r in results if "--jit" in r.name]
    if probe == "pass":
        assert jit.status == "pass", jit
    else:
        assert jit.status == "skip" and jit.detail.endswith("here: XlaRuntimeError: no XLA compiler for CUDA"), jit
    assert gpu_check.exit_status(results) == 0 and results[-1].status == "measured"  # the others still ran


def test_the_handoff_verdict_is_the_ratio_of_the_two_step_times():
    result = gpu_check.handoff_verdict({"step_ms": 30.0}, {"step_ms": 20.0})
    assert result.status == "measured" and "off is faster by 1.50x" in result.detail
    assert "on is faster by 2.00x" in gpu_check.handoff_verdict({"step_ms": 10.0}, {"step_ms": 20.0}).detail
    assert gpu_check.handoff_verdict({}, {"step_ms": 20.0}).status == "skip"


@pytest.mark.parametrize("timeout", ["-5", "0", "nan"])
def test_a_timeout_that_is_not_positive_is_refused(timeout, capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--timeout", timeout])
    assert stop.value.code == 2 and "give the seconds a run may take, > 0" in capsys.readouterr().err


@pytest.mark.slow
def test_the_audit_child_reports_every_op_with_its_owner_on_logical_devices(devs, tmp_path, capsys):
    from tutorial_lib import gpu_audit

    out = tmp_path / "audit.json"
    assert gpu_audit.main(["--devices", ",".join(devs[:3]), "--json", str(out)]) == 0
    counts = json.loads(out.read_text())
    assert counts["misplaced"] == 0 and counts["ops_checked"] > 1000 and counts["variables_checked"] > 50
    printed = capsys.readouterr().out
    assert printed.count("data-parallel step, ") == 6 and "pipelined step (zb_h1, recomputed): placement:" in printed
    result = gpu_check.finished("audit", 1, {**counts, "misplaced": 3})
    assert result.status == "fail" and result.detail.endswith("3 misplaced")
    assert gpu_check.run_audit(1, 5) == []  # one GPU: nothing to audit across


@pytest.mark.parametrize(
    "devices, message",
    [
        ("junk", "no device 'junk' here; this machine has /device:CPU:0"),
        ("/GPU:97,/GPU:98", "no device '/GPU:97', '/GPU:98' here"),
        ("/CPU:0,/cpu:0", "a device named twice"),
        ("/CPU:0", "give 2 or more devices"),
    ],
)
def test_the_audit_child_refuses_devices_it_cannot_audit_across_with_exit_2(devices, message, monkeypatch, capsys):
    from tutorial_lib import gpu_audit

    monkeypatch.setattr(gpu_audit, "data_parallel_reports", lambda *_a: pytest.fail("audited before refusing"))
    with pytest.raises(SystemExit) as stop:  # exit 1 means a misplaced op: a traceback said so
        gpu_audit.main(["--devices", devices])
    assert stop.value.code == 2 and message in capsys.readouterr().err
