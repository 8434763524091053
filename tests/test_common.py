"""examples/common.py, what both take-away programs share: a quiet start, the data and what it refuses, the devices,
JSON, the checks of a reader's model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import checkpoints
import common
import keras
import numpy as np
import pytest
import tensorflow as tf

ROOT = Path(__file__).resolve().parents[1]


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def _mnist_like(x_train=None, y_train=None, dtype=np.uint8):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (40, 8, 8)).astype(dtype)
    y = rng.integers(0, 10, 40).astype(np.uint8)
    return {"x_train": x if x_train is None else x_train, "y_train": y if y_train is None else y_train,
            "x_test": x[:10], "y_test": y[:10]}  # fmt: skip


OTHER_NUMBERS = {  # images and labels stored as other numbers than MNIST's
    "12-bit whole numbers": lambda good: {"x_train": good["x_train"].astype(np.uint16) * 16},  # 0 to 4080: / 255, 16
    "negative whole numbers": lambda good: {"x_train": good["x_train"].astype(np.int16) - 128},  # centred on 0
    "one-hot labels": lambda good: {"y_train": np.eye(10)[good["y_train"]]},
}


def _bad_data(tmp_path, kind):
    """An --data file of each kind a user may give by mistake."""
    good = _mnist_like()
    if kind in OTHER_NUMBERS:
        return _npz(tmp_path / "m.npz", **_mnist_like(**OTHER_NUMBERS[kind](good)))
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
        x = good["x_train"].astype(np.float32) / 255
        x[3, 4, 5] = np.nan
        return _npz(tmp_path / "m.npz", **_mnist_like(x_train=x))
    if kind == "float pixels 0 to 255":
        return _npz(tmp_path / "m.npz", **_mnist_like(dtype=np.float32))
    if kind == "test images of another size":
        return _npz(tmp_path / "m.npz", **{**good, "x_test": np.zeros((10, 12, 12), np.uint8)})
    return _npz(tmp_path / "m.npz", **_mnist_like(y_train=good["y_train"] + 1))  # labels 1 to 10


@pytest.mark.parametrize(
    "kind, message",
    [
        ("corrupt", "not a readable .npz"),
        ("no x_train", "no x_train; an mnist.npz holds"),
        ("flat images", "x_train has shape (40, 64): give images (N, height, width)"),
        ("(N, 1) labels", "y_train has shape (40, 1): give one label per image"),
        ("a NaN pixel", "x_train: 1 pixels are not finite"),
        ("labels 1 to 10", "labels must be the whole numbers 0 to 9"),
        ("float pixels 0 to 255", "float pixels from 0 to 255; give floats in [0, 1]"),
        ("12-bit whole numbers", "whole-number pixels from 0 to 4080; give whole numbers 0 to 255"),
        ("negative whole numbers", "whole-number pixels from -128 to 127; give whole numbers 0 to 255"),
        ("one-hot labels", "y_train has shape (40, 10): one-hot labels; give each image's class, y.argmax(axis=1)"),
        ("test images of another size", "x_train holds 8x8x1 images (height x width x channels) and x_test 12x12x1"),
    ],
)
def test_data_a_program_cannot_use_exits_2_saying_why(kind, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        common.load_data(_bad_data(tmp_path, kind), smallest=4)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_whole_number_pixels_are_divided_by_255_and_floats_in_0_1_used_as_they_are(tmp_path):
    good = _mnist_like()
    as_floats = {**good, "x_train": good["x_train"] / 255.0, "x_test": good["x_test"] / 255.0}
    (x, y), (x_test, _) = common.load_data(_npz(tmp_path / "u8.npz", **good), smallest=4)
    (xf, yf), _ = common.load_data(_npz(tmp_path / "f.npz", **as_floats), smallest=4)
    assert x.dtype == xf.dtype == np.float32 and x.shape == (40, 8, 8, 1) and x_test.shape == (10, 8, 8, 1)
    np.testing.assert_allclose(x, xf, rtol=1e-6)  # the same images whichever way they were stored
    assert 0 <= x.min() and x.max() <= 1 and y.dtype == np.int32 and np.array_equal(y, yf)


def test_colour_images_keep_their_channels(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (64, 32, 32, 3)).astype(np.uint8), rng.integers(0, 10, 64).astype(np.uint8)
    path = _npz(tmp_path / "cifar.npz", x_train=x, y_train=y, x_test=x[:16], y_test=y[:16])
    assert common.load_data(path, smallest=4)[0][0].shape == (64, 32, 32, 3)


def test_without_the_digits_file_or_mnist_it_exits_2_saying_where_data_comes_from(monkeypatch, capsys, tmp_path):
    assert common.digits_file() == ROOT / "tutorial_lib" / "digits.csv.gz"  # the course's copy
    monkeypatch.setattr(common, "digits_file", lambda: None)  # the folder copied alone, without scikit-learn
    monkeypatch.setattr(common, "MNIST_CACHE", tmp_path / "mnist.npz")
    for path in (None, "digits"):
        with pytest.raises(SystemExit) as stop:
            common.load_data(path, smallest=4)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and "no data" in err and "keras.datasets.mnist.load_data()" in err


@pytest.mark.parametrize("names", ["/CPU:0,/CPU:7", "gpu0,gpu1", "/GPU:97,/GPU:98,/GPU:99", "/CPU:0,/cpu:0"])
def test_devices_this_machine_lacks_exit_2_listing_the_ones_it_has(names, capsys):
    with pytest.raises(SystemExit) as stop:
        common.choose_devices(names, None, want=None)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "this machine has /device:CPU:0" in err and "--simulate N" in err, err


def test_simulated_devices_on_a_started_runtime_are_the_first_n_it_has_or_a_refusal(devs, capsys):
    assert common.choose_devices(None, 3, want=None) == devs[:3]
    with pytest.raises(SystemExit) as stop:
        common.choose_devices(None, 8, want=None)  # the tests' process runs 4
    assert stop.value.code == 2 and "start a new Python (restart the kernel)" in capsys.readouterr().err


def test_json_is_valid_where_a_figure_is_not_finite(tmp_path):
    path = tmp_path / "m.json"
    common.write_json(path, {"a": float("nan"), "b": [np.float64(1.5), float("inf")], "c": {"d": np.int64(3)}})
    assert json.loads(path.read_text()) == {"a": None, "b": [1.5, None], "c": {"d": 3}}


def test_the_layers_inside_a_model_are_found_at_any_depth_and_random_ones_named():
    class Holding(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.parts = [keras.layers.Dense(3), {"noise": keras.layers.GaussianNoise(0.1)}]

        def call(self, x):
            return self.parts[1]["noise"](self.parts[0](x))

    inner = keras.Sequential([keras.layers.Dropout(0.5)])
    model = keras.Sequential([keras.Input((4,)), Holding(), inner, keras.layers.Dense(2)])
    kinds = {type(layer).__name__ for layer in common.all_layers(model)}
    assert {"Holding", "Dense", "GaussianNoise", "Sequential", "Dropout"} <= kinds
    assert sorted(type(layer).__name__ for layer in common.random_layers(model)) == ["Dropout", "GaussianNoise"]


@pytest.mark.slow
def test_a_program_starts_without_tensorflows_start_up_lines():
    env = {"PATH": os.environ["PATH"], "HOME": str(Path.home())}  # none of the tests' quieting settings
    code = "import common; import tensorflow as tf; print(len(tf.config.list_logical_devices('CPU')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT / "examples")  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr
    assert done.stderr == "", done.stderr


def test_another_programs_checkpoints_in_the_folder_exit_2_and_are_kept(tmp_path, capsys):
    """tf.train.CheckpointManager names its files ckpt-N too: they are not damaged ones of this program, to pass over
    and then overwrite or delete as older than the two newest."""
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=tf.Variable(3.0)), str(tmp_path), max_to_keep=5)
    for _ in range(3):
        manager.save()
    before = sorted(p.name for p in tmp_path.iterdir())
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(SystemExit) as stop:
        checkpoints.Checkpoints(str(tmp_path)).restore(model, keras.optimizers.Adam(), {"batch": 8})
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "ckpt-3 was not saved by this program" in err and "an empty folder" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
