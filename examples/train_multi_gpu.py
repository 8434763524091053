"""Train a CNN on MNIST on N GPUs without Estimator or fit: one file to copy.

Notebook 03's and 04's functions (below their `# lesson:` lines). One Keras replica per device, each
starting from the first one's weights (the broadcast); each computes the gradients of its share of the
batch; tensorpack's `allreduce_grads`, in TF 2, sums them over NCCL (over a ring of copies where NCCL
cannot run: CPUs, logical GPUs of one card); one Adam per replica applies the same sum on its device,
so that the replicas stay equal. Batch norm is synchronized: every BatchNormalization layer normalizes
with the mean and variance of the whole global batch, one all-reduce per layer.

    python train_multi_gpu.py [--devices /GPU:0,/GPU:1] [--epochs 3] [--batch 256]
    python train_multi_gpu.py --strategy mirrored     # the same under tf.distribute.MirroredStrategy
    python train_multi_gpu.py --all-reduce ring       # another all-reduce than NCCL (or central)
    python train_multi_gpu.py --check --steps 20      # the same weights as one device?
"""

import argparse
import importlib.util
import itertools
import json
import sys
import time
import weakref
import zipfile
import zlib
from pathlib import Path

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
    return keras.Sequential([keras.Input(input_shape), *block(32), *block(64), keras.layers.Flatten(),
                             keras.layers.Dense(10)])  # fmt: skip


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
    if x.ndim != 3 or min(x.shape[1:], default=0) < smallest:
        return f"x_{name} has shape {x.shape}: give images (N, height, width), at least {smallest}x{smallest}"
    if y.shape != x.shape[:1] or not len(y):
        return f"y_{name} has shape {y.shape}: give one label per image, shape ({len(x)},) (y.ravel()), none empty"
    if not np.isfinite(x).all():
        return f"x_{name}: {np.size(x) - np.isfinite(x).sum()} pixels are not finite (NaN or inf); fix or drop them"
    if not np.all((y >= 0) & (y <= 9) & (y == np.round(y))):
        return f"y_{name}: labels must be the whole numbers 0 to 9, got {y.min()} to {y.max()}"
    return None


def load_data(path):
    """((x_train, y_train), (x_test, y_test)) from an mnist.npz (default: Keras' cache, if there), else
    the 8x8 digits (`digits_file`); images (N, H, W, 1) in [0, 1]. Exit 2 on data the CNN cannot take."""
    path = path or (MNIST_CACHE if MNIST_CACHE.exists() else "digits")
    print(f"data: {path}" if path != "digits" else "data: 8x8 digits (no MNIST in the Keras cache)")
    if path != "digits":
        splits, scale = read_npz(path), 255.0
    else:
        table = np.loadtxt(digits_file(), delimiter=",")
        order = np.random.default_rng(0).permutation(len(table))
        splits, scale = [(table[i, :64].reshape(-1, 8, 8), table[i, 64]) for i in (order[300:], order[:300])], 16.0
    for name, (x, y) in zip(("train", "test"), splits, strict=True):
        if problem := data_problem(name, x, y, smallest=4):  # the CNN pools twice by 2
            refuse(f"--data {path}: {problem}")
    return [((x[..., None] / scale).astype(keras.config.floatx()), y.astype(np.int32)) for x, y in splits]


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


def trainer(args, devices, input_shape):
    """(a step of a global batch (x, y) that returns its loss, the model to evaluate, every model's variables)."""
    make_adam = lambda: keras.optimizers.Adam(args.lr)  # noqa: E731
    if args.strategy == "mirrored":
        reduce = tf.distribute.NcclAllReduce() if args.method == "nccl" else tf.distribute.ReductionToOneDevice()
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=reduce)
        with strategy.scope():  # one copy of every variable per device, Adam's too
            model, optimizer = make_cnn(input_shape, synchronized=True), make_adam()
            optimizer.build(model.trainable_variables)
        mirrored_step, n = mirrored_train_step(strategy, model, optimizer), len(devices)

        def step(x, y):  # replica i gets the i-th n-th of the batch, as the replicated path does
            share = lambda t: lambda ctx: tf.split(t, n)[ctx.replica_id_in_sync_group]  # noqa: E731
            return mirrored_step(*(strategy.experimental_distribute_values_from_function(share(t)) for t in (x, y)))

        copies = [strategy.experimental_local_results(v.value) for v in model.variables]  # one per device
        return step, model, [list(per_device) for per_device in zip(*copies, strict=True)]
    replicas = make_replicas(lambda: make_cnn(input_shape), devices)
    # One Adam per replica, each applied once a step to its replica's weights. ONE Adam applied to the
    # same weights once per tower (the asker's script) takes K steps a step and counts K in its moments.
    optimizers = replica_optimizers(replicas, devices, make_adam)
    step = make_sync_bn_train_step(replicas, devices, optimizers, args.method)
    return step, replicas[0], [replica.variables for replica in replicas]


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
    order = np.random.default_rng(seed).permutation(len(x))[: len(x) // batch * batch]
    return [(x[i], y[i]) for i in order.reshape(-1, batch)]


def train(args, devices, data):
    """--epochs epochs (or --steps steps) with a Progbar; train and test accuracy and images/s each epoch."""
    (x_train, y_train), (x_test, y_test) = data
    step, model, _ = trainer(args, devices, x_train.shape[1:])
    writer = tf.summary.create_file_writer(args.logdir) if args.logdir else None
    print(f"{args.strategy}: {len(devices)} replicas of {args.batch // len(devices)} examples on {devices}; "
          f"all-reduce: {args.method_said}")  # fmt: skip
    done, metrics, profiling = 0, {}, False
    for epoch in range(args.epochs):
        epoch_batches = batches(x_train, y_train, args.batch, seed=epoch)[: args.steps - done if args.steps else None]
        progress, start, losses = keras.utils.Progbar(len(epoch_batches), unit_name="step"), time.perf_counter(), []
        print(f"epoch {epoch + 1}/{args.epochs}")
        for x, y in epoch_batches:
            if args.profile and done + len(losses) == 2:  # steps 3 to 5: the first two also trace the step
                tf.profiler.experimental.start(args.logdir)
                profiling = True
            elif profiling and done + len(losses) == 5:
                tf.profiler.experimental.stop()
                profiling = False
            losses.append(float(step(x, y)))
            progress.update(len(losses), [("loss", losses[-1])])
        seconds, done = time.perf_counter() - start, done + len(epoch_batches)
        metrics = {"loss": np.mean(losses), "train_accuracy": accuracy(model, x_train[:2000], y_train[:2000]),
                   "test_accuracy": accuracy(model, x_test, y_test),
                   "images_per_second": len(epoch_batches) * args.batch / seconds}  # fmt: skip
        print(
            "  ".join(
                f"{name} {value:,.0f}" if "second" in name else f"{name} {value:.3f}" for name, value in metrics.items()
            )
        )
        if writer:
            with writer.as_default(step=epoch):
                for name, value in metrics.items():
                    tf.summary.scalar(name, value)
        if args.steps and done >= args.steps:
            break
    if profiling:  # fewer than 5 steps in all
        tf.profiler.experimental.stop()
    return {**metrics, "steps": done}


def check(args, devices, data):
    """--steps steps against the same CNN with plain Keras BN and one Adam on ONE device, over the same
    batches, in float64 (so that only a wrong method, not float32 rounding, differs): the largest
    relative difference of the losses, the weights and BN's moving statistics of every replica."""
    (x, y), _ = data
    x, floatx, policy = x.astype(np.float64), keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")  # the models below, and their optimizers, in float64: a layer
    keras.config.set_dtype_policy("float64")  # takes its dtype from the policy, once one is set
    try:
        return compare(args, devices, x, y)
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)


def compare(args, devices, x, y):
    step, _, variables = trainer(args, devices, x.shape[1:])
    with tf.device(devices[0]):
        single, optimizer = make_cnn(x.shape[1:]), keras.optimizers.Adam(args.lr)
    for v, first in zip(single.variables, variables[0], strict=True):
        v.assign(first)  # the same start

    @tf.function
    def single_step(x, y):
        with tf.GradientTape() as tape:
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=single(x, training=True))
            loss = tf.reduce_mean(per_example) + sum(single.losses)
        grads = tape.gradient(loss, single.trainable_variables)
        optimizer.apply_gradients(zip(grads, single.trainable_variables, strict=True))
        return loss

    differences, compared = [], batches(x, y, args.batch, seed=0)[: args.steps]
    for x_batch, y_batch in compared:
        loss, reference = np.float64(step(x_batch, y_batch)), np.float64(single_step(x_batch, y_batch))
        differences.append(abs(loss - reference) / abs(reference))
    for replica in variables:
        for a, b in zip(replica, single.variables, strict=True):
            b = b.numpy()
            differences.append(np.max(np.abs(np.asarray(a) - b)) / max(np.max(np.abs(b)), 1e-30))
    worst = float(np.max(differences))  # NaN if any is: max(0.0, nan) would be 0.0
    print(f"check: {steps_said(len(compared), args)} of {args.strategy} on {len(devices)} devices against one, "
          f"all-reduce {args.method}: largest relative difference {worst:.2e} ({verdict(worst)})")  # fmt: skip
    return worst


def steps_said(compared, args):
    """'N steps', and why when the training set holds fewer full batches than --steps asks for."""
    short = f" (of {args.steps} asked: the training set holds {compared} full batches of {args.batch})"
    return f"{compared} steps" + (short if compared < args.steps else "")


def verdict(worst):
    return "ok" if worst <= 1e-5 else "they differ" if np.isfinite(worst) else "not finite: they differ"


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", help="comma-separated names (default: every GPU if 2 or more, else --simulate)")
    p.add_argument("--simulate", type=int, help="N logical CPU devices (default without 2 GPUs: 2)")
    p.add_argument("--all-reduce", choices=("auto", "nccl", "ring", "central"), default="auto",
                   help="how gradients and BN statistics are summed (auto: NCCL on whole GPUs, else ring)")  # fmt: skip
    p.add_argument("--strategy", choices=("replicated", "mirrored"), default="replicated",
                   help="replicated: this file's own loop; mirrored: MirroredStrategy, same model")  # fmt: skip
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=128, help="the global batch, a multiple of the device count")
    p.add_argument("--steps", type=int, help="stop after this many steps (with --check: compare so many; 20)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    p.add_argument("--data", help="digits, or the path of an mnist.npz (default: the Keras cache's MNIST, else digits)")
    p.add_argument("--check", action="store_true", help="compare with one device in float64; exit 1 if they differ")
    p.add_argument("--json", metavar="PATH", help="write the final metrics to PATH")
    p.add_argument("--logdir", help="TensorBoard scalars here (loss, accuracy, images per second)")
    p.add_argument("--profile", action="store_true", help="and a profiler trace of steps 3 to 5 in --logdir")
    a = p.parse_args(argv)
    n = len(a.devices.split(",")) if a.devices else a.simulate or 2
    problems = [
        (a.devices and a.simulate, "give --devices or --simulate, not both"),
        (a.simulate is not None and not 1 <= a.simulate <= 16, "--simulate: 1 to 16 devices"),
        (min(a.epochs, a.batch, 1 if a.steps is None else a.steps) < 1, "--epochs, --batch and --steps must be >= 1"),
        (a.batch % n, f"--batch {a.batch}: give a multiple of the {n} devices, e.g. {max(n, a.batch // n * n)}"),
        (not 0 < a.lr < float("inf"), f"--lr {a.lr}: give a positive learning rate, e.g. 1e-3"),
        (a.profile and not a.logdir, "--profile writes into --logdir: give --logdir DIR too"),
        (a.logdir and not importlib.util.find_spec("tensorboard"), "--logdir: pip install tensorboard first"),
        (a.data not in (None, "digits") and not Path(a.data or "").is_file(), f"--data {a.data}: no such file"),
        ((a.data == "digits" or not (a.data or MNIST_CACHE.exists())) and not digits_file(),
         "no data: run the file from the course (tutorial_lib/digits.csv.gz) or give --data PATH of an mnist.npz"),
        (a.json and not Path(a.json).absolute().parent.is_dir(), f"--json {a.json}: no such folder"),
        (a.json and Path(a.json).is_dir(), f"--json {a.json}: a folder; give a file in it, e.g. {a.json}/m.json"),
        (a.logdir and Path(a.logdir).exists() and not Path(a.logdir).is_dir(),
         f"--logdir {a.logdir}: a file, not a folder; give a folder (made if missing)"),
    ]  # fmt: skip
    for message in [message for problem, message in problems if problem][:1]:
        p.error(message)
    return a


def main(argv=None):
    args = parse(argv)
    args.steps = args.steps or (20 if args.check else None)
    data, devices = load_data(args.data), choose_devices(args)
    if args.batch > len(data[0][0]):  # batches() would give none: nothing trained, nothing compared
        most = len(data[0][0]) // len(devices) * len(devices)
        refuse(f"--batch {args.batch}: the training set holds {len(data[0][0])} images; give --batch {most} or less")
    args.method, args.method_said = all_reduce_method(devices, args.all_reduce)
    metrics = {"largest_relative_difference": check(args, devices, data)} if args.check else train(args, devices, data)
    if args.json:
        head = {"devices": devices, "strategy": args.strategy, "all_reduce": args.method}
        Path(args.json).write_text(json.dumps(json_ready({**head, **metrics})))
    return 0 if metrics.get("largest_relative_difference", 0) <= 1e-5 else 1  # NaN: 1


def json_ready(value):
    """`value` with every NaN and infinity replaced by None: JSON has no such numbers (json.dumps writes NaN)."""
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    return None if isinstance(value, float) and not np.isfinite(value) else value


if __name__ == "__main__":
    sys.exit(main())
