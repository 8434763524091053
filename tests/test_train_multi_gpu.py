"""examples/train_multi_gpu.py: the NCCL asker's take-away file."""

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
EXAMPLE = ROOT / "examples" / "train_multi_gpu.py"
_spec = importlib.util.spec_from_file_location("train_multi_gpu", EXAMPLE)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)
from test_train_pipelined import example as pipelined  # noqa: E402 (tests/ is on sys.path)


def run(*args, timeout=600):
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.slow
def test_both_strategies_pass_check_on_three_devices(devs, capsys):
    argv = ["--check", "--steps", "6", "--batch", "24", "--devices", ",".join(devs[:3]), "--strategy"]
    assert [example.main([*argv, strategy]) for strategy in ("replicated", "mirrored")] == [0, 0]
    assert example.main([*argv, "replicated", "--all-reduce", "central"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("check:")]
    assert len(lines) == 3 and all("on 3 devices" in line and "(ok)" in line for line in lines), lines


def _one_device_keras(start, device, batches):
    """The same CNN, start and batches on one device, with Keras' own batch norm: the reference."""
    with tf.device(device):
        single, sgd = example.make_cnn((8, 8, 1)), keras.optimizers.SGD(0.1)
    for v, first in zip(single.variables, start, strict=True):
        v.assign(first)
    for x, y in batches:
        with tf.GradientTape() as tape:
            logits = single(x, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        grads = tape.gradient(loss, single.trainable_variables)
        sgd.apply_gradients(zip(grads, single.trainable_variables, strict=True))
    return single


def test_sync_bn_replicas_equal_keras_on_one_device_moving_statistics_included(devs):
    # SGD, not Adam: in float32 Adam turns the rounding of a gradient near 0 into a step of up to
    # its learning rate (m / sqrt(v) is about +-1); the float64 --check above compares with Adam.
    keras.utils.set_random_seed(0)  # the same weights whatever ran before in this process
    (x, y), _ = example.load_data("digits")
    batches = example.batches(x, y, 16, seed=0)[:3]
    replicas = example.make_replicas(lambda: example.make_cnn((8, 8, 1)), devs)
    start = [v.numpy() for v in replicas[0].variables]
    optimizers = example.replica_optimizers(replicas, devs, lambda: keras.optimizers.SGD(0.1))
    step = example.make_sync_bn_train_step(replicas, devs, optimizers)
    for xb, yb in batches:
        step(xb, yb)
    single = _one_device_keras(start, devs[0], batches)
    for replica in replicas:  # float32: the float64 check in the tests above is exact to 1e-13
        for v, r in zip(replica.variables, single.variables, strict=True):
            np.testing.assert_allclose(v.numpy(), r.numpy(), rtol=1e-3, atol=1e-4, err_msg=v.path)
    bn = replicas[-1].layers[1]
    assert isinstance(bn, keras.layers.BatchNormalization) and np.any(bn.moving_mean.numpy() != 0)
    assert tf.DeviceSpec.from_string(bn.moving_mean.value.device).device_index == len(devs) - 1  # its own device


def test_check_finds_averaged_instead_of_summed_gradients(devs, monkeypatch):
    """With sync BN the replicas' gradients must be summed: averaging them takes 1/N of the step."""
    (x, y), test = example.load_data("digits")
    args = example.parse(["--check", "--steps", "3", "--batch", "16", "--simulate", "2"])
    args.method, args.method_said = "ring", "ring"
    assert example.check(args, devs[:2], ((x, y), test)) <= 1e-5
    grads = example.allreduce_grads
    averaged = lambda g, average, **kw: grads(g, average=not average, **kw)  # noqa: E731 (the step asks for a sum)
    monkeypatch.setattr(example, "allreduce_grads", averaged)
    assert example.check(args, devs[:2], ((x, y), test)) > 1e-3


def test_check_finds_a_replica_that_normalizes_with_its_own_batch(devs, monkeypatch):
    (x, y), test = example.load_data("digits")
    args = example.parse(["--check", "--steps", "3", "--batch", "16", "--simulate", "2"])
    args.method, args.method_said = "ring", "ring"
    monkeypatch.setattr(example, "sync_bn32", _per_device_batch_norm)  # the statistics of the program's step
    assert example.check(args, devs[:2], ((x, y), test)) > 1e-3


def _per_device_batch_norm(layers, devices, hs, _all_sum):
    out = []
    for layer, h, device in zip(layers, hs, devices, strict=True):
        with tf.device(device):
            out.append(layer(h, training=True))  # plain Keras BN: this device's statistics only
    return out


def test_all_reduce_is_the_ring_on_cpus_and_nccl_only_on_whole_gpus(monkeypatch):
    assert example.all_reduce_method(["/device:CPU:0", "/device:CPU:1"])[0] == "ring"
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda _kind=None: ["gpu"] * 2)
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda _kind=None: ["gpu"] * 2)
    assert example.all_reduce_method(["/GPU:0", "/GPU:1"])[0] == "nccl"
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda _kind=None: ["gpu"] * 4)  # carved from 2 cards
    method, said = example.all_reduce_method(["/GPU:0", "/GPU:1"])
    assert method == "ring" and "distinct GPUs" in said
    assert example.all_reduce_method(["/GPU:0", "/GPU:1"], "central")[0] == "central"  # --all-reduce central
    with pytest.raises(SystemExit) as stop:  # NCCL asked for where it cannot run
        example.all_reduce_method(["/GPU:0", "/GPU:1"], "nccl")
    assert stop.value.code == 2


@pytest.mark.slow
def test_a_default_run_trains_reports_accuracy_each_epoch_and_writes_json_and_scalars(tmp_path):
    path, logs = tmp_path / "metrics.json", tmp_path / "logs"
    done = run(str(EXAMPLE), "--epochs", "4", "--json", str(path), "--logdir", str(logs), "--profile")
    assert done.returncode == 0, done.stderr
    assert "simulated CPU devices" in done.stdout and "8x8 digits" in done.stdout and "a ring of copies" in done.stdout
    assert done.stdout.count("test_accuracy") == 4, done.stdout  # every epoch
    assert "triggered tf.function retracing" not in done.stderr  # accuracy() traces once per shape, not per call
    metrics = json.loads(path.read_text())
    assert metrics["test_accuracy"] > 0.8 and metrics["train_accuracy"] > 0.8, metrics  # it learns
    assert metrics["images_per_second"] > 0 and metrics["all_reduce"] == "ring" and len(metrics["devices"]) == 2
    assert list(logs.glob("events.out.tfevents.*")), "no TensorBoard scalars in --logdir"
    assert list(logs.rglob("*.xplane.pb")), "no profiler trace in --logdir"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--simulate", "0"], "1 to 16 devices"),
        (["--devices", "/GPU:0", "--simulate", "2"], "not both"),
        (["--batch", "9"], "multiple of the 2 devices"),
        (["--devices", "/GPU:0,/GPU:1,/GPU:2", "--batch", "64"], "e.g. 63"),
        (["--steps", "0"], ">= 1"),
        (["--lr", "-1"], "positive learning rate"),
        (["--lr", "inf"], "positive learning rate"),
        (["--profile"], "give --logdir DIR too"),
        (["--data", "/nowhere/mnist.npz"], "no such file"),
        (["--json", "/nowhere/m.json"], "no such folder"),
        (["--strategy", "parameter-server"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        example.parse(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_a_functional_model_and_a_batch_norm_of_another_axis_are_refused(devs):
    """Walking layers in order is the graph of a Sequential model only; local_moments reduces all but the last axis."""
    inputs = keras.Input((8, 8, 1))
    functional = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Flatten()(inputs)))
    xs = [tf.zeros((2, 8, 8, 1))] * 2
    with pytest.raises(TypeError, match=r"walks a keras.Sequential.*got a Functional"):
        example.replicated_forward([functional, functional], devs[:2], xs, example.ALL_SUMS["ring"])
    bn = keras.layers.BatchNormalization(axis=1)
    bn.build((None, 8, 8, 1))
    with pytest.raises(ValueError, match=r"normalizes the last axis.*BatchNormalization\(axis=-1"):
        example.sync_batch_norm([bn, bn], devs[:2], xs, example.ALL_SUMS["ring"])


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def _mnist_like(x_train=None, y_train=None):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (40, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 40).astype(np.uint8)
    return {"x_train": x if x_train is None else x_train, "y_train": y if y_train is None else y_train,
            "x_test": x[:10], "y_test": y[:10]}  # fmt: skip


def _bad_data(tmp_path, kind):
    """An --data file of each kind a user may give by mistake."""
    good = _mnist_like()
    if kind == "corrupt":
        path = tmp_path / "mnist.npz"
        path.write_bytes(b"PK\x03\x04 not a whole zip file")
        return str(path)
    if kind == "no x_train":
        return _npz(tmp_path / "m.npz", **{k: v for k, v in good.items() if k != "x_train"})
    if kind == "flat images":
        return _npz(tmp_path / "m.npz", **_mnist_like(x_train=good["x_train"].reshape(40, 64)))
    if kind == "(N, 1) labels":
        return _npz(tmp_path / "m.npz", **_mnist_like(y_train=good["y_train"][:, None]))
    if kind == "a NaN pixel":
        x = good["x_train"].copy()
        x[3, 4, 5] = np.nan
        return _npz(tmp_path / "m.npz", **_mnist_like(x_train=x))
    return _npz(tmp_path / "m.npz", **_mnist_like(y_train=good["y_train"] + 1))  # labels 1 to 10


@pytest.mark.parametrize("name", ["train_multi_gpu", "train_pipelined"])
@pytest.mark.parametrize(
    "kind, message",
    [
        ("corrupt", "not a readable .npz"),
        ("no x_train", "no x_train; an mnist.npz holds"),
        ("flat images", "x_train has shape (40, 64): give images (N, height, width)"),
        ("(N, 1) labels", "y_train has shape (40, 1): give one label per image"),
        ("a NaN pixel", "x_train: 1 pixels are not finite"),
        ("labels 1 to 10", "labels must be the whole numbers 0 to 9"),
    ],
)
def test_data_a_take_away_file_cannot_use_exits_2_saying_why(name, kind, message, tmp_path, capsys):
    module = example if name == "train_multi_gpu" else pipelined
    with pytest.raises(SystemExit) as stop:
        module.load_data(_bad_data(tmp_path, kind))
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("name", ["train_multi_gpu", "train_pipelined"])
@pytest.mark.parametrize("devices", ["/CPU:0,/CPU:7", "gpu0,gpu1", "/GPU:97,/GPU:98,/GPU:99", "/CPU:0,/cpu:0"])
def test_devices_this_machine_lacks_exit_2_listing_the_ones_it_has(name, devices, capsys):
    module = example if name == "train_multi_gpu" else pipelined
    with pytest.raises(SystemExit) as stop:
        module.main(["--devices", devices, "--batch", "24"])  # 24: a multiple of 8 micro-batches and of 2 or 3 devices
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "this machine has /device:CPU:0" in err and "--simulate N" in err, err


@pytest.mark.parametrize("name", ["train_multi_gpu", "train_pipelined"])
@pytest.mark.parametrize("check", [[], ["--check"]])
def test_a_batch_larger_than_the_training_set_exits_2_before_any_work(name, check, devs, tmp_path, capsys):
    module = example if name == "train_multi_gpu" else pipelined
    path = tmp_path / "m.json"
    with pytest.raises(SystemExit) as stop:
        module.main([*check, "--batch", "2000", "--devices", ",".join(devs[:2]), "--json", str(path)])
    assert stop.value.code == 2 and "the training set holds 1497 images" in capsys.readouterr().err
    assert not path.exists()


@pytest.mark.parametrize("name", ["train_multi_gpu", "train_pipelined"])
def test_json_naming_a_folder_and_logdir_naming_a_file_exit_2_before_any_work(name, tmp_path, capsys):
    module = example if name == "train_multi_gpu" else pipelined
    (tmp_path / "file").write_text("")
    for argv, message in ((["--json", str(tmp_path)], "a folder; give a file"), (["--logdir", str(tmp_path / "file")],
                                                                                "a file, not a folder")):  # fmt: skip
        with pytest.raises(SystemExit) as stop:
            module.parse(argv)
        assert stop.value.code == 2 and message in capsys.readouterr().err


def test_check_says_how_many_steps_it_compared_and_writes_valid_json(devs, tmp_path, capsys):
    path = tmp_path / "m.json"
    argv = ["--check", "--steps", "5", "--batch", "512", "--devices", ",".join(devs[:2]), "--json", str(path)]
    assert example.main(argv) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("check:"))
    assert line.startswith("check: 2 steps (of 5 asked: the training set holds 2 full batches of 512)"), line
    assert json.loads(path.read_text())["largest_relative_difference"] <= 1e-5


def test_a_non_finite_difference_fails_the_check_and_is_written_as_null(devs, tmp_path, monkeypatch, capsys):
    (x, y), test = example.load_data("digits")
    x = x.copy()
    x[:, 3, 3, 0] = np.nan  # one pixel of each image: its first batch holds some, were NaN not refused at load
    args = example.parse(["--check", "--steps", "1", "--batch", "16", "--devices", ",".join(devs[:2])])
    args.method, args.method_said = "ring", "ring"
    assert np.isnan(example.check(args, devs[:2], ((x, y), test)))
    assert "(not finite: they differ)" in capsys.readouterr().out
    monkeypatch.setattr(example, "check", lambda *_: float("nan"))
    path = tmp_path / "m.json"
    assert example.main(["--check", "--devices", ",".join(devs[:2]), "--json", str(path)]) == 1
    assert json.loads(path.read_text())["largest_relative_difference"] is None  # JSON has no NaN


def test_accuracy_builds_one_tf_function_per_model(monkeypatch):
    """A new tf.function per call traces anew at every epoch: TensorFlow's retracing warnings."""
    model, (x, y) = example.make_cnn((8, 8, 1)), example.load_data("digits")[1]
    built, function = [], tf.function

    def counted(*args, **kwargs):  # Keras calls tf.function too, also as a decorator factory
        built.extend(["accuracy"] if "accuracy" in getattr(args[0] if args else None, "__qualname__", "") else [])
        return function(*args, **kwargs)

    monkeypatch.setattr(example.tf, "function", counted)
    assert len({example.accuracy(model, x, y) for _ in range(3)}) == 1 and built == ["accuracy"]


@pytest.mark.parametrize("name", ["train_multi_gpu", "train_pipelined"])
def test_without_the_digits_file_or_mnist_a_take_away_file_exits_2_saying_where_data_comes_from(
    name, monkeypatch, capsys, tmp_path
):
    module = example if name == "train_multi_gpu" else pipelined
    assert module.digits_file() == ROOT / "tutorial_lib" / "digits.csv.gz"  # the course's copy
    monkeypatch.setattr(module, "digits_file", lambda: None)  # a file copied alone, without scikit-learn
    monkeypatch.setattr(module, "MNIST_CACHE", tmp_path / "mnist.npz")
    for argv in ([], ["--data", "digits"]):
        with pytest.raises(SystemExit) as stop:
            module.parse(argv)
        assert stop.value.code == 2 and "no data" in capsys.readouterr().err


def _blocks_cnn(frozen=False):
    """A CNN whose first batch norm sits in a nested keras.Sequential block; `frozen`: the second one
    does not train (fine-tuning), as `layer.trainable = False` sets it."""
    block = keras.Sequential([keras.layers.Conv2D(4, 3, padding="same"), keras.layers.BatchNormalization()])
    bn = keras.layers.BatchNormalization(momentum=0.5)
    bn.trainable = not frozen
    layers = [keras.Input((8, 8, 1)), block, keras.layers.ReLU(), keras.layers.Conv2D(4, 3, padding="same"), bn]
    return keras.Sequential([*layers, keras.layers.Flatten(), keras.layers.Dense(10)])


@pytest.mark.parametrize("frozen", [False, True])
def test_nested_and_frozen_batch_norm_train_as_keras_on_one_device(devs, frozen):
    keras.utils.set_random_seed(0)
    (x, y), _ = example.load_data("digits")
    batches = example.batches(x, y, 16, seed=0)[:3]
    replicas = example.make_replicas(lambda: _blocks_cnn(frozen), devs[:2])
    frozen_bn = replicas[0].layers[-3]
    for replica in replicas:  # moving statistics away from 0 and 1, so that using them shows
        replica.layers[-3].moving_mean.assign(tf.fill([4], 0.5))
    start = [v.numpy() for v in replicas[0].variables]
    optimizers = example.replica_optimizers(replicas, devs[:2], lambda: keras.optimizers.SGD(0.1))
    step = example.make_sync_bn_train_step(replicas, devs[:2], optimizers)
    for xb, yb in batches:
        step(xb, yb)
    with tf.device(devs[0]):
        single, sgd = _blocks_cnn(frozen), keras.optimizers.SGD(0.1)
    for v, first in zip(single.variables, start, strict=True):
        v.assign(first)
    for xb, yb in batches:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=single(xb, training=True))
            )
        grads = tape.gradient(loss, single.trainable_variables)
        sgd.apply_gradients(zip(grads, single.trainable_variables, strict=True))
    for replica in replicas:
        for v, r in zip(replica.variables, single.variables, strict=True):
            np.testing.assert_allclose(v.numpy(), r.numpy(), rtol=1e-3, atol=1e-4, err_msg=v.path)
    nested = [r.layers[0].layers[1].moving_mean.numpy() for r in replicas]
    np.testing.assert_allclose(nested[0], nested[1], rtol=1e-5)  # synchronized, not per-device
    moved = np.abs(frozen_bn.moving_mean.numpy() - 0.5).max()
    assert (moved == 0) if frozen else (moved > 0.01), moved


def test_a_batch_norm_inside_a_functional_block_is_refused_not_left_per_device(devs):
    inputs = keras.Input((8, 8, 1))
    block = keras.Model(inputs, keras.layers.BatchNormalization()(inputs), name="functional_block")
    model = keras.Sequential([keras.Input((8, 8, 1)), block, keras.layers.Flatten(), keras.layers.Dense(10)])
    with pytest.raises(TypeError, match=r"functional_block .* holds a BatchNormalization.*keras.Sequential"):
        example.replicated_forward([model, model], devs[:2], [tf.zeros((2, 8, 8, 1))] * 2, example.ALL_SUMS["ring"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bucket-mb", "-1"], "give 0 MB or more"),
        (["--bucket-mb", "nan"], "give 0 MB or more"),
        (["--log-every", "0"], "give 1 or more steps"),
        (["--bn", "ghost"], "invalid choice"),
        (["--precision", "float8"], "invalid choice"),
        (["--precision", "float16", "--strategy", "mirrored"], "needs loss scaling"),
        (["--check", "--checkpoint", "/tmp"], "drop --checkpoint"),
        (["--check", "--baseline"], "drop one"),
        (["--baseline", "--simulate", "1"], "give 2 or more devices"),
    ],
)
def test_bad_values_of_the_speed_options_exit_2_with_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        example.parse(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_bn_auto_is_sync_for_small_shares_and_local_for_large_ones():
    assert example.parse(["--batch", "32", "--simulate", "2"]).bn == "sync"  # 16 a device
    assert example.parse(["--batch", "128", "--simulate", "2"]).bn == "local"  # 64 a device
    assert example.parse(["--batch", "128", "--simulate", "2", "--bn", "sync"]).bn == "sync"


@pytest.mark.parametrize(
    "extra",
    [["--bn", "local"], ["--bucket-mb", "0.02"], ["--bucket-mb", "0"], ["--precision", "bfloat16", "--bn", "sync"]],
)
def test_every_option_passes_check_against_one_device(devs, extra, capsys):
    assert example.main(["--check", "--steps", "3", "--batch", "24", "--devices", ",".join(devs[:3]), *extra]) == 0
    assert "(ok)" in capsys.readouterr().out


@pytest.mark.slow
def test_float16_with_loss_scaling_and_mirrored_local_bn_pass_check(devs, monkeypatch, capsys):
    # Two MirroredStrategy objects of one process reuse collective keys: a group of its own for this one.
    monkeypatch.setattr(tf.distribute.MirroredStrategy, "_collective_key_base", 7000)
    argv = ["--check", "--steps", "4", "--batch", "32", "--devices", ",".join(devs[:2])]
    assert example.main([*argv, "--precision", "float16", "--bn", "sync"]) == 0
    assert example.main([*argv, "--strategy", "mirrored", "--bn", "local"]) == 0
    assert capsys.readouterr().out.count("(ok)") == 2


def test_check_finds_local_statistics_where_the_reference_syncs(devs, monkeypatch):
    (x, y), test = example.load_data("digits")
    args = example.parse(["--check", "--steps", "3", "--batch", "16", "--devices", ",".join(devs[:2]), "--bn", "local"])
    args.method, args.method_said = "ring", "ring"
    real = example.make_train_step
    monkeypatch.setattr(example, "make_train_step", lambda r, d, o, method, _local, b: real(r, d, o, method, False, b))
    assert example.check(args, devs[:2], ((x, y), test)) > 1e-3


def test_buckets_start_from_the_last_layer_and_hold_at_most_their_bytes():
    tensors = [tf.zeros([n]) for n in (10, 300, 20, 20, 5)]  # 40, 1200, 80, 80, 20 bytes
    assert example.bucket_plan(tensors, 200) == [[4, 3, 2], [1], [0]]
    assert example.bucket_plan(tensors, 10**6) == [[4, 3, 2, 1, 0]]


@pytest.mark.parametrize("n", [2, 4])
def test_the_bucketed_step_traces_one_nccl_all_reduce_per_bucket_on_gpu_names_every_op_on_its_replica(n):
    from test_placement import GPUS, _batch, _sync_bn

    from tutorial_lib import placement

    replicas, optimizers, owners = _sync_bn(GPUS[:n])
    plan = example.bucket_plan(replicas[0].trainable_variables, 40_000)
    step = example.make_train_step(replicas, GPUS[:n], optimizers, "nccl", bucket_bytes=40_000)
    x, y = _batch(2 * n)
    args = [tf.split(x, n), tf.split(y, n)]
    report = placement.audit(step, *args, owners=owners)
    assert report.ok and report.ops_checked > 500, report
    graph = step.get_concrete_function(*args).graph
    nccl = [op.device for op in graph.get_operations() if op.type == "NcclAllReduce"]
    assert len(plan) == 3  # the dense kernel alone, the second convolution alone, the rest
    # Per GPU: each BN layer's statistics forward and backward (2 x 2), and one per bucket.
    assert sorted(nccl) == sorted(f"/device:GPU:{i}" for i in range(n) for _ in range(4 + len(plan)))


@pytest.mark.parametrize("bn", [False, True])
def test_the_bucketed_step_runs_with_every_op_and_variable_on_its_replica(devs, bn):
    from test_placement import _batch, _sync_bn

    from tutorial_lib import placement

    replicas, optimizers, owners = _sync_bn(devs[:2])
    step = example.make_train_step(replicas, devs[:2], optimizers, local_bn=bn, bucket_bytes=40_000)
    x, y = _batch()
    shares = [[tf.identity(t) for t in tf.split(v, 2)] for v in (x, y)]
    report = placement.audit(step, *shares, owners=owners, run=True)
    assert report.ok and report.variables_checked == 60, report


def test_a_cifar_like_npz_of_colour_images_trains(devs, tmp_path, capsys):
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (64, 32, 32, 3)).astype(np.uint8), rng.integers(0, 10, 64).astype(np.uint8)
    path = _npz(tmp_path / "cifar.npz", x_train=x, y_train=y, x_test=x[:16], y_test=y[:16])
    assert example.load_data(path)[0][0].shape == (64, 32, 32, 3)
    assert example.main(["--data", path, "--steps", "2", "--batch", "16", "--devices", ",".join(devs[:2])]) == 0
    out = capsys.readouterr().out
    assert "step 1 traced the step" in out and "timing: 1 timed steps" in out, out


@pytest.mark.parametrize("name", ["train_multi_gpu", "train_pipelined"])
def test_test_images_of_another_size_than_the_training_images_exit_2_before_any_work(name, tmp_path, capsys):
    module = example if name == "train_multi_gpu" else pipelined
    good = _mnist_like()
    path = _npz(tmp_path / "m.npz", **{**good, "x_test": np.zeros((10, 12, 12), np.float32)})
    with pytest.raises(SystemExit) as stop:
        module.load_data(path)
    assert stop.value.code == 2 and "x_train holds 8x8" in capsys.readouterr().err


def test_a_checkpoint_folder_that_cannot_be_made_exits_2_before_any_work(devs, tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(example, "train", lambda *_a: pytest.fail("trained before refusing --checkpoint"))
    with pytest.raises(SystemExit) as stop:
        example.main(["--devices", ",".join(devs[:2]), "--checkpoint", str(tmp_path / "file" / "ckpt")])
    assert stop.value.code == 2 and "cannot make that folder" in capsys.readouterr().err


def test_a_batch_the_default_gpus_do_not_divide_exits_2_and_bn_auto_counts_them(devs, monkeypatch, capsys):
    # Without --devices or --simulate, parse assumes 2 devices; every GPU of the machine may be 3.
    monkeypatch.setattr(example, "choose_devices", lambda _args: devs[:3])
    monkeypatch.setattr(example, "train", lambda *_a: pytest.fail("trained a batch 3 devices do not divide"))
    with pytest.raises(SystemExit) as stop:
        example.main(["--batch", "64"])
    assert stop.value.code == 2 and "multiple of the 3 devices, e.g. 63" in capsys.readouterr().err
    seen = []
    monkeypatch.setattr(example, "train", lambda args, *_a: seen.append(args.bn) or {"steps": 0})
    assert example.main(["--batch", "72"]) == 0 and seen == ["sync"]  # 36 a device on 2, 24 on 3


def test_a_checkpoint_of_another_run_or_already_done_exits_2_and_a_new_lr_is_used(devs, tmp_path, monkeypatch, capsys):
    argv = ["--devices", ",".join(devs[:2]), "--batch", "32", "--epochs", "1", "--checkpoint", str(tmp_path / "c")]
    assert example.main([*argv, "--steps", "2"]) == 0
    for extra, message in ((["--precision", "float16"], "does not fit this run"), ([], "already reach the 2 asked")):
        with pytest.raises(SystemExit) as stop:
            example.main([*argv, "--steps", "2", *extra])
        assert stop.value.code == 2 and message in capsys.readouterr().err
    runs, real = [], example.trainer
    monkeypatch.setattr(example, "trainer", lambda *a: runs.append(real(*a)) or runs[-1])
    assert example.main([*argv, "--steps", "3", "--lr", "0.02"]) == 0
    assert "saved with learning rate 0.001; training on with --lr 0.02" in capsys.readouterr().out
    assert np.isclose(float(runs[-1].optimizer.learning_rate), 0.02)


def _final_weights(argv, monkeypatch):
    runs, real = [], example.trainer
    keras.utils.set_random_seed(0)  # the same initial weights in each run
    monkeypatch.setattr(example, "trainer", lambda *a: runs.append(real(*a)) or runs[-1])
    assert example.main(argv) == 0
    return [[np.asarray(v) for v in replica] for replica in runs[-1].variables]


@pytest.mark.slow
def test_a_run_stopped_and_resumed_from_its_checkpoint_ends_equal_to_one_that_did_not(devs, tmp_path, monkeypatch):
    argv = ["--batch", "256", "--bn", "sync", "--devices", ",".join(devs[:2]), "--log-every", "2"]  # 5 steps an epoch
    straight = _final_weights([*argv, "--steps", "8"], monkeypatch)
    folder = str(tmp_path / "ckpt")
    _final_weights([*argv, "--steps", "3", "--checkpoint", folder], monkeypatch)  # stops inside epoch 1
    resumed = _final_weights([*argv, "--steps", "8", "--checkpoint", folder], monkeypatch)
    for a, b in zip(straight, resumed, strict=True):
        for u, v in zip(a, b, strict=True):
            np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-7)
    for replica in resumed[1:]:  # every replica restored equal, and still equal
        for u, v in zip(replica, resumed[0], strict=True):
            np.testing.assert_array_equal(u, v)


@pytest.mark.slow
def test_baseline_prints_the_efficiency_against_one_device(devs, tmp_path, capsys):
    path = tmp_path / "m.json"
    argv = ["--steps", "4", "--batch", "64", "--devices", ",".join(devs[:2]), "--baseline", "--json", str(path)]
    assert example.main(argv) == 0
    assert "efficiency:" in capsys.readouterr().out
    metrics = json.loads(path.read_text())
    assert metrics["efficiency"] > 0 and metrics["baseline_step_ms"] > 0 and metrics["steps"] == 4
