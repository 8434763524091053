"""train_multi_gpu.py's checks: is its step right (--check, against one device), and how fast is it (the
efficiency against a plain one-device step, --breakdown). Each builds fresh copies of the run's model
(`program.build`), so a trained run stays as trained. Nothing here is part of the method.
"""

import statistics
import time
from types import SimpleNamespace

import common  # noqa: F401 (TensorFlow, quietly)
import data_parallel as dp
import keras
import multi_gpu_cli as cli
import numpy as np
import tensorflow as tf

# One step of 16-bit SGD against one device, weight moves compared as vectors: bfloat16 keeps 8 significant bits
# (2^-8 = 0.4%), float16 11 (0.05%); a step sums thousands of rounded products. Measured with the course's CNN on
# 2 devices, 6 seeds, batches 8 and 16: up to 5.6 units of that rounding (bfloat16) and 3.6 (float16); and 16.1
# units (bfloat16) under --strategy mirrored --jit on 3 devices. Allowed: 32 units of bfloat16's (12.5%), 16 of
# float16's (0.8%). A wrong method is off by far more: an average for a sum by 1 - 1/N, 50% or more.
TOLERANCE = {"float64": 1e-5, "bfloat16": 32 * 2.0**-8, "float16": 16 * 2.0**-11}


def check(args, devices, data, program):
    """--steps steps of the run's step (every option as given) against a plain Keras step on ONE device over the
    same global batches: the largest relative difference of the losses, weights and batch norm statistics, in
    float64, where only a wrong method, not rounding, differs. 16-bit: and one step in that precision."""
    (x, y), _ = data
    with cli.precision("float64"):
        worst = compare(args, devices, x.astype(np.float64), y, program)
    results = {"float64": worst}
    if args.precision != "float32":
        with cli.precision(args.precision):
            results[args.precision] = first_step(args, devices, x, y, program)
    failed = [p for p, w in results.items() if not w <= TOLERANCE[p]]  # NaN fails
    said = "; ".join(f"{p}: {w:.2e} (tolerance {TOLERANCE[p]:.0e})" for p, w in results.items())
    print(f"check: {said}: {'they differ' if failed else 'ok'}")
    return {"largest_relative_difference": results, "verdict": "they differ" if failed else "ok"}


def compare(args, devices, x, y, program):
    run, n = program.build(args, devices, x.shape[1:]), len(devices)
    shares = n if args.bn == "local" else 1  # local BN: the reference normalizes each replica's share by itself
    with tf.device(devices[0]):
        single, optimizer = program.make_model(x.shape[1:]), cli.optimizer(args)
    for v, first in zip(single.weights, run.weights[0], strict=True):
        v.assign(first)  # the same start
    left_out = without_random_layers([*getattr(run, "replicas", [run.model]), single])
    step = reference_step(single, optimizer, shares, devices[0])
    feed, reference = run.feed(x, y), iter(program.batches(x, y, args))
    differences, done = [], 0
    while done < args.steps:
        k = min(args.steps_per_call, args.steps - done)
        loss = np.float64(run.step(feed, tf.constant(k)))
        expected = np.mean([np.float64(step(*next(reference))) for _ in range(k)])
        differences.append(abs(loss - expected) / abs(expected))
        done += k
    # A weight is measured against its size, and at least one Adam step (about the learning rate): a bias before
    # batch norm gets a gradient of rounding alone, stays near 0, and differs from one device's by rounding too.
    one_step = min(args.lr, cli.scaled_lr(args))
    for i, replica in enumerate(run.weights):
        for a, b in zip(replica, step.expected(i), strict=True):
            differences.append(np.max(np.abs(np.asarray(a) - b)) / max(np.max(np.abs(b)), one_step))
    worst = float(np.max(differences))  # NaN if any is: max(0.0, nan) would be 0.0
    print(
        f"check: {done} steps of {args.strategy} on {n} devices against one, batch norm {args.bn}, --bucket-mb "
        f"{args.bucket_mb:g}, {args.steps_per_call} steps a call{', XLA' * args.jit}, in float64: largest relative "
        f"difference {worst:.2e}" + left_out
    )
    return worst


def without_random_layers(models):
    """Make every layer that draws random numbers in training pass its input through, and say which: each replica
    draws its own numbers (as it should), which one device cannot draw; the rest is compared."""
    found = [layer for model in models for layer in common.random_layers(model)]
    for layer in found:
        layer.call = lambda inputs, *_args, **_kwargs: inputs
    names = sorted({type(layer).__name__ for layer in found})
    return f" ({', '.join(names)} left out: each replica draws its own random numbers)" if found else ""


def reference_step(model, optimizer, shares, device):
    """One plain Keras step on one device, the whole global batch at once; with `shares` > 1 each share normalized
    by its own batch norm statistics, kept apart (local BN). step.expected(i): replica i's expected variables."""
    moving = model.non_trainable_variables  # BN's moving statistics: with local BN, one set per replica
    with tf.device(device):
        kept = [[tf.Variable(v.numpy()) for v in moving] for _ in range(shares)]

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            total = 0.0
            for xs, ys, stats in zip(tf.split(x, shares), tf.split(y, shares), kept, strict=True):
                for v, s in zip(moving, stats, strict=True):
                    v.assign(s)
                total += tf.reduce_sum(dp.cross_entropy(ys, model(xs, training=True)))
                for v, s in zip(moving, stats, strict=True):
                    s.assign(v)
            loss = total / tf.cast(tf.shape(x)[0], total.dtype) + sum(model.losses)
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    index = {id(v): j for j, v in enumerate(moving)}
    step.expected = lambda i: [(kept[i % shares][index[id(v)]] if id(v) in index else v).numpy() for v in model.weights]
    return step


def first_step(args, devices, x, y, program):
    """One step of SGD (its move is the gradient) in the run's 16-bit precision, from the same weights as one
    device: how far the replicas' weight moves are from one device's, as vectors (norm of the difference over the
    norm of the move)."""
    sgd = lambda: cli.optimizer(args, keras.optimizers.SGD(0.1), initial_scale=2.0**8)  # noqa: E731 (no overflow)
    run = program.build(args, devices, x.shape[1:], make_optimizer=sgd)
    with tf.device(devices[0]):
        single = program.make_model(x.shape[1:])
    for v, first in zip(single.weights, run.weights[0], strict=True):
        v.assign(first)
    without_random_layers([*getattr(run, "replicas", [run.model]), single])
    start = [v.numpy() for v in single.trainable_variables]
    reference = reference_step(single, sgd(), len(devices) if args.bn == "local" else 1, devices[0])
    reference(*next(iter(program.batches(x, y, args))))
    run.step(run.feed(x, y), tf.constant(1))
    moved = [np.asarray(a, np.float64) - s for a, s in zip(run.model.trainable_variables, start, strict=True)]
    expected = [v.numpy().astype(np.float64) - s for v, s in zip(single.trainable_variables, start, strict=True)]
    gap = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(moved, expected, strict=True)))
    return float(gap / np.sqrt(sum(np.sum(b**2) for b in expected)))


def plain_step(model, optimizer):
    """The plain one-device step a reader would write: a tf.function of (iterator, k), k steps a call as the run's."""

    @tf.function
    def step(iterator, k):
        total = 0.0
        for _ in range(k):  # autograph: a tf.while_loop for a tensor k, unrolled for a Python int
            x, y = next(iterator)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(dp.cross_entropy(y, model(x, training=True))) + sum(model.losses)
                scaled = optimizer.scale_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            total += tf.cast(loss, tf.float32)
        return total / tf.cast(k, tf.float32)

    return step


def timed(variants, rounds=7):
    """{name: [ms a step]} of `variants` ({name: (call, steps a call)}), called in turns, the order turned each round,
    after a warm-up call each (it traces)."""
    names, samples = list(variants), {name: [] for name in variants}
    for name in names:
        np.asarray(variants[name][0]())
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            call, steps = variants[name]
            start = time.perf_counter()
            np.asarray(call())  # waits for the call
            samples[name].append(1000 * (time.perf_counter() - start) / steps)
    return samples


def spread(samples):
    """(median, half the interquartile range): the course's timing statistic."""
    q = statistics.quantiles(samples, n=4)
    return statistics.median(samples), (q[2] - q[0]) / 2


def baseline(args, devices, data, program):
    """The efficiency: the run's step on N devices (global batch B) against the plain one-device step on one of
    them (B/N, as each device gets), from interleaved timings of fresh copies; 1.0 is perfect weak scaling."""
    (x, y), _ = data
    n, k = len(devices), args.steps_per_call
    with cli.precision(args.precision):
        run = program.build(args, devices, x.shape[1:])
        with tf.device(devices[0]):
            model, optimizer = program.make_model(x.shape[1:]), cli.optimizer(args)
    one = plain_step(model, optimizer)
    alone = iter(program.batches(x, y, SimpleNamespace(**{**vars(args), "batch": args.batch // n})))
    feed = run.feed(x, y)
    times = timed({"N": (lambda: run.step(feed, tf.constant(k)), k), "one": (lambda: one(alone, tf.constant(k)), k)})
    (t_n, d_n), (t_1, d_1) = spread(times["N"]), spread(times["one"])
    low, high = max(t_1 - d_1, 0) / (t_n + d_n), (t_1 + d_1) / max(t_n - d_n, 1e-9)
    said = " (simulated devices share this machine's cores: this says nothing of GPUs)" * common.simulated(devices)
    print(
        f"efficiency: {t_1 / t_n:.0%} (range {low:.0%}-{high:.0%}) of {n} x one device: {t_n:.2f} ms a step of "
        f"{args.batch} on {n} devices, {t_1:.2f} ms a step of {args.batch // n} on one{said}"
    )
    return {"baseline_step_ms": t_1, "efficiency": t_1 / t_n, "efficiency_range": [low, high]}


def breakdown(args, devices, data, program, rounds=7):
    """--breakdown: a step split into what it spends, from interleaved timings of fresh copies: the step as it
    trains; the same step fed one batch that is already on the devices ("no input"); that step with no all-reduce
    at all, of the gradients nor of batch norm's statistics ("no all-reduce": each replica keeps its own); the
    input pipeline alone. Input = step - no input, all-reduce = no input - no all-reduce, compute = no all-reduce,
    from medians, or "not told apart" where the spreads allow no difference. Each part is what it adds to a step:
    an all-reduce that overlaps the backward adds (shows) little."""
    (x, y), _ = data
    k, n = args.steps_per_call, len(devices)
    with cli.precision(args.precision):
        full = program.build(args, devices, x.shape[1:])
        solo = program.build(args, devices, x.shape[1:], all_sum=lambda tensors: list(tensors))
    feed, (xb, yb) = full.feed(x, y), iter(program.batches(x, y, args)).get_next()
    held = [
        iter(tf.data.Dataset.from_tensors(share).repeat().apply(tf.data.experimental.prefetch_to_device(d, 2)))
        for d, share in zip(devices, zip(tf.split(xb, n), tf.split(yb, n), strict=True), strict=True)
    ]
    inputs = lambda: [[next(f) for f in feed] for _ in range(k)][-1][0][0]  # noqa: E731
    samples = timed(
        {
            "step": (lambda: full.step(feed, tf.constant(k)), k),
            "no input": (lambda: full.step(held, tf.constant(k)), k),
            "no all-reduce": (lambda: solo.step(held, tf.constant(k)), k),
            "input alone": (inputs, k),
        },
        rounds,
    )
    parts = {
        "step": spread(samples["step"]),
        "input": told_apart(samples["step"], samples["no input"]),
        "all_reduce": told_apart(samples["no input"], samples["no all-reduce"]),
        "compute": spread(samples["no all-reduce"]),
        "input_alone": spread(samples["input alone"]),
    }
    said = [f"{name.replace('all_', 'all-').replace('_', ' ')} {part_said(part)}" for name, part in parts.items()]
    print(f"breakdown ({rounds} interleaved rounds of {k} steps a variant; median +- half-IQR): " + ", ".join(said))
    return {name: None if part is None else {"ms": part[0], "spread": part[1]} for name, part in parts.items()}


def told_apart(more, less):
    """(median difference, its spread) where the two samples' spreads leave a difference, else None."""
    (a, da), (b, db) = spread(more), spread(less)
    return (a - b, da + db) if a - da > b + db else None


def part_said(part):
    return "not told apart" if part is None else f"{part[0]:.2f} +- {part[1]:.2f} ms"
