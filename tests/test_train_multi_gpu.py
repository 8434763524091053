"""examples/train_multi_gpu.py, the NCCL asker's program: what it refuses before any work, what it trains, its
--check against one device for every option and for a reader's own kinds of Keras model, its checkpoints."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import common
import data_parallel as dp
import keras
import numpy as np
import pytest
import tensorflow as tf
import train_multi_gpu as program

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_multi_gpu.py"


def run(*args, timeout=900):
    """The file as a reader runs it: a child Python in the course folder, none of the tests' settings."""
    env = {"PATH": os.environ["PATH"], "HOME": str(Path.home())}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def main(argv, devs, n=2):
    return program.main([*argv, "--devices", ",".join(devs[:n]), "--data", "digits"])


def refused(argv, capsys, code=2):
    with pytest.raises(SystemExit) as stop:
        program.main(argv)
    assert stop.value.code == code
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--simulate", "0"], "1 to 16 devices"),
        (["--devices", "/GPU:0", "--simulate", "2"], "not both"),
        (["--batch", "9"], "multiple of the 2 devices"),
        (["--devices", "/GPU:0,/GPU:1,/GPU:2", "--batch", "64"], "e.g. 63"),
        (["--steps", "0"], ">= 1"),
        (["--steps-per-call", "0"], ">= 1"),
        (["--lr", "-1"], "positive learning rate"),
        (["--lr", "inf"], "positive learning rate"),
        (["--bucket-mb", "1e305"], "give 0 to 1e6 MB"),
        (["--bucket-mb", "nan"], "give 0 to 1e6 MB"),
        (["--timeout", "0"], "1 to 1e6 seconds"),
        (["--profile"], "give --logdir DIR too"),
        (["--data", "/nowhere/mnist.npz"], "no such file"),
        (["--json", "/nowhere/m.json"], "no such folder"),
        (["--strategy", "parameter-server"], "invalid choice"),
        (["--check", "--checkpoint", "c"], "drop one side"),
        (["--breakdown", "--strategy", "mirrored"], "give --strategy replicated"),
        (["--precision", "float16", "--strategy", "mirrored"], "needs loss scaling"),
        (["--warmup", "10"], "drop --warmup"),
    ],
)
def test_bad_arguments_exit_2_with_the_fix(argv, message, capsys):
    assert message in refused(argv, capsys)


def test_devices_this_machine_lacks_exit_2_listing_the_ones_it_has(capsys):
    err = refused(["--devices", "/CPU:0,/GPU:7"], capsys)
    assert "no device '/GPU:7' here" in err and "/device:CPU:0" in err


def test_a_batch_larger_than_the_training_set_exits_2_before_any_work(devs, capsys, monkeypatch):
    monkeypatch.setattr(program, "build", lambda *_a, **_k: pytest.fail("built a run before refusing --batch"))
    assert "at most the 1497 training images" in refused(["--batch", "2000", "--devices", ",".join(devs[:2])], capsys)


def resnet_block(bn=True):
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    h = keras.layers.BatchNormalization()(h) if bn else h
    h = keras.layers.Add()([h, keras.layers.Conv2D(4, 1)(inputs)])  # a skip connection: not a Sequential
    return keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Flatten()(h)))


class Holding(keras.layers.Layer):
    """A custom layer that holds its own batch norm, which model.layers does not list."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv, self.bn = keras.layers.Conv2D(4, 3, padding="same"), keras.layers.BatchNormalization()

    def call(self, x, training=None):
        return self.bn(self.conv(x), training=training)


def sequential(*layers):
    return keras.Sequential([keras.Input((8, 8, 1)), *layers, keras.layers.Flatten(), keras.layers.Dense(10)])


def two_inputs():
    a, b = keras.Input((8, 8, 1)), keras.Input((3,))
    return keras.Model([a, b], keras.layers.Dense(10)(keras.layers.Concatenate()([keras.layers.Flatten()(a), b])))


MODELS = {
    "functional": lambda: resnet_block(bn=False),
    "functional with batch norm": resnet_block,
    "custom layer holding batch norm": lambda: sequential(Holding()),
    "dropout": lambda: sequential(keras.layers.Conv2D(4, 3), keras.layers.Dropout(0.5)),
    "preprocessing": lambda: sequential(keras.layers.RandomRotation(0.1), keras.layers.Conv2D(4, 3)),
    "an unused weight": lambda: _with_unused(sequential(keras.layers.Conv2D(4, 3))),
}


def _with_unused(model):
    """The model with a layer that it holds and never calls: its weights get None gradients."""
    model.unused = keras.layers.Dense(3)
    model.unused.build((None, 2))
    return model


def with_model(monkeypatch, name):
    monkeypatch.setattr(program, "make_model", lambda _shape, **_kwargs: MODELS[name]())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_a_readers_own_kind_of_model_trains_and_passes_check_with_local_batch_norm(devs, monkeypatch, capsys, name):
    with_model(monkeypatch, name)
    assert main(["--check", "--steps", "3", "--batch", "16", "--bn", "local"], devs) == 0
    out = capsys.readouterr().out
    assert "ok" in out.splitlines()[-1], out
    if name in ("dropout", "preprocessing"):  # what cannot be compared is said, the rest compared
        assert ("Dropout" if name == "dropout" else "RandomRotation") + " left out: each replica draws" in out


@pytest.mark.parametrize("name", ["functional with batch norm", "custom layer holding batch norm"])
def test_batch_norm_that_synchronization_cannot_reach_is_refused_under_sync_and_said_under_auto(
    devs, monkeypatch, capsys, name
):
    with_model(monkeypatch, name)
    monkeypatch.setattr(program, "build", lambda *_a, **_k: pytest.fail("built a run before refusing the model"))
    err = refused(["--bn", "sync", "--devices", ",".join(devs[:2]), "--data", "digits"], capsys)
    assert "is not one of its layers" in err and "--bn local or --strategy mirrored take any model" in err
    monkeypatch.setattr(program, "build", lambda *_a, **_k: pytest.skip("said; not trained here"))
    with pytest.raises(pytest.skip.Exception):
        main(["--batch", "16"], devs)  # --bn auto at 8 a device would synchronize: it says why it cannot
    assert "batch norm: local, each replica its own 8 examples (auto would synchronize, but" in capsys.readouterr().out


def whole_number_input():
    """A model for uint8 pixels, as a Keras tutorial feeds them: the programs feed floats in [0, 1], cast to 0 or 1."""
    inputs = keras.Input((8, 8, 1), dtype="uint8")
    return keras.Model(inputs, sequential()(keras.layers.Rescaling(1 / 255)(inputs)))


def batch_norm_model(synchronized=False):
    return sequential(
        keras.layers.Conv2D(4, 3, use_bias=False), keras.layers.BatchNormalization(synchronized=synchronized)
    )


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda _shape: batch_norm_model(), "make_model takes no synchronized argument"),
        (lambda _shape, synchronized=False: batch_norm_model(), "leaves batch_normalization"),  # noqa: ARG005 (ignored)
    ],
)
def test_batch_norm_that_make_model_leaves_unsynchronized_is_refused_under_mirrored_sync(devs, monkeypatch, capsys,
                                                                                          make, message):  # fmt: skip
    monkeypatch.setattr(program, "make_model", make)
    monkeypatch.setattr(program, "build", lambda *_a, **_k: pytest.fail("built a run before refusing the model"))
    err = refused(["--strategy", "mirrored", "--bn", "sync", "--devices", ",".join(devs[:2]), "--data", "digits"],
                  capsys)  # fmt: skip
    assert message in err and "pass synchronized on to each BatchNormalization, or give --bn local" in err, err


@pytest.mark.slow
def test_a_make_model_without_synchronized_trains_under_mirrored_with_local_batch_norm(devs, monkeypatch, capsys):
    monkeypatch.setattr(program, "make_model", lambda _shape: batch_norm_model())
    assert main(["--strategy", "mirrored", "--batch", "16", "--steps", "1"], devs) == 0  # --bn auto: local, said
    assert "batch norm: local, each replica its own 8 examples (auto would synchronize, but make_model takes no" in (
        capsys.readouterr().out
    )
    monkeypatch.setattr(program, "make_model", lambda _shape: sequential(keras.layers.Conv2D(4, 3)))  # no BN at all
    assert main(["--strategy", "mirrored", "--batch", "16", "--steps", "1"], devs) == 0


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: keras.Sequential([*sequential().layers, keras.layers.Softmax()]), "these programs take LOGITS"),
        (whole_number_input, "the model's input is uint8"),
        (lambda: sequential(keras.layers.Rescaling(1 / 255)), "Rescaling(scale=0.00392) divides them again"),
        (two_inputs, "the model cannot take a batch of these images"),
        (lambda: keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(7)]),
         "return (batch, 10)"),
    ],
)  # fmt: skip
def test_a_model_the_program_cannot_train_is_refused_before_any_work(devs, monkeypatch, capsys, make, message):
    monkeypatch.setattr(program, "make_model", lambda _shape, **_kwargs: make())
    monkeypatch.setattr(program, "build", lambda *_a, **_k: pytest.fail("built a run before refusing the model"))
    assert message in refused(["--devices", ",".join(devs[:2]), "--data", "digits"], capsys)


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ["--bn", "sync", "--bucket-mb", "0"],
        ["--bn", "sync", "--steps-per-call", "3"],
        ["--bn", "local", "--jit"],
        ["--strategy", "mirrored"],
        ["--strategy", "mirrored", "--bn", "local", "--precision", "bfloat16", "--jit"],
        ["--precision", "bfloat16"],
        ["--precision", "float16"],
    ],
)
def test_every_option_passes_check_against_one_device(devs, capsys, extra):
    assert main(["--check", "--steps", "4", "--batch", "24", *extra], devs, n=3) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("check: float64: ") and last.endswith(": ok"), last


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["replicated", "mirrored"])
def test_check_passes_a_right_run_of_a_model_with_a_bias_before_batch_norm(devs, monkeypatch, capsys, strategy):
    """Keras' Conv2D has a bias; batch norm after it makes its gradient zero but for rounding, so the bias stays
    near 0 and its relative difference is rounding over rounding."""
    make = lambda _shape, synchronized=False: sequential(  # noqa: E731
        keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(synchronized=synchronized)
    )
    monkeypatch.setattr(program, "make_model", make)
    assert main(["--check", "--steps", "2", "--batch", "16", "--bn", "sync", "--strategy", strategy], devs) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(": ok")


@pytest.mark.slow  # make unit keeps the check's other planted fault (a replica normalizing with its own share)
def test_check_finds_gradients_averaged_instead_of_summed(devs, monkeypatch, capsys):
    summed = dp.all_reduce_gradients
    averaged = lambda grads, devices, *a: [[g / len(devices) for g in r] for r in summed(grads, devices, *a)]  # noqa: E731
    monkeypatch.setattr(dp, "all_reduce_gradients", averaged)
    assert main(["--check", "--steps", "2", "--batch", "16", "--bn", "sync"], devs) == 1
    assert capsys.readouterr().out.splitlines()[-1].endswith("they differ")


def test_check_finds_a_replica_that_normalizes_with_its_own_share(devs, monkeypatch, capsys):
    def own_statistics(layers, devices, hs, _all_sum):
        out = []
        for layer, h, device in zip(layers, hs, devices, strict=True):
            with tf.device(device):
                out.append(layer(h, training=True))  # Keras' batch norm: this device's examples only
        return out

    monkeypatch.setattr(dp, "sync_batch_norm", own_statistics)
    assert main(["--check", "--steps", "2", "--batch", "16", "--bn", "sync"], devs) == 1
    assert capsys.readouterr().out.splitlines()[-1].endswith("they differ")


def test_a_device_that_fails_or_hangs_stops_the_run_with_exit_3_saying_why(devs, monkeypatch, capsys):
    def stuck(*_args):
        raise tf.errors.DeadlineExceededError(None, None, "Collective has timed out waiting for other workers.")

    monkeypatch.setattr(program, "train", stuck)
    err = refused(["--devices", ",".join(devs[:2]), "--data", "digits", "--timeout", "5"], capsys, code=3)
    assert "waited more than --timeout 5 s" in err and "the run stopped instead of waiting" in err


@pytest.mark.slow
def test_a_default_run_starts_quiet_trains_reports_each_epoch_and_writes_json(tmp_path):
    path, logs = tmp_path / "metrics.json", tmp_path / "logs"
    done = run(str(EXAMPLE), "--epochs", "4", "--data", "digits", "--json", str(path), "--logdir", str(logs))
    assert done.returncode == 0, done.stderr[-3000:]
    assert not [line for line in done.stderr.splitlines() if common.NOISE.search(line)], done.stderr[:2000]
    first = done.stdout.splitlines()[0]
    assert first.startswith("data: 8x8 digits"), first
    assert done.stdout.count("test_accuracy") == 4 and "efficiency" not in done.stdout  # nothing said of speed here
    metrics = json.loads(path.read_text())
    assert metrics["test_accuracy"] > 0.8 and metrics["images_per_second"] > 0, metrics
    assert list(logs.glob("events.out.tfevents.*")), "no TensorBoard scalars in --logdir"


def final_weights(argv, devs, monkeypatch, n=2):
    built, real = [], program.build
    monkeypatch.setattr(program, "build", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    assert main(argv, devs, n) == 0
    return [[np.asarray(v) for v in replica] for replica in built[-1].weights]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["replicated", "mirrored"])
def test_a_run_stopped_and_resumed_ends_equal_to_one_that_did_not(devs, tmp_path, monkeypatch, strategy):
    argv = ["--batch", "256", "--bn", "sync", "--strategy", strategy, "--steps-per-call", "2"]  # 5 steps an epoch
    straight = final_weights([*argv, "--steps", "8"], devs, monkeypatch)
    folder = str(tmp_path / "ckpt")
    final_weights([*argv, "--steps", "3", "--checkpoint", folder], devs, monkeypatch)  # stops inside epoch 1
    resumed = final_weights([*argv, "--steps", "8", "--checkpoint", folder], devs, monkeypatch)
    for a, b in zip(straight, resumed, strict=True):
        for u, v in zip(a, b, strict=True):
            np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_checkpoints_resume_from_the_newest_intact_and_refuse_another_run(devs, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "ckpt"
    argv = ["--batch", "256", "--steps-per-call", "5", "--checkpoint", str(folder)]
    final_weights([*argv, "--epochs", "2"], devs, monkeypatch)  # ckpt-5 and ckpt-10
    assert sorted(p.name for p in folder.glob("*.index")) == ["ckpt-10.index", "ckpt-5.index"]
    err = refused([*argv, "--epochs", "3", "--batch", "128", "--devices", ",".join(devs[:2]), "--data", "digits"],
                  capsys)  # fmt: skip
    assert "was saved with --batch 256 (this run: 128)" in err
    data = next(folder.glob("ckpt-10.data-*"))
    data.write_bytes(data.read_bytes()[:100])  # cut short, as a run killed while it saved leaves it
    copy = tmp_path / "copied"  # only the ckpt-N files, copied elsewhere: no state file needed
    shutil.copytree(folder, copy)
    final_weights([*argv[:-1], str(copy), "--epochs", "3"], devs, monkeypatch)
    out = capsys.readouterr().out
    assert "ckpt-10 is damaged" in out and "resumed from" in out and "ckpt-5, 5 steps done" in out
    with_model(monkeypatch, "dropout")
    err = refused([*argv[:-1], str(copy), "--epochs", "4", "--devices", ",".join(devs[:2]), "--data", "digits"],
                  capsys)  # fmt: skip
    assert "was saved from another model" in err


@pytest.mark.slow
def test_a_resume_with_another_learning_rate_exits_2_not_trained_at_the_saved_one(devs, tmp_path, monkeypatch, capsys):
    argv = ["--batch", "16", "--steps-per-call", "1", "--checkpoint", str(tmp_path / "ckpt")]
    final_weights([*argv, "--steps", "1"], devs, monkeypatch)  # Adam's learning rate is a variable it saves
    again = [*argv, "--steps", "2", "--devices", ",".join(devs[:2]), "--data", "digits"]
    assert "was saved with --lr 0.001 (this run: 0.01)" in refused([*again, "--lr", "0.01"], capsys)
    assert "--scale-lr none (this run: sqrt)" in refused([*again, "--scale-lr", "sqrt"], capsys)


def test_more_steps_than_the_epochs_hold_says_how_many_it_trains(devs, monkeypatch, capsys):
    monkeypatch.setattr(program, "build", lambda *_a, **_k: pytest.skip("said; not trained here"))
    with pytest.raises(pytest.skip.Exception):
        main(["--batch", "128", "--steps", "1000", "--epochs", "2"], devs)  # 1497 digits: 11 steps an epoch
    assert "--steps 1000: --epochs 2 hold 22 steps of 128; it trains 22 (give --epochs 91 for 1000)" in (
        capsys.readouterr().out
    )


@pytest.mark.slow
def test_a_resume_with_nothing_left_to_train_says_so(devs, tmp_path, monkeypatch, capsys):
    argv = ["--batch", "16", "--steps-per-call", "1", "--checkpoint", str(tmp_path / "ckpt")]
    final_weights([*argv, "--steps", "2"], devs, monkeypatch)
    final_weights([*argv, "--steps", "1"], devs, monkeypatch)
    assert "nothing to train: ckpt-2 has done 2 steps, and this run asks 1; give more --steps or --epochs" in (
        capsys.readouterr().out
    )


def test_a_checkpoint_folder_that_cannot_be_written_exits_2_before_any_work(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    err = refused(["--checkpoint", str(tmp_path / "file" / "ckpt")], capsys)
    assert "cannot write there" in err


def test_the_learning_rate_scales_with_the_batch_and_warms_up_from_lr():
    import multi_gpu_cli as cli

    args = cli.parse(["--lr", "1e-3", "--batch", "512", "--scale-lr", "linear", "--warmup", "100"], "")
    assert cli.lr_said(args) == ("learning rate: 0.001 tuned for batch 128, scaled linearly to 0.004 for batch 512, "
                                 "warmed up over 100 steps from 0.001")  # fmt: skip
    rates = [float(cli.learning_rate(args)(step)) for step in (0, 50, 100, 101, 10_000)]
    np.testing.assert_allclose(rates, [1e-3, 2.5e-3, 4e-3, 4e-3, 4e-3], rtol=1e-6)  # Goyal et al.: lr, linear, k lr
    assert cli.learning_rate(cli.parse(["--batch", "512", "--scale-lr", "sqrt"], "")) == pytest.approx(2e-3)


@pytest.mark.slow
def test_baseline_and_breakdown_say_the_efficiency_and_the_parts_of_a_step(devs, tmp_path, capsys):
    path = tmp_path / "m.json"
    assert main(["--steps", "4", "--batch", "64", "--baseline", "--breakdown", "--json", str(path)], devs) == 0
    out = capsys.readouterr().out
    assert "efficiency:" in out and "this says nothing of GPUs" in out and "breakdown (7 interleaved rounds" in out
    metrics = json.loads(path.read_text())
    assert metrics["efficiency"] > 0 and metrics["baseline_step_ms"] > 0 and metrics["steps"] == 4
    assert metrics["breakdown"]["step"]["ms"] > 0 and metrics["breakdown"]["input_alone"]["ms"] > 0
