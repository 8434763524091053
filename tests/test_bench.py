"""The benchmark's CLI and cases. This process has 4 logical CPUs (conftest.py), so the CLI runs
here with --device-model logical; the default, core devices, runs in a process of its own."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf

from tutorial_lib import bench, bench_pipeline, devices, timing

ROOT = Path(__file__).resolve().parents[1]
LOGICAL = ["--device-model", "logical"]
VERDICTS = {"faster", "slower", "no significant difference"}


def test_cli_runs_a_case_and_writes_json(tmp_path, capsys, devs):
    path = tmp_path / "bench.json"
    argv = ["--devices", str(len(devs)), "--cases", "packing,mixed", "--repeats", "3", "--json", str(path)]
    assert bench.main(LOGICAL + argv) == 0
    out = capsys.readouterr().out
    assert "[packing] running" in out and "packed into one bucket" in out and "mixed precision" in out
    result = json.loads(path.read_text())
    assert result["device_model"] == "logical"
    assert {r["device_model"] for r in result["rows"]} == {"logical"}
    one_by_one, packed = (r for r in result["rows"] if r["case"] == "packing")
    assert packed["variant"] == "packed into one bucket"
    assert packed["speedup"] == pytest.approx(one_by_one["ms"] / packed["ms"])
    low, high = packed["speedup_range"]
    assert low <= packed["speedup"] <= high
    assert packed["speedup_verdict"] in VERDICTS


@pytest.mark.parametrize(
    "args, message",
    [
        (["--devices", "0"], "--devices must be >= 1"),
        (["--repeats", "0"], "must be >= 1"),
        (["--cases", "weak,bogus"], "unknown case"),
        (["--json", "/nonexistent-folder/out.json"], "not a writable folder"),
        (["--cases", ","], "names no case"),
        (["--cases", " , ,"], "names no case"),
        (["--device-model", "gpu"], "invalid choice: 'gpu'"),
        (["--per-device", "64,0"], "give whole numbers >= 1 separated by commas"),
        (["--per-device", "64,big"], "give whole numbers >= 1 separated by commas"),
        (["--per-device", ","], "give whole numbers >= 1 separated by commas"),
    ],
)
def test_cli_rejects_bad_options(args, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(args)
    assert message in capsys.readouterr().err


@pytest.fixture
def fake_mixed(monkeypatch):
    """The "mixed" case replaced by one that records its calls and measures nothing."""
    ran = []
    monkeypatch.setitem(bench.CASES, "mixed", lambda devs, **options: ran.append((devs, options)) or [])
    return ran


@pytest.mark.usefixtures("fake_mixed")
def test_cli_warns_when_devices_outnumber_cores(monkeypatch, capsys, devs):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    bench.main(LOGICAL + ["--devices", str(len(devs)), "--cases", "mixed"])
    assert "at most 2 run at once" in capsys.readouterr().err


@pytest.mark.parametrize("load, warned", [(8.0, True), (2.0, False), (0.3, False)])
def test_cli_warns_before_measuring_when_the_machine_is_busy(monkeypatch, capsys, devs, load, warned):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.getloadavg", lambda: (load, 0.0, 0.0))
    err_when_measured = []
    monkeypatch.setitem(
        bench.CASES, "mixed", lambda _devs, **_options: err_when_measured.append(capsys.readouterr().err) or []
    )
    bench.main(LOGICAL + ["--devices", str(len(devs)), "--cases", "mixed"])
    (err,) = err_when_measured  # printed before the case ran
    assert ("ratios become noisy and speedups shrink" in err) is warned
    assert (f"load average {load:.1f} on 2 cores" in err) is warned


def test_cli_refuses_a_json_folder_before_measuring(tmp_path, capsys, devs, fake_mixed):
    with pytest.raises(SystemExit):
        bench.main(LOGICAL + ["--devices", str(len(devs)), "--cases", "mixed", "--json", str(tmp_path)])
    assert "is a folder; give a file name in it, such as" in capsys.readouterr().err
    assert fake_mixed == []


def test_cli_runs_each_case_once(capsys, devs, fake_mixed):
    assert bench.main(LOGICAL + ["--devices", str(len(devs)), "--cases", "mixed, mixed,"]) == 0
    assert len(fake_mixed) == 1
    assert "[mixed] running" in capsys.readouterr().out


def test_cli_passes_the_weak_scaling_sweep(devs, monkeypatch):
    ran = []
    monkeypatch.setitem(bench.CASES, "weak", lambda _devs, **options: ran.append(options) or [])
    bench.main(LOGICAL + ["--devices", str(len(devs)), "--cases", "weak", "--per-device", "8,32,8"])
    assert ran[0]["per_device"] == (8, 32)


# --- what the cases time -------------------------------------------------------------


@pytest.fixture
def timed(monkeypatch):
    """`timing.interleaved` replaced: each variant is called once, its function and result kept; 1 ms each."""
    calls = {}

    def interleaved(variants, **_counts):
        for name, fn in variants.items():
            calls.setdefault(name, []).append((fn, fn()))
        return {name: timing.Timing(1e-3, 0.0) for name in variants}

    monkeypatch.setattr(timing, "interleaved", interleaved)
    return calls


TINY_CASES = {
    "weak": dict(hidden=(8,), per_device=(4, 8), repeats=1),
    "strong": dict(hidden=(8,), global_batch=8, repeats=1),
    "packing": dict(tensors=3, elements=5, repeats=1),
    "allreduce": dict(sizes=(1, 10), repeats=1),
    "input": dict(batch=4, steps=2, read_ms=0.0, repeats=1),
}


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


@pytest.mark.parametrize("case", sorted(TINY_CASES))
def test_every_timed_call_returns_tensors_that_the_timing_waits_for(case, timed, devs):
    # A step that returns nothing would be timed at its launch on a GPU: timing._block
    # can only wait for tensors that the step returns.
    bench.CASES[case](devs[:2], **TINY_CASES[case])
    assert timed
    for name, calls in timed.items():
        for _, result in calls:
            assert _tensors(result), f"{case}: {name} returned {result!r}, nothing to wait for"


@pytest.mark.parametrize("case", ["packing", "allreduce"])
def test_all_reduce_cases_return_a_value_computed_on_every_device(case, timed, devs):
    bench.CASES[case](devs[:2], **TINY_CASES[case])
    for name, calls in timed.items():
        for fn, result in calls:
            assert len(_tensors(result)) == 2, name
            assert _computed_on(fn) == set(devs[:2]), name


def test_the_ring_step_returns_a_loss_computed_on_every_device(timed, devs):
    bench.weak_scaling(devs[:2], **TINY_CASES["weak"])
    for fn, _ in timed["ring, replicated", 2]:
        assert _computed_on(fn) == set(devs[:2])


@pytest.mark.usefixtures("timed")
def test_weak_scaling_rows_cover_the_sweep_with_efficiency_from_the_timings(devs):
    rows = bench.weak_scaling(devs[:2], **TINY_CASES["weak"])
    seen = {(r["variant"], r["devices"], r["per_device"]) for r in rows}
    variants = ("hand towers", "ring, replicated", "MirroredStrategy")  # logical devices: MirroredStrategy
    assert seen == {(v, k, b) for v in variants for k in (1, 2) for b in (4, 8)}
    for r in rows:  # every fake time is 1 ms
        assert r["efficiency"] == pytest.approx(1.0)
        assert r["examples_per_s"] == pytest.approx(r["per_device"] * r["devices"] / 1e-3)
        assert r["device_model"] == "logical"


def test_allreduce_reports_each_methods_fitted_latency_and_bandwidth(devs, monkeypatch):
    # Times that follow t = messages x alpha + per_byte x bytes x beta exactly: the fit returns them.
    alpha, beta, n = 50e-6, 1e-9, 2
    per_byte = {"central": 2 * (n - 1), "ring": 2 * (n - 1) / n, "collective (MirroredStrategy)": 2 * (n - 1) / n}
    sizes = (1, 100, 10_000)

    def interleaved(variants, **_counts):
        (size,) = {
            fn.args[0] if isinstance(fn.args[0], int) else int(fn.args[0][0].shape[0]) for fn in variants.values()
        }
        return {m: timing.Timing(2 * (n - 1) * alpha + per_byte[m] * 4 * size * beta, 0.0) for m in variants}

    monkeypatch.setattr(timing, "interleaved", interleaved)
    fits = [r for r in bench.allreduce_methods(devs[:n], sizes=sizes) if r["case"] == "all-reduce fit"]
    assert [r["variant"] for r in fits] == [
        "central (central model)",
        "ring (ring model)",
        "collective (MirroredStrategy) (ring model)",
    ]
    for r in fits:
        assert r["alpha_us"] == pytest.approx(50.0)
        assert r["link_gb_per_s"] == pytest.approx(1.0)


def test_the_default_all_reduce_sizes_start_tiny_so_that_the_latency_is_measured():
    assert min(bench.ALLREDUCE_SIZES) <= 10 and max(bench.ALLREDUCE_SIZES) >= 1_000_000
    assert len(bench.ALLREDUCE_SIZES) >= 5


def test_summary_lines_are_computed_from_the_rows():
    def weak(variant, per_device, efficiency):
        return {
            "case": "weak scaling",
            "variant": variant,
            "devices": 2,
            "per_device": per_device,
            "efficiency": efficiency,
        }

    rows = [
        weak("hand towers", 64, 0.5),
        weak("hand towers", 1024, 0.9),
        weak("hand towers", 256, 0.7),
        weak("ring, replicated", 64, 0.6),
        weak("ring, replicated", 256, 0.4),
        {"case": "weak scaling", "variant": "hand towers", "devices": 1, "per_device": 64, "efficiency": 1.0},
        {
            "case": "weak scaling",
            "variant": "MultiWorkerMirroredStrategy",
            "devices": 2,
            "per_device": 64,
            "hand_towers_speedup": 1.234,
            "hand_towers_speedup_verdict": "faster",
        },
        {"case": "packing", "variant": "packed into one bucket", "speedup": 4.0, "speedup_verdict": "faster"},
        {
            "case": "all-reduce fit",
            "variant": "ring (ring model)",
            "alpha_us": 12.3,
            "smallest_us_per_message": 20.0,
            "link_gb_per_s": None,
        },
    ]
    assert bench.summary(rows) == [
        "hand towers, 2 devices, weak-scaling efficiency per per-device batch: 0.50 at 64, 0.70 at 256, "
        "0.90 at 1024; best 0.90 at 1024; rising with the batch: yes",
        "ring, replicated, 2 devices, weak-scaling efficiency per per-device batch: 0.60 at 64, 0.40 at 256; "
        "best 0.60 at 64; rising with the batch: no",
        "hand towers vs MultiWorkerMirroredStrategy at 64 per device: 1.23x (faster)",
        "packing into one bucket: 4.00x (faster)",
        "ring (ring model): alpha 12 us per message (smallest size: 20 us), link unbounded (beta fitted as 0)",
    ]


# --- the default: core devices, in a process of their own -----------------------------


def test_cli_on_core_devices_by_default(tmp_path):
    path = tmp_path / "cores.json"
    command = [sys.executable, "-m", "tutorial_lib.bench", "--devices", "2", "--cases", "weak,packing,allreduce"]
    command += ["--hidden", "16", "--per-device", "8,16", "--repeats", "3", "--json", str(path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(path.read_text())
    assert report["device_model"] == "cores" and report["options"]["device_model"] == "cores"
    assert report["summary"] and "[weak] running" in result.stdout
    rows = report["rows"]
    assert {r["device_model"] for r in rows} == {"cores"}
    variants = {r["variant"] for r in rows if r["case"] == "weak scaling"}
    assert variants == {"hand towers", "ring, replicated", "MultiWorkerMirroredStrategy"}  # no MirroredStrategy
    mwms = [r for r in rows if r["variant"] == "MultiWorkerMirroredStrategy"]
    assert sorted(r["per_device"] for r in mwms) == [8, 16] and {r["devices"] for r in mwms} == {2}
    for r in mwms:
        hand = next(
            h for h in rows if (h["variant"], h["devices"], h["per_device"]) == ("hand towers", 2, r["per_device"])
        )
        assert r["hand_towers_speedup"] == pytest.approx(r["ms"] / hand["ms"])
        assert r["hand_towers_speedup_verdict"] in VERDICTS
    packed = next(r for r in rows if r["variant"] == "packed into one bucket")
    assert packed["speedup_verdict"] in VERDICTS
    fits = [r for r in rows if r["case"] == "all-reduce fit"]
    assert [r["variant"] for r in fits] == ["central (central model)", "ring (ring model)"]


def test_the_ring_step_ends_with_the_single_device_reference(devs):
    import numpy as np

    from tutorial_lib import bench_scaling, models, reference

    x, y = bench.synthetic_batch(16)
    replicas = []
    for d in devs[:2]:
        with tf.device(d):
            replicas.append(models.MLP(hidden=(8,)))
    single = models.MLP(hidden=(8,))
    losses = bench_scaling.ring_step(replicas, devs[:2])(x, y)
    expected = reference.sgd_step(single, x, y, bench_scaling.LEARNING_RATE)
    np.testing.assert_allclose(np.mean([float(v) for v in losses]), float(expected), rtol=1e-5)
    for replica in replicas:
        for v, w in zip(replica.trainable_variables, single.trainable_variables, strict=True):
            np.testing.assert_allclose(v.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)


def test_every_pipeline_variant_returns_tensors_that_the_timing_waits_for(devs, monkeypatch):
    # The pipeline case times with `measure`, not `interleaved`: the same rule, checked there.
    results = []

    def measure(fn, *args, **_counts):
        results.append(fn(*args))
        return timing.Timing(1e-3, 0.0)

    monkeypatch.setattr(bench_pipeline, "measure", measure)
    rows = bench.pipeline_vs_naive(
        devs[:2], width=8, batch=8, micro_batches=2, repeats=1, rounds=1, steps=2, gap=False, memory=False
    )
    assert len(results) == len(rows)  # one round: each variant measured once, in the rows' order
    for row, result in zip(rows, results, strict=True):
        assert _tensors(result), f"pipeline: {row['variant']} returned {result!r}, nothing to wait for"
