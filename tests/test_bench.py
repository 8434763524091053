"""The benchmark: its command line (cases faked, nothing measured), its rows, and what each case
times (timing faked). This process has 4 logical CPUs (conftest.py); the one real run of the
command line, on core devices, is the slow test at the end, in a process of its own."""

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf

from tutorial_lib import devices, models, reference, replicated, timing
from tutorial_lib.bench import __main__ as cli
from tutorial_lib.bench import cases, rows, scaling

ROOT = Path(__file__).resolve().parents[1]
LOGICAL = ["--device-model", "logical"]
VERDICTS = {"faster", "slower", "no significant difference"}


@pytest.fixture
def fake_case(monkeypatch):
    """Every case replaced by one that records its calls and returns one row of a 1 ms Timing."""
    ran = []

    def case(name):
        def run(devs, args):
            ran.append((name, devs, args))
            return [rows.row(name, "fake", timing.Timing(1e-3, 1e-4, 3), devices=len(devs))]

        return run

    for name, (_, needs_two) in list(cli.CASES.items()):
        monkeypatch.setitem(cli.CASES, name, (case(name), needs_two))
    return ran


def _main(devs, *args):
    return cli.main([*LOGICAL, "--devices", str(len(devs)), *args])


def test_cli_writes_the_table_the_summary_and_the_rows_as_json(tmp_path, capsys, devs, fake_case):
    path = tmp_path / "bench.json"
    assert _main(devs, "--cases", "packing,mixed", "--repeats", "3", "--json", str(path)) == 0
    out = capsys.readouterr().out
    assert "[packing] running" in out and "[mixed] 1 figures" in out and f"wrote {path}" in out
    assert [name for name, *_ in fake_case] == ["packing", "mixed"]
    result = json.loads(path.read_text())
    assert result["device_model"] == "logical" and result["options"]["repeats"] == 3
    assert [(r["case"], r["ms"], r["samples"]) for r in result["rows"]] == [("packing", 1.0, 3), ("mixed", 1.0, 3)]
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left beside it


@pytest.mark.parametrize(
    "args, message",
    [
        (["--devices", "0"], "--devices must be >= 1"),
        (["--repeats", "2"], "a verdict needs at least 3 samples of each variant"),
        (["--hidden", "0"], "--hidden and --batch must be >= 1"),
        (["--cases", "weak,bogus"], "unknown case"),
        (["--json", "/nonexistent-folder/out.json"], "not a writable folder"),
        (["--json", ""], "--json needs a file name"),
        (["--cases", ","], "names no case"),
        (["--per-device", "64,0"], "give whole numbers >= 1 separated by commas"),
        (["--per-device", "64,big"], "give whole numbers >= 1 separated by commas"),
    ],
)
def test_cli_rejects_bad_options_before_measuring(args, message, capsys, fake_case):
    with pytest.raises(SystemExit):
        cli.main(args)
    assert message in capsys.readouterr().err
    assert fake_case == []


def test_cli_bounds_the_devices_by_this_machines_memory(monkeypatch, capsys, fake_case):
    monkeypatch.setattr(cli, "_available_memory", lambda: 24e9)  # 24 GB: 28 shares of 830 MB, one for the bench
    with pytest.raises(SystemExit):
        cli.main(["--devices", "99", "--device-model", "logical"])
    err = capsys.readouterr().err
    assert "--devices 99: each device takes about 830 MB" in err and "24.0 GB available: pass --devices 27" in err
    assert fake_case == []
    assert cli._devices_problem(27, 24e9) is None and cli._devices_problem(4, None) is None  # unknown: no bound


@pytest.mark.usefixtures("fake_case")
def test_cli_warns_when_devices_outnumber_cores(monkeypatch, capsys, devs):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    _main(devs, "--cases", "mixed")
    assert "at most 2 run at once" in capsys.readouterr().err


@pytest.mark.parametrize("load, warned", [(8.0, True), (2.0, False), (0.3, False)])
def test_cli_warns_before_measuring_when_the_machine_is_busy(monkeypatch, capsys, devs, load, warned):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.getloadavg", lambda: (load, 0.0, 0.0))
    err_when_measured = []
    monkeypatch.setitem(cli.CASES, "mixed", (lambda *_: err_when_measured.append(capsys.readouterr().err) or [], None))
    _main(devs, "--cases", "mixed")
    (err,) = err_when_measured  # printed before the case ran
    assert ("ratios become noisy and speedups shrink" in err) is warned
    assert (f"load average {load:.1f} on 2 cores" in err) is warned


def test_cli_refuses_a_json_folder_before_measuring(tmp_path, capsys, devs, fake_case):
    with pytest.raises(SystemExit):
        _main(devs, "--cases", "mixed", "--json", str(tmp_path))
    assert "is a folder; give a file name in it, such as" in capsys.readouterr().err
    assert fake_case == []


def test_cli_runs_each_case_once_and_passes_the_sweep(devs, fake_case):
    assert _main(devs, "--cases", "weak, mixed, weak,", "--per-device", "8,32,8") == 0
    assert [name for name, *_ in fake_case] == ["weak", "mixed"]
    assert fake_case[0][2].per_device == (8, 32)


def test_cli_skips_the_all_reduce_cases_on_one_device(capsys, devs, fake_case):
    args, selected = cli._parse(["--devices", "1", "--cases", "packing,mixed"])
    cli._run_cases(selected, devs[:1], args)
    assert "[packing] skipped: an all-reduce needs 2 or more devices" in capsys.readouterr().out
    assert [name for name, *_ in fake_case] == ["mixed"]


def test_json_is_written_whole_or_not_at_all(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('{"rows": "an earlier run"}')
    with pytest.raises(TypeError):
        rows.write_json(str(path), {"rows": [1, object()]})  # fails half-way through the dump
    assert json.loads(path.read_text()) == {"rows": "an earlier run"}
    assert list(tmp_path.iterdir()) == [path]


# --- rows ----------------------------------------------------------------------------


def test_a_row_keeps_its_samples_and_converts_back_to_its_timing():
    t = timing.Timing(0.004, 0.001, 7)
    r = rows.row("case", "variant", t, per=2, devices=1)
    assert (r["ms"], r["spread_ms"], r["samples"]) == (2.0, 0.5, 7)
    assert rows.timing_of(r) == timing.Timing(0.002, 0.0005, 7)
    assert rows.row("fit", "ring", None)["ms"] is None


def test_the_table_shows_the_ratio_with_its_verdict_and_the_other_fields_below():
    t = timing.Timing(0.002, 0.0001, 5)
    packed = rows.row("packing", "packed", t, devices=2, bytes=400) | rows.compared(
        t, timing.Timing(0.004, 0, 5), "speedup"
    )
    lines = rows.format_table([packed, rows.row("mixed precision", "skipped", None, reason="no GPU")]).splitlines()
    assert "speedup 2.00 [1.95-2.05]" in lines[1] and lines[1].endswith(" faster") and lines[2].strip() == "bytes 400"
    assert lines[3].split()[:4] == ["mixed", "precision", "skipped", "-"] and lines[4].strip() == "reason no GPU"
    assert max(map(len, lines)) <= 110


# --- summaries -----------------------------------------------------------------------


def _weak(variant, per_device, efficiency, devices=2):
    return {"case": "weak scaling", "variant": variant, "devices": devices, "per_device": per_device,
            "efficiency": efficiency}  # fmt: skip


def test_the_weak_summary_reads_a_trend_only_from_two_batches_or_more():
    lines = scaling.summary(
        [
            _weak("hand towers", 64, 0.5),
            _weak("hand towers", 1024, 0.9),
            _weak("hand towers", 256, 0.7),
            _weak("hand towers", 64, 1.0, devices=1),
            _weak("ring, replicated", 64, 0.6),
            _weak("ring, replicated", 256, 0.4),
            _weak("MirroredStrategy", 256, 0.8),
        ]
    )
    assert lines == [
        "hand towers, 2 devices, weak-scaling efficiency per per-device batch: 0.50 at 64, 0.70 at 256, "
        "0.90 at 1024; rising with the batch: yes",
        "ring, replicated, 2 devices, weak-scaling efficiency per per-device batch: 0.60 at 64, 0.40 at 256; "
        "rising with the batch: no",
        "MirroredStrategy, 2 devices, weak-scaling efficiency per per-device batch: 0.80 at 256",
    ]


def test_the_other_summaries_are_computed_from_the_rows():
    strong = {"case": "strong scaling", "variant": "hand towers", "devices": 2, "global_batch": 512,
              "efficiency": 0.61, "efficiency_verdict": "faster"}  # fmt: skip
    assert scaling.summary([strong]) == [
        "strong scaling, global batch 512: efficiency 0.61 on 2 devices; 2 devices against one: faster",
    ]
    packed = {"case": "packing", "variant": "packed into one bucket", "speedup": 4.0, "speedup_verdict": "faster"}
    fit = {"case": "all-reduce fit", "variant": "ring (ring model)", "alpha_us": 12.3, "link_gb_per_s": None}
    assert cases.summary([packed, fit]) == [
        "packing into one bucket: 4.00x (faster)",
        "ring (ring model): alpha 12 us per message, link unbounded (beta fitted as 0)",
    ]


# --- what the cases time -------------------------------------------------------------


TINY_CASES = {
    "weak": (scaling.weak_scaling, dict(hidden=(8,), per_device=(4, 8), repeats=3)),
    "strong": (scaling.strong_scaling, dict(hidden=(8,), global_batch=8, repeats=3)),
    "packing": (cases.packing, dict(tensors=3, elements=5, repeats=3)),
    "allreduce": (cases.allreduce_methods, dict(sizes=(1, 10), repeats=3)),
    "input": (cases.input_pipeline, dict(batch=4, steps=2, read_ms=0.0, repeats=3)),
}


@pytest.fixture(scope="module")
def tiny_runs(devs):
    """Each case run once at a tiny size with `timing.interleaved` replaced: each variant is called
    once and timed at 1 ms. {case: (rows, {variant: (function, result)}, printed)}."""
    runs = {}
    with pytest.MonkeyPatch.context() as patch:
        for case, (run, options) in TINY_CASES.items():
            calls = {}

            def interleaved(variants, calls=calls, **_counts):
                calls.update({name: (fn, fn()) for name, fn in variants.items()})
                return {name: timing.Timing(1e-3, 0.0, 3) for name in variants}

            patch.setattr(timing, "interleaved", interleaved)
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                found = run(devs[:2], **options)
            runs[case] = (found, calls, printed.getvalue())
    return runs


def _tensors(result) -> list:
    return [t for t in tf.nest.flatten(result) if isinstance(t, tf.Tensor)]


def _computed_on(fn) -> set[str]:
    """The devices that compute the values a timed `partial(tf.function, ...)` returns.

    TensorFlow copies a function's outputs to the device it is called from, so the devices
    of the returned tensors say nothing; the ops behind the function's outputs do.
    """
    concrete = fn.func.get_concrete_function(*fn.args, **fn.keywords)
    found = set()
    for t in concrete.outputs:
        op = t.op
        while op.type == "Identity" and not op.device:  # the function's own output copies
            op = op.inputs[0].op
        found.add(devices.normalize(op.device))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(TINY_CASES))
def test_every_timed_call_returns_tensors_that_the_timing_waits_for(case, tiny_runs):
    # A step that returns nothing would be timed at its launch on a GPU: the timing can only
    # wait for tensors that the step returns.
    found, calls, _ = tiny_runs[case]
    assert calls and all(r["samples"] == 3 for r in found if r["ms"] is not None)
    for name, (_, result) in calls.items():
        assert _tensors(result), f"{case}: {name} returned {result!r}, nothing to wait for"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["packing", "allreduce"])
def test_all_reduce_cases_return_a_value_computed_on_every_device(case, tiny_runs, devs):
    for name, (fn, result) in tiny_runs[case][1].items():
        if name == cases.CALL:  # the baseline: a call that reaches the first device and moves nothing
            assert _computed_on(fn) == {devs[0]}
            continue
        assert len(_tensors(result)) == 2, name
        assert _computed_on(fn) == set(devs[:2]), name


@pytest.mark.slow
def test_the_replicated_step_returns_a_loss_computed_on_every_device(tiny_runs, devs):
    fn, _ = tiny_runs["weak"][1]["ring, replicated", 2]
    assert _computed_on(fn) == set(devs[:2])


@pytest.mark.slow
def test_weak_scaling_covers_the_sweep_with_progress_and_efficiency_from_the_timings(tiny_runs):
    found, _, printed = tiny_runs["weak"]
    assert "[weak] 4 per device, on 1 to 2 devices ..." in printed
    seen = {(r["variant"], r["devices"], r["per_device"]) for r in found}
    variants = ("hand towers", "ring, replicated", "MirroredStrategy")  # logical devices: MirroredStrategy
    assert seen == {(v, k, b) for v in variants for k in (1, 2) for b in (4, 8)}
    for r in found:  # every fake time is 1 ms: k devices make k times the examples in the same time
        assert r["efficiency"] == pytest.approx(1.0)
        assert r["efficiency_verdict"] == ("faster" if r["devices"] > 1 else "no significant difference")
        assert r["examples_per_s"] == pytest.approx(r["per_device"] * r["devices"] / 1e-3)
        assert r["device_model"] == "logical"


def test_allreduce_fits_each_methods_latency_and_bandwidth_beyond_the_call(devs, monkeypatch):
    # Times that follow t = call + messages x alpha + per_byte x bytes x beta exactly: the fit returns them.
    alpha, beta, n, call = 50e-6, 1e-9, 2, 2e-3
    per_byte = {"central": 2 * (n - 1), "ring": 2 * (n - 1) / n, "collective (MirroredStrategy)": 2 * (n - 1) / n}

    def interleaved(variants, **_counts):
        (size,) = {
            fn.args[0] if isinstance(fn.args[0], int) else int(fn.args[0][0].shape[0]) for fn in variants.values()
        }
        assert cases.CALL in variants  # timed in the same rounds
        seconds = {m: call + 2 * (n - 1) * alpha + per_byte[m] * 4 * size * beta for m in per_byte}
        return {m: timing.Timing(seconds.get(m, call), 0.0, 3) for m in variants}

    monkeypatch.setattr(timing, "interleaved", interleaved)
    fits = [r for r in cases.allreduce_methods(devs[:n], sizes=(1, 100, 10_000)) if r["case"] == "all-reduce fit"]
    assert [r["variant"] for r in fits] == [
        "central (central model)",
        "ring (ring model)",
        "collective (MirroredStrategy) (ring model)",
    ]
    for r in fits:
        assert r["alpha_us"] == pytest.approx(50.0) and r["link_gb_per_s"] == pytest.approx(1.0)


def test_mixed_precision_says_why_it_is_skipped_on_cpus(devs):
    (skipped,) = cases.mixed_precision(devs[:1])
    assert skipped["variant"] == "skipped" and "no GPU with tensor cores" in skipped["reason"]


def test_the_replicated_step_ends_with_the_single_device_reference(devs):
    import numpy as np

    x, y = rows.synthetic_batch(16)
    replicas = []
    for d in devs[:2]:
        with tf.device(d):
            replicas.append(models.MLP(hidden=(8,)))
    single = models.MLP(hidden=(8,))
    losses = replicated.make_train_step(replicas, devs[:2], learning_rate=scaling.LEARNING_RATE)(x, y)
    expected = reference.sgd_step(single, x, y, scaling.LEARNING_RATE)
    np.testing.assert_allclose(np.mean([float(v) for v in losses]), float(expected), rtol=1e-5)
    for replica in replicas:
        for v, w in zip(replica.trainable_variables, single.trainable_variables, strict=True):
            np.testing.assert_allclose(v.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)


# --- the default: core devices, in a process of their own -----------------------------


@pytest.mark.slow
def test_cli_on_core_devices_by_default(tmp_path):
    path = tmp_path / "cores.json"
    command = [sys.executable, "-m", "tutorial_lib.bench", "--devices", "2", "--cases", "weak,allreduce"]
    command += ["--hidden", "16", "--per-device", "8", "--repeats", "3", "--json", str(path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(path.read_text())
    assert report["device_model"] == "cores" and report["options"]["device_model"] == "cores"
    assert report["summary"] and "[weak] 8 per device, on 1 to 2 devices" in result.stdout
    found = report["rows"]
    assert {r["device_model"] for r in found} == {"cores"}
    assert {r["samples"] for r in found if r["ms"] is not None} == {3}
    variants = {r["variant"] for r in found if r["case"] == "weak scaling"}
    assert variants == {"hand towers", "ring, replicated"}  # MirroredStrategy refuses core devices
    assert all(r["efficiency_verdict"] in VERDICTS for r in found if r["case"] == "weak scaling")
    fits = [r for r in found if r["case"] == "all-reduce fit"]
    assert [r["variant"] for r in fits] == ["central (central model)", "ring (ring model)"]


def test_steps_in_one_call_are_the_same_steps_as_one_call_each(devs):
    import numpy as np
    import tensorflow as tf

    from tutorial_lib import models, towers
    from tutorial_lib.bench import scaling

    x, y = tf.random.stateless_normal([8, 64], [0, 3]), tf.constant(np.arange(8) % 10, tf.int32)
    nets = [models.MLP(hidden=(16,), seed=0) for _ in range(2)]
    steps = [towers.make_train_step(net, devs[:2], 0.1) for net in nets]
    scaling.in_one_call(steps[0], 3)(x, y)
    for _ in range(3):
        steps[1](x, y)
    for a, b in zip(nets[0].trainable_variables, nets[1].trainable_variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)
    assert scaling.in_one_call(steps[1], 1) is steps[1]


@pytest.mark.parametrize("k", [0, -1, 2.5, True, "2"])
def test_in_one_call_and_the_sweeps_refuse_a_count_of_steps_that_is_not_one_or_more(k, capsys):
    from tutorial_lib.bench import scaling

    with pytest.raises(ValueError, match=r"k \(steps per call\) must be a whole number >= 1"):
        scaling.in_one_call(lambda x, _y: x, k)
    for sweep in (scaling.weak_scaling, scaling.strong_scaling):
        with pytest.raises(ValueError, match="steps_per_call must be a whole number >= 1"):
            sweep(["/CPU:0"], steps_per_call=k)
    assert capsys.readouterr().out == ""  # refused before the sweep says it starts
