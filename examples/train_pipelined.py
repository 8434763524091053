"""Train the asker's Keras CNN split over three devices as a pipeline: one file to copy.

Notebook 05's functions (below its `# lesson:` lines): each step ONE graph of M micro-batches' forwards and
backwards in the schedule's order, then Adam per stage on its device; the next batch staged on the first
device in a StagingArea (a PRIVATE TensorFlow API; its public route: tf.data's prefetch_to_device).

    python train_pipelined.py [--devices /GPU:0,/GPU:1,/CPU:0] [--schedule gpipe] [--micro-batches 8]
    python train_pipelined.py --check --steps 5        # the same as one device?
"""

import argparse
import importlib.util
import json
import math
import statistics
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
from keras.layers import Conv2D, Dense, Dropout, Flatten, MaxPooling2D
from tensorflow.python.ops import data_flow_ops  # PRIVATE API: StagingArea
from tensorflow.tsl.profiler.protobuf import xplane_pb2  # the profiler's trace format

# lesson: 05_staging_pipeline
SCHEDULES = ("sequential", "gpipe", "1f1b")


# lesson: 05_staging_pipeline
def schedule(S, M, kind="gpipe"):
    """For each of S stages, its order of ("F", m) and ("B", m) over M micro-batches."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {kind!r}.")
    if kind == "sequential":
        return [[op for m in range(M) for op in (("F", m), ("B", m))] for _ in range(S)]
    if kind == "gpipe":
        return [[("F", m) for m in range(M)] + [("B", m) for m in range(M)] for _ in range(S)]
    orders = []  # 1F1B: S-1-s warm-up forwards, then one forward and one backward, then the last backwards
    for s in range(S):
        warmup = min(S - 1 - s, M)
        order = [("F", m) for m in range(warmup)]
        for m in range(M - warmup):
            order += [("F", warmup + m), ("B", m)]
        orders.append(order + [("B", m) for m in range(M - warmup, M)])
    return orders


# lesson: 05_staging_pipeline
def unroll(orders):
    """(stage, op, m) in an order that respects every stage's order and every data dependency."""
    S, done, plan, next_op = len(orders), set(), [], [0] * len(orders)

    def ready(s, op, m):
        if op == "F":  # a forward needs the previous stage's forward
            return s == 0 or (s - 1, "F", m) in done
        return (s, "F", m) in done and (s == S - 1 or (s + 1, "B", m) in done)  # and the next stage's backward

    while len(plan) < sum(map(len, orders)):
        before = len(plan)
        for s in range(S):
            while next_op[s] < len(orders[s]) and ready(s, *orders[s][next_op[s]]):
                done.add((s, *orders[s][next_op[s]]))
                plan.append((s, *orders[s][next_op[s]]))
                next_op[s] += 1
        if len(plan) == before:
            waiting = {s: orders[s][next_op[s]] for s in range(S) if next_op[s] < len(orders[s])}
            raise ValueError(f"these stage orders wait on each other forever: next ops {waiting}")
    return plan


# lesson: 05_staging_pipeline
def run_stage(stage, h):
    """A Keras stage is told that it trains: otherwise its Dropout passes everything through."""
    return stage(h, training=True) if isinstance(stage, keras.Layer) else stage(h)


# lesson: 05_staging_pipeline
def added_losses(stage):
    """What a Keras stage adds to the loss in its last call (weight regularizers, add_loss); 0 for others."""
    losses = list(getattr(stage, "losses", []))
    return tf.add_n(losses) if losses else tf.constant(0.0)


# lesson: 05_staging_pipeline
def pipelined_gradients(stages, devices, orders, x, y, loss_fn, wait_for_arrival=True, start_after=()):
    """Build one step's forwards and backwards in the graph being traced, in the stages' orders.
    Returns (the batch's mean loss, for each stage the gradients of its weights summed over the
    micro-batches). Every stage's first op waits for `start_after`."""
    S, M = len(stages), len(orders[0]) // 2
    with tf.device(devices[0]):
        inputs = {(0, m): xm for m, xm in enumerate(tf.split(x, M))}
    with tf.device(devices[-1]):
        labels = tf.split(y, M)
    after = [list(start_after) for _ in range(S)]  # each stage's latest outputs: its next op waits for them
    tapes, upstream, grads, losses = {}, {}, [None] * S, []
    for s, op, m in unroll(orders):
        with tf.device(devices[s]), tf.name_scope(f"stage{s}/{op}{m}"), tf.control_dependencies(after[s]):
            if op == "F":
                h = tf.identity(inputs.pop((s, m)))
                with tf.GradientTape() as tape:
                    tape.watch(h)
                    out = run_stage(stages[s], h)
                    if s == S - 1:
                        out = loss_fn(out, labels[m])  # the MEAN over the micro-batch
                    added = added_losses(stages[s])
                tapes[s, m] = (tape, h, out, added)
                losses.append(added if s < S - 1 else out + added)
                if s < S - 1:
                    if wait_for_arrival:  # the output moves to the next stage inside this op
                        with tf.device(devices[s + 1]):
                            out = tf.identity(out)
                    inputs[s + 1, m] = out
                after[s] = [out]  # with the copy: the stage goes on once its output has arrived
            else:
                tape, h, out, added = tapes.pop((s, m))
                g_out = upstream.pop((s, m)) if s < S - 1 else tf.constant(1 / M)  # d(mean of M)/d(loss m)
                wrt = ([h] if s else []) + list(stages[s].trainable_variables)  # stage 0: weights only
                g = tape.gradient([out, added], wrt, output_gradients=[g_out, tf.constant(1 / M)])
                if s:
                    upstream[s - 1, m] = g[0]
                g_vars = g[1:] if s else g
                grads[s] = g_vars if grads[s] is None else [a + b for a, b in zip(grads[s], g_vars, strict=True)]
                after[s] = list(g)
    with tf.device(devices[-1]):
        return tf.add_n(losses) / M, grads


# lesson: 05_staging_pipeline
def update_stages(stages, devices, grads, learning_rate=None, optimizers=None):
    """Each stage's update on its own device, once every gradient of the step exists: SGD with
    `learning_rate`, or `optimizers[s]` for stage s. Returns ops that end with every write."""
    updates = []
    with tf.control_dependencies([g for per_stage in grads for g in per_stage]):  # no stage updates alone
        for s, (stage, device) in enumerate(zip(stages, devices, strict=True)):
            variables = list(stage.trainable_variables)
            with tf.device(device), tf.name_scope(f"update{s}"):
                if optimizers is None:
                    updates += [v.assign_sub(learning_rate * g) for v, g in zip(variables, grads[s], strict=True)]
                elif variables:
                    optimizers[s].apply(grads[s], variables)
                    # apply gives no op to wait for. A read of a variable runs after its writes (a
                    # tf.function keeps the program's order on one variable): read them all.
                    updates += [tf.identity(v) for v in (*variables, *optimizers[s].variables)]
    return updates


# lesson: 05_staging_pipeline
def one_optimizer_per_stage(stages, devices, make_optimizer):
    """`make_optimizer()` once per stage, created and built on the stage's weights under its device."""
    optimizers = []
    for stage, device in zip(stages, devices, strict=True):
        with tf.device(device):  # its step count and learning rate here; Keras puts the moments beside the weights
            optimizer = make_optimizer()
            optimizer.build(list(stage.trainable_variables))
        optimizers.append(optimizer)
    return optimizers


# lesson: 05_staging_pipeline
def make_train_steps(stages, devices, orders, loss_fn, learning_rate=None, optimizers=None, wait_for_arrival=True):
    """A `tf.function` of (xs, ys), lists of K batches: K steps in ONE call (a wave), step k+1
    starting on every stage once step k is applied. Returns the K losses."""

    @tf.function(autograph=False)
    def train_steps(xs, ys):
        losses, applied = [], []
        for x, y in zip(xs, ys, strict=True):  # unrolled when traced: K steps in one graph
            loss, grads = pipelined_gradients(stages, devices, orders, x, y, loss_fn, wait_for_arrival, applied)
            applied = update_stages(stages, devices, grads, learning_rate, optimizers)  # the next step waits for these
            losses.append(loss)
        with tf.device(devices[-1]):  # where the losses are
            return tf.stack(losses)

    return train_steps


# lesson: 05_staging_pipeline
def staged_step(area, build_step, x_next=None, y_next=None):
    """Build, in the graph being traced: this step's batch taken from `area`, the step on it
    (`build_step(x, y)` returns its loss), and the put of the next batch, if any."""
    x, y = area.get()
    loss = build_step(x, y)
    if x_next is not None:  # built after the step, which does not wait for it: the copy overlaps the step
        area.put([x_next, y_next])
    return loss


def build_stages(devices, input_shape):
    """The asker's three `tf.device` blocks as Keras models, each made on its device (on 2 devices the
    first block and the other two, on 1 the whole model), with the same weights and dropout seeds each
    build. keras.Input replaces `input_shape=`; padding="same": an 8x8 digit is too small for "valid"."""
    keras.utils.set_random_seed(0)
    same = {"activation": "relu", "padding": "same"}
    blocks = [  # made when called: a layer built from a list made outside tf.device keeps state outside it
        lambda: [Conv2D(32, (3, 3), **same), Conv2D(64, (3, 3), **same), MaxPooling2D((2, 2))],
        lambda: [Conv2D(128, (3, 3), **same), MaxPooling2D((2, 2)), Conv2D(64, (3, 3), **same), MaxPooling2D((2, 2))],
        lambda: [Dropout(0.25), Flatten(), Dense(1500, activation="relu"), Dropout(0.5),
                 Dense(10, activation="softmax")],
    ]  # fmt: skip
    groups, stages, shape = {1: [(0, 1, 2)], 2: [(0,), (1, 2)], 3: [(0,), (1,), (2,)]}[len(devices)], [], input_shape
    for device, group in zip(devices, groups, strict=True):
        with tf.device(device):  # Keras creates Dropout's seed state when the layer is made: here, not outside
            stages.append(keras.Sequential([keras.Input(shape), *(layer for b in group for layer in blocks[b]())]))
        shape = stages[-1].compute_output_shape((None, *shape))[1:]
    return stages


def mean_cross_entropy(probabilities, labels):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, probabilities))


def pipeline(args, devices, input_shape, wait=True):
    """The stages, Adam per stage, and the pipelined and naive (one micro-batch) steps over them."""
    stages = build_stages(devices, input_shape)
    refuse_batch_norm(stages)
    optimizers = one_optimizer_per_stage(stages, devices, lambda: keras.optimizers.Adam(1e-3))
    steps = [schedule(len(devices), m, args.schedule) for m in (args.micro_batches, 1)]
    return stages, *(make_train_steps(stages, devices, o, mean_cross_entropy, None, optimizers, wait) for o in steps)


def refuse_batch_norm(stages):
    """A BatchNormalization in a stage would normalize each micro-batch alone and move its moving
    statistics M times a step: not the model's batch norm. Refused, as tutorial_lib's Pipeline does."""
    for stage in stages:
        for layer in stage.layers:
            if isinstance(layer, keras.layers.BatchNormalization):
                raise ValueError(f"{layer.name}: a pipeline stage runs each micro-batch alone, so batch norm "
                                 "would use micro-batch statistics and update its moving ones M times a step. "
                                 "Use LayerNormalization or GroupNormalization, or data parallelism.")  # fmt: skip


def expected(S, M):
    """(bubble, ideal speedup over the naive split) of S equal stages and M micro-batches."""
    return (S - 1) / (M + S - 1), S * M / (M + S - 1)


def data_parallel_step(devices, input_shape):
    """The same model whole on every device (data parallelism), each on its share of the batch, the
    gradients averaged on the first device and sent back, one Adam per replica: a tf.function of (xs, ys)
    as the pipeline's, to time against it on the same devices."""
    replicas, adams = [], []
    for device in devices:
        with tf.device(device):
            replicas.append(build_stages([device], input_shape)[0])
            adams.append(keras.optimizers.Adam(1e-3))
            adams[-1].build(replicas[-1].trainable_variables)

    @tf.function
    def step(xs, ys):
        grads, losses = [], []
        for device, replica, x, y in zip(devices, replicas, tf.split(xs[0], len(devices)),
                                         tf.split(ys[0], len(devices)), strict=True):  # fmt: skip
            with tf.device(device), tf.GradientTape() as tape:
                losses.append(mean_cross_entropy(replica(x, training=True), y))
            with tf.device(device):
                grads.append(tape.gradient(losses[-1], replica.trainable_variables))
        with tf.device(devices[0]):
            summed = [tf.add_n(list(g)) / len(devices) for g in zip(*grads, strict=True)]
        for device, replica, adam in zip(devices, replicas, adams, strict=True):
            with tf.device(device):
                adam.apply([tf.identity(g) for g in summed], replica.trainable_variables)
        with tf.device(devices[0]):
            return tf.stack([tf.add_n(losses) / len(devices)])

    step.replicas, step.optimizers = replicas, adams  # for its checks
    return step


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
        if problem := data_problem(name, x, y, smallest=8):  # the CNN pools three times by 2
            refuse(f"--data {path}: {problem}")
    (x_train, _), (x_test, _) = splits
    if x_train.shape[1:] != x_test.shape[1:]:  # the stages are built for the training images
        refuse(f"--data {path}: x_train holds {'x'.join(map(str, x_train.shape[1:]))} images and x_test "
               f"{'x'.join(map(str, x_test.shape[1:]))}; give both splits images of one size")  # fmt: skip
    return [((x[..., None] / scale).astype(np.float32), y.astype(np.int32)) for x, y in splits]


def staged_training(train_steps, batches, device, on_step):
    """Each (x, y) of `batches` put into a StagingArea on `device` while the step before runs (the first
    before any), then got by its step. A get from an empty area waits forever: it is emptied on failure."""

    def area():  # one buffer, by its name; every graph that uses it builds an object for it
        with tf.device(device):
            shapes = [[None, *batches[0][0].shape[1:]], [None]]
            return data_flow_ops.StagingArea([tf.float32, tf.int32], shapes, capacity=1, shared_name="batches")

    @tf.function
    def put(x=None, y=None):  # without a batch: empty the area
        if x is None:
            area().clear()
        else:
            area().put([x, y])

    step = tf.function(lambda x=None, y=None: staged_step(area(), lambda a, b: train_steps([a], [b])[0], x, y))
    put(*batches[0])
    try:
        for k, batch in enumerate([*batches[1:], None]):
            on_step(k, float(step(*batch) if batch else step()))
    except BaseException:
        put()
        raise


def timed(fns, rounds=9):
    """{name: (median, interquartile range)} in seconds, the functions called in turns after a warm-up."""
    times = {name: [] for name in fns}
    for r in range(rounds + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn().numpy()
            times[name] += [time.perf_counter() - start] if r else []
    quartiles = {name: statistics.quantiles(t, n=4) for name, t in times.items()}  # as tutorial_lib.timing does
    return {name: (statistics.median(times[name]), q[2] - q[0]) for name, q in quartiles.items()}


def speedup(fast, slow):
    """slow / fast, the range the spreads allow (each time within half its spread of its median), a verdict."""
    (a, da), (b, db) = fast, slow
    low, high = max(b - db / 2, 0.0) / (a + da / 2), (b + db / 2) / max(a - da / 2, 1e-12)
    return b / a, low, high, "faster" if low > 1 else "slower" if high < 1 else "no significant difference"


def busy_shares(train_steps, xs, ys, devices, logdir):
    """Each device's share of three traced steps during which it ran an op: a GPU's from its kernels
    (its own plane of the trace), a CPU device's from the host's ops, found by name in the graph."""
    canonical = {tf.DeviceSpec.from_string(d).to_string(): d for d in devices}
    graph = train_steps.get_concrete_function(xs, ys).graph
    where = {op.name: canonical.get(tf.DeviceSpec.from_string(op.device).to_string()) for op in graph.get_operations()}
    tf.profiler.experimental.start(logdir)
    for _ in range(3):
        train_steps(xs, ys).numpy()
    tf.profiler.experimental.stop()
    spans = {d: [] for d in devices}
    for path in Path(logdir).rglob("*.xplane.pb"):
        for plane in xplane_pb2.XSpace.FromString(path.read_bytes()).planes:
            gpu = plane.name.startswith("/device:GPU")
            for line, e in ((ln, e) for ln in plane.lines for e in ln.events):
                parts = plane.event_metadata[e.metadata_id].name.rpartition(":")[0].split("/")  # "scope/op:type"
                names = ["/".join(parts[i:]) for i in range(len(parts))]  # inlined ops carry their caller's name
                device = canonical.get(plane.name) if gpu else next((where[n] for n in names if where.get(n)), None)
                if device and (gpu or "GPU" not in device.upper()):  # on the host, a GPU op is only its launch
                    start = line.timestamp_ns * 1000 + e.offset_ps
                    spans[device].append((start, start + e.duration_ps))
    ends = [t for per_device in spans.values() for span in per_device for t in span]
    return {d: union(s) / (max(ends) - min(ends)) for d, s in spans.items()}


def union(spans):
    total, end = 0, -1
    for a, b in sorted(spans):
        total, end = total + max(0, b - max(a, end)), max(end, b)
    return total


def check(args, devices, x, y):
    """`args.steps` pipelined steps against the same model on ONE device, over the same micro-batches
    (so that its dropout draws the same masks): the largest relative difference of losses and weights."""
    stages, train_steps, _ = pipeline(args, devices, tuple(x.shape[1:]))
    [single], optimizer = build_stages(devices[:1], tuple(x.shape[1:])), keras.optimizers.Adam(1e-3)
    M, differences, steps = args.micro_batches, [], min(args.steps, len(x) // args.batch)  # full batches only
    for k in range(steps):
        xs, ys = x[k * args.batch : (k + 1) * args.batch], y[k * args.batch : (k + 1) * args.batch]
        loss = float(train_steps([xs], [ys])[0])
        with tf.GradientTape() as tape:
            parts = zip(np.split(xs, M), np.split(ys, M), strict=True)
            reference = tf.add_n([mean_cross_entropy(single(a, training=True), b) for a, b in parts]) / M
        optimizer.apply(tape.gradient(reference, single.trainable_variables), single.trainable_variables)
        differences.append(abs(np.float64(loss) - np.float64(reference)) / abs(np.float64(reference)))
    weights = zip([v for stage in stages for v in stage.trainable_variables], single.trainable_variables, strict=True)
    for a, b in weights:
        differences.append(np.max(np.abs(a.numpy() - b.numpy())) / np.max(np.abs(b.numpy())))
    worst = float(np.max(differences))  # NaN if any is: max(0.0, nan) would be 0.0
    verdict = "ok" if worst <= 1e-5 else "they differ" if np.isfinite(worst) else "not finite: they differ"
    short = f" (of {args.steps} asked: the training set holds {steps} full batches of {args.batch})"
    print(f"check: {steps} steps{short if steps < args.steps else ''} of {args.schedule}, M={M}, on {len(devices)} "
          f"devices against one: largest relative difference {worst:.2e} ({verdict})")  # fmt: skip
    return worst


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", help="1 to 3 comma-separated device names (default: 3 GPUs, or --simulate 3)")
    p.add_argument("--simulate", type=int, choices=(1, 2, 3), help="N logical CPU devices (default without 3 GPUs)")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--micro-batches", type=int, default=8,
                   help="M, micro-batches per step (must divide --batch); 8: a bubble of 2/10 on 3 stages")  # fmt: skip
    p.add_argument("--batch", type=int, default=72,
                   help="the global batch: 72 splits into 8 micro-batches, and over 2 or 3 devices")  # fmt: skip
    p.add_argument("--steps", type=int, default=100, help="steps to train (with --check: to compare)")
    p.add_argument("--handoff-wait", choices=("auto", "on", "off"), default="auto",
                   help="a stage waits for its output's copy to the next device (auto: on with CPUs only)")  # fmt: skip
    p.add_argument("--data", help="digits, or the path of an mnist.npz (default: the Keras cache's MNIST, else digits)")
    p.add_argument("--check", action="store_true", help="compare with one device; exit 1 if they differ")
    p.add_argument("--json", metavar="PATH", help="write the final metrics to PATH")
    p.add_argument("--logdir", help="TensorBoard scalars here (loss, accuracy, images per second)")
    p.add_argument("--profile", action="store_true", help="and a profiler trace of three steps in --logdir")
    a = p.parse_args(argv)
    problems = [
        (a.devices and a.simulate, "give --devices or --simulate, not both"),
        (a.devices and not 1 <= len(a.devices.split(",")) <= 3, "--devices: 1 to 3 names, e.g. /GPU:0,/GPU:1,/CPU:0"),
        (min(a.micro_batches, a.batch, a.steps) < 1, "--micro-batches, --batch and --steps must be >= 1"),
        (a.batch % max(a.micro_batches, 1), f"--batch {a.batch}: give a multiple of --micro-batches {a.micro_batches}"),
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
    """--devices (exit 2 if this machine lacks one); else three GPUs if there are; else --simulate N
    (default 3) logical CPUs, said so."""
    gpus, cpu = tf.config.list_physical_devices("GPU"), tf.config.list_physical_devices("CPU")[0]
    if args.devices:
        devices = [d.strip() for d in args.devices.split(",")]
        if unknown := unknown_devices(devices):
            names = ", ".join(d.name for d in tf.config.list_logical_devices())
            refuse(f"--devices: no device {', '.join(map(repr, unknown))} here, or named twice; this machine has "
                   f"{names}. Name some of those once each, or give --simulate N for N logical CPUs")  # fmt: skip
        return devices
    if len(gpus) >= 3 and not args.simulate:
        return [f"/GPU:{i}" for i in range(3)]
    n = args.simulate or 3
    if len(tf.config.get_logical_device_configuration(cpu) or []) != n:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
        print(f"{len(gpus)} GPU(s): {n} simulated CPU devices, which share this process's threads: the speed "
              "figures show the method at work, not a speedup that GPUs would get")  # fmt: skip
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def train(args, devices, data):
    """Train with staged batches, evaluate, then time against the naive split and trace the busy shares."""
    (x_train, y_train), (x_test, y_test) = data
    wait = {"on": True, "off": False}.get(args.handoff_wait, not any("GPU" in d.upper() for d in devices))
    stages, train_steps, naive = pipeline(args, devices, tuple(x_train.shape[1:]), wait)
    picks = np.random.default_rng(0).integers(0, len(x_train), (args.steps, args.batch))
    progress, start = keras.utils.Progbar(args.steps), time.perf_counter()
    writer = tf.summary.create_file_writer(args.logdir) if args.logdir else None

    def on_step(k, loss):
        progress.update(k + 1, [("loss", loss)])
        if writer:
            with writer.as_default(step=k):
                tf.summary.scalar("loss", loss)
                tf.summary.scalar("images_per_second", (k + 1) * args.batch / (time.perf_counter() - start))

    bubble, ideal = expected(len(devices), args.micro_batches)
    print(f"{args.steps} steps of {args.batch} examples, {args.schedule} with M={args.micro_batches}, on {devices}: "
          f"with equal stages each device idles {bubble:.0%} of a step (the bubble, (S-1)/(M+S-1)), and the "
          f"ideal speedup over the naive split is {ideal:.2f}x (S*M/(M+S-1)); unequal stages get less")  # fmt: skip
    staged_training(train_steps, [(x_train[i], y_train[i]) for i in picks], devices[0], on_step)
    accuracy = float(np.mean(np.argmax(keras.Sequential(stages).predict(x_test, verbose=0), -1) == y_test))
    if writer:
        with writer.as_default(step=args.steps):
            tf.summary.scalar("test_accuracy", accuracy)
    with tf.device(devices[0]):
        x = tf.constant(x_train[picks[0]])
    with tf.device(devices[-1]):
        y = tf.constant(y_train[picks[0]])
    variants = {"pipelined": lambda: train_steps([x], [y]), "naive split": lambda: naive([x], [y])}
    if len(devices) > 1 and args.batch % len(devices) == 0:
        data_parallel = data_parallel_step(devices, tuple(x_train.shape[1:]))
        variants["data parallel"] = lambda: data_parallel([x], [y])
    elif len(devices) > 1:  # each replica takes an equal share: said, not silently left out
        even = -(-args.batch // math.lcm(args.micro_batches, len(devices))) * math.lcm(args.micro_batches, len(devices))
        print(f"data parallelism not timed: --batch {args.batch} does not split evenly over {len(devices)} devices; "
              f"give --batch {even} (a multiple of --micro-batches and of the devices) to compare with it")  # fmt: skip
    times = timed(variants)
    ratio, low, high, verdict = speedup(times["pipelined"], times["naive split"])
    with tempfile.TemporaryDirectory() as scratch:
        shares = busy_shares(train_steps, [x], [y], devices, args.logdir if args.profile else scratch)
    step_ms, naive_ms = times["pipelined"][0] * 1e3, times["naive split"][0] * 1e3
    _, ideal = expected(len(devices), args.micro_batches)
    print(f"test accuracy {accuracy:.3f}; step {step_ms:.1f} ms, naive split {naive_ms:.1f} ms: {ratio:.2f}x "
          f"(range {low:.2f}-{high:.2f}, {verdict}; the ideal for equal stages is {ideal:.2f}x)")  # fmt: skip
    print("busy share per device:", ", ".join(f"{d} {share:.0%}" for d, share in shares.items()))
    metrics = {"test_accuracy": accuracy, "step_ms": step_ms, "naive_ms": naive_ms, "speedup": ratio,
               "speedup_range": [low, high], "verdict": verdict, "busy_share": shares}  # fmt: skip
    if "data parallel" in times:
        metrics.update(versus_data_parallel(times))
    return metrics


def versus_data_parallel(times):
    """The pipeline against data parallelism on the same devices, and what to use."""
    ratio, low, high, verdict = speedup(times["pipelined"], times["data parallel"])
    advice = {"slower": "use data parallelism: this model fits on one device, and it is faster",
              "faster": "the pipeline is faster here"}.get(verdict, "no clear winner: measure your model")  # fmt: skip
    print(f"against data parallelism on the same devices ({times['data parallel'][0] * 1e3:.1f} ms): the pipeline "
          f"is {ratio:.2f}x (range {low:.2f}-{high:.2f}, {verdict}): {advice}")  # fmt: skip
    return {"data_parallel_ms": times["data parallel"][0] * 1e3, "speedup_vs_data_parallel": ratio,
            "speedup_vs_data_parallel_range": [low, high], "advice": advice}  # fmt: skip


def main(argv=None):
    args = parse(argv)
    data, devices = load_data(args.data), choose_devices(args)
    if args.batch > len(data[0][0]):  # --check compares full batches of the training set, in order
        most = len(data[0][0]) // args.micro_batches * args.micro_batches
        refuse(f"--batch {args.batch}: the training set holds {len(data[0][0])} images; give --batch {most} or less")
    if args.check:
        metrics = {"largest_relative_difference": check(args, devices, *data[0])}
    else:
        metrics = train(args, devices, data)
    if args.json:
        head = {"devices": devices, "schedule": args.schedule, "micro_batches": args.micro_batches}
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
