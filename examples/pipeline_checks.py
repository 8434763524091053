"""train_pipelined.py's checks, apart from its training loop: what a model split over devices cannot take (refused
before any work), --check (the pipeline against the same model on ONE device, in float64) and --baseline (its step
timed against the naive split and one device). Each builds fresh copies of the run's model (`program.build`), so a
trained run stays as trained. Nothing here is part of the method.
"""

import re
from types import SimpleNamespace

import common  # noqa: F401 (TensorFlow, quietly)
import keras
import numpy as np
import pipeline_parallel as pp
import tensorflow as tf
from data_parallel_checks import spread, timed, without_random_layers  # as train_multi_gpu.py times and checks

# Op types that draw random numbers: stateful ones (a new draw at each run) and stateless ones (Keras' dropout,
# seeded from a variable that each call advances). A forward run twice (--recompute) draws twice.
RANDOM_OPS = re.compile(r"Random|Rng|Multinomial|TruncatedNormal|^Stateful(?!PartitionedCall)")
TOLERANCE = 1e-5  # float64: a right pipeline differs from one device by rounding, about 1e-15


def random_ops(model, x):
    """The op types of `model`'s training forward on images like x that draw random numbers, function bodies
    entered (a Lambda layer calling tf.random.uniform, a tf.random.Generator, Keras' Dropout)."""
    spec = tf.TensorSpec([None, *x.shape[1:]], tf.as_dtype(keras.config.floatx()))
    graph = tf.function(lambda h: model(h, training=True)).get_concrete_function(spec).graph.as_graph_def()
    ops = [n.op for n in graph.node] + [n.op for f in graph.library.function for n in f.node_def]
    return sorted({op for op in ops if RANDOM_OPS.search(op)})


def model_problem(model, x, recompute):
    """What the pipeline cannot train as one device would, with the fix; None if nothing. `model` is the whole
    model (its chunks in one keras.Sequential)."""
    layers = common.all_layers(model)
    if norm := [layer.name for layer in layers if isinstance(layer, keras.layers.BatchNormalization)]:
        return (
            f"the model has batch norm ({', '.join(norm)}): a pipeline stage sees one micro-batch at a time, so it "
            "would normalize each micro-batch alone and update its moving statistics M times a step. Use "
            "LayerNormalization or GroupNormalization, or data parallelism with synchronized batch norm "
            "(train_multi_gpu.py)"
        )
    if recompute and (drawn := random_ops(model, x)):
        named = ", ".join(layer.name for layer in common.random_layers(model)) or "none: a tf.random op"
        return (
            f"--recompute runs each forward twice, and the model draws random numbers in its forward (ops "
            f"{', '.join(drawn)}; Keras layers {named}): the second draw differs from the first, so the backward "
            "would not be the gradient of the forward that made the loss. Drop --recompute, or the random layers"
        )
    if recompute and (written := state_written(model, x)):
        return f"--recompute runs each forward twice, and the model's state {written[0]} would change twice; drop one"
    return common.output_problem(model, x)


def state_written(model, x):
    """The paths of the non-trainable variables that a training forward on x[:2] changes, each put back after: a
    layer's state (a counter, moving statistics), not a frozen layer's weights, which no forward writes."""
    held = [v for v in model.non_trainable_variables if "seed_generator" not in v.path]
    before = [v.numpy() for v in held]
    model(tf.constant(x[:2], keras.config.floatx()), training=True)
    written = [v.path for v, old in zip(held, before, strict=True) if not np.array_equal(v.numpy(), old)]
    for v, old in zip(held, before, strict=True):
        v.assign(old)
    return written


def check(args, devices, data, program):
    """--steps pipelined steps of the run's schedule (every option as given), Adam per stage, against the same
    model on ONE device taking Adam steps on the same batches (clipped by the same --clipnorm), its gradients summed
    over the same micro-batches in order (so that its dropout draws the same masks; with --replicas each replica
    draws its own, and the random layers are left out): the largest relative difference of the losses and every
    replica's weights, in float64, where only a wrong method, not rounding, differs."""
    (x, y), _ = data
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")  # every model built here: float64 weights and arithmetic (the policy too:
    keras.config.set_dtype_policy("float64")  # Keras keeps the first one it made, from floatx at that time)
    try:
        run = program.build(args, devices, x.shape[1:])
        single = program.one_device_model(devices[0], x.shape[1:])
        optimizer = keras.optimizers.Adam(args.lr, global_clipnorm=args.clipnorm)
        if other := {v.dtype for v in single.trainable_variables} - {"float64"}:
            common.refuse(f"--check compares in float64, and the model fixes some layers' dtype ({other}): drop it")
        for v, same in zip(single.variables, [v for chunk in run.chunks for v in chunk.variables], strict=True):
            v.assign(same)  # the same weights, and the same dropout seeds
        left_out = without_random_layers([c for r in run.replicas for c in r.chunks] + [single]) if len(
            run.replicas) > 1 else ""  # fmt: skip
        step = reference_step(single, optimizer, args.micro_batches * len(run.replicas))
        batches = iter(program.batches(x.astype(np.float64), y, args))
        differences = []
        for _ in range(args.steps):
            xb, yb = next(batches)
            loss, expected = run.steps([xb], [yb])[0], step(xb, yb)
            differences.append(abs(float(loss) - float(expected)) / abs(float(expected)))
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)
    for replica in run.replicas:
        weights = zip([v for chunk in replica.chunks for v in chunk.trainable_variables], single.trainable_variables,
                      strict=True)  # fmt: skip
        differences += [np.max(np.abs(a.numpy() - b.numpy())) / np.max(np.abs(b.numpy())) for a, b in weights]
    worst = float(np.max(differences))  # NaN if any is: max(0.0, nan) would be 0.0
    verdict = "ok" if worst <= TOLERANCE else "they differ"
    print(
        f"check: {args.steps} steps of {run.said}, Adam per stage, against one device in float64: largest relative "
        f"difference {worst:.2e} ({verdict}; a right pipeline differs by rounding alone, about 1e-15){left_out}"
    )
    return {"largest_relative_difference": worst, "verdict": verdict}


def reference_step(model, optimizer, micro_batches):
    """One Adam step of `model` on one device: the mean of the micro-batches' mean losses (each with what the
    model adds to the loss), the micro-batches taken in order, as the pipeline takes them."""

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            losses = []
            for xm, ym in zip(tf.split(x, micro_batches), tf.split(y, micro_batches), strict=True):
                losses.append(pp.mean_cross_entropy(model(xm, training=True), ym) + sum(model.losses))
            loss = tf.add_n(losses) / micro_batches
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return step


def plain_step(model, optimizer):
    """The plain one-device step a reader would write: one tape, one Adam, the whole batch at once."""

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = pp.mean_cross_entropy(model(x, training=True), y) + sum(model.losses)
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return step


NO_SPEED = (
    "speed: not measured. These devices are logical CPUs of one process: they share one thread pool, so one of "
    "them alone can keep every core busy, and no split over them can show a speed-up. On GPUs this prints the "
    "step against the naive split and against one device (notebook 05 measures on core devices)"
)


def baseline(args, devices, data, program, rounds=7):
    """The run's step (fresh copies) against the naive split (the same step, with one micro-batch and the
    sequential schedule: one device busy at a time) and against the whole model on ONE device (a plain step),
    timed in interleaved rounds on one batch already on the devices."""
    if common.simulated(devices):
        print(NO_SPEED)
        return {}
    (x, y), _ = data
    naive = SimpleNamespace(**{**vars(args), "schedule": "sequential", "micro_batches": 1, "recompute": False})
    runs = {
        "pipelined": program.build(args, devices, x.shape[1:]),
        "naive split": program.build(naive, devices, x.shape[1:]),
    }
    with tf.device(devices[0]):
        xb = tf.constant(x[: args.batch])
    with tf.device(devices[-1]):
        yb = tf.constant(y[: args.batch])
    variants = {name: (lambda run=run: run.steps([xb], [yb]), 1) for name, run in runs.items()}
    try:
        one = plain_step(program.one_device_model(devices[0], x.shape[1:]), keras.optimizers.Adam(args.lr))
        one(xb, yb)
        variants["one device"] = (lambda: one(xb, yb), 1)
    except tf.errors.ResourceExhaustedError:
        print(f"one device: the whole model does not fit on {devices[0]}: the pipeline's reason to be")
    times = {name: spread(samples) for name, samples in timed(variants, rounds).items()}
    found = {"timed_step_ms": times["pipelined"][0]}
    for other in [name for name in times if name != "pipelined"]:
        ratio, low, high, verdict = speedup(times["pipelined"], times[other])
        found[f"speedup_vs_{other.replace(' ', '_')}"] = ratio
        print(f"against {other}: {ratio:.2f}x (range {low:.2f}-{high:.2f}, {verdict}; {times['pipelined'][0]:.1f} ms "
              f"a step against {times[other][0]:.1f} ms; medians of {rounds} interleaved rounds)")  # fmt: skip
    return found


def speedup(fast, slow):
    """slow / fast from (median, half-IQR) pairs, the range their spreads allow, and the verdict it supports."""
    (a, da), (b, db) = fast, slow
    low, high = max(b - db, 0.0) / (a + da), (b + db) / max(a - da, 1e-12)
    return b / a, low, high, "faster" if low > 1 else "slower" if high < 1 else "no significant difference"
