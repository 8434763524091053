"""The benchmark's pipeline case: the naive split against GPipe, 1F1B and data parallelism on
the same two devices, timed in interleaved rounds, and each schedule's bubble read from a trace.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import statistics

from .. import schedules, timing
from .rows import compared, row

# The name scopes of the pipelined step: stage{s}/F{m}/... and, for a backward, stage{s}/B{m}/...
# (a kept tape's ops also carry its forward's scope under gradient_tape/).
_OP_SCOPE = re.compile(r"(?P<tape>gradient_tape/)?stage(?P<stage>\d+)/(?P<op>[FB])(?P<m>\d+)/")


def input_width(width: int) -> int:
    """The width of the batch that `balanced_stages` takes: 1.5 x `width` (see there why)."""
    return width * 3 // 2


def balanced_stages(devs, width, depth=3):
    """Two stages of `depth` ReLU layers, one per device, that cost the same to train: a layer
    trains with three products (forward, weight and input gradients), but the model's first has
    no input gradient, so its input is 1.5 x as wide (`input_width`) and its two cost three."""
    import tensorflow as tf

    from .. import models

    stages = []
    for s, d in enumerate(devs):
        with tf.device(d):
            widths = [input_width(width) if s == 0 else width] + [width] * depth
            layers = [
                models.Dense(a, b, relu=True, seed=10 * s + i) for i, (a, b) in enumerate(itertools.pairwise(widths))
            ]
            stages.append(models.Sequential(layers + ([models.Dense(width, 10)] if s else [])))
    return stages


def dense_batch(batch, width, devs, seed=0):
    """A random batch of `width` features, on the first device, and its labels on the last."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    with tf.device(devs[0]):
        x = tf.constant(rng.normal(size=(batch, width)).astype(np.float32))
    with tf.device(devs[-1]):
        y = tf.constant(rng.integers(0, 10, batch).astype(np.int32))
    return x, y


def naive_step(stages, devs):
    """The naive split as one tf.function: one device busy at a time. It updates nothing (SGD at
    rate 0, which keeps the backward: unused gradients would be pruned) and ends, as a
    pipeline's step does, by counting itself on the first device (`traced_steps` reads that)."""
    import tensorflow as tf

    from .. import pipeline

    with tf.init_scope(), tf.device(devs[0]):
        count = tf.Variable(0, dtype=tf.int64, trainable=False, name="naive_step")
    sizes = [len(stage.trainable_variables) for stage in stages]

    @tf.function
    def naive(x, y):
        loss, grads = pipeline.staged_gradients(stages, devs, x, y)
        per_stage = [grads[sum(sizes[:s]) : sum(sizes[: s + 1])] for s in range(len(stages))]
        with tf.control_dependencies(pipeline.update_stages(stages, devs, per_stage, 0.0)), tf.device(devs[0]):
            count.assign_add(1)
        return loss

    return naive


def pipeline_vs_naive(devs, width=384, batch=768, micro_batches=4, sweep=(1, 2), repeats=10):
    """The case's rows: each variant's time and speedup over the naive split on a 2-stage MLP of
    equal stages, and the traced bubble of GPipe at `micro_batches` and each M of `sweep`, and of 1F1B."""
    from .. import pipeline

    pair, M = list(devs[:2]), micro_batches
    stages = balanced_stages(pair, width)
    x, y = dense_batch(batch, input_width(width), pair)
    kinds = [("gpipe", M), ("1f1b", M), *(("gpipe", m) for m in sweep)]
    pipes = {f"{k}, M={m}": pipeline.Pipeline(stages, pair, m, learning_rate=0.0, schedule=k) for k, m in kinds}
    rows = _timed_rows(stages, pair, pipes, x, y, M, repeats)
    for pipe in pipes.values():
        pipe.check_batch(x, y)  # traced_step takes checked batches
    traced = traced_steps({name: pipe.traced_step for name, pipe in pipes.items()}, x, y, pair)
    by_name = {r["variant"]: r for r in rows}
    for name, pipe in pipes.items():
        if name not in by_name:  # traced only
            by_name[name] = row("pipeline", name, None, devices=len(pair))
            rows.append(by_name[name])
        by_name[name].update(bubble(traced[name], pipe))
    return rows


def _timed_rows(stages, pair, pipes, x, y, M, repeats):
    naive = naive_step(stages, pair)
    variants = {"naive split": lambda: naive(x, y)}
    for name in (f"gpipe, M={M}", f"1f1b, M={M}"):
        variants[name] = lambda pipe=pipes[name]: pipe.train_step(x, y)
    variants["data parallel"] = data_parallel_variant(pair, x, y)
    times = timing.interleaved(variants, rounds=repeats)
    rows = [row("pipeline", name, t, devices=len(pair)) for name, t in times.items()]
    for r in rows:
        if r["variant"] != "naive split":
            r.update(compared(times[r["variant"]], times["naive split"], "speedup_vs_naive"))
    return rows


def data_parallel_variant(devs, x, y):
    """The same model, a replica per device, each on its half of the batch: a function of no arguments."""
    import tensorflow as tf

    from .. import models, replicated

    replicas = []
    for d in devs:
        with tf.device(d):
            replicas.append(models.Sequential(balanced_stages([d, d], int(x.shape[1]) * 2 // 3)))  # equal weights
    step = replicated.make_train_step(replicas, devs, learning_rate=0.0)
    return lambda: step(x, y)


def traced_steps(steps: dict, x, y, devs) -> dict:
    """{name: the events of its second step, times from its first op} for each tf.function of
    (x, y) in `steps`, all in ONE capture (a capture costs seconds). A step is cut at its step
    counter's update on the first device, so each function must end with one (`naive_step`)."""
    import tensorflow as tf

    from .. import timeline

    concrete = [fn.get_concrete_function(x, y) for fn in steps.values()]
    events = timeline.trace(lambda: [fn(x, y) for fn in steps.values() for _ in range(2)], placement_of=concrete)
    first = devs[0]
    ends = sorted(e.end for e in events if _is_counter(e, first))
    if len(ends) != 2 * len(steps):
        where = tf.DeviceSpec.from_string(first).to_string()
        raise RuntimeError(f"expected {2 * len(steps)} step counter updates on {where} in the trace, found {len(ends)}")
    read = {}
    for k, name in enumerate(steps):
        before, end = ends[2 * k], ends[2 * k + 1]
        start = min(e.start for e in events if e.device == first and before < e.start <= end)
        window = [e for e in events if start <= e.start <= end]
        read[name] = [dataclasses.replace(e, start=e.start - start, end=e.end - start) for e in window]
    return read


def _is_counter(event, first_device) -> bool:
    """The step counter's update: an AssignAddVariableOp on the first device outside an optimizer's update."""
    return event.type == "AssignAddVariableOp" and event.device == first_device and "update" not in event.op


def bubble(events, pipe) -> dict:
    """Read from one traced step of `pipe`: each stage device's idle share, the pacing stage's
    (the least idle: a faster stage also waits for the slower, which is imbalance, not the
    schedule's bubble), the formula's, and the schedule's own with this step's op times."""
    from .. import timeline

    busy = timeline.busy_fraction(events, pipe.devices)
    idle = [1 - busy[d] for d in pipe.devices]
    pace = idle.index(min(idle))
    op_ms = op_times(events, pipe.devices)
    return {
        "schedule": pipe.kind,
        "micro_batches": pipe.micro_batches,
        "idle_per_stage": idle,
        "bubble_measured": idle[pace],
        "bubble_theory": schedules.bubble_fraction(len(pipe.stages), pipe.micro_batches),
        "bubble_schedule": schedules.simulated_idle(pipe.orders, op_ms["F"], op_ms["B"])[pace],
        "op_ms": op_ms,
    }


def op_times(events, devices) -> dict[str, list[float]]:
    """{"F": [...], "B": [...]}: each stage's mean forward and backward in milliseconds, from its
    first op to its last on its device (reads of weights left out: they run as soon as the op's
    turn comes, before its input has arrived)."""
    spans = {}
    for e in events:
        found = _OP_SCOPE.search(e.op)
        if found and e.type != "ReadVariableOp" and e.device == devices[int(found["stage"])]:
            key = (int(found["stage"]), "B" if found["tape"] or found["op"] == "B" else "F", int(found["m"]))
            a, b = spans.get(key, (e.start, e.end))
            spans[key] = (min(a, e.start), max(b, e.end))
    times = {}
    for (s, op, _), (a, b) in spans.items():
        times.setdefault((s, op), []).append(b - a)
    return {op: [statistics.fmean(times.get((s, op), [0.0])) for s in range(len(devices))] for op in "FB"}


def summary(rows) -> list[str]:
    """The case's headline, one line per schedule and for data parallelism: the speedup over the
    naive split with its verdict, and the bubble read from the trace against the formula's."""
    lines = []
    for r in (r for r in rows if r.get("case") == "pipeline" and "speedup_vs_naive" in r):
        low, high = r["speedup_vs_naive_range"]
        line = f"pipeline {r['variant']}: {r['speedup_vs_naive']:.2f}x the naive split "
        line += f"(range {low:.2f}-{high:.2f}, {r['speedup_vs_naive_verdict']})"
        if "bubble_measured" in r:
            line += f"; bubble {r['bubble_measured']:.3f} (formula {r['bubble_theory']:.3f})"
        lines.append(line)
    return lines
