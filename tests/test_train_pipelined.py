"""examples/train_pipelined.py: the pipeline asker's take-away program, with pipeline_checks.py beside it."""

import importlib.util
import json
import re
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
checks, pp, pg, ps, common = example.checks, example.pp, example.pg, example.ps, example.common


def run(*args, timeout=600):
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def no_dropout():
    """The asker's CNN without its dropout: what --recompute can take."""
    return [[layer for layer in block if not isinstance(layer, keras.layers.Dropout)] for block in MAKE_MODEL()]


MAKE_MODEL = example.make_model


def _check_lines(capsys):
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("check:")]


@pytest.mark.parametrize(
    "argv",
    [["--schedule", "1f1b"], pytest.param(["--schedule", "zb_h1"], marks=pytest.mark.slow),
     pytest.param(["--schedule", "gpipe"], marks=pytest.mark.slow),
     pytest.param(["--schedule", "sequential"], marks=pytest.mark.slow),
     pytest.param(["--schedule", "interleaved", "--micro-batches", "3"], marks=pytest.mark.slow)],
)  # fmt: skip
def test_every_schedule_passes_check_in_float64_on_the_askers_three_devices(devs, capsys, argv):
    common_args = ["--check", "--steps", "3", "--batch", "24", "--devices", ",".join(devs[:3])]
    assert example.main([*common_args, *argv]) == 0
    (line,) = _check_lines(capsys)
    assert "against one device in float64" in line and "(ok;" in line, line
    assert float(line.split("difference ")[1].split()[0]) < 1e-12, line  # rounding alone


@pytest.mark.slow  # make unit: test_pipeline_global checks replicas and clipping across stages, in seconds
@pytest.mark.parametrize(
    "argv",
    [["--schedule", "zb_h1", "--replicas", "2", "--clipnorm", "0.05"], ["--schedule", "zb_v", "--replicas", "2"],
     ["--schedule", "1f1b", "--clipnorm", "0.05"]],
)  # fmt: skip
def test_replicas_of_the_pipeline_and_clipping_across_stages_pass_check_in_float64(devs, capsys, argv):
    """2 replicas of a 2-stage pipeline on 4 devices (each stage's gradients all-reduced among its 2 devices), the
    global norm clipped at 0.05 (every step clipped: the digits' first gradients have norms near 1)."""
    devices = devs[:4] if "--replicas" in argv else devs[:2]
    common_args = ["--check", "--steps", "3", "--batch", "24", "--micro-batches", "3", "--devices", ",".join(devices)]
    assert example.main([*common_args, *argv]) == 0
    (line,) = _check_lines(capsys)
    assert "(ok;" in line and float(line.split("difference ")[1].split()[0]) < 1e-12, line
    assert ("2 replicas" in line) == ("--replicas" in argv) and ("clipped at 0.05" in line) == ("--clipnorm" in argv)
    assert ("Dropout left out" in line) == ("--replicas" in argv)  # each replica draws its own masks


@pytest.mark.parametrize(
    "argv, broken, replaced",
    [(["--replicas", "2"], "all_reduce_stages", lambda grads, _replicas, _sums: grads),
     (["--clipnorm", "0.05"], "verdict", lambda state, _clip_norm, right=pg.verdict: right(state, None))],
)  # fmt: skip
@pytest.mark.slow
def test_check_finds_replicas_that_step_on_their_share_alone_and_a_clip_left_out(
    devs, monkeypatch, capsys, argv, broken, replaced
):
    monkeypatch.setattr(pg, broken, replaced)  # no all-reduce among the replicas; no clipping, the norm unread
    devices = devs[:4] if "--replicas" in argv else devs[:2]
    common_args = ["--check", "--steps", "2", "--batch", "24", "--micro-batches", "3", "--devices", ",".join(devices)]
    assert example.main([*common_args, *argv]) == 1
    (line,) = _check_lines(capsys)
    assert "(they differ;" in line and float(line.split("difference ")[1].split()[0]) > 1e-3, line


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1", "interleaved", "zb_v"])
def test_recomputation_passes_check_for_a_model_without_dropout(devs, capsys, monkeypatch, schedule):
    monkeypatch.setattr(example, "make_model", no_dropout)
    argv = ["--check", "--steps", "2", "--batch", "12", "--micro-batches", "3", "--recompute", "--schedule", schedule]
    assert example.main([*argv, "--devices", ",".join(devs[:3])]) == 0
    (line,) = _check_lines(capsys)
    assert ", recomputed," in line and "(ok;" in line, line


@pytest.mark.slow
def test_a_correct_run_that_float32_adam_called_different_passes_in_float64(devs, capsys):
    # Issue 49/51: under oneDNN, a float32 comparison of this run said "they differ" (3e-2); in float64, 0.
    argv = ["--check", "--steps", "3", "--batch", "499", "--micro-batches", "1", "--devices", devs[0]]
    assert example.main(argv) == 0
    (line,) = _check_lines(capsys)
    assert float(line.split("difference ")[1].split()[0]) < 1e-12, line


@pytest.mark.slow
def test_check_finds_a_step_that_is_not_the_one_device_step(devs, monkeypatch, capsys):
    update = pp.update_stages

    def forgets_stage_1(stages, devices, grads, learning_rate=None, optimizers=None):
        keep = [s for s in range(len(stages)) if s != 1]
        pick = lambda xs: [xs[s] for s in keep] if xs is not None else None  # noqa: E731
        return update(pick(stages), pick(devices), pick(grads), learning_rate, pick(optimizers))

    monkeypatch.setattr(pp, "update_stages", forgets_stage_1)
    assert example.main(["--check", "--steps", "2", "--batch", "24", "--devices", ",".join(devs[:3])]) == 1
    (line,) = _check_lines(capsys)
    assert "(they differ;" in line and float(line.split("difference ")[1].split()[0]) > 1e-3, line


def test_a_non_finite_difference_fails_the_check(devs, capsys):
    (x, y), test = common.load_data("digits", 8)
    x = x.copy()
    x[:, 3, 3, 0] = np.nan  # what load_data refuses; here straight into the check
    args = example.parse(["--check", "--steps", "1", "--batch", "24", "--micro-batches", "2"])
    assert checks.check(args, devs[:3], ((x, y), test), example)["verdict"] == "they differ"
    assert "(they differ;" in _check_lines(capsys)[0]


@pytest.mark.slow
def test_a_default_run_prints_the_bubble_and_no_speed_on_logical_devices_and_writes_json(tmp_path):
    path = tmp_path / "metrics.json"
    done = run(str(EXAMPLE), "--epochs", "1", "--steps", "6", "--simulate", "3", "--json", str(path))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "simulated CPU devices" in out and "8x8 digits" in out and "the first call traced the step" in out
    assert "each device idles 25% of a step, and the ideal speed-up over the naive split is 2.25x" in out, out
    assert "zb_h1 10%" in out and "interleaved 14%" in out  # every schedule's bubble at this S and M
    assert "speed: not measured" in out and "share one thread pool" in out
    assert not any(word in out for word in ("faster", "slower", "no significant difference")), out
    metrics = json.loads(path.read_text())
    assert metrics["schedule"] == "1f1b" and metrics["bubble"] == pytest.approx(0.25) and metrics["steps"] == 6
    assert 0 <= metrics["test_accuracy"] <= 1 and metrics["images_per_second"] > 0


@pytest.mark.slow
def test_on_devices_that_can_show_speed_it_times_the_naive_split_and_one_device_with_verdicts(
    devs, monkeypatch, capsys
):
    monkeypatch.setattr(common, "simulated", lambda _devices: False)  # as on GPUs
    args = example.parse(["--batch", "24", "--schedule", "zb_h1"])
    found = checks.baseline(args, devs[:3], common.load_data("digits", 8), example, rounds=3)
    out = capsys.readouterr().out
    assert set(found) == {"timed_step_ms", "speedup_vs_naive_split", "speedup_vs_one_device"}, found
    for other in ("naive split", "one device"):
        line = next(line for line in out.splitlines() if line.startswith(f"against {other}:"))
        assert any(word in line for word in ("faster", "slower", "no significant difference")), line


def test_the_bubble_and_ideal_are_the_schedules_own():
    assert ps.expected(ps.orders_of("1f1b", 3, 6)) == pytest.approx((2 / 8, 18 / 8))  # (S-1)/(M+S-1), SM/(M+S-1)
    assert ps.expected(ps.orders_of("gpipe", 1, 4)) == pytest.approx((0.0, 1.0))
    bubbles = example.every_bubble(3, 6, 2)
    assert set(bubbles) == set(ps.EVERY_SCHEDULE) and bubbles["zb_h1"][0] < bubbles["interleaved"][0] < 0.25
    assert "interleaved" not in example.every_bubble(3, 4, 2)  # M not a multiple of S: left out, not an error


def _refused(argv, capsys, devs, n=3):
    with pytest.raises(SystemExit) as stop:
        example.main([*argv, "--devices", ",".join(devs[:n]), "--check"])
    assert stop.value.code == 2
    return capsys.readouterr().err


def _with_layer(layer, where=0):
    def make_model():
        blocks = MAKE_MODEL()
        blocks[where].append(layer())
        return blocks

    return make_model


@pytest.mark.parametrize(
    "make_model, argv, message",
    [
        (_with_layer(keras.layers.BatchNormalization), [], "the model has batch norm"),
        (MAKE_MODEL, ["--recompute"], "draws random numbers in its forward .*Keras layers dropout"),
        (lambda: [*no_dropout()[:2], [keras.layers.Flatten(), keras.layers.Lambda(lambda h: h + tf.random.normal(
            tf.shape(h))), keras.layers.Dense(10)]], ["--recompute"], r"ops RandomStandardNormal; Keras layers none"),
        (_with_layer(keras.layers.Softmax, 2), [], "outputs are probabilities .* take LOGITS"),
        (MAKE_MODEL, ["--schedule", "interleaved", "--micro-batches", "4", "--batch", "24"],
         "interleaving needs M a multiple of S .* use M=3 or M=6"),
        (MAKE_MODEL, ["--schedule", "interleaved", "--chunks", "5"], "the model has 12 layers, fewer than the 15"),
        (MAKE_MODEL, ["--batch", "1500"], "the training set holds 1497 images"),
        (MAKE_MODEL, ["--replicas", "2"], "3 devices do not split into 2 equal pipelines"),
        (MAKE_MODEL, ["--schedule", "zb_v", "--chunks", "3"], "ZB-V runs two chunks a device in a V, got v=3"),
    ],
)  # fmt: skip
def test_what_the_pipeline_cannot_train_as_one_device_is_refused_before_any_work(
    devs, monkeypatch, capsys, make_model, argv, message
):
    monkeypatch.setattr(example, "make_model", make_model)
    monkeypatch.setattr(example, "build", lambda *_a: pytest.fail("built a model it should refuse"))

    assert re.search(message, _refused(argv, capsys, devs))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch", "21", "--micro-batches", "3"], "each of 2 replicas cuts its share into 3 micro-batches; give a "
         "multiple of 6"),
        (["--batch", "1504", "--micro-batches", "4"], "the training set holds 1497 images; give --batch 1496 or less"),
        (["--schedule", "interleaved", "--micro-batches", "3", "--batch", "24"], "--schedule interleaved on 2 devices:"
         " interleaving needs M a multiple of S"),
        (["--schedule", "interleaved", "--chunks", "7"], "the model has 12 layers, fewer than the 14 stages of 2 "
         "devices x 7 chunks"),
    ],
)  # fmt: skip
def test_replicas_that_cannot_share_the_batch_or_the_devices_are_refused_before_any_work(
    devs, monkeypatch, capsys, argv, message
):
    """On 4 devices, 2 replicas of a 2-stage pipeline: the batch, the schedule and the cut are each replica's."""
    monkeypatch.setattr(example, "build", lambda *_a: pytest.fail("built a model it should refuse"))
    assert re.search(message, _refused([*argv, "--replicas", "2"], capsys, devs, n=4))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--simulate", "17"], "--simulate: 1 to 16 devices"),
        (["--devices", "/GPU:0", "--simulate", "2"], "not both"),
        (["--batch", "10", "--micro-batches", "4"], "multiple of --micro-batches 4"),
        (["--steps", "0"], ">= 1"),
        (["--schedule", "zb_w"], "invalid choice"),
        (["--replicas", "0"], "--replicas 0: give 1 or more"),
        (["--replicas", "-2"], "--replicas -2: give 1 or more"),
        (["--clipnorm", "0"], "--clipnorm 0.0: give a positive norm"),
        (["--clipnorm", "-1"], "--clipnorm -1.0: give a positive norm"),
        (["--clipnorm", "inf"], "--clipnorm inf: give a positive norm"),
        (["--clipnorm", "nan"], "--clipnorm nan: give a positive norm"),
        (["--schedule", "interleaved", "--chunks", "1"], "interleaving needs 2 or more a device"),
        (["--lr", "-1"], "positive learning rate"),
        (["--data", "/nowhere/mnist.npz"], "no such file"),
        (["--json", "/nowhere/metrics.json"], "no such folder"),
    ],
)
def test_bad_arguments_exit_2_with_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as done:
        example.parse(argv)
    assert done.value.code == 2 and message in capsys.readouterr().err


def test_the_chunks_are_one_models_layers_cut_where_asked_and_each_made_on_its_device(devs):
    on = [devs[k % 3] for k in range(6)]
    chunks = example.make_chunks(on, (8, 8, 1), seed=0)
    assert [len(c.layers) for c in chunks] == [2] * 6  # 12 layers in 6 runs of 2 (3 blocks != 6 chunks)
    assert [len(c.layers) for c in example.make_chunks(devs[:3], (8, 8, 1), seed=0)] == [3, 4, 5]  # the blocks
    for chunk, device in zip(chunks, on, strict=True):
        assert {tf.DeviceSpec.from_string(v.value.device).device_index for v in chunk.variables} <= {
            tf.DeviceSpec.from_string(device).device_index
        }
    single = example.one_device_model(devs[0], (8, 8, 1))
    assert [v.shape for c in chunks for v in c.variables] == [v.shape for v in single.variables]
    for a, b in zip([v for c in chunks for v in c.trainable_variables], single.trainable_variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # the same seeds: the same weights


def test_staged_training_takes_one_adam_step_a_stage_per_batch(devs):
    args = example.parse(["--steps", "3", "--batch", "24", "--schedule", "zb_h1"])
    data = common.load_data("digits", 8)
    run = example.build(args, devs[:3], data[0][0].shape[1:])
    metrics = example.train(args, run, data)
    assert metrics["steps"] == 3 and [int(o.iterations) for o in run.optimizers] == [3, 3, 3]
    assert np.isfinite(metrics["loss"]) and 0 <= metrics["test_accuracy"] <= 1


@pytest.mark.slow
def test_replicas_train_in_step_one_adam_step_a_stage_and_replica_per_batch_clipped(devs):
    """2 replicas of 2 stages, 2 steps clipped at a norm of 1: every stage's Adam steps on every replica, and the
    all-reduced gradients keep the replicas' weights equal though each draws its own dropout masks."""
    args = example.parse(["--steps", "2", "--batch", "24", "--micro-batches", "3", "--replicas", "2",
                          "--clipnorm", "1.0"])  # fmt: skip
    data = common.load_data("digits", 8)
    run = example.build(args, devs[:4], data[0][0].shape[1:])
    metrics = example.train(args, run, data)
    assert metrics["steps"] == 2 and [int(o.iterations) for r in run.replicas for o in r.optimizers] == [2] * 4
    assert [r.physical for r in run.replicas] == [devs[:2], devs[2:4]]
    first, second = ([v.numpy() for c in r.chunks for v in c.trainable_variables] for r in run.replicas)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert np.isfinite(metrics["loss"]) and 0 <= metrics["test_accuracy"] <= 1
