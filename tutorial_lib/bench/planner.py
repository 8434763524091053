"""The pipeline planner (examples/pipeline_planner.py) held against measured runs on core devices.

    python -m tutorial_lib.bench.planner            # 2 core devices, both models; a table and a verdict per model

For each model: its layers profiled on the first device (`measure_profile`), the hand-off timed between the two
(`measure_send`, a line through three sizes), every configuration ranked (`plan`); then the planner's top few and
the best of each other schedule built as `pipeline_split.SplitPipeline` runs on the devices, timed in interleaved
rounds, and the planner's first choice set against the fastest measured: within 10%? Notebook 05's last deep dive
calls these functions. With two cores, at most two core devices: a third would share a core.
"""

from __future__ import annotations

import numpy as np

from .. import models, pipeline_split, schedules, timing

WITHIN = 1.10  # the planner's first choice, measured, at most this over the best measured


def deep_narrow(i, n=16, width=256):
    """Layer i of a deep narrow MLP: n equal ReLU layers of `width`, the last one 10 logits out."""
    return models.Dense(width, 10 if i == n - 1 else width, relu=i < n - 1, seed=200 + i)


def heavy_block(i, n=8, width=128, heavy=1024):
    """Layer i of an MLP of n layers of `width` but layers 2 and 3, which go out to `heavy` and back: a block that
    costs as much as all the others, so the balanced cut is not the even one."""
    widths = [width] * (n + 1)
    widths[3], widths[n] = heavy, 10
    return models.Dense(widths[i], widths[i + 1], relu=i < n - 1, seed=300 + i)


MODELS = {"deep narrow MLP (16 x 256)": (deep_narrow, 16, 256), "MLP with one heavy block (8 x 128, 1024)":
          (heavy_block, 8, 128)}  # fmt: skip


def batch_of(width, rows, devices, seed=0):
    """A batch of `rows` random inputs on the first device and labels on the last."""
    import tensorflow as tf

    with tf.device(devices[0]):
        x = tf.random.stateless_normal([rows, width], [seed, 1])
    with tf.device(devices[-1]):
        y = tf.constant(np.arange(rows) % 10, tf.int32)
    return x, y


def profiles_of(make_layer, n_layers, x, y, devices, micro_batches, repeats=5):
    """({rows: Profile} on devices[0] for each M of `micro_batches`, a send time function of bytes)."""
    import pipeline_planner as planner
    import tensorflow as tf

    with tf.device(devices[0]):
        layers = [make_layer(i) for i in range(n_layers)]
    rows = [int(x.shape[0]) // m for m in micro_batches]
    found = {r: planner.measure_profile(layers, x, y, models.cross_entropy, devices[0], r, repeats) for r in rows}
    if len(devices) < 2:
        return found, 0.0
    sizes = [r * int(x.shape[1]) for r in rows]  # floats of a hand-off
    seconds = [planner.measure_send([size], devices[0], devices[1], repeats) for size in sizes]
    slope, latency = np.polyfit(np.multiply(sizes, 4), seconds, 1) if len(set(sizes)) > 1 else (0.0, seconds[0])
    return found, lambda nbytes: max(latency + slope * nbytes, 0.0)


def to_measure(plans, top=4):
    """The planner's `top` first plans, then the first of each schedule (and of one device) not among them."""
    chosen = list(plans[:top])
    for p in plans[top:]:
        if all((p.schedule, p.S) != (q.schedule, q.S) for q in chosen):
            chosen.append(p)
    return chosen


def name_of(p) -> str:
    v = f", v={p.v}" if p.schedule == "interleaved" else ""
    where = "one device" if p.S == 1 else f"{p.schedule}{v}"
    return f"{where}, M={p.M}{', recompute' if p.recompute else ''}"


def build(p, make_layer, n_layers, devices):
    """The SplitPipeline of plan `p`: its chunks cut where the plan says, each made on the device that runs it."""
    import tensorflow as tf

    placement, bounds = schedules.placement_of(p.schedule, p.S, p.v), (*p.cut, n_layers)
    chunks = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):  # noqa: B905 (one shorter by design)
        with tf.device(devices[placement[k]]):
            chunks.append(models.Sequential([make_layer(i) for i in range(a, b)]))
    kind = "1f1b" if p.S == 1 else p.schedule
    return pipeline_split.SplitPipeline(chunks, devices[: p.S], p.M, 0.0, kind, recompute=p.recompute)


def held_against_runs(make_layer, n_layers, width, devices, batch=512, micro_batches=(1, 2, 4, 8), rounds=8,
                      memory_limit=float("inf"), repeats=5):  # fmt: skip
    """Rows {name, plan, predicted, measured (Timing)} of the measured plans, in the planner's order, and (busy?,
    the machine's state) measured before and after."""
    import pipeline_planner as planner

    busy, said = timing.machine_state(timing.cores_taken(), len(devices))
    x, y = batch_of(width, batch, devices)
    profiles, send = profiles_of(make_layer, n_layers, x, y, devices, micro_batches, repeats)
    plans = planner.plan(profiles, batch, len(devices), memory_limit, t_send=send)
    chosen = to_measure(plans)
    pipes = {name_of(p): build(p, make_layer, n_layers, devices) for p in chosen}
    times = timing.interleaved(
        {name: (lambda pipe=pipe: pipe.train_step(x, y)) for name, pipe in pipes.items()}, rounds
    )
    after, said_after = timing.machine_state(timing.cores_taken(), len(devices))
    rows = [{"name": name_of(p), "plan": p, "predicted": p.step, "measured": times[name_of(p)]} for p in chosen]
    return rows, (busy or after, said if after <= busy else said_after)


def verdict(rows, busy):
    """(first choice's measured time over the best measured, the best's name, timing's verdict between them)."""
    best = min(rows, key=lambda r: r["measured"].median)
    first = rows[0]
    over = first["measured"].median / best["measured"].median
    word = "the same" if best is first else timing.verdict(first["measured"], best["measured"], busy)
    return over, best["name"], word


def report(name, rows, state) -> list[str]:
    busy, said = state
    lines = [f"{name}: {said}", f"  {'configuration':32s} {'predicted ms':>12s} {'measured ms':>12s} {'spread':>7s}"]
    for r in rows:
        t = r["measured"]
        lines.append(f"  {r['name']:32s} {r['predicted'] * 1e3:12.1f} {t.median * 1e3:12.1f} {t.spread * 1e3:7.1f}")
    over, best, word = verdict(rows, busy)
    within = "within" if over <= WITHIN else "NOT within"
    lines.append(f"  first choice {rows[0]['name']!r}: {over:.2f}x the best measured ({best!r}; {word}): "
                 f"{within} {WITHIN - 1:.0%}")  # fmt: skip
    return lines


def main():
    from .. import devices as tutorial_devices

    devs = tutorial_devices.simulate(2, kind="cores")
    for name, (make_layer, n_layers, width) in MODELS.items():
        rows, state = held_against_runs(make_layer, n_layers, width, devs)
        print("\n".join(report(name, rows, state)), flush=True)


if __name__ == "__main__":
    main()
