"""What both programs need besides their method: a quiet start, refusals, the data, the devices, JSON.

Imported first by train_multi_gpu.py and train_pipelined.py: it imports TensorFlow with its start-up lines
filtered. Nothing here is multi-device training; read the method files for that.
"""

import importlib.util
import json
import os
import re
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

import numpy as np

# TensorFlow writes these while it loads and probes for CUDA, to file descriptor 2, before any setting
# applies (TF_CPP_MIN_LOG_LEVEL hides the rest of its INFO and WARNING lines, not these).
NOISE = re.compile(
    r"All log messages before absl::InitializeLog|oneDNN custom operations are on|Could not find cuda drivers"
    r"|failed call to cuInit|TensorFlow binary is optimized to use available CPU instructions"
    r"|rebuild TensorFlow with the appropriate compiler flags|Unable to register cu(?:DNN|FFT|BLAS) factory"
    r"|computation placer already registered|TF-TRT Warning"
)


def import_tensorflow_quietly():
    """Import TensorFlow and find its devices with file descriptor 2 caught; pass on every line but NOISE."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "tensorflow" in sys.modules:
        return
    with tempfile.TemporaryFile() as caught:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            import tensorflow as tf

            tf.config.list_physical_devices()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        for line in caught.read().decode(errors="replace").splitlines():
            if line.strip() and not NOISE.search(line):
                print(line, file=sys.stderr)


import_tensorflow_quietly()
import keras  # noqa: E402 (after the quiet import above)
import tensorflow as tf  # noqa: E402

MNIST_CACHE = Path.home() / ".keras/datasets/mnist.npz"


def refuse(message, code=2):
    """Exit 2 with `message`, as argparse refuses an argument: for what only the data, the model or the machine
    tells. (Exit 1 is the checks' "they differ"; 3, a step that failed on a device.)"""
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def digits_file():
    """The 8x8 digits' CSV: the course's copy beside this folder (tutorial_lib/), else scikit-learn's."""
    sklearn = importlib.util.find_spec("sklearn")
    folders = [Path(__file__).resolve().parents[1] / "tutorial_lib"]
    folders += [Path(sklearn.submodule_search_locations[0], "datasets", "data")] if sklearn else []
    return next((f / "digits.csv.gz" for f in folders if (f / "digits.csv.gz").is_file()), None)


NO_DATA = (
    "no data: there is no MNIST in Keras' cache (~/.keras/datasets/mnist.npz) and no 8x8 digits file beside "
    "this folder. Give --data PATH of an .npz holding x_train, y_train, x_test, y_test (Keras' mnist.npz: "
    "python -c 'import keras; keras.datasets.mnist.load_data()' downloads it), or install scikit-learn, "
    "which ships the digits"
)


def read_npz(path):
    """The two splits of an .npz, or exit 2 saying what the file is not."""
    try:
        with np.load(path) as f:
            if missing := [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in f.files]:
                refuse(f"--data {path}: no {', '.join(missing)}; an mnist.npz holds x_train, y_train, x_test, y_test")
            return [(f[f"x_{s}"], f[f"y_{s}"]) for s in ("train", "test")]
    except (AttributeError, EOFError, OSError, TypeError, ValueError, zipfile.BadZipFile, zlib.error) as err:
        refuse(f"--data {path}: not a readable .npz ({type(err).__name__}: {err}); give Keras' mnist.npz or digits")


def data_problem(name, x, y, smallest):
    """What is wrong with one split's images x (N, H, W[, 1 or 3]) and labels y (N,) of 0 to 9; None if nothing."""
    if not (np.issubdtype(x.dtype, np.number) and np.issubdtype(y.dtype, np.number)):
        return f"{name}: images and labels must be numbers, got {x.dtype} and {y.dtype}"
    if x.ndim not in (3, 4) or min(x.shape[1:3], default=0) < smallest or x.ndim == 4 and x.shape[3] not in (1, 3):
        return (
            f"x_{name} has shape {x.shape}: give images (N, height, width), or (N, height, width, 3) in colour, "
            f"at least {smallest}x{smallest}"
        )
    if y.shape == (len(x), 10):
        return f"y_{name} has shape {y.shape}: one-hot labels; give each image's class, y.argmax(axis=1)"
    if y.shape != x.shape[:1] or not len(y):
        return f"y_{name} has shape {y.shape}: give one label per image, shape ({len(x)},) (y.ravel()), none empty"
    if not np.isfinite(x).all():
        return f"x_{name}: {np.size(x) - np.isfinite(x).sum()} pixels are not finite (NaN or inf); fix or drop them"
    if not np.all((y >= 0) & (y <= 9) & (y == np.round(y))):
        return f"y_{name}: labels must be the whole numbers 0 to 9, got {y.min()} to {y.max()}"
    if np.issubdtype(x.dtype, np.floating) and (x.min() < 0 or x.max() > 1):
        return (
            f"x_{name}: float pixels from {x.min():g} to {x.max():g}; give floats in [0, 1] (used as they are) "
            "or whole numbers 0 to 255 (divided by 255)"
        )
    if np.issubdtype(x.dtype, np.integer) and (x.min() < 0 or x.max() > 255):  # 12-bit, 16-bit or signed images
        return (
            f"x_{name}: whole-number pixels from {x.min()} to {x.max()}; give whole numbers 0 to 255 (divided by "
            "255) or floats in [0, 1] (used as they are), e.g. (x - x.min()) / (x.max() - x.min())"
        )
    return None


def load_data(path, smallest):
    """((x_train, y_train), (x_test, y_test)) from an .npz (default: Keras' cached MNIST, if there), else the 8x8
    digits; images (N, H, W, 1 or 3) in [0, 1], float32: whole numbers divided by 255 (the digits by 16), floats
    in [0, 1] as they are. Exit 2 on data the model cannot take."""
    path = path or (MNIST_CACHE if MNIST_CACHE.exists() else "digits")
    if path == "digits" and not digits_file():
        refuse(NO_DATA)
    print(
        f"data: {path}"
        if path != "digits"
        else "data: 8x8 digits, THE BUNDLED STAND-IN: 1,497 training images "
        "(no MNIST in the Keras cache, and nothing downloads): give --data mnist.npz to measure"
    )
    if path != "digits":
        splits, scale = read_npz(path), 255.0
    else:
        table = np.loadtxt(digits_file(), delimiter=",").astype(np.uint8)  # whole numbers 0 to 16
        order = np.random.default_rng(0).permutation(len(table))
        splits, scale = [(table[i, :64].reshape(-1, 8, 8), table[i, 64]) for i in (order[300:], order[:300])], 16.0
    for name, (x, y) in zip(("train", "test"), splits, strict=True):
        if problem := data_problem(name, x, y, smallest):
            refuse(f"--data {path}: {problem}")
    sizes = [(*x.shape[1:3], x.shape[3] if x.ndim == 4 else 1) for x, _ in splits]
    if sizes[0] != sizes[1]:  # the model is built for the training images: the test images would fail it
        refuse(
            f"--data {path}: x_train holds {'x'.join(map(str, sizes[0]))} images (height x width x channels) "
            f"and x_test {'x'.join(map(str, sizes[1]))}; give both splits images of one size"
        )
    return [(scaled(x, scale).reshape(*x.shape[:3], -1), y.astype(np.int32)) for x, y in splits]


def scaled(x, scale):
    """Pixels in [0, 1]: whole numbers divided by `scale`; floats (already checked to be in [0, 1]) as they are."""
    return (x if np.issubdtype(x.dtype, np.floating) else x / scale).astype(np.float32)


def unknown_devices(names):
    """The names in `names` that are not devices of this process, or that repeat one."""
    local, seen, unknown = tf.DeviceSpec(job="localhost", replica=0, task=0), set(), []
    full_name = lambda name: local.make_merged_spec(tf.DeviceSpec.from_string(name)).to_string()  # noqa: E731
    known = {full_name(d.name) for d in tf.config.list_logical_devices()}
    for name in names:
        try:
            full = full_name(name)
        except ValueError:  # not a device name: 'gpu0'
            full = None
        unknown += [name] if full not in known or full in seen else []
        seen.add(full)
    return unknown


def choose_devices(names, simulate, want):
    """`names` (comma-separated; exit 2 if this machine lacks one); else `want` GPUs (every GPU if want is None)
    where there are that many; else `simulate` (default: want, or 2) logical CPUs, said so."""
    gpus, cpu = tf.config.list_physical_devices("GPU"), tf.config.list_physical_devices("CPU")[0]
    if names:
        devices = [d.strip() for d in names.split(",")]
        if unknown := unknown_devices(devices):
            have = ", ".join(d.name for d in tf.config.list_logical_devices())
            refuse(
                f"--devices: no device {', '.join(map(repr, unknown))} here, or named twice; this machine has "
                f"{have}. Name some of those once each, or give --simulate N for N logical CPUs"
            )
        return devices
    if len(gpus) >= max(want or 2, 2) and not simulate:
        return [f"/GPU:{i}" for i in range(want or len(gpus))]
    n, made = simulate or want or 2, tf.config.get_logical_device_configuration(cpu) or []
    if len(made) < n:  # none yet, or too few: made now (TensorFlow allows it only before it starts)
        try:
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
        except RuntimeError:
            refuse(f"--simulate {n}: this process already runs TensorFlow with {len(made) or 1} CPU device(s); "
                   "start a new Python (restart the kernel), or name devices it has with --devices")  # fmt: skip
    print(
        f"{len(gpus)} GPU(s): {n} simulated CPU devices, which share this process's threads and cores: they show "
        "the method at work and check it, not a speed that GPUs would get"
    )
    return [d.name for d in tf.config.list_logical_devices("CPU")][:n]


def simulated(devices):
    """Are these logical CPU devices of one process (no speed to measure)?"""
    return all("CPU" in d.upper() for d in devices)


def write_json(path, value):
    """`value` as JSON, every NaN and infinity written as null (JSON has no such numbers)."""
    if path:
        Path(path).write_text(json.dumps(json_ready(value)))


def json_ready(value):
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    return None if isinstance(value, float) and not np.isfinite(value) else value


def input_problem(model):
    """Why `model` would not see the pixels load_data gives (float32 in [0, 1]), or None: an input of whole numbers
    (they would be cast to 0 or 1), or a Rescaling that divides them again (to [0, 0.004]); both train, wrongly."""
    if kept := [i.dtype for i in getattr(model, "inputs", None) or [] if not keras.backend.is_float_dtype(i.dtype)]:
        return (f"the model's input is {kept[0]}, and these programs feed float32 pixels in [0, 1] (whole numbers "
                "divided by 255): give keras.Input(shape) without a dtype, and no Rescaling(1 / 255)")  # fmt: skip
    for layer in [x for x in all_layers(model) if isinstance(x, keras.layers.Rescaling)]:
        if np.all(np.abs(np.asarray(layer.scale, np.float64)) < 0.01):  # 1 / 255, 1 / 127.5: pixels already divided
            return (f"these programs feed pixels already in [0, 1], and the model's Rescaling(scale="
                    f"{np.max(layer.scale):.3g}) divides them again: drop it")  # fmt: skip
    return None


def output_problem(model, x):
    """Why `model`'s outputs are not one logit per class for images like x, or None: the programs take LOGITS
    (no softmax at the end), as the method's loss does; a model that ends in softmax would train far worse. Its
    input first (input_problem)."""
    if problem := input_problem(model):
        return problem
    try:
        out = np.asarray(model(x[:4], training=False), np.float64)
    except (TypeError, ValueError, tf.errors.OpError) as err:  # another input shape, or several inputs
        said = " ".join(str(err).split())[:300]
        return (f"the model cannot take a batch of these images, shape (4, {', '.join(map(str, x.shape[1:]))}): "
                f"{type(err).__name__}: {said}; build it for one input of that shape, or feed your data")  # fmt: skip
    if out.ndim != 2 or out.shape[1] != 10:
        return f"the model returns shape {out.shape} for 4 images; return (batch, 10): one logit per class"
    if np.all(out >= 0) and np.allclose(out.sum(axis=1), 1, atol=1e-3):
        return (
            "the model's outputs are probabilities (each row sums to 1: a softmax at the end); these programs "
            "take LOGITS: drop the final softmax (activation=None in the last Dense)"
        )
    return None


def all_layers(layer):
    """Every layer inside `layer`, at any depth, once each: those Keras tracks in its attributes (and in lists and
    dicts of them), so a custom layer's own sublayers too, which model.layers does not list."""
    found, todo = {}, [layer]
    while todo:
        for value in vars(todo.pop()).values():
            items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else [value]
            for item in items:
                if isinstance(item, keras.Layer) and id(item) not in found:
                    found[id(item)] = item
                    todo.append(item)
    return list(found.values())


def sync_bn_problem(model):
    """Why data_parallel.replicated_forward cannot synchronize `model`'s batch norm, or None. It walks a
    keras.Sequential layer by layer (its Sequential blocks too) and normalizes the last axis; a trainable
    BatchNormalization anywhere else (in a functional block, inside a custom layer) would keep each device's own
    statistics without a word."""
    reached, todo = set(), [model] if isinstance(model, keras.Sequential) else []
    while todo:
        for layer in todo.pop().layers:
            reached.add(id(layer))
            todo += [layer] if isinstance(layer, keras.Sequential) else []
    for bn in [x for x in all_layers(model) if isinstance(x, keras.layers.BatchNormalization) and x.trainable]:
        if id(bn) not in reached:
            return (
                f"synchronized batch norm walks a keras.Sequential layer by layer, and the model's {bn.name} is "
                "not one of its layers (it sits in a functional model or inside a custom layer)"
            )
        if bn.axis not in (-1, len(bn.input.shape) - 1) or bn.renorm:
            return f"synchronized batch norm normalizes the last axis without renorm; {bn.name} has axis {bn.axis}"
    return None


def random_layers(model):
    """The layers that draw random numbers in training (Dropout, GaussianNoise, RandomRotation...): those that
    hold a keras.random.SeedGenerator."""
    return [x for x in all_layers(model) if any(isinstance(v, keras.random.SeedGenerator) for v in vars(x).values())]


def stopped_by_a_device(train, timeout):
    """train(), or exit 3 saying so when an all-reduce waited longer than `timeout` seconds for a device."""
    try:
        return train()
    except tf.errors.DeadlineExceededError as err:
        last = str(err).strip().splitlines()[-1][:200]
        refuse(
            f"an all-reduce waited more than --timeout {timeout:g} s for every device's part: a device failed or "
            f"hangs ({last}); the run stopped instead of waiting",
            code=3,
        )
