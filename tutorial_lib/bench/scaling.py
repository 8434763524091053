"""Weak and strong scaling of the course's MLP on 1..N devices, with their summary lines.

Variants: the hand towers (`towers.make_train_step`: one copy of the variables, averaged on
the first device), the replicated step (`replicated.make_train_step`: a replica per device,
ring all-reduce) and, on devices of this process, `MirroredStrategy` (it refuses core devices).
"""

from __future__ import annotations

import functools
import itertools

from .. import checks, timing
from .rows import compared, device_model, row, synthetic_batch

LEARNING_RATE = 0.01  # every variant's SGD step: the same update, so only the time differs


def efficiency(t, one, k: int, examples: int, one_examples: int) -> dict:
    """Throughput on k devices over k times that on one, with its range; the verdict says whether
    k devices process examples faster than one, beyond the spreads."""
    fields = compared(_per(t, examples), _per(one, one_examples), "efficiency")
    fields["efficiency"] /= k
    fields["efficiency_range"] = [v / k for v in fields["efficiency_range"]]
    return fields


def _per(t: timing.Timing, count: float) -> timing.Timing:
    return timing.Timing(t.median / count, t.spread / count, t.samples)  # per example


def weak_scaling(devs, hidden=(256, 256), per_device=(256,), repeats=15, steps_per_call=1) -> list[dict]:
    """The same batch per device on 1..N devices, for each per-device batch of the sweep; each call
    runs `steps_per_call` steps (`in_one_call`), and the times are per step."""
    checks.whole_number(steps_per_call, "steps_per_call")  # before the sweep prints and builds anything
    rows = []
    for b in per_device:
        print(f"[weak] {b} per device, on 1 to {len(devs)} devices ...", flush=True)
        rows += _weak_at(devs, hidden, b, repeats, steps_per_call)
    return rows


def in_one_call(step, k: int):
    """`step` (a tf.function of (x, y)) run k times in one tf.function: one call from this process
    per k steps. On core devices each call is a remote call that a GPU's host would not wait for:
    k > 1 spreads its cost over k steps. The steps run in order: each reads the weights the one
    before wrote."""
    import tensorflow as tf

    if checks.whole_number(k, "k (steps per call)") == 1:  # 0 would run no step and fail inside the tf.function
        return step
    return tf.function(lambda x, y: [step(x, y) for _ in range(k)][-1])


def _weak_at(devs, hidden, b, repeats, steps_per_call=1):
    """Every variant on 1..N devices, all in the same interleaved rounds."""
    x, y = synthetic_batch(b * len(devs))
    variants = {}
    for k in range(1, len(devs) + 1):
        xk, yk = x[: b * k], y[: b * k]
        for name, step in _variants(devs[:k], hidden, xk, yk).items():
            variants[name, k] = functools.partial(in_one_call(step, steps_per_call), xk, yk)
    times = {key: _per(t, steps_per_call) for key, t in timing.interleaved(variants, rounds=repeats).items()}
    return [
        row("weak scaling", name, t, devices=k, per_device=b, examples_per_s=b * k / t.median)
        | efficiency(t, times[name, 1], k, b * k, b)
        for (name, k), t in times.items()
    ]


def _variants(devs, hidden, x, y) -> dict:
    """Each data-parallel step over `devs` by name; each returns a loss from every device that trains."""
    import tensorflow as tf

    from .. import models, replicated, towers

    with tf.device(devs[0]):
        net = models.MLP(hidden=hidden)
    replicas = []
    for d in devs:
        with tf.device(d):
            replicas.append(models.MLP(hidden=hidden))
    variants = {
        "hand towers": towers.make_train_step(net, devs, LEARNING_RATE),
        "ring, replicated": replicated.make_train_step(replicas, devs, learning_rate=LEARNING_RATE),
    }
    if device_model() != "cores":  # MirroredStrategy refuses devices of other processes
        variants["MirroredStrategy"] = _mirrored_step(devs, hidden, x, y)
    return variants


def _mirrored_step(devs, hidden, x, y):
    """MirroredStrategy's step on this batch, as a function of (x, y) like the others (it splits them itself)."""
    import tensorflow as tf

    from .. import models
    from ..strategy import mirrored_strategy, mirrored_train_step

    strategy = mirrored_strategy(devs)
    with strategy.scope():
        net, sgd = models.MLP(hidden=hidden), tf.keras.optimizers.SGD(LEARNING_RATE)
    step = mirrored_train_step(strategy, net, sgd)
    batches = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((x, y)).repeat()))
    return lambda _x, _y: step(batches, tf.constant(1))  # the strategy splits each batch over the replicas


def strong_scaling(devs, hidden=(256, 256), global_batch=512, repeats=15, steps_per_call=1) -> list[dict]:
    """The same global batch on 1..N devices (those that divide it): each device's share shrinks.
    Each call runs `steps_per_call` steps (`in_one_call`); the times are per step."""
    import tensorflow as tf

    from .. import models, towers

    checks.whole_number(steps_per_call, "steps_per_call")
    x, y = synthetic_batch(global_batch)
    variants = {}
    for k in (k for k in range(1, len(devs) + 1) if global_batch % k == 0):
        with tf.device(devs[0]):
            net = models.MLP(hidden=hidden)
        step = in_one_call(towers.make_train_step(net, devs[:k], LEARNING_RATE), steps_per_call)
        variants[k] = functools.partial(step, x, y)
    times = {k: _per(t, steps_per_call) for k, t in timing.interleaved(variants, rounds=repeats).items()}
    return [
        row("strong scaling", "hand towers", t, devices=k, global_batch=global_batch)
        | efficiency(t, times[1], k, global_batch, global_batch)
        for k, t in times.items()
    ]


def summary(rows) -> list[str]:
    """One line per variant and device count of weak scaling, and per strong-scaling row beyond one device."""
    lines = []
    groups = {}
    for r in rows:
        if r["case"] == "weak scaling" and r["devices"] > 1 and "efficiency" in r:
            groups.setdefault((r["variant"], r["devices"]), []).append(r)
    for (variant, k), mine in groups.items():
        mine.sort(key=lambda r: r["per_device"])
        figures = ", ".join(f"{r['efficiency']:.2f} at {r['per_device']}" for r in mine)
        line = f"{variant}, {k} devices, weak-scaling efficiency per per-device batch: {figures}"
        if len(mine) > 1:  # a trend needs two points at least
            rising = all(a["efficiency"] < b["efficiency"] for a, b in itertools.pairwise(mine))
            line += f"; rising with the batch: {'yes' if rising else 'no'}"
        lines.append(line)
    for r in rows:
        if r["case"] == "strong scaling" and r["devices"] > 1:
            lines.append(
                f"strong scaling, global batch {r['global_batch']}: efficiency {r['efficiency']:.2f} on "
                f"{r['devices']} devices; {r['devices']} devices against one: {r['efficiency_verdict']}"
            )
    return lines
