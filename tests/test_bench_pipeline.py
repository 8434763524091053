"""The benchmark's pipeline case (tutorial_lib/bench/pipeline.py), on this process's logical CPUs."""

import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import pipeline, schedules, timing
from tutorial_lib.bench import pipeline as bench_pipeline

VERDICTS = {"faster", "slower", "no significant difference"}


@pytest.fixture
def timed(monkeypatch):
    """`timing.interleaved` replaced: each variant called once, its result kept; 1 ms each, no spread."""
    calls = {}

    def interleaved(variants, **_counts):
        for name, fn in variants.items():
            calls[name] = fn()
        return {name: timing.Timing(1e-3, 0.0, 3) for name in variants}

    monkeypatch.setattr(timing, "interleaved", interleaved)
    return calls


@pytest.mark.slow
def test_every_timed_variant_returns_tensors_that_the_timing_waits_for(devs, timed, monkeypatch):
    monkeypatch.setattr(bench_pipeline, "traced_steps", lambda steps, *_: dict.fromkeys(steps, []))
    monkeypatch.setattr(bench_pipeline, "bubble", lambda *_: {"bubble_measured": 0.5})
    rows = bench_pipeline.pipeline_vs_naive(devs[:2], width=8, batch=8, micro_batches=2, sweep=(1,), repeats=1)
    names = ["naive split", "gpipe, M=2", "1f1b, M=2", "data parallel"]
    assert [r["variant"] for r in rows] == [*names, "gpipe, M=1"]  # the sweep's M = 1 is traced, not timed
    assert list(timed) == names
    for name, result in timed.items():
        assert [t for t in tf.nest.flatten(result) if isinstance(t, tf.Tensor)], f"{name} returned {result!r}"
    assert all(r["speedup_vs_naive"] == 1 and r["speedup_vs_naive_verdict"] in VERDICTS for r in rows[1:4])
    assert rows[4]["ms"] is None and rows[4]["bubble_measured"] == 0.5


def test_the_naive_step_is_notebook_01s_split_and_counts_itself(devs):
    stages = bench_pipeline.balanced_stages(devs[:2], 8)
    x, y = bench_pipeline.dense_batch(8, bench_pipeline.input_width(8), devs[:2])
    loss = bench_pipeline.naive_step(stages, devs[:2])(x, y)
    np.testing.assert_allclose(loss, pipeline.staged_gradients(stages, devs[:2], x, y)[0], atol=1e-6)


@pytest.mark.slow
def test_the_case_reads_each_pipelines_bubble_from_one_traced_capture(devs):
    rows = bench_pipeline.pipeline_vs_naive(devs[:2], width=16, batch=32, micro_batches=4, sweep=(1, 2), repeats=3)
    by_name = {r["variant"]: r for r in rows}
    assert by_name["naive split"]["samples"] == 3 and "speedup_vs_naive" not in by_name["naive split"]
    for name in ("gpipe, M=4", "1f1b, M=4", "data parallel"):
        low, high = by_name[name]["speedup_vs_naive_range"]
        assert (
            low <= by_name[name]["speedup_vs_naive"] <= high and by_name[name]["speedup_vs_naive_verdict"] in VERDICTS
        )
    for name, m in (("gpipe, M=1", 1), ("gpipe, M=2", 2), ("gpipe, M=4", 4), ("1f1b, M=4", 4)):
        r = by_name[name]
        assert len(r["idle_per_stage"]) == 2 and all(0 <= share < 1 for share in r["idle_per_stage"])
        assert r["bubble_measured"] == min(r["idle_per_stage"]) and r["micro_batches"] == m
        assert r["bubble_theory"] == pytest.approx(schedules.bubble_fraction(2, m))
        assert 0 <= r["bubble_schedule"] < 1 and all(t > 0 for op in "FB" for t in r["op_ms"][op])
    lines = bench_pipeline.summary(rows)
    assert [line.split(":")[0] for line in lines] == [
        "pipeline gpipe, M=4",
        "pipeline 1f1b, M=4",
        "pipeline data parallel",
    ]
    assert "bubble" in lines[0] and "bubble" not in lines[2]


@pytest.mark.slow
def test_traced_steps_gives_one_step_of_each_function_from_one_capture(devs):
    stages = bench_pipeline.balanced_stages(devs[:2], 16)
    x, y = bench_pipeline.dense_batch(32, bench_pipeline.input_width(16), devs[:2])
    pipe = pipeline.Pipeline(stages, devs[:2], 4, learning_rate=0.0)
    pipe.check_batch(x, y)
    steps = {"naive": bench_pipeline.naive_step(stages, devs[:2]), "gpipe": pipe.traced_step}
    traced = bench_pipeline.traced_steps(steps, x, y, devs[:2])
    assert list(traced) == ["naive", "gpipe"]
    for events in traced.values():
        assert min(e.start for e in events) == 0 and {e.device for e in events} >= set(devs[:2])
        assert sum(bench_pipeline._is_counter(e, devs[0]) for e in events) == 1  # one step: its own counter
    forwards = {e.op.split("/")[1] for e in traced["gpipe"] if e.op.startswith("stage0/F")}
    assert forwards == {f"F{m}" for m in range(4)}  # every micro-batch's forward, of one step
    times = bench_pipeline.op_times(traced["gpipe"], devs[:2])
    assert len(times["F"]) == len(times["B"]) == 2 and min(times["F"] + times["B"]) > 0


def test_the_summary_says_each_speedup_with_its_verdict():
    speedup = {"speedup_vs_naive": 1.5, "speedup_vs_naive_range": [1.2, 1.8], "speedup_vs_naive_verdict": "faster"}
    rows = [
        {"case": "pipeline", "variant": "naive split", "ms": 10.0},
        {"case": "pipeline", "variant": "gpipe, M=4", **speedup, "bubble_measured": 0.25, "bubble_theory": 0.2},
        {"case": "pipeline", "variant": "data parallel", **speedup},  # not traced: no bubble
        {"case": "packing", "variant": "packed into one bucket", **speedup},  # another case's row
    ]
    assert bench_pipeline.summary(rows) == [
        "pipeline gpipe, M=4: 1.50x the naive split (range 1.20-1.80, faster); bubble 0.250 (formula 0.200)",
        "pipeline data parallel: 1.50x the naive split (range 1.20-1.80, faster)",
    ]
