"""Train a CNN on MNIST on N GPUs without Estimator or fit: one file to copy.

Notebook 03's and 04's functions (below their `# lesson:` lines). One Keras replica per device, each
starting from the first one's weights (the broadcast); each computes the gradients of its share of the
batch; tensorpack's `allreduce_grads`, in TF 2, sums them over NCCL (over a ring of copies where NCCL
cannot run: CPUs, logical GPUs of one card); one Adam per replica applies the same sum on its device,
so that the replicas stay equal. Batch norm is synchronized (every BatchNormalization layer normalizes with
the statistics of the whole global batch, one all-reduce per layer) where each device's share is small,
local where it is large (--bn). Made for speed (make_train_step): each replica's share prefetched to its
device by tf.data, the gradients summed in buckets, the loss read every few steps, optional 16-bit.

    python train_multi_gpu.py [--devices /GPU:0,/GPU:1] [--epochs 3] [--batch 256]
    python train_multi_gpu.py --strategy mirrored     # the same under tf.distribute.MirroredStrategy
    python train_multi_gpu.py --all-reduce ring       # another all-reduce than NCCL (or central)
    python train_multi_gpu.py --check --steps 20      # the same weights as one device?
    python train_multi_gpu.py --precision bfloat16 --bn sync --bucket-mb 1 --checkpoint ckpt --baseline
    python train_multi_gpu.py --bn local --jit --breakdown            # XLA per replica; where a step's time goes
    python train_multi_gpu.py --batch 512 --scale-lr linear --warmup 100    # the learning rate of a grown batch
"""

import argparse
import contextlib
import importlib.util
import itertools
import json
import sys
import time
import weakref
import zipfile
import zlib
from pathlib import Path
from types import SimpleNamespace

import keras
import numpy as np
import tensorflow as tf


# lesson: 03_nccl_allreduce
def central_all_reduce(tensors, devices):
    """Sum of one tensor per device, on every device, through the first: it receives N-1 tensors and sends N-1."""
    with tf.name_scope("central_all_reduce"):  # a timeline shows the ops of this scope as communication
        with tf.device(devices[0]):
            total = tf.add_n(tensors)
        results = []
        for d in devices:
            with tf.device(d):
                results.append(tf.identity(total))
        return results


# lesson: 03_nccl_allreduce
def ring_schedule(n):
    """Every chunk move of a ring all-reduce on n devices, in order: (phase, step, source, destination, chunk)."""
    moves = []
    for s in range(n - 1):  # reduce-scatter: device i passes its running sum of chunk (i - s - 1) on
        moves += [("reduce-scatter", s, i, (i + 1) % n, (i - s - 1) % n) for i in range(n)]
    for s in range(n - 1):  # all-gather: device i passes the finished chunk (i - s) on
        moves += [("all-gather", s, i, (i + 1) % n, (i - s) % n) for i in range(n)]
    return moves


# lesson: 03_nccl_allreduce
def reduce_scatter(tensors, devices, stats=None):
    """One 1-D tensor per device in; device i ends with the sum of chunk i (returned on devices[i])."""
    n, size = len(tensors), tensors[0].shape[0]
    sizes = [size // n + (1 if c < size % n else 0) for c in range(n)]  # n chunks, as equal as possible
    chunks = []  # chunks[i][c]: device i's running sum of chunk c
    for t, d in zip(tensors, devices, strict=True):
        with tf.device(d):
            chunks.append(tf.split(t, sizes))
    moves = [move for move in ring_schedule(n) if move[0] == "reduce-scatter"]
    sent = [0] * n
    for _, _, src, dst, c in moves:  # in one step a device receives another chunk than the one it sends
        with tf.device(devices[dst]):  # the receiver adds
            chunks[dst][c] = chunks[dst][c] + chunks[src][c]
        sent[src] += sizes[c] * tensors[0].dtype.size
    if stats is not None:
        stats.update(bytes_sent=sent, sends=moves)
    return [chunks[i][i] for i in range(n)]


# lesson: 03_nccl_allreduce
def all_gather(chunks, devices, stats=None):
    """Chunk i on devices[i] in; every device ends with all the chunks, concatenated (1-D)."""
    n = len(chunks)
    held = [[None] * n for _ in range(n)]  # held[i][c]: device i's copy of chunk c
    for i in range(n):
        held[i][i] = chunks[i]
    moves = [move for move in ring_schedule(n) if move[0] == "all-gather"]
    sent = [0] * n
    for _, _, src, dst, c in moves:
        with tf.device(devices[dst]):
            held[dst][c] = tf.identity(held[src][c])  # a copy, received from the left-hand neighbour
        sent[src] += chunks[c].shape.num_elements() * chunks[c].dtype.size
    if stats is not None:
        stats.update(bytes_sent=sent, sends=moves)
    results = []
    for row, d in zip(held, devices, strict=True):
        with tf.device(d):
            results.append(tf.concat(row, 0))
    return results


# lesson: 03_nccl_allreduce
def ring_all_reduce(tensors, devices, stats=None):
    """Sum of one tensor per device, on every device: reduce-scatter, then all-gather, of the flattened tensors."""
    with tf.name_scope("ring_all_reduce"):  # a timeline shows the ops of this scope as communication
        flat = []
        for t, d in zip(tensors, devices, strict=True):
            with tf.device(d):
                flat.append(tf.reshape(t, [-1]))
        halves = ({}, {})
        summed = all_gather(reduce_scatter(flat, devices, halves[0]), devices, halves[1])
        if stats is not None:
            sent = [a + b for a, b in zip(halves[0]["bytes_sent"], halves[1]["bytes_sent"], strict=True)]
            stats.update(bytes_sent=sent, sends=halves[0]["sends"] + halves[1]["sends"])
        results = []
        for s, d in zip(summed, devices, strict=True):
            with tf.device(d):
                results.append(tf.reshape(s, tensors[0].shape))
        return results


# lesson: 03_nccl_allreduce
nccl_names = itertools.count()


# lesson: 03_nccl_allreduce
def nccl_all_sum(tensors, devices):
    """NCCL all-reduce: one tf.raw_ops.NcclAllReduce per GPU, all in one graph."""
    name = f"nccl_{next(nccl_names)}"  # the ops of one all-reduce find each other by this name

    def build():
        summed = []
        for t, d in zip(tensors, devices, strict=True):
            with tf.device(d), tf.name_scope("nccl_all_reduce"):
                summed.append(
                    tf.raw_ops.NcclAllReduce(input=t, reduction="sum", num_devices=len(tensors), shared_name=name)
                )
        return summed

    # Run eagerly, each op would wait for peers that eager mode never starts: build them in one graph.
    return tf.function(build)() if tf.executing_eagerly() else build()


# lesson: 03_nccl_allreduce
ALL_SUMS = {"central": central_all_reduce, "ring": ring_all_reduce, "nccl": nccl_all_sum}


# lesson: 03_nccl_allreduce
def allreduce_grads(all_grads, average=True, method="ring", devices=None):
    """K towers x N gradients in, K x N out: each gradient replaced by its sum (or mean) over the
    towers, on its tower's device (`devices`, or the device of each tower's first gradient)."""
    k = len(all_grads)
    devices = devices or [grads[0].device for grads in all_grads]
    new_all_grads = []  # N x K
    for grads in zip(*all_grads, strict=True):  # one variable's gradient from every tower
        if grads[0] is None:  # a variable that the loss does not use
            new_all_grads.append([None] * k)
            continue
        summed = ALL_SUMS[method](list(grads), devices)
        reduced = []
        for g, d in zip(summed, devices, strict=True):
            with tf.device(d):  # average on the device that will use it
                reduced.append(g / k if average else g)
        new_all_grads.append(reduced)
    return [list(tower) for tower in zip(*new_all_grads, strict=True)]  # transpose back to K x N


# lesson: 03_nccl_allreduce
def make_replicas(make_model, devices):
    """One model per device, made under its device (every variable, Keras' dropout seed state too, is created
    there), all with the first one's initial weights (the broadcast). Keras' seed state is not copied: each
    replica draws its own dropout masks, as each GPU's share of the batch should."""
    replicas = []
    for device in devices:
        with tf.device(device):
            replicas.append(make_model())
    for replica in replicas[1:]:
        weights = getattr(replica, "weights", replica.variables)  # a Keras model's weights leave out seed states
        for v, first in zip(weights, getattr(replicas[0], "weights", replicas[0].variables), strict=True):
            v.assign(first)
    return replicas


# lesson: 03_nccl_allreduce
def replica_optimizers(replicas, devices, make_optimizer):
    """One optimizer per replica, made and built under the replica's device: its step counter, its learning
    rate and its slots (Adam's m and v) live beside the replica's weights, not on the default device."""
    optimizers = []
    for replica, device in zip(replicas, devices, strict=True):
        with tf.device(device):
            optimizer = make_optimizer()
            optimizer.build(replica.trainable_variables)
        optimizers.append(optimizer)
    return optimizers


# lesson: 03_nccl_allreduce
def mirrored_train_step(strategy, model, optimizer):
    """A tf.function of a distributed batch (x, y) under `strategy`: one training step, the batch's loss back.

    Each replica divides its summed loss by the examples the whole batch holds (a short last batch
    holds fewer), and its regularization losses by the number of replicas: the replicas' gradients
    are summed inside apply_gradients, so the sum is the gradient of the batch's loss."""

    @tf.function
    def step(dist_x, dist_y):
        def replica_step(x, y):
            context = tf.distribute.get_replica_context()
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
                examples = context.all_reduce("SUM", tf.cast(tf.shape(y)[0], per_example.dtype))  # every replica's
                loss = tf.reduce_sum(per_example) / examples + sum(model.losses) / context.num_replicas_in_sync
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        losses = strategy.run(replica_step, args=(dist_x, dist_y))
        return strategy.reduce("SUM", losses, axis=None)

    return step


# lesson: 04_sync_batchnorm
def local_moments(x):
    """One device's row [count, mean (C), M2 (C)] over all axes but the last, in float64."""
    x64 = tf.cast(tf.reshape(x, [-1, x.shape[-1]]), tf.float64)
    count = tf.cast(tf.shape(x64)[0], tf.float64)
    mean = tf.math.divide_no_nan(tf.reduce_sum(x64, 0), count)  # 0, not NaN, for an empty batch
    m2 = tf.reduce_sum(tf.square(x64 - mean), 0)  # centred around this device's own mean
    return tf.concat([[count], mean, m2], 0)


# lesson: 04_sync_batchnorm
def combine_moments(rows):
    """Chan et al.: M2 = sum M2_i + sum n_i (mean_i - mean)^2. Returns (count, mean, variance)."""
    c = (rows.shape[-1] - 1) // 2
    counts, means, m2s = rows[:, :1], rows[:, 1 : 1 + c], rows[:, 1 + c :]
    count = tf.reduce_sum(counts)
    mean = tf.reduce_sum(counts * means, 0) / count
    m2 = tf.reduce_sum(m2s, 0) + tf.reduce_sum(counts * tf.square(means - mean), 0)
    return count, mean, m2 / count


# lesson: 04_sync_batchnorm
def sync_batch_norm(layers, devices, hs, all_sum):
    """Keras BatchNormalization layers, one per replica, applied in training with the statistics of the
    global batch: every device's local_moments row, in its own slot of a matrix of zeros, summed by ONE
    all-reduce (`all_sum`, e.g. ALL_SUMS["nccl"]), then merged on each device. Each replica's moving
    statistics move as Keras moves them, so the replicas keep equal ones."""
    if layers[0].axis not in (-1, len(hs[0].shape) - 1) or layers[0].renorm:  # what local_moments assumes
        raise ValueError(f"{layers[0].name}: sync_batch_norm normalizes the last axis, without renorm; "
                         "build it as BatchNormalization(axis=-1, renorm=False).")  # fmt: skip
    n = len(hs)
    slots = []
    for i, (h, device) in enumerate(zip(hs, devices, strict=True)):
        with tf.device(device):
            slots.append(tf.pad(local_moments(h)[None], [[i, n - 1 - i], [0, 0]]))
    out = []
    for layer, h, device, rows in zip(layers, hs, devices, all_sum(slots, devices), strict=True):
        with tf.device(device):
            compute = tf.float64 if h.dtype == tf.float64 else tf.float32  # as Keras: 16-bit inputs in float32
            _, mean, variance = (tf.cast(t, compute) for t in combine_moments(rows))
            for moving, batch in ((layer.moving_mean, mean), (layer.moving_variance, variance)):
                moving.assign(tf.cast(moving, compute) * layer.momentum + batch * (1 - layer.momentum))
            gamma, beta = (None if v is None else tf.cast(v, compute) for v in (layer.gamma, layer.beta))
            y = tf.nn.batch_normalization(tf.cast(h, compute), mean, variance, beta, gamma, layer.epsilon)
            out.append(tf.cast(y, h.dtype))
    return out


# lesson: 04_sync_batchnorm
def holds_batch_norm(model):
    """Does a model hold a BatchNormalization among its layers, at any depth?"""
    inner = getattr(model, "layers", [])
    return any(isinstance(layer, keras.layers.BatchNormalization) or holds_batch_norm(layer) for layer in inner)


# lesson: 04_sync_batchnorm
def replicated_forward(replicas, devices, xs, all_sum):
    """Each Sequential replica's training forward on its share xs[i], layer by layer: the replicas'
    BatchNormalization layers by sync_batch_norm, every other layer as Keras runs it."""
    if not isinstance(replicas[0], keras.Sequential):  # a functional model's layers in order are not its graph
        raise TypeError(f"replicated_forward walks a keras.Sequential model layer by layer, got a "
                        f"{type(replicas[0]).__name__}: build the model as keras.Sequential([...]).")  # fmt: skip
    hs = list(xs)
    for layers in zip(*(replica.layers for replica in replicas), strict=True):
        first = layers[0]
        if isinstance(first, keras.Sequential):  # a block of layers: walked in turn, its BN synchronized too
            hs = replicated_forward(layers, devices, hs, all_sum)
        elif isinstance(first, keras.layers.BatchNormalization) and first.trainable:
            hs = sync_batch_norm(layers, devices, hs, all_sum)
        elif holds_batch_norm(first):  # inside another kind of model, it would stay per-device: refuse
            raise TypeError(f"{first.name} ({type(first).__name__}) holds a BatchNormalization that replicated_"
                            "forward cannot reach: build that block as keras.Sequential([...]).")  # fmt: skip
        else:  # a frozen BatchNormalization (trainable=False) too: Keras then uses its moving statistics
            for i, (layer, device) in enumerate(zip(layers, devices, strict=True)):
                with tf.device(device):
                    hs[i] = layer(hs[i], training=True)
    return hs


# lesson: 04_sync_batchnorm
def make_sync_bn_train_step(replicas, devices, optimizers, method="ring"):
    """A tf.function of (x, y): the batch split over the replicas, one forward with synchronized batch norm,
    the gradient of the batch's mean loss by each replica's weights, summed over the replicas by
    allreduce_grads, and each replica's own optimizer applied on its device. Returns the batch's loss.

    Why a sum: the statistics mix every replica's examples, so the loss depends on every replica's copy of
    a weight, and its gradient by the (shared) weight is the sum of its gradients by the copies.

    Why tf.gradients, not a GradientTape: it builds each gradient op beside the forward op it differentiates,
    so every replica's backward pass runs on the replica's device, and NCCL's registered gradient (another
    all-reduce) gets the real op. A tape builds the whole backward pass under the device scope of its
    gradient() call, here none (device 0), and hands that gradient a stand-in op without a device."""
    n, k = len(devices), len(replicas[0].trainable_variables)

    @tf.function
    def step(x, y):
        logits = replicated_forward(replicas, devices, tf.split(x, n), ALL_SUMS[method])
        parts = []
        for device, replica, lg, ys in zip(devices, replicas, logits, tf.split(y, n), strict=True):
            with tf.device(device):
                per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=ys, logits=lg)
                examples = tf.cast(tf.shape(y)[0], per_example.dtype)
                parts.append(tf.reduce_sum(per_example) / examples + sum(replica.losses) / n)  # regularizers once
        loss = tf.add_n(parts)
        weights = [v.value for replica in replicas for v in replica.trainable_variables]  # Keras' tf.Variables
        flat = tf.gradients(loss, weights)  # ONE backward pass over every replica
        grads = [flat[i * k : (i + 1) * k] for i in range(n)]  # K replicas x N gradients
        grads = allreduce_grads(grads, average=False, method=method, devices=devices)
        for device, replica, optimizer, g in zip(devices, replicas, optimizers, grads, strict=True):
            with tf.device(device):
                optimizer.apply_gradients(zip(g, replica.trainable_variables, strict=True))
        return loss

    return step


def make_cnn(input_shape, synchronized=False):
    """The CNN: two 3x3 convolutions, each with batch norm, ReLU and 2x2 pooling, then a dense layer to the
    10 classes' logits. `synchronized=True`: Keras' own sync BN, for MirroredStrategy."""
    block = lambda filters: [  # noqa: E731
        keras.layers.Conv2D(filters, 3, padding="same", use_bias=False),  # BN's beta is the bias
        keras.layers.BatchNormalization(momentum=0.9, synchronized=synchronized),  # Keras: 0.99, slow for short runs
        keras.layers.ReLU(),
        keras.layers.MaxPooling2D(2),
    ]
    head = "float32" if keras.config.dtype_policy().name.startswith("mixed") else None  # 16-bit: float32 logits
    return keras.Sequential([keras.Input(input_shape), *block(32), *block(64), keras.layers.Flatten(),
                             keras.layers.Dense(10, dtype=head)])  # fmt: skip


MNIST_CACHE = Path.home() / ".keras/datasets/mnist.npz"


def digits_file():
    """The 8x8 digits' CSV: the course's copy in tutorial_lib/, else scikit-learn's (found, not imported)."""
    sklearn = importlib.util.find_spec("sklearn")
    folders = [Path(__file__).resolve().parents[1] / "tutorial_lib"]
    folders += [Path(sklearn.submodule_search_locations[0], "datasets", "data")] if sklearn else []
    return next((f / "digits.csv.gz" for f in folders if (f / "digits.csv.gz").is_file()), None)


def refuse(message):
    """Exit 2 with `message`, as argparse refuses an argument: for what only the data or the machine tells."""
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def read_npz(path):
    """The two splits of an mnist.npz, or exit 2 saying what the file is not."""
    try:
        with np.load(path) as f:
            if missing := [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in f.files]:
                refuse(f"--data {path}: no {', '.join(missing)}; an mnist.npz holds x_train, y_train, x_test, y_test")
            return [(f[f"x_{s}"], f[f"y_{s}"]) for s in ("train", "test")]
    except (AttributeError, EOFError, OSError, TypeError, ValueError, zipfile.BadZipFile, zlib.error) as err:
        refuse(f"--data {path}: not a readable .npz ({type(err).__name__}: {err}); give Keras' mnist.npz or digits")


def data_problem(name, x, y, smallest):
    """What is wrong with one split's images x (N, H, W) and labels y (N,) of 0 to 9; None if nothing."""
    if not (np.issubdtype(x.dtype, np.number) and np.issubdtype(y.dtype, np.number)):
        return f"{name}: images and labels must be numbers, got {x.dtype} and {y.dtype}"
    if x.ndim not in (3, 4) or min(x.shape[1:3], default=0) < smallest or x.ndim == 4 and x.shape[3] not in (1, 3):
        return (
            f"x_{name} has shape {x.shape}: give images (N, height, width), or (N, height, width, 3) in colour, "
            f"at least {smallest}x{smallest}"
        )
    if y.shape != x.shape[:1] or not len(y):
        return f"y_{name} has shape {y.shape}: give one label per image, shape ({len(x)},) (y.ravel()), none empty"
    if not np.isfinite(x).all():
        return f"x_{name}: {np.size(x) - np.isfinite(x).sum()} pixels are not finite (NaN or inf); fix or drop them"
    if not np.all((y >= 0) & (y <= 9) & (y == np.round(y))):
        return f"y_{name}: labels must be the whole numbers 0 to 9, got {y.min()} to {y.max()}"
    return None


def load_data(path):
    """((x_train, y_train), (x_test, y_test)) from an mnist.npz (default: Keras' cache, if there) or a CIFAR-10 .npz,
    else the 8x8 digits (`digits_file`); images (N, H, W, 1 or 3) in [0, 1]. Exit 2 on data the CNN cannot take."""
    path = path or (MNIST_CACHE if MNIST_CACHE.exists() else "digits")
    print(
        f"data: {path}"
        if path != "digits"
        else "data: 8x8 digits, THE BUNDLED STAND-IN: 1,497 training images "
        "(no MNIST in the Keras cache, and nothing downloads): give --data mnist.npz or a CIFAR-10 .npz to measure"
    )
    if path != "digits":
        splits, scale = read_npz(path), 255.0
    else:
        table = np.loadtxt(digits_file(), delimiter=",")
        order = np.random.default_rng(0).permutation(len(table))
        splits, scale = [(table[i, :64].reshape(-1, 8, 8), table[i, 64]) for i in (order[300:], order[:300])], 16.0
    for name, (x, y) in zip(("train", "test"), splits, strict=True):
        if problem := data_problem(name, x, y, smallest=4):  # the CNN pools twice by 2
            refuse(f"--data {path}: {problem}")
    sizes = [(*x.shape[1:3], x.shape[3] if x.ndim == 4 else 1) for x, _ in splits]
    if sizes[0] != sizes[1]:  # the CNN is built for the training images: the test images would fail it at epoch end
        refuse(f"--data {path}: x_train holds {'x'.join(map(str, sizes[0]))} images (height x width x channels) "
               f"and x_test {'x'.join(map(str, sizes[1]))}; give both splits images of one size")  # fmt: skip
    return [
        ((x.reshape(*x.shape[:3], -1) / scale).astype(keras.config.floatx()), y.astype(np.int32)) for x, y in splits
    ]


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


def choose_devices(args):
    """--devices (exit 2 if this machine lacks one); else every GPU if there are 2 or more; else --simulate N
    (default 2) logical CPUs, said so."""
    gpus, cpu = tf.config.list_physical_devices("GPU"), tf.config.list_physical_devices("CPU")[0]
    if args.devices:
        devices = [d.strip() for d in args.devices.split(",")]
        if unknown := unknown_devices(devices):
            names = ", ".join(d.name for d in tf.config.list_logical_devices())
            refuse(f"--devices: no device {', '.join(map(repr, unknown))} here, or named twice; this machine has "
                   f"{names}. Name some of those once each, or give --simulate N for N logical CPUs")  # fmt: skip
        return devices
    if len(gpus) >= 2 and not args.simulate:
        return [f"/GPU:{i}" for i in range(len(gpus))]
    n = args.simulate or 2
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    print(f"{len(gpus)} GPU(s): {n} simulated CPU devices, which share this process's threads: the speed "
          "figures show the method at work, not a speedup that GPUs would get")  # fmt: skip
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def all_reduce_method(devices, choice="auto"):
    """(method, what to print) for --all-reduce: "auto" is NCCL where it runs, on GPUs that are distinct cards
    (not logical GPUs carved from one), else the ring; "nccl" is refused elsewhere (exit 2, saying why)."""
    gpus = [d for d in devices if "GPU" in d.upper()]
    whole_cards = len(tf.config.list_logical_devices("GPU")) == len(tf.config.list_physical_devices("GPU"))
    nccl_runs = len(gpus) == len(devices) and whole_cards
    if choice == "nccl" and not nccl_runs:
        refuse("--all-reduce nccl: NCCL runs on distinct GPUs only, not on these devices; give --all-reduce ring")
    if choice in ("nccl", "ring", "central"):
        return choice, {"nccl": "NCCL", "ring": "a ring of copies", "central": "through the first device"}[choice]
    if nccl_runs:
        return "nccl", "NCCL"
    return "ring", "a ring of copies (NCCL runs on distinct GPUs only, not on these devices)"


def forward(replicas, devices, xs, all_sum, local):
    """replicated_forward (notebook 04) for make_cnn's Sequential replicas, with float32 statistics (sync_bn32),
    or `local` batch norm: each replica normalizes with its own examples' statistics and moves its own moving
    statistics (as Keras under MirroredStrategy; evaluation and checkpoints use replica 0's): nothing crosses."""
    hs = list(xs)
    for layers in zip(*(replica.layers for replica in replicas), strict=True):
        if isinstance(layers[0], keras.Sequential):
            hs = forward(layers, devices, hs, all_sum, local)
        elif isinstance(layers[0], keras.layers.BatchNormalization) and layers[0].trainable and not local:
            hs = sync_bn32(layers, devices, hs, all_sum)
        else:
            for i, (layer, device) in enumerate(zip(layers, devices, strict=True)):
                with tf.device(device):
                    hs[i] = layer(hs[i], training=True)
    return hs


def sync_bn32(layers, devices, hs, all_sum):
    """sync_batch_norm (notebook 04) with local_moments' row in float32, not float64 (which runs at a fraction of
    float32's speed on most GPUs); in float64 for float64 inputs, as --check runs."""
    n, slots = len(hs), []
    for i, (h, device) in enumerate(zip(hs, devices, strict=True)):
        with tf.device(device):
            x = tf.cast(tf.reshape(h, [-1, h.shape[-1]]), tf.float64 if h.dtype == tf.float64 else tf.float32)
            count = tf.cast(tf.shape(x)[0], x.dtype)
            mean = tf.math.divide_no_nan(tf.reduce_sum(x, 0), count)
            row = tf.concat([[count], mean, tf.reduce_sum(tf.square(x - mean), 0)], 0)
            slots.append(tf.pad(row[None], [[i, n - 1 - i], [0, 0]]))
    out = []
    for layer, h, device, rows in zip(layers, hs, devices, all_sum(slots, devices), strict=True):
        with tf.device(device):
            _, mean, variance = combine_moments(rows)
            for moving, batch in ((layer.moving_mean, mean), (layer.moving_variance, variance)):
                moving.assign(tf.cast(tf.cast(moving, mean.dtype) * layer.momentum + batch * (1 - layer.momentum),
                                      moving.dtype))  # fmt: skip
            gamma, beta = (None if v is None else tf.cast(v, mean.dtype) for v in (layer.gamma, layer.beta))
            y = tf.nn.batch_normalization(tf.cast(h, mean.dtype), mean, variance, beta, gamma, layer.epsilon)
            out.append(tf.cast(y, h.dtype))
    return out


def bucket_plan(tensors, bucket_bytes):
    """The indices of `tensors` in buckets of at most `bucket_bytes` (a larger tensor alone), one dtype each, from
    the LAST tensor: backprop yields the last layers' gradients first, so the first buckets can be summed while
    the earlier layers' gradients are computed (Horovod's tensor fusion, PyTorch DDP's buckets)."""
    plan, size = [], 0
    for j in reversed(range(len(tensors))):
        nbytes = int(np.prod(tensors[j].shape)) * tf.as_dtype(tensors[j].dtype).size
        if plan and size + nbytes <= bucket_bytes and tensors[j].dtype == tensors[plan[-1][0]].dtype:
            plan[-1].append(j)
            size += nbytes
        else:
            plan.append([j])
            size = nbytes
    return plan


def all_reduce_buckets(grads, devices, method, bucket_bytes):
    """allreduce_grads (notebook 03), summed, with each replica's gradients packed into the buckets of bucket_plan:
    one all-reduce per bucket, not one per variable. bucket_bytes 0: one per variable, the lesson's form."""
    if not bucket_bytes:
        return allreduce_grads(grads, average=False, method=method, devices=devices)
    plan, packed = bucket_plan(grads[0], bucket_bytes), []
    for g, device in zip(grads, devices, strict=True):
        with tf.device(device):
            packed.append([tf.concat([tf.reshape(g[j], [-1]) for j in bucket], 0) for bucket in plan])
    out = []
    for g, device, summed in zip(
        grads, devices, allreduce_grads(packed, average=False, method=method, devices=devices), strict=True
    ):
        unpacked = [None] * len(g)
        with tf.device(device):
            for bucket, vector in zip(plan, summed, strict=True):
                for j, piece in zip(bucket, tf.split(vector, [g[j].shape.num_elements() for j in bucket]), strict=True):
                    unpacked[j] = tf.reshape(piece, g[j].shape)
        out.append(unpacked)
    return out


def make_train_step(replicas, devices, optimizers, method="ring", local_bn=False, bucket_bytes=0):
    """make_sync_bn_train_step (notebook 04), for speed: a tf.function of each replica's share of the batch (xs[i],
    ys[i], already on devices[i]); batch norm synchronized in float32, or local (`forward`); the gradients summed in
    buckets (`all_reduce_buckets`); each replica's part of the loss scaled by its optimizer (by Keras'
    LossScaleOptimizer for float16, by 1 otherwise). Still tf.gradients, for the lesson's reasons."""
    n, k = len(devices), len(replicas[0].trainable_variables)

    @tf.function
    def step(xs, ys):
        logits = forward(replicas, devices, xs, ALL_SUMS[method], local_bn)
        parts, scaled = [], []
        for device, replica, optimizer, lg, y in zip(devices, replicas, optimizers, logits, ys, strict=True):
            with tf.device(device):
                per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=lg)
                examples = tf.cast(n * tf.shape(y)[0], per_example.dtype)  # every share holds as many
                parts.append(tf.reduce_sum(per_example) / examples + sum(replica.losses) / n)
                scaled.append(optimizer.scale_loss(parts[-1]))
        weights = [v.value for replica in replicas for v in replica.trainable_variables]
        flat = tf.gradients(tf.add_n(scaled), weights)
        grads = all_reduce_buckets([flat[i * k : (i + 1) * k] for i in range(n)], devices, method, bucket_bytes)
        apply_each(devices, replicas, optimizers, grads)
        return tf.add_n(parts)

    return step


def apply_each(devices, replicas, optimizers, grads):
    """Each replica's optimizer applies its (all-reduced) gradients on the replica's device."""
    for device, replica, optimizer, g in zip(devices, replicas, optimizers, grads, strict=True):
        with tf.device(device):
            optimizer.apply_gradients(zip(g, replica.trainable_variables, strict=True))


def compiled_share(model, optimizer, replicas):
    """--jit: a function of one replica's share (x, y) and the global batch's example count that returns the share's
    part of the loss and the gradients of that part (scaled by `optimizer`: LossScaleOptimizer for float16), compiled
    by XLA into ONE call on the device it is called under. Nothing crosses devices inside: batch norm must be local."""

    @tf.function(jit_compile=True)
    def compute(x, y, examples):
        with tf.GradientTape() as tape:  # the whole call runs on one device: a tape's placement is right here
            logits = model(x, training=True)
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            part = tf.reduce_sum(per_example) / tf.cast(examples, per_example.dtype) + sum(model.losses) / replicas
            scaled = optimizer.scale_loss(part)
        return part, tape.gradient(scaled, model.trainable_variables)

    return compute


def make_jit_train_step(replicas, devices, optimizers, method="ring", bucket_bytes=0):
    """make_train_step with local batch norm and each replica's forward and backward compiled by XLA (`compiled_share`,
    one call per replica on its device); the bucketed all-reduce and the update stay outside, run by TensorFlow."""
    n = len(devices)
    shares = [compiled_share(replica, optimizer, n) for replica, optimizer in zip(replicas, optimizers, strict=True)]

    @tf.function
    def step(xs, ys):
        parts, grads = [], []
        for device, share, x, y in zip(devices, shares, xs, ys, strict=True):
            with tf.device(device):
                part, g = share(x, y, n * tf.shape(y)[0])  # every share holds as many examples
            parts.append(part)
            grads.append(g)
        apply_each(devices, replicas, optimizers, all_reduce_buckets(grads, devices, method, bucket_bytes))
        return tf.add_n(parts)

    return step


def mirrored_jit_step(strategy, model, optimizer):
    """mirrored_train_step (notebook 03) with each replica's forward and backward compiled by XLA (`compiled_share`);
    the example count's all-reduce, the gradients' (inside apply_gradients) and the update stay outside. (Where every
    device is a GPU, strategy.run can also compile a whole jit_compile replica step, its all-reduce as XLA's own
    collective: tensorflow/python/distribute/mirrored_run.py. This form runs on CPUs too.)"""
    share = compiled_share(model, optimizer, strategy.num_replicas_in_sync)

    @tf.function
    def step(dist_x, dist_y):
        def replica_step(x, y):
            examples = tf.distribute.get_replica_context().all_reduce("SUM", tf.cast(tf.shape(y)[0], tf.float32))
            loss, grads = share(x, y, examples)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        return strategy.reduce("SUM", strategy.run(replica_step, args=(dist_x, dist_y)), axis=None)

    return step


def order(examples, batch, seed):
    """The indices of the training set shuffled by `seed`, one row per full batch (the short last one dropped)."""
    return np.random.default_rng(seed).permutation(examples)[: examples // batch * batch].reshape(-1, batch)


def trainer(args, devices, input_shape):
    """What a run needs: step (of what inputs yields: returns the batch's loss), inputs(x, y, seed, skip) (an
    epoch's batches from the skip-th on, each replica's share prefetched to its device by tf.data), model (to
    evaluate), optimizer (saved with it), broadcast() (the saved replica's state onto every replica), variables."""
    adam = lambda: keras.optimizers.Adam(learning_rate(args))  # noqa: E731
    scaled = lambda: keras.optimizers.LossScaleOptimizer(adam())  # noqa: E731 (float16's small gradients underflow)
    make_optimizer, n = scaled if args.precision == "float16" else adam, len(devices)
    if args.strategy == "mirrored":
        reduce = tf.distribute.ReductionToOneDevice() if args.method == "central" else None  # None: TF's default
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=reduce)
        with strategy.scope():  # one copy of every variable per device, Adam's too
            model, optimizer = make_cnn(input_shape, synchronized=args.bn == "sync"), make_optimizer()
            optimizer.build(model.trainable_variables)

        def inputs(x, y, seed, skip=0):  # replica i gets the i-th n-th of each batch, as the replicated route
            rows = order(len(x), args.batch, seed)[skip:].ravel()
            return iter(strategy.experimental_distribute_dataset(
                tf.data.Dataset.from_tensor_slices((x[rows], y[rows])).batch(args.batch).prefetch(2)))  # fmt: skip

        copies = [strategy.experimental_local_results(v.value) for v in model.variables]  # one per device
        step = (mirrored_jit_step if args.jit else mirrored_train_step)(strategy, model, optimizer)
        return SimpleNamespace(step=step, inputs=inputs, model=model,
                               optimizer=optimizer, broadcast=lambda: None,  # a restore sets every copy
                               variables=[list(per_device) for per_device in zip(*copies, strict=True)])  # fmt: skip
    replicas = make_replicas(lambda: make_cnn(input_shape), devices)
    # One Adam per replica, each applied once a step to its replica's weights. ONE Adam applied to the
    # same weights once per tower (the asker's script) takes K steps a step and counts K in its moments.
    optimizers = replica_optimizers(replicas, devices, make_optimizer)
    bucket_bytes = int(args.bucket_mb * 2**20)
    if args.jit:
        step = make_jit_train_step(replicas, devices, optimizers, args.method, bucket_bytes)
    else:
        step = make_train_step(replicas, devices, optimizers, args.method, args.bn == "local", bucket_bytes)

    def inputs(x, y, seed, skip=0):
        shares, iterators = order(len(x), args.batch, seed)[skip:].reshape(-1, n, args.batch // n), []
        for i, device in enumerate(devices):  # one pipeline per device, its last stage a copy onto the device
            ds = tf.data.Dataset.from_tensor_slices((x[shares[:, i].ravel()], y[shares[:, i].ravel()]))
            iterators.append(iter(ds.batch(args.batch // n).apply(tf.data.experimental.prefetch_to_device(device, 2))))
        for pairs in zip(*iterators, strict=True):
            yield [x for x, _ in pairs], [y for _, y in pairs]

    def broadcast():
        first = [*replicas[0].weights, *optimizers[0].variables]
        for replica, optimizer in zip(replicas[1:], optimizers[1:], strict=True):
            for v, value in zip([*replica.weights, *optimizer.variables], first, strict=True):
                v.assign(value)

    return SimpleNamespace(step=step, inputs=inputs, model=replicas[0], optimizer=optimizers[0], broadcast=broadcast,
                           variables=[replica.variables for replica in replicas])  # fmt: skip


PREDICTORS = weakref.WeakKeyDictionary()  # one tf.function per model: a new one per call traces anew


def accuracy(model, x, y, batch=1000):
    """The share of x that `model` classifies right, in inference mode (BN's moving statistics)."""
    if model not in PREDICTORS:
        ref = weakref.ref(model)  # not the model itself: the dictionary would keep every model alive
        predict = lambda xs: tf.argmax(ref()(xs, training=False), -1, output_type=tf.int32)  # noqa: E731
        PREDICTORS[model] = tf.function(predict, autograph=False, reduce_retracing=True)
    predict = PREDICTORS[model]
    return float(np.mean(np.concatenate([predict(x[i : i + batch]).numpy() for i in range(0, len(x), batch)]) == y))


def batches(x, y, batch, seed):
    """The training set shuffled by `seed`, in full batches (the last, short one dropped: every device gets batch/N)."""
    return [(x[i], y[i]) for i in order(len(x), batch, seed)]


@contextlib.contextmanager
def precision(name):
    """Keras' floatx and dtype policy for the models built inside: "float64" (--check), "float32", or 16-bit
    ("bfloat16", "float16": Keras' mixed precision, float32 variables, 16-bit compute)."""
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64" if name == "float64" else "float32")
    keras.config.set_dtype_policy(f"mixed_{name}" if name in ("bfloat16", "float16") else name)
    try:
        yield
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)


def restore(args, run):
    """(a CheckpointManager of --checkpoint, the steps its latest checkpoint had done): replica 0 and its optimizer
    are saved; at a resume each replica gets them. (None, 0) without --checkpoint."""
    if not args.checkpoint:
        return None, 0
    done = tf.Variable(0, dtype=tf.int64)
    saved = tf.train.Checkpoint(model=run.model, optimizer=run.optimizer, steps=done)
    manager = tf.train.CheckpointManager(saved, args.checkpoint, max_to_keep=2)
    if manager.latest_checkpoint:
        try:
            saved.restore(manager.latest_checkpoint).assert_existing_objects_matched()
        except (AssertionError, ValueError, tf.errors.OpError) as err:  # another model, image size or optimizer
            refuse(f"--checkpoint {args.checkpoint}: {manager.latest_checkpoint} does not fit this run "
                   f"({type(err).__name__}: {str(err).splitlines()[0][:200]}); it was saved with another --precision, "
                   "--data image size, or with a --warmup schedule where this run has none: give those of the run "
                   "that saved it, or an empty folder")  # fmt: skip
        lr, saved_lr = learning_rate(args), float(run.optimizer.learning_rate)  # a schedule: at the restored step
        if isinstance(lr, float) and not np.isclose(saved_lr, lr):  # the checkpoint holds Adam's rate: --lr wins, said
            run.optimizer.learning_rate = lr
            scaled = f" scaled to {lr:g}" * (lr != args.lr)
            print(f"checkpoint: saved with learning rate {saved_lr:g}; training on with --lr {args.lr:g}{scaled}")
        run.broadcast()
        print(f"checkpoint: resumed from {manager.latest_checkpoint}, {int(done)} steps done")
    return manager, int(done)


def save(manager, done):
    if manager:
        manager.checkpoint.steps.assign(done)
        print(f"checkpoint: {manager.save(checkpoint_number=done)}")


def train(args, devices, data):
    """--epochs epochs (or --steps steps): the loss read every --log-every steps (reading it makes the host wait for
    the step), step 1 (which traces the step) left out of the timing; accuracy and images/s each epoch, a
    checkpoint each epoch with --checkpoint; the timing summary."""
    (x_train, y_train), (x_test, y_test) = data
    with precision(args.precision):
        run = trainer(args, devices, x_train.shape[1:])
    per_epoch = len(x_train) // args.batch
    manager, done = restore(args, run)
    total = min(args.steps or args.epochs * per_epoch, args.epochs * per_epoch)
    if done >= total:  # nothing to train, time or compare with --baseline
        refuse(
            f"--checkpoint {args.checkpoint}: its {done} steps already reach the {total} asked (--steps, or --epochs "
            f"{args.epochs} of {per_epoch} steps each); ask for more, or give an empty folder to start afresh"
        )
    writer = tf.summary.create_file_writer(args.logdir) if args.logdir else None
    print(f"{args.strategy}: {len(devices)} replicas of {args.batch // len(devices)} examples on {devices}; "
          f"all-reduce: {args.method_said}; precision {args.precision}" + "; XLA: each replica's forward and "
          "backward compiled (--jit)" * args.jit)  # fmt: skip
    metrics, profiling, traced, timed, seconds, waited = {}, False, False, 0, 0.0, 0.0
    for epoch in range(done // per_epoch, args.epochs):
        if done >= total:
            break
        steps, losses, pending = min(per_epoch - done % per_epoch, total - done), [], []
        print(f"epoch {epoch + 1}/{args.epochs}")
        feed, progress = run.inputs(x_train, y_train, seed=epoch, skip=done % per_epoch), keras.utils.Progbar(steps)
        start, epoch_timed = time.perf_counter(), 0
        for s in range(steps):
            profiling = profile(args, done + s, profiling)
            fetched = time.perf_counter()
            batch = next(feed)
            waited += (time.perf_counter() - fetched) if traced else 0.0
            pending.append(run.step(*batch))
            if not traced:  # tracing, and a first run that builds what it needs: not what a step costs
                traced = float(pending[-1]) or True
                print(f"  step {done + 1} traced the step and ran in {time.perf_counter() - start:.1f} s (not timed)")
                start, epoch_timed = time.perf_counter(), -1
            if len(pending) == args.log_every or s == steps - 1:
                losses += [float(loss) for loss in pending]  # waits for the last of them
                progress.update(s + 1, [("loss", np.mean(losses[-len(pending) :]))])
                pending = []
        epoch_seconds, epoch_timed, done = time.perf_counter() - start, epoch_timed + steps, done + steps
        timed, seconds = timed + epoch_timed, seconds + epoch_seconds
        metrics = {
            "loss": np.mean(losses),
            "train_accuracy": accuracy(run.model, x_train[:2000], y_train[:2000]),
            "test_accuracy": accuracy(run.model, x_test, y_test),
            "images_per_second": epoch_timed * args.batch / epoch_seconds if epoch_timed else np.nan,
        }
        print("  ".join(f"{name} {value:,.0f}" if "second" in name else f"{name} {value:.3f}"
                        for name, value in metrics.items()))  # fmt: skip
        if writer:
            with writer.as_default(step=epoch):
                for name, value in metrics.items():
                    tf.summary.scalar(name, value)
        save(manager, done)
    if profiling:  # fewer than 5 steps in all
        tf.profiler.experimental.stop()
    step_ms = 1000 * seconds / timed if timed else float("nan")
    print(f"timing: {timed} timed steps of {args.batch} images, {step_ms:.1f} ms a step "
          f"({args.batch / step_ms * 1000:,.0f} images/s); waiting for input {1000 * waited / max(timed, 1):.2f} ms "
          "a step. Compute and all-reduce overlap inside a step: --profile --logdir DIR shows them apart")  # fmt: skip
    return {**metrics, "steps": done, "step_ms": step_ms}


def profile(args, step, profiling):
    """--profile: a profiler trace of steps 3 to 5 (the first two also trace the step). Whether it now runs."""
    if args.profile and step == 2:
        tf.profiler.experimental.start(args.logdir)
        return True
    if profiling and step == 5:
        tf.profiler.experimental.stop()
        return False
    return profiling


def baseline(args, devices, data, metrics):
    """--baseline: the same number of steps on devices[0] alone, with one replica's share of the batch; the
    efficiency: N devices' images/s against N times one device's (1.0: perfect scaling) = t_one / t_N."""
    n, one = len(devices), argparse.Namespace(**vars(args))
    one.batch, one.steps, one.checkpoint, one.logdir, one.profile = args.batch // n, metrics["steps"], None, None, False
    print(f"baseline: the same {one.steps} steps on {devices[0]} alone, {one.batch} images a step")
    single = train(one, devices[:1], data)
    efficiency = single["step_ms"] / metrics["step_ms"]
    simulated = " (simulated devices share this machine's cores: expect about 1/N)" * ("CPU" in devices[0].upper())
    print(f"efficiency: {efficiency:.0%} of {n} x one device{simulated}")
    return {"baseline_step_ms": single["step_ms"], "efficiency": efficiency}


ALL_SUMS["none"] = lambda tensors, _devices: list(tensors)  # --breakdown's step without all-reduce: each keeps its own


def breakdown(args, devices, data, rounds=7, steps=5):
    """--breakdown: `rounds` rounds, each timing `steps` steps of four variants in turn (the order turned each round):
    the step fed by the input pipeline; the same step on one batch already on the devices ("no input"); that step
    with no all-reduce at all, of the gradients nor of BN's statistics ("no all-reduce": every replica keeps its own);
    the input pipeline alone. Fresh replicas, so that the trained ones stay as trained. Input = step - no input,
    all-reduce = no input - no all-reduce, compute (forward, backward, update) = no all-reduce: from medians, or "not
    told apart". Each part is what it adds to a step: an all-reduce that overlaps the backward adds (shows) little."""
    (x, y), _ = data
    alone = argparse.Namespace(**{**vars(args), "method": "none"})
    with precision(args.precision):
        full, solo = trainer(args, devices, x.shape[1:]), trainer(alone, devices, x.shape[1:])
    per_epoch, seeds, steps = len(x) // args.batch, itertools.count(1000), min(steps, len(x) // args.batch)
    feed, left = iter(()), 0
    batch = next(full.inputs(x, y, seed=999))

    def timed(work):
        nonlocal feed, left
        if left < steps:  # a new epoch's pipelines, built (and their first batch fetched) outside the timing
            feed, left = full.inputs(x, y, seed=next(seeds)), per_epoch
            feed = itertools.chain([next(feed)], feed)
        left -= steps
        start = time.perf_counter()
        for _ in range(steps):
            out = work()
        np.asarray(out[0] if isinstance(out, tuple) else out)  # waits for the last step (or batch)
        return 1000 * (time.perf_counter() - start) / steps

    variants = {"step": lambda: full.step(*next(feed)), "no input": lambda: full.step(*batch),
                "no all-reduce": lambda: solo.step(*batch), "input alone": lambda: next(feed)}  # fmt: skip
    for work in variants.values():
        timed(work)  # traces the steps, fills the pipeline: not timed
    samples = {name: [] for name in variants}
    for r in range(rounds):
        for name in list(variants)[r % 4 :] + list(variants)[: r % 4]:
            samples[name].append(timed(variants[name]))
    parts = {"step": spread(samples["step"]), "input": told_apart(samples["step"], samples["no input"]),
             "all_reduce": told_apart(samples["no input"], samples["no all-reduce"]),
             "compute": spread(samples["no all-reduce"]), "input_alone": spread(samples["input alone"])}  # fmt: skip
    said = [f"{name.replace('all_', 'all-').replace('_', ' ')} {part_said(part)}" for name, part in parts.items()]
    print(f"breakdown ({rounds} interleaved rounds of {steps} steps a variant; median +- half-IQR): " + ", ".join(said))
    return {**parts, "rounds": rounds, "steps_a_sample": steps, "samples_ms": samples}


def part_said(part):
    return "not told apart" if part["ms"] is None else f"{part['ms']:.2f} +- {part['spread']:.2f} ms"


def spread(samples):
    """{"ms": the median, "spread": half the interquartile range} of a list of times."""
    q1, median, q3 = np.percentile(samples, [25, 50, 75])
    return {"ms": float(median), "spread": float((q3 - q1) / 2)}


def told_apart(more, less):
    """The part of `more`'s time that `less` leaves out: the difference of their medians, with the sum of their
    half-IQRs as its spread; "ms" None ("not told apart") unless the difference is above that spread (a negative
    one is noise: leaving work out does not make a step slower)."""
    a, b = spread(more), spread(less)
    difference, width = a["ms"] - b["ms"], a["spread"] + b["spread"]
    return {"ms": difference if difference > width else None, "spread": width, "difference": difference}


TOLERANCE = {"float32": 1e-5, "bfloat16": 0.05, "float16": 0.02}  # 16-bit: measured up to 5e-3 and 2e-3
TOLERANCE_WHY = {
    "float32": "checked in float64, where only a wrong method differs",
    "bfloat16": "bfloat16 keeps 8 significant bits (2^-8 = 0.4%); another split of the batch rounds otherwise, and "
    "Adam turns a rounded gradient near 0 into a step of up to its learning rate (weights against the largest)",
    "float16": "float16 keeps 11 significant bits (2^-11 = 0.05%); another split rounds otherwise, and Adam turns a "
    "rounded gradient near 0 into a step of up to its learning rate (weights against the largest)",
}


def check(args, devices, data):
    """--steps steps against the same CNN with plain Keras BN and one Adam on ONE device, over the same batches: the
    largest relative difference of the losses, the weights and BN's moving statistics of every replica. In float64
    for --precision float32 (so that only a wrong method, not rounding, differs), else in that mixed precision."""
    (x, y), _ = data
    with precision("float64" if args.precision == "float32" else args.precision):
        return compare(args, devices, x.astype(keras.config.floatx()), y)


def compare(args, devices, x, y):
    run, n = trainer(args, devices, x.shape[1:]), len(devices)
    shares = n if args.bn == "local" else 1  # local BN: the reference normalizes each replica's share by itself
    with tf.device(devices[0]):
        single, adam = make_cnn(x.shape[1:]), keras.optimizers.Adam(learning_rate(args))
        optimizer = keras.optimizers.LossScaleOptimizer(adam) if args.precision == "float16" else adam
    for v, first in zip(single.variables, run.variables[0], strict=True):
        v.assign(first)  # the same start
    moving = single.non_trainable_variables  # BN's moving statistics: with local BN, one set per replica
    with tf.device(devices[0]):
        kept = [[tf.Variable(v.numpy()) for v in moving] for _ in range(shares)]

    @tf.function
    def single_step(x, y):
        with tf.GradientTape() as tape:
            total = 0.0
            for xs, ys, stats in zip(tf.split(x, shares), tf.split(y, shares), kept, strict=True):
                for v, s in zip(moving, stats, strict=True):
                    v.assign(s)
                logits = single(xs, training=True)
                for v, s in zip(moving, stats, strict=True):
                    s.assign(v)
                total += tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=ys, logits=logits))
            loss = total / x.shape[0] + sum(single.losses)
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, single.trainable_variables)
        optimizer.apply_gradients(zip(grads, single.trainable_variables, strict=True))
        return loss

    differences, compared = [], batches(x, y, args.batch, seed=0)[: args.steps]
    for (x_batch, y_batch), batch in zip(compared, run.inputs(x, y, seed=0), strict=False):
        loss, reference = np.float64(run.step(*batch)), np.float64(single_step(x_batch, y_batch))
        differences.append(abs(loss - reference) / abs(reference))
    index = {id(v): j for j, v in enumerate(moving)}
    # 16-bit: each variable's difference against the model's largest weight, not its own: Adam moves a weight
    # near 0 (a new BN beta) by up to its learning rate on a rounded gradient's sign, whatever the weight's size.
    scale = max(float(np.max(np.abs(v.numpy()))) for v in single.variables) if args.precision != "float32" else 0.0
    for i, replica in enumerate(run.variables):
        expected = [kept[i % shares][index[id(v)]] if id(v) in index else v for v in single.variables]
        for a, b in zip(replica, expected, strict=True):
            b = b.numpy()
            differences.append(np.max(np.abs(np.asarray(a) - b)) / max(np.max(np.abs(b)), scale, 1e-30))
    worst = float(np.max(differences))  # NaN if any is: max(0.0, nan) would be 0.0
    print(f"check: {steps_said(len(compared), args)} of {args.strategy} on {len(devices)} devices against one, "
          f"all-reduce {args.method}, batch norm {args.bn}, precision {args.precision}{', XLA' * args.jit}: largest "
          f"relative difference "
          f"{worst:.2e} ({verdict(worst, TOLERANCE[args.precision])}); tolerance {TOLERANCE[args.precision]:g}: "
          f"{TOLERANCE_WHY[args.precision]}")  # fmt: skip
    return worst


def steps_said(compared, args):
    """'N steps', and why when the training set holds fewer full batches than --steps asks for."""
    short = f" (of {args.steps} asked: the training set holds {compared} full batches of {args.batch})"
    return f"{compared} steps" + (short if compared < args.steps else "")


def verdict(worst, tolerance=1e-5):
    return "ok" if worst <= tolerance else "they differ" if np.isfinite(worst) else "not finite: they differ"


SYNC_BELOW = 32  # --bn auto: synchronized below this many examples a device


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", help="comma-separated names (default: every GPU if 2 or more, else --simulate)")
    p.add_argument("--simulate", type=int, help="N logical CPU devices (default without 2 GPUs: 2)")
    p.add_argument("--all-reduce", choices=("auto", "nccl", "ring", "central"), default="auto",
                   help="how gradients and BN statistics are summed (auto: NCCL on whole GPUs, else ring); under "
                   "--strategy mirrored, central is ReductionToOneDevice, the others TensorFlow's default")  # fmt: skip
    p.add_argument("--strategy", choices=("replicated", "mirrored"), default="replicated",
                   help="replicated: this file's own loop; mirrored: MirroredStrategy, same model")  # fmt: skip
    p.add_argument("--bn", choices=("auto", "sync", "local"), default="auto",
                   help=f"batch norm over the whole batch (sync: one all-reduce per BN layer each way) or each "
                        f"device's share (local: none); auto: sync below {SYNC_BELOW} examples a device, where a "
                        "share's statistics get noisy (notebook 04), else local")  # fmt: skip
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="gradients summed in buckets of this many MB, last layers first (25: PyTorch DDP's); "
                        "0: one all-reduce per gradient, the lesson's form")  # fmt: skip
    p.add_argument("--precision", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="16-bit: Keras' mixed precision (float32 weights); float16 with loss scaling")  # fmt: skip
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=128, help="the global batch, a multiple of the device count")
    p.add_argument("--steps", type=int, help="stop after this many steps (with --check: compare so many; 20)")
    p.add_argument("--lr", type=float, default=1e-3,
                   help="Adam's learning rate, tuned for --lr-batch (a larger batch often wants more: --scale-lr, "
                   "--warmup)")  # fmt: skip
    p.add_argument("--scale-lr", choices=tuple(SCALINGS), default="none",
                   help="scale --lr from --lr-batch to --batch: linear (Goyal et al. 2017) or sqrt")  # fmt: skip
    p.add_argument("--lr-batch", type=int, default=128, metavar="B",
                   help="the global batch --lr was tuned for (%(default)s)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=0, metavar="STEPS",
                   help="grow the learning rate linearly from --lr to the scaled one over STEPS steps (Goyal et "
                   "al.)")  # fmt: skip
    p.add_argument("--jit", action="store_true",
                   help="compile each replica's forward and backward with XLA: one call per replica on its device; the "
                   "all-reduce and the update stay outside (NCCL's op has no XLA kernel; a compiled call runs on one "
                   "device); needs --bn local. Off by default: it compiles at the first step and may be slower on "
                   "CPUs: measure on your GPUs (--breakdown, --baseline)")  # fmt: skip
    p.add_argument("--breakdown", action="store_true",
                   help="after training, time steps with and without input and all-reduce, interleaved: the step split "
                   "into input, compute and all-reduce where the run tells them apart (replicated route)")  # fmt: skip
    p.add_argument("--log-every", type=int, default=10, metavar="K",
                   help="read the loss every K steps: reading it makes the host wait for the step")  # fmt: skip
    p.add_argument(
        "--data",
        help="digits, or the path of an mnist.npz or a CIFAR-10 .npz (x_train (N, 32, 32, 3), "
        "y_train, x_test, y_test); default: the Keras cache's MNIST, else digits; nothing downloads",
    )
    p.add_argument("--check", action="store_true", help="compare with one device (in float64 for float32); exit 1 if "
                   "they differ")  # fmt: skip
    p.add_argument("--checkpoint", metavar="DIR", help="save replica 0 each epoch; resume from DIR's latest")
    p.add_argument("--baseline", action="store_true", help="and the same steps on one device: the efficiency")
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights (keras.utils.set_random_seed)")
    p.add_argument("--json", metavar="PATH", help="write the final metrics to PATH")
    p.add_argument("--logdir", help="TensorBoard scalars here (loss, accuracy, images per second)")
    p.add_argument("--profile", action="store_true", help="and a profiler trace of steps 3 to 5 in --logdir")
    a = p.parse_args(argv)
    n = len(a.devices.split(",")) if a.devices else a.simulate or 2

    def folder_of(flag, path):
        return Path(path).exists() and not Path(path).is_dir(), f"{flag} {path}: a file, not a folder; give a folder"

    problems = [
        (a.devices and a.simulate, "give --devices or --simulate, not both"),
        (a.simulate is not None and not 1 <= a.simulate <= 16, "--simulate: 1 to 16 devices"),
        (min(a.epochs, a.batch, 1 if a.steps is None else a.steps) < 1, "--epochs, --batch and --steps must be >= 1"),
        (a.batch % n, f"--batch {a.batch}: give a multiple of the {n} devices, e.g. {max(n, a.batch // n * n)}"),
        (not 0 < a.lr < float("inf"), f"--lr {a.lr}: give a positive learning rate, e.g. 1e-3"),
        (not 0 <= a.bucket_mb < float("inf"), f"--bucket-mb {a.bucket_mb}: give 0 MB or more (0: per gradient)"),
        (a.log_every < 1, f"--log-every {a.log_every}: give 1 or more steps"),
        (a.lr_batch < 1, f"--lr-batch {a.lr_batch}: give the global batch --lr was tuned for, e.g. 128"),
        (a.warmup < 0, f"--warmup {a.warmup}: give 0 or more steps"),
        (a.warmup and np.isclose(scaled_lr(a), a.lr), f"--warmup grows the learning rate from --lr to the scaled one, "
         f"here both {a.lr:g}: give --scale-lr linear or sqrt and a --batch other than --lr-batch, or drop --warmup"),
        (a.breakdown and a.strategy == "mirrored", "--breakdown times steps without their all-reduce, which "
         "MirroredStrategy runs inside apply_gradients: give --strategy replicated, or --profile --logdir DIR"),
        (a.breakdown and a.check, "--breakdown times training and --check trains none: drop one"),
        (a.precision == "float16" and a.strategy == "mirrored", "--precision float16 needs loss scaling, which the "
         "mirrored step (notebook 03's) does not do: give --precision bfloat16, or --strategy replicated"),
        (a.check and a.checkpoint, "--check compares fresh weights and saves none: drop --checkpoint"),
        (a.check and a.baseline, "--baseline times a training run and --check trains none: drop one"),
        (a.baseline and n < 2, "--baseline compares with one device: give 2 or more devices"),
        (a.profile and not a.logdir, "--profile writes into --logdir: give --logdir DIR too"),
        (a.logdir and not importlib.util.find_spec("tensorboard"), "--logdir: pip install tensorboard first"),
        (a.data not in (None, "digits") and not Path(a.data or "").is_file(), f"--data {a.data}: no such file"),
        ((a.data == "digits" or not (a.data or MNIST_CACHE.exists())) and not digits_file(),
         "no data: run the file from the course (tutorial_lib/digits.csv.gz) or give --data PATH of an mnist.npz"),
        (a.json and not Path(a.json).absolute().parent.is_dir(), f"--json {a.json}: no such folder"),
        (a.json and Path(a.json).is_dir(), f"--json {a.json}: a folder; give a file in it, e.g. {a.json}/m.json"),
        folder_of("--logdir", a.logdir or ""),
        folder_of("--checkpoint", a.checkpoint or ""),
    ]  # fmt: skip
    for message in [message for problem, message in problems if problem][:1]:
        p.error(message)
    a.bn_auto = a.bn == "auto"
    a.bn = ("sync" if a.batch // n < SYNC_BELOW else "local") if a.bn_auto else a.bn
    if problem := jit_problem(a, n):
        p.error(problem)
    return a


def jit_problem(args, n):
    """Why --jit cannot compile this run, or None: synchronized batch norm all-reduces inside each replica's forward
    and backward, which one compiled call on one device cannot hold."""
    if not (args.jit and args.bn == "sync"):
        return None
    auto = f" (--bn auto chose sync: {args.batch // n} examples a device, below {SYNC_BELOW})" * args.bn_auto
    return (f"--jit compiles each replica's forward and backward alone, and synchronized batch norm{auto} all-reduces "
            "inside them, across devices: give --bn local (a larger --batch for auto), or drop --jit")  # fmt: skip


def bn_said(args, n):
    share = args.batch // n
    why = f" (auto: sync below {SYNC_BELOW} examples a device, where a share's statistics get noisy)" * args.bn_auto
    if args.bn == "sync":
        return f"batch norm: synchronized, the statistics of all {args.batch} examples, all-reduced per layer{why}"
    return f"batch norm: local, each replica its own {share} examples' statistics, no all-reduce{why}"


SCALINGS = {"none": lambda _: 1.0, "linear": lambda ratio: ratio, "sqrt": lambda ratio: ratio**0.5}


def scaled_lr(args):
    """--lr, tuned for a global batch of --lr-batch, scaled for --batch: linear (Goyal et al. 2017, "when the
    minibatch size is multiplied by k, multiply the learning rate by k"), sqrt (Krizhevsky 2014: keeps the variance
    of a step as it was), or none."""
    return args.lr * SCALINGS[args.scale_lr](args.batch / args.lr_batch)


def learning_rate(args):
    """Adam's learning rate: scaled_lr, a float; with --warmup W, a schedule of each optimizer's step that starts at
    --lr and grows linearly to scaled_lr over W steps, then stays (Goyal et al.'s gradual warm-up). Keras' CosineDecay
    holds that warm-up; alpha=1 makes its decay keep the rate. The schedule reads the optimizer's step count,
    which a checkpoint saves: a resumed run goes on where it stopped."""
    if not args.warmup:
        return scaled_lr(args)
    return keras.optimizers.schedules.CosineDecay(args.lr, decay_steps=1, alpha=1.0, warmup_target=scaled_lr(args),
                                                  warmup_steps=args.warmup)  # fmt: skip


def lr_said(args):
    said = {"none": "not scaled", "linear": "scaled linearly", "sqrt": "scaled by the square root of the ratio"}
    line = f"learning rate: {args.lr:g} tuned for batch {args.lr_batch}, {said[args.scale_lr]}"
    line += f" to {scaled_lr(args):g}" * (args.scale_lr != "none") + f" for batch {args.batch}"
    return line + f", warmed up over {args.warmup} steps from {args.lr:g}" * bool(args.warmup)


def gradients_said(args, input_shape):
    """What the all-reduce of the gradients will be: how many buckets of how many bytes."""
    if args.strategy == "mirrored":
        return "gradients: summed by MirroredStrategy's apply_gradients (--bucket-mb is the replicated route's)"
    with precision(args.precision):
        weights = make_cnn(input_shape).trainable_variables
    if not args.bucket_mb:
        return f"gradients: one all-reduce per gradient, {len(weights)} a step (--bucket-mb 0, the lesson's form)"
    plan = bucket_plan(weights, args.bucket_mb * 2**20)
    sizes = [sum(int(np.prod(weights[j].shape)) * 4 for j in bucket) for bucket in plan]  # float32 weights
    return (f"gradients: {len(weights)} tensors, {sum(sizes):,} bytes, in {len(plan)} bucket(s) of up to "
            f"{args.bucket_mb:g} MB, last layers first: {', '.join(f'{s:,}' for s in sizes)} bytes")  # fmt: skip


def mirrored_reduce_said(devices, method):
    """What MirroredStrategy will sum with: ReductionToOneDevice for --all-reduce central, else TensorFlow's default,
    as tf.distribute picks it (CollectiveAllReduce, or ReductionToOneDevice for a mix of CPUs and GPUs)."""
    gpus = [d for d in devices if "GPU" in d.upper()]
    if method == "central":
        return "central", "ReductionToOneDevice, through the first device"
    if gpus and len(gpus) < len(devices):
        return "default", "TensorFlow's default for a mix of CPUs and GPUs: ReductionToOneDevice"
    logical = len(tf.config.list_logical_devices("GPU")) > len(tf.config.list_physical_devices("GPU"))
    how = "ring (CPUs)" if not gpus else "ring (logical GPUs)" if logical else "NCCL (whole GPUs)"
    return "default", f"TensorFlow's default, CollectiveAllReduce: {how}"


def main(argv=None):
    args = parse(argv)
    args.steps = args.steps or (20 if args.check else None)
    if args.checkpoint:  # now, not after the first epoch's training
        try:
            Path(args.checkpoint).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            refuse(
                f"--checkpoint {args.checkpoint}: cannot make that folder ({err.strerror}); give a folder you can write"
            )
    keras.utils.set_random_seed(args.seed)  # one run's weights, hence its accuracy, again on the same machine
    data, devices = load_data(args.data), choose_devices(args)
    n = len(devices)  # parse assumed --simulate's or 2: every GPU may be more
    if args.batch % n:
        refuse(f"--batch {args.batch}: give a multiple of the {n} devices, e.g. {max(n, args.batch // n * n)}")
    args.bn = ("sync" if args.batch // n < SYNC_BELOW else "local") if args.bn_auto else args.bn
    if problem := jit_problem(args, n):
        refuse(problem)
    if args.batch > len(data[0][0]):  # batches() would give none: nothing trained, nothing compared
        most = len(data[0][0]) // len(devices) * len(devices)
        refuse(f"--batch {args.batch}: the training set holds {len(data[0][0])} images; give --batch {most} or less")
    args.method, args.method_said = all_reduce_method(devices, args.all_reduce)
    if args.strategy == "mirrored":
        args.method, args.method_said = mirrored_reduce_said(devices, args.method)
    print(bn_said(args, len(devices)))
    print(lr_said(args))
    print(gradients_said(args, data[0][0].shape[1:]))
    if args.check:
        metrics = {"largest_relative_difference": check(args, devices, data)}
    else:
        metrics = train(args, devices, data)
        metrics.update(baseline(args, devices, data, metrics) if args.baseline else {})
        metrics.update({"breakdown": breakdown(args, devices, data)} if args.breakdown else {})
    if args.json:
        head = {"devices": devices, "strategy": args.strategy, "all_reduce": args.method, "bn": args.bn,
                "precision": args.precision, "jit": args.jit, "learning_rate": scaled_lr(args),
                "warmup": args.warmup}  # fmt: skip
        Path(args.json).write_text(json.dumps(json_ready({**head, **metrics})))
    return 0 if metrics.get("largest_relative_difference", 0) <= TOLERANCE[args.precision] else 1  # NaN: 1


def json_ready(value):
    """`value` with every NaN and infinity replaced by None: JSON has no such numbers (json.dumps writes NaN)."""
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    return None if isinstance(value, float) and not np.isfinite(value) else value


if __name__ == "__main__":
    sys.exit(main())
