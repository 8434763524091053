"""examples/train_pipelined.py: the pipeline asker's take-away file."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_pipelined.py"
_spec = importlib.util.spec_from_file_location("train_pipelined", EXAMPLE)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def run(*args, timeout=600):
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.slow
def test_every_schedule_passes_check_on_the_askers_three_devices(devs, capsys):  # notebook 05 checks two
    argv = ["--check", "--steps", "2", "--batch", "16", "--devices", ",".join(devs[:3]), "--schedule"]
    assert [example.main([*argv, schedule]) for schedule in example.SCHEDULES] == [0, 0, 0]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("check:")]
    assert len(lines) == 3 and all("on 3 devices" in line and "(ok)" in line for line in lines), lines


@pytest.mark.slow
def test_check_finds_a_step_that_is_not_the_one_device_step(devs, monkeypatch):
    update = example.update_stages

    def forgets_stage_1(stages, devices, grads, learning_rate=None, optimizers=None):
        ops = update(stages[:1], devices[:1], grads[:1], learning_rate, optimizers[:1] if optimizers else None)
        return ops + update(stages[2:], devices[2:], grads[2:], learning_rate, optimizers[2:] if optimizers else None)

    monkeypatch.setattr(example, "update_stages", forgets_stage_1)
    (x, y), _ = example.load_data("digits")
    args = example.parse(["--check", "--steps", "2", "--batch", "16"])
    assert example.check(args, devs[:3], x, y) > 1e-3


@pytest.mark.slow
def test_a_default_run_prints_its_speedup_and_busy_shares_and_writes_json(tmp_path):
    path = tmp_path / "metrics.json"
    logs = tmp_path / "logs"
    done = run(
        str(EXAMPLE), "--steps", "4", "--batch", "16", "--simulate", "2", "--json", str(path), "--logdir", str(logs)
    )
    assert done.returncode == 0, done.stderr
    assert "simulated CPU devices" in done.stdout and "8x8 digits" in done.stdout
    metrics = json.loads(path.read_text())
    assert metrics["verdict"] in {"faster", "slower", "no significant difference"} and metrics["verdict"] in done.stdout
    assert len(metrics["busy_share"]) == 2 and all(0 < share <= 1 for share in metrics["busy_share"].values())
    assert 0 <= metrics["test_accuracy"] <= 1 and metrics["speedup"] > 0
    assert list(logs.glob("events.out.tfevents.*")), "no TensorBoard scalars in --logdir"
    # What to expect, said at the start (S = 2, the default M = 8), and the data-parallel comparison at the end.
    assert "idles 11% of a step" in done.stdout and "ideal speedup over the naive split is 1.78x" in done.stdout
    assert metrics["speedup_vs_data_parallel"] > 0 and "against data parallelism" in done.stdout
    assert metrics["advice"] in done.stdout


def test_a_batch_norm_in_a_stage_is_refused_saying_what_to_use(monkeypatch, devs):
    build = example.build_stages

    def with_batch_norm(devices, input_shape):
        stages = build(devices, input_shape)
        with tf.device(devices[0]):
            stages[0] = keras.Sequential(
                [keras.Input(input_shape), keras.layers.BatchNormalization(), *stages[0].layers]
            )
        return stages

    monkeypatch.setattr(example, "build_stages", with_batch_norm)
    args = example.parse(["--micro-batches", "2"])
    with pytest.raises(ValueError, match="micro-batch statistics.*LayerNormalization"):
        example.pipeline(args, devs[:2], (8, 8, 1))


def test_the_expected_bubble_and_ideal_speedup_are_the_formulas():
    assert example.expected(3, 8) == (2 / 10, 24 / 10) and example.expected(1, 4) == (0.0, 1.0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--simulate", "4"], "choose from 1, 2, 3"),
        (["--devices", "/GPU:0", "--simulate", "2"], "not both"),
        (["--batch", "10", "--micro-batches", "4"], "multiple of --micro-batches 4"),
        (["--steps", "0"], ">= 1"),
        (["--profile"], "give --logdir DIR too"),
        (["--data", "/nowhere/mnist.npz"], "no such file"),
        (["--schedule", "zigzag"], "invalid choice"),
        (["--json", "/nowhere/metrics.json"], "no such folder"),
    ],
)
def test_bad_arguments_exit_2_with_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as done:
        example.parse(argv)
    assert done.value.code == 2 and message in capsys.readouterr().err


def test_its_timing_statistic_and_verdict_are_the_courses(monkeypatch):
    # The file cannot import tutorial_lib: its copy of the statistic must agree with timing's.
    from tutorial_lib import timing

    samples = {"a": [3.0, 1.0, 2.0, 5.0, 4.0, 9.0, 2.5, 3.5, 1.5], "b": [6.0, 7.0, 5.5, 8.0, 6.5, 9.0, 7.5, 6.0, 5.0]}
    warmup = [0.0 for name in samples]  # the warm-up round reads the clock once per call
    ticks = iter(warmup + [t for r in range(9) for name in samples for t in (0.0, samples[name][r])])
    monkeypatch.setattr(example.time, "perf_counter", lambda: next(ticks))

    class Done:
        def numpy(self):
            return None

    times = example.timed({name: Done for name in samples}, rounds=9)
    for name, seconds in samples.items():
        assert times[name] == pytest.approx(tuple(timing.summarize(seconds)[:2]))
    a, b = (timing.summarize(s) for s in samples.values())
    ratio, low, high, verdict = example.speedup(times["a"], times["b"])
    assert (ratio, low, high) == pytest.approx(timing.ratio(b, a)) and verdict == timing.verdict(a, b)


def test_logdir_without_tensorboard_exits_2_with_the_fix(monkeypatch, capsys):
    # tf.summary.scalar raises once training has started when TensorBoard is missing: refuse before.
    monkeypatch.setattr(example.importlib.util, "find_spec", lambda _: None)
    with pytest.raises(SystemExit) as done:
        example.parse(["--logdir", "logs"])
    assert done.value.code == 2 and "pip install tensorboard" in capsys.readouterr().err


def test_check_compares_full_batches_only_and_says_how_many(devs, capsys):
    # The digits hold 3 full batches of 400: a 4th step would be a slice of 297 that 4 micro-batches cannot split.
    argv = ["--check", "--batch", "400", "--micro-batches", "4", "--steps", "4", "--devices", ",".join(devs[:2])]
    assert example.main(argv) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("check:"))
    assert line.startswith("check: 3 steps (of 4 asked: the training set holds 3 full batches of 400)"), line


def test_a_non_finite_difference_fails_the_check(devs, capsys):
    (x, y), _ = example.load_data("digits")
    x = x.copy()
    x[:, 3, 3, 0] = np.nan  # one pixel of each image: its first batch holds some, were NaN not refused at load
    args = example.parse(["--check", "--steps", "1", "--batch", "16", "--micro-batches", "2"])
    assert np.isnan(example.check(args, devs[:2], x, y))
    assert "(not finite: they differ)" in capsys.readouterr().out


def test_a_batch_the_devices_do_not_divide_says_why_data_parallelism_is_not_timed(devs, capsys):
    argv = ["--steps", "1", "--batch", "16", "--micro-batches", "4", "--devices", ",".join(devs[:3])]
    assert example.main(argv) == 0
    out = capsys.readouterr().out
    assert "data parallelism not timed: --batch 16 does not split evenly over 3 devices; give --batch 24" in out, out


def test_the_data_parallel_step_it_times_equals_one_device_and_keeps_each_replica_on_its_device(devs, monkeypatch):
    """Without dropout (its masks differ with the split), two steps on two replicas == Adam on one device."""
    from tutorial_lib import placement

    def small(devices, input_shape):
        keras.utils.set_random_seed(0)  # every replica, and the reference, starts from the same weights
        with tf.device(devices[0]):
            return [keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(), keras.layers.Dense(10)])]

    monkeypatch.setattr(example, "build_stages", small)
    step = example.data_parallel_step(devs[:2], (8, 8, 1))
    [single], adam = small(devs[:1], (8, 8, 1)), keras.optimizers.Adam(1e-3)
    (x, y), _ = example.load_data("digits")
    for k in range(2):
        xs, ys = x[16 * k : 16 * k + 16], y[16 * k : 16 * k + 16]
        loss = float(step([tf.constant(xs)], [tf.constant(ys)])[0])
        with tf.GradientTape() as tape:
            reference = example.mean_cross_entropy(single(xs, training=True), ys)
        adam.apply(tape.gradient(reference, single.trainable_variables), single.trainable_variables)
        np.testing.assert_allclose(loss, float(reference), rtol=1e-5)
    for replica in step.replicas:  # each replica took the same steps
        for a, b in zip(replica.trainable_variables, single.trainable_variables, strict=True):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
    owners = {d: [*r.variables, *o.variables] for d, r, o in zip(devs[:2], step.replicas, step.optimizers, strict=True)}
    report = placement.audit(step, [tf.constant(x[:16])], [tf.constant(y[:16])], owners=owners, run=True)
    assert report.ok and report.variables_checked > 0, report
