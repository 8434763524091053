"""The benchmark's data-parallel cases: weak and strong scaling of the course's MLP.

Weak scaling keeps the batch per device and adds devices, for each per-device batch of a
sweep; its variants are the hand-built towers (`towers.make_train_step`, one copy of the
variables), a ring all-reduce between replicas, and TensorFlow's own data parallelism:
`MirroredStrategy` on devices of this process, `MultiWorkerMirroredStrategy` on core
devices (`bench_worker`). Strong scaling keeps the global batch. `bench` runs them;
`ring_step` is public so that notebook 06 can check it against the single-device reference.
"""

from __future__ import annotations

import functools

from . import timing
from .bench_rows import compared, device_model, row, synthetic_batch

LEARNING_RATE = 0.01  # every variant's SGD step: the same update, so only the time differs


def weak_scaling(devs, hidden=(256, 256), per_device=256, repeats=15):
    """Same batch per device, 1..N devices, for each per-device batch (an int or a sweep of them).

    Variants: hand towers (`towers.make_train_step`), ring all-reduce between replicas, and
    TensorFlow's own data parallelism: `MirroredStrategy` on devices of this process,
    `MultiWorkerMirroredStrategy` with one worker per core on core devices (see
    `bench_worker`; timed in its own processes, so not in the others' rounds), with the hand
    towers' speedup over it. Efficiency on k devices is the one-device step time over the
    k-device one, with the range that the spreads allow.
    """
    sweep = (per_device,) if isinstance(per_device, int) else tuple(per_device)
    rows = []
    for b in sweep:
        rows += _weak_scaling_at(devs, hidden, b, repeats)
    if device_model() == "cores" and len(devs) > 1:
        rows += _mwms_rows(rows, devs, hidden, sweep, repeats)
    return rows


def _weak_scaling_at(devs, hidden, per_device, repeats):
    """Every variant at 1..N devices, all timed in the same interleaved rounds."""
    x, y = synthetic_batch(per_device * len(devs))
    variants = {}
    for k in range(1, len(devs) + 1):
        xk, yk = x[: per_device * k], y[: per_device * k]
        for name, step in _weak_variants(devs[:k], hidden, xk, yk).items():
            variants[name, k] = functools.partial(step, xk, yk)
    timings = timing.interleaved(variants, rounds=repeats)
    rows = []
    for (name, k), t in timings.items():
        new = row("weak scaling", name, *t, devices=k, per_device=per_device, examples_per_s=per_device * k / t.median)
        efficiency, low, high = timing.ratio(timings[name, 1], t)
        rows.append({**new, "efficiency": efficiency, "efficiency_range": [low, high]})
    return rows


def _weak_variants(devs, hidden, x, y) -> dict:
    """Each data-parallel step over `devs`, by name; each returns a loss from every device that trains."""
    import tensorflow as tf

    from . import models, towers

    with tf.device(devs[0]):
        net = models.MLP(hidden=hidden)
    replicas = []
    for d in devs:
        with tf.device(d):
            replicas.append(models.MLP(hidden=hidden))
    variants = {
        "hand towers": towers.make_train_step(net, devs, LEARNING_RATE),
        "ring, replicated": ring_step(replicas, devs),
    }
    if device_model() != "cores":  # MirroredStrategy refuses devices of other processes
        variants["MirroredStrategy"] = _mirrored_step(devs, hidden, x, y)
    return variants


def ring_step(replicas, devs):
    """A replicated SGD step: replica k trains on device k's share of the batch, and the gradients
    are averaged by ring all-reduce so that every replica applies the same update; returns each
    device's loss (their mean is the loss of the whole batch)."""
    import tensorflow as tf

    from . import allreduce, models, towers

    @tf.function
    def step(x, y):
        grads, losses = [], []
        for d, net, xs, ys in zip(devs, replicas, tf.split(x, len(devs)), tf.split(y, len(devs)), strict=True):
            with tf.device(d):
                with tf.GradientTape() as tape:
                    loss = models.cross_entropy(net(xs), ys)
                grads.append(tape.gradient(loss, net.trainable_variables))
                losses.append(loss)
        for net, g in zip(replicas, allreduce.allreduce_grads(grads, method="ring"), strict=True):
            towers.apply_sgd(net.trainable_variables, g, LEARNING_RATE)
        # One value from every device: on a GPU, fetching them waits for each device's work.
        return losses

    return step


def _mirrored_step(devs, hidden, x, y):
    """MirroredStrategy's step on this batch, as a function of (x, y) like the others (it splits them itself)."""
    import tensorflow as tf

    from . import models
    from .strategy import mirrored_strategy, mirrored_train_step

    strategy = mirrored_strategy(devs)
    with strategy.scope():
        net, sgd = models.MLP(hidden=hidden), tf.keras.optimizers.SGD(LEARNING_RATE)
    k, batch = len(devs), int(x.shape[0])
    step = mirrored_train_step(strategy, net, sgd, batch)
    dist = strategy.experimental_distribute_values_from_function(
        lambda ctx: (tf.split(x, k)[ctx.replica_id_in_sync_group], tf.split(y, k)[ctx.replica_id_in_sync_group])
    )
    return lambda _x, _y: step(*dist)


def _mwms_rows(rows, devs, hidden, sweep, repeats):
    """MultiWorkerMirroredStrategy on as many cores as devices, against the hand towers on the devices."""
    from .bench_worker import time_mwms

    k = len(devs)
    print(f"[weak] MultiWorkerMirroredStrategy: {k} worker processes, one per core ...", flush=True)
    timings = time_mwms(k, hidden, sweep, rounds=repeats)
    new = []
    for b, t in timings.items():
        hand = next(r for r in rows if (r["variant"], r["devices"], r["per_device"]) == ("hand towers", k, b))
        hand_t = timing.Timing(hand["ms"] / 1e3, hand["spread_ms"] / 1e3)
        mwms = row(
            "weak scaling", "MultiWorkerMirroredStrategy", *t, devices=k, per_device=b, examples_per_s=b * k / t.median
        )
        mwms["timed"] = "in its own processes, after the other variants: not interleaved with them"
        new.append({**mwms, **compared(hand_t, t, "hand_towers_speedup")})
    return new


def strong_scaling(devs, hidden=(256, 256), global_batch=512, repeats=15):
    """Same global batch, 1..N devices: each device's share shrinks."""
    import tensorflow as tf

    from . import models, towers

    x, y = synthetic_batch(global_batch)
    variants = {}
    for k in range(1, len(devs) + 1):
        if global_batch % k:
            continue
        with tf.device(devs[0]):
            net = models.MLP(hidden=hidden)
        variants[k] = functools.partial(towers.make_train_step(net, devs[:k], LEARNING_RATE), x, y)
    timings = timing.interleaved(variants, rounds=repeats)
    rows = []
    for k, t in timings.items():
        new = row("strong scaling", "hand towers", *t, devices=k, examples_per_s=global_batch / t.median)
        efficiency, low, high = timing.ratio(timings[1], t)
        rows.append({**new, "efficiency": efficiency / k, "efficiency_range": [low / k, high / k]})
    return rows
