"""Train a Keras CNN split over three devices as a pipeline that keeps them all busy: the program to copy, with
its folder.

Your model goes in make_model below, as blocks of layers; it returns LOGITS. The method is pipeline_parallel.py
(notebook 05): each step ONE tf.function that runs the schedule's forwards and backwards on every device at once,
one Adam per stage on its device, the next batch staged on the first device in a StagingArea (a PRIVATE TensorFlow
API; its public route: tf.data's prefetch_to_device). pipeline_schedules.py holds the schedules (sequential, GPipe,
1F1B, zero bubble's ZB-H1, interleaved 1F1B); pipeline_checks.py holds --check (against one device) and
--baseline. Loss, test accuracy and images/s each epoch.

    python train_pipelined.py [--devices /GPU:0,/GPU:1,/GPU:2] [--schedule zb_h1] [--micro-batches 6]
    python train_pipelined.py --schedule interleaved --chunks 2 --recompute
    python train_pipelined.py --check --steps 5        # the same weights as one device?
"""

import argparse
import time
from pathlib import Path
from types import SimpleNamespace

import common  # first: it imports TensorFlow with its start-up lines filtered
import keras
import numpy as np
import pipeline_checks as checks
import pipeline_parallel as pp
import pipeline_schedules as ps
import tensorflow as tf
from keras.layers import Conv2D, Dense, Dropout, Flatten, MaxPooling2D


# ---------------------------------------------------------------------------------------------------------------
# YOUR MODEL: the one place to change. Images in (N, height, width, channels), 10 LOGITS out (no softmax: the
# loss applies it).
# A list of blocks, each a list of Keras layers made when this is called (under the device that will run them, so
# that a Dropout's seed lives there). With as many blocks as stages (devices x --chunks), each block is a stage;
# otherwise the layers are cut into runs of nearly equal count. Balance the blocks' work: the slowest sets the pace.
# Refused before any work: batch norm (a stage sees micro-batches), random layers with --recompute.
def make_model():
    """The asker's CNN, their three tf.device blocks; padding="same" (an 8x8 digit is too small for "valid")."""
    same = {"activation": "relu", "padding": "same"}
    return [
        [Conv2D(32, 3, **same), Conv2D(64, 3, **same), MaxPooling2D(2)],
        [Conv2D(128, 3, **same), MaxPooling2D(2), Conv2D(64, 3, **same), MaxPooling2D(2)],
        [Dropout(0.25), Flatten(), Dense(1500, activation="relu"), Dropout(0.5), Dense(10)],
    ]


# ---------------------------------------------------------------------------------------------------------------


def cut(blocks, n):
    """The model as n chunks: its blocks where there are n, else its layers in n runs of nearly equal count."""
    if len(blocks) == n:
        return blocks
    layers = [layer for block in blocks for layer in block]
    bounds = [round(i * len(layers) / n) for i in range(n + 1)]
    return [layers[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def make_chunks(on, input_shape, seed):
    """The model cut into len(on) chunks, chunk k a keras.Sequential made under on[k] (its weights and dropout
    seeds there), each from a fresh make_model with the same seeds, so that the chunks are one model's layers."""
    chunks, shape = [], tuple(input_shape)
    for k, device in enumerate(on):
        keras.utils.set_random_seed(seed)
        with tf.device(device):
            chunks.append(keras.Sequential([keras.Input(shape), *cut(make_model(), len(on))[k]]))
        shape = chunks[-1].compute_output_shape((None, *shape))[1:]
    return chunks


def one_device_model(device, input_shape, seed=0):
    """The same model whole on one device: the reference of --check, the plain step of --baseline."""
    keras.utils.set_random_seed(seed)
    with tf.device(device):
        return keras.Sequential([keras.Input(tuple(input_shape)), *cut(make_model(), 1)[0]])


def build(args, devices, input_shape):
    """What a run trains: the chunks (S x v, chunk k on device k mod S), one Adam per chunk on its device, the
    orders of --schedule, and `steps`, pipeline_parallel's tf.function of lists of batches (a wave per call)."""
    S, v = len(devices), args.chunks if args.schedule == "interleaved" else 1
    on = [devices[k % S] for k in range(S * v)]
    chunks = make_chunks(on, input_shape, args.seed)
    optimizers = pp.one_optimizer_per_stage(chunks, on, lambda: keras.optimizers.Adam(args.lr))
    orders = ps.orders_of(args.schedule, S, args.micro_batches, v)
    wait = {"on": True, "off": False}.get(args.handoff_wait, not any("GPU" in d.upper() for d in devices))
    steps = pp.make_train_steps(chunks, on, orders, pp.mean_cross_entropy, optimizers=optimizers,
                                recompute=args.recompute, wait_for_arrival=wait)  # fmt: skip
    said = (
        f"{args.schedule}{f' ({v} chunks a device)' * (v > 1)}{', recomputed' * args.recompute}, M={args.micro_batches}"
    )
    return SimpleNamespace(chunks=chunks, devices=on, orders=orders, steps=steps, optimizers=optimizers, said=said)


def batches(x, y, args, skip=0):
    """The run's batches, built once: the training set reshuffled each epoch by --seed, the short last batch of
    each epoch dropped (every micro-batch the same size), the first `skip` left out."""
    order = tf.data.Dataset.range(len(x)).shuffle(len(x), seed=args.seed, reshuffle_each_iteration=True)
    x, y = tf.constant(x), tf.constant(y)
    picked = order.batch(args.batch, drop_remainder=True).repeat().skip(skip)
    return picked.map(lambda rows: (tf.gather(x, rows), tf.gather(y, rows))).prefetch(2)


def train(args, run, data):
    """--epochs epochs (or --steps steps), each step ONE call that gets its batch from the StagingArea and puts
    the next; the loss, test accuracy and images/s each epoch, from the time after the first call (it traces)."""
    (x, y), (x_test, y_test) = data
    per_epoch = len(x) // args.batch
    total = min(args.steps or args.epochs * per_epoch, args.epochs * per_epoch)
    done, timed, seconds, metrics = 0, 0, 0.0, {}
    feed = pp.StagedFeed(batches(x, y, args), run.devices[0], lambda a, b: run.steps.python_function([a], [b])[0])
    feed.start()
    try:
        while done < total:
            steps = min(per_epoch, total - done)
            print(f"epoch {done // per_epoch + 1}/{args.epochs}")
            progress, losses, start, epoch_timed = keras.utils.Progbar(steps), [], time.perf_counter(), steps
            for i in range(steps):
                losses.append(feed.step())
                if done == 0 and i == 0:  # the first call traces the step: not what a step costs
                    print(f"  the first call traced the step and ran it in {time.perf_counter() - start:.1f} s")
                    start, epoch_timed = time.perf_counter(), steps - 1
                if i % 10 == 9 or i == steps - 1:
                    progress.update(i + 1, [("loss", float(losses[-1]))])
            epoch_seconds, done = time.perf_counter() - start, done + steps
            timed, seconds = timed + epoch_timed, seconds + epoch_seconds
            speed = epoch_timed * args.batch / epoch_seconds if epoch_timed else np.nan
            metrics = {"loss": float(np.mean(losses)), "test_accuracy": accuracy(run, x_test, y_test),
                       "images_per_second": speed}  # fmt: skip
            print("  ".join(f"{k} {v:,.0f}" if "second" in k else f"{k} {v:.3f}" for k, v in metrics.items()))
    finally:
        feed.stop()  # the batch put for a step that will not come
    return {**metrics, "steps": done, "step_ms": 1000 * seconds / timed if timed else np.nan}


def accuracy(run, x, y, batch=1000):
    """The share of x the chunks classify right, each on its device, in inference mode (no dropout)."""
    if not hasattr(run, "predict"):  # one tf.function for the run: a new one per call would trace anew
        run.predict = tf.function(lambda h: tf.argmax(chained(run, h), -1, output_type=tf.int32))
    return float(np.mean(np.concatenate([run.predict(x[i : i + batch]) for i in range(0, len(x), batch)]) == y))


def chained(run, h):
    for chunk, device in zip(run.chunks, run.devices, strict=True):
        with tf.device(device):
            h = chunk(h, training=False)
    return h


def plan(args, devices, data):
    """Everything decided before any work, said, or refused with the fix: the batch, the cut, the model."""
    (x, _), S = data[0], len(devices)
    v = args.chunks if args.schedule == "interleaved" else 1
    if args.batch > len(x):
        most = len(x) // args.micro_batches * args.micro_batches
        common.refuse(f"--batch {args.batch}: the training set holds {len(x)} images; give --batch {most} or less")
    try:
        orders = ps.orders_of(args.schedule, S, args.micro_batches, v)
    except ValueError as err:
        common.refuse(f"--schedule {args.schedule} on {S} devices: {err}")
    layers = sum(map(len, make_model()))
    if layers < S * v:
        common.refuse(f"the model has {layers} layers, fewer than the {S * v} stages of {S} devices x {v} chunks")
    keras.utils.set_random_seed(args.seed)
    if problem := checks.model_problem(one_device_model("/CPU:0", x.shape[1:], args.seed), x, args.recompute):
        common.refuse(problem)
    bubble, ideal = ps.expected(orders)
    recomputed = "; each backward reruns its forward (--recompute)" * args.recompute
    print(
        f"pipeline: {S * v} stages on {devices}{f', {v} a device' * (v > 1)}; {args.schedule}, "
        f"M={args.micro_batches} micro-batches of {args.batch // args.micro_batches}; Adam per stage{recomputed}"
    )
    others = ", ".join(f"{kind} {found[0]:.0%}" for kind, found in every_bubble(S, args.micro_batches, v).items())
    print(f"bubble: with equal stages (F = B = W) each device idles {bubble:.0%} of a step, and the ideal "
          f"speed-up over the naive split is {ideal:.2f}x; the slowest stage sets the pace. Idle at this S and M: "
          f"{others}")  # fmt: skip
    return {"bubble": bubble, "ideal_speedup": ideal}


def every_bubble(S, M, v):
    """{schedule: (bubble, ideal speed-up)} of every schedule at S devices and M micro-batches (v: interleaved's)."""
    found = {}
    for kind in ps.EVERY_SCHEDULE:
        try:
            found[kind] = ps.expected(ps.orders_of(kind, S, M, max(v, 2) if kind == "interleaved" else 1))
        except ValueError:  # interleaving needs M a multiple of S
            continue
    return found


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", help="comma-separated device names (default: 3 GPUs, or --simulate 3)")
    p.add_argument("--simulate", type=int, metavar="N", help="N logical CPU devices (default without 3 GPUs: 3)")
    p.add_argument("--schedule", choices=ps.EVERY_SCHEDULE, default="1f1b")
    p.add_argument("--chunks", type=int, default=2, metavar="V", help="interleaved: V model chunks a device")
    p.add_argument("--micro-batches", type=int, default=6, help="M a step; it must divide --batch")
    p.add_argument("--recompute", action="store_true", help="keep each stage's input only; rerun its forward")
    p.add_argument("--batch", type=int, default=96, help="the global batch, cut into M micro-batches")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, help="stop after this many steps (with --check: compare so many; 5)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    p.add_argument("--handoff-wait", choices=("auto", "on", "off"), default="auto",
                   help="a stage waits for its output's copy to the next device (auto: on with CPUs only)")  # fmt: skip
    p.add_argument("--data", help="digits, or an .npz of x_train, y_train, x_test, y_test (default: Keras' MNIST)")
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights, dropout and the batches' order")
    p.add_argument("--check", action="store_true", help="compare with one device (float64); exit 1 if they differ")
    p.add_argument("--json", metavar="PATH", help="write the final metrics to PATH")
    a = p.parse_args(argv)
    problems = [
        (a.devices and a.simulate, "give --devices or --simulate, not both"),
        (a.simulate is not None and not 1 <= a.simulate <= 16, "--simulate: 1 to 16 devices"),
        (min(a.micro_batches, a.batch, a.epochs, a.steps or 1) < 1 or a.steps == 0, "--micro-batches, --batch, "
         "--epochs and --steps must be >= 1"),
        (a.chunks < 2 and a.schedule == "interleaved", f"--chunks {a.chunks}: interleaving needs 2 or more a device"),
        (a.batch % max(a.micro_batches, 1), f"--batch {a.batch}: give a multiple of --micro-batches {a.micro_batches}"),
        (not 0 < a.lr < float("inf"), f"--lr {a.lr}: give a positive learning rate, e.g. 1e-3"),
        (a.data not in (None, "digits") and not Path(a.data or "").is_file(), f"--data {a.data}: no such file"),
        (a.json and not Path(a.json).absolute().parent.is_dir(), f"--json {a.json}: no such folder"),
        (a.json and Path(a.json).is_dir(), f"--json {a.json}: a folder; give a file in it, e.g. {a.json}/m.json"),
    ]  # fmt: skip
    for message in [message for problem, message in problems if problem][:1]:
        p.error(message)
    a.steps = a.steps or (5 if a.check else None)
    return a


def main(argv=None):
    args = parse(argv)
    keras.utils.set_random_seed(args.seed)
    data = common.load_data(args.data, smallest=8)  # the CNN pools three times by 2
    devices = common.choose_devices(args.devices, args.simulate, want=3)
    metrics = plan(args, devices, data)
    program = SimpleNamespace(build=build, batches=batches, one_device_model=one_device_model)  # for the checks
    if args.check:
        metrics.update(checks.check(args, devices, data, program))
    else:
        metrics.update(train(args, build(args, devices, data[0][0].shape[1:]), data))
        metrics.update(checks.baseline(args, devices, data, program))  # not on logical CPUs: they cannot show speed
    said = {k: vars(args)[k] for k in ("schedule", "micro_batches", "chunks", "recompute", "batch")}
    common.write_json(args.json, {"devices": devices, **said, **metrics})
    return 1 if metrics.get("verdict", "ok") != "ok" else 0


if __name__ == "__main__":
    raise SystemExit(main())
