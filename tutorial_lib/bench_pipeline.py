"""The benchmark's pipeline case: one-graph GPipe and 1F1B against the naive split, the parts
of the gap to the ideal speedup, and the same model data-parallel on the same devices.

`pipeline_vs_naive(devs)` times, in the same interleaved rounds, on a 2-stage MLP whose
stages do equal work (`balanced_stages`), every batch resident where it is used:

- the naive split, GPipe and 1F1B at M micro-batches and at M = 1, 2, 4 (the bubble, read
  from traced steps, against (S-1)/(M+S-1)), GPipe with recomputation, fed from this
  process with and without `StagedInput`, and 1F1B steps a call each against a wave of
  steps in one call (`Pipeline.train_steps`);
- "data parallel, ring": each device a full replica on its half of the batch, gradients
  averaged by ring all-reduce (`data_parallel_step`);
- for the parts of the gap (`gap_parts`): each stage alone on its device (the whole batch,
  then M micro-batches); the rest of the parts come from the traced steps. And every
  stage's work at M at once, each on its device with no hand-off ("stages together"): how
  much the stages slow each other down by sharing the machine alone.

`memory_rows(devs)` reads each schedule's stash from a profiler trace of a step and turns
it into bytes of kept activations.
"""

from __future__ import annotations

import itertools
import statistics

from . import checks, timing
from .bench_rows import compared, row
from .timing import Timing, measure


def input_width(width: int) -> int:
    """The width of the batch that `balanced_stages` takes: 1.5 x `width` (see there why)."""
    return width * 3 // 2


def balanced_stages(devs, width, depth=3):
    """Two stages of `depth` ReLU layers, one per device, that cost the same to train.

    A layer costs its forward, its weight gradient and, except on the first layer of the
    model, its input gradient: three matrix products of the same size. The first layer has
    no input gradient to compute, so it takes a batch 1.5 x as wide (`input_width`), which
    makes its two products cost three of the others: each stage then does 3 x depth (the
    second also computes the small logits).
    """
    import tensorflow as tf

    from . import models

    stages = []
    for s, d in enumerate(devs):
        with tf.device(d):
            widths = [input_width(width) if s == 0 else width] + [width] * depth
            pairs = enumerate(itertools.pairwise(widths))
            layers = [models.Dense(a, b, relu=True, seed=10 * s + i) for i, (a, b) in pairs]
            stages.append(models.Sequential(layers + ([models.Dense(width, 10)] if s else [])))
    return stages


def dense_batch(batch, width, seed=0):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=(batch, width)).astype(np.float32))
    return x, tf.constant(rng.integers(0, 10, batch).astype(np.int32))


def naive_step(stages, devs):
    """The naive split (notebook 01) as one tf.function: one device busy at a time."""
    import tensorflow as tf

    from . import pipeline

    variables = [v for stage in stages for v in stage.trainable_variables]

    @tf.function
    def naive(x, y):  # the update keeps the backward pass: unused gradients would be pruned
        loss, grads = pipeline.sequential_gradients(stages, devs, x, y)
        for v, g in zip(variables, grads, strict=True):
            with tf.device(v.device):
                v.assign_sub(0.0 * g)
        return loss

    return naive


def data_parallel_step(replicas, devs, learning_rate):
    """Data parallelism on the same devices: replica k (the whole model, on device k) trains on
    shard k; the gradients are averaged by ring all-reduce, so every replica applies the same
    update. `step(x_shards, y_shards)` returns the mean loss, equal to the whole batch's."""
    import tensorflow as tf

    from . import allreduce, models, reference

    @tf.function
    def step(x_shards, y_shards):
        grads, losses = [], []
        for d, net, xs, ys in zip(devs, replicas, x_shards, y_shards, strict=True):
            with tf.device(d):  # the backward too: outside a device scope it would run in this process
                with tf.GradientTape() as tape:
                    losses.append(models.cross_entropy(net(xs), ys))
                grads.append(tape.gradient(losses[-1], net.trainable_variables))
        for net, g in zip(replicas, allreduce.allreduce_grads(grads, method="ring", devices=devs), strict=True):
            reference.apply_sgd(net.trainable_variables, g, learning_rate)
        with tf.device(devs[0]):
            return tf.add_n(losses) / len(losses)

    return step


# --- the parts of the gap to the ideal speedup ----------------------------------------------


def _stage_work(stages, s, micro_batches):
    """Stage s's forwards and backwards of M micro-batches, alone on its device, as the pipeline
    runs them (an input gradient except on the first stage), without waiting for any other stage.
    A function of (stage input, upstream gradient or labels) returning a checksum, the outputs
    and the input gradients of each micro-batch."""
    import tensorflow as tf

    from . import models

    last, stage = s == len(stages) - 1, stages[s]

    def work(h, after):
        outs, g_ins, total = [], [], None
        for hm, am in zip(tf.split(h, micro_batches), tf.split(after, micro_batches), strict=True):
            with tf.GradientTape() as tape:
                tape.watch(hm)
                out = stage(hm)
                target = models.cross_entropy(out, am) if last else out
            g = tape.gradient(target, ([hm] if s else []) + list(stage.trainable_variables), None if last else am)
            g_ins += g[:1] if s else []
            total = (
                g[1 if s else 0 :] if total is None else [a + b for a, b in zip(total, g[1 if s else 0 :], strict=True)]
            )
            outs.append(out)
        # the checksum uses the input gradients too: TensorFlow would not compute them otherwise
        return tf.add_n([tf.reduce_sum(t) for t in [*total, *g_ins]]), outs, g_ins

    return work


def _gap_variants(stages, devs, inputs, micro_batches):
    """Timed functions for `gap_parts`: each stage alone on its device, at M = 1 and at M; and
    every stage's work at M at the same time, each on its device, none waiting for another
    (`sharing_slowdown`)."""
    import tensorflow as tf

    def on_devices(works):
        outs = []
        for s, work in works.items():
            with tf.device(devs[s]):
                outs.append(work(*inputs[s])[0])
        return outs

    variants = {}
    for s in range(len(stages)):
        for m in sorted({1, micro_batches}):
            work = {s: _stage_work(stages, s, m)}
            variants[f"stage {s} alone, M={m}"] = (
                tf.function(lambda work=work: on_devices(work)),
                {"part": "stage alone", "stage": s, "m": m},
            )
    every = {s: _stage_work(stages, s, micro_batches) for s in range(len(stages))}
    variants[f"stages together, M={micro_batches}"] = (
        tf.function(lambda: on_devices(every)),
        {"part": "stages together", "m": micro_batches},
    )
    return {name: (lambda *_, fn=fn: fn(), info) for name, (fn, info) in variants.items()}


def gap_parts(rows, variant: str) -> dict[str, float]:
    """The gap between `variant`'s step time and the formula's, t_naive (M+S-1)/(S M), in
    measured parts (milliseconds) that add up to it.

    Each part is the change from one model of the step to the next, every model built from
    measurements of the same run: t_s(m), stage s timed alone on its device at m micro-batches,
    and the traced steps of `variant` (`idle_shares`), read for the stage that sets the pace:
    its busy share and the parts of its idle share (`bubble_parts`). The profiler slows the
    steps it traces, so the traced shares are applied to the timed step: b, the pacing
    stage's busy time, is its busy share of the timed step.
    1. the naive split's transfers and call, which the formula divides among the stages too:
       the ideal with only the stages' compute, Σ_s t_s(1), in place of t_naive;
    2. micro-batching: Σ_s t_s(M) in place of Σ_s t_s(1) (M small products against one);
    3. imbalance: the slowest stage sets the pace, S max_s t_s(M) in place of Σ_s t_s(M);
    4. both devices at once: b in place of the slowest stage alone (its ops run slower next to
       the other stage's work and the transfers: shared cores, caches and memory);
    5. the schedule with this run's op times: its idle share in place of the formula's;
    6. gaps inside ops: the executor going from one op to the next;
    7. the rest of the idle share: waiting for hand-offs and for the update; with it, the
       model is the timed step.
    """
    rows = [r for r in rows if r.get("case", "pipeline") == "pipeline"]  # not the memory rows' names
    by = {r["variant"]: r for r in rows}
    row_, naive = by[variant], by["naive split"]
    S, M = row_.get("devices", 2), row_["micro_batches"]
    alone = {(r["stage"], r["m"]): r["ms"] for r in rows if r.get("part") == "stage alone"}
    if (0, M) not in alone:
        raise ValueError(
            f"{variant!r}: the stages were timed alone at M = {sorted({m for _, m in alone})}, not at {M}."
        )
    if "bubble_parts" not in row_:
        raise ValueError(f"{variant!r} has no traced steps (bubble_parts): only the plain schedules are traced.")
    parts = row_["bubble_parts"]
    if not (row_["bubble_measured"] < 1 and parts["schedule"] + parts["inside ops"] < 1):
        raise ValueError(f"{variant!r}: the pacing stage was idle for the whole step: there is no busy time to split.")
    fill = (M + S - 1) / M  # the pipeline's length in steps of the slowest stage: 1 / (1 - formula)
    ideal = naive["ms"] * fill / S
    busy = row_["ms"] * (1 - row_["bubble_measured"])  # the pacing stage's busy share of the timed step
    models = [
        ideal,
        sum(alone[s, 1] for s in range(S)) * fill / S,
        sum(alone[s, M] for s in range(S)) * fill / S,
        max(alone[s, M] for s in range(S)) * fill,
        busy * fill,
        busy / (1 - parts["schedule"]),
        busy / (1 - parts["schedule"] - parts["inside ops"]),
        row_["ms"],  # busy / (1 - the measured idle share)
    ]
    names = [
        "naive's transfers and call (the formula divides them)",
        "micro-batching (M small products, not one)",
        "imbalance (the slowest stage sets the pace)",
        "both devices at once (ops slowed by the other stage and the transfers)",
        "the schedule with this run's op times, not the formula's",
        "gaps inside ops (the executor between two ops)",
        "the rest: waiting for hand-offs and for the update",
    ]
    return {
        "measured_ms": row_["ms"],
        "ideal_ms": ideal,
        "gap_ms": row_["ms"] - ideal,
        **{name: b - a for name, a, b in zip(names, models[:-1], models[1:], strict=True)},
    }


def sharing_rows(rows, micro_batches: int) -> tuple[dict, dict]:
    """The row of every stage's work at M timed at once, each on its device with no hand-off
    ("stages together"), and the row of the slowest stage timed alone at M."""
    together = [r for r in rows if r.get("part") == "stages together" and r["m"] == micro_batches]
    alone = [r for r in rows if r.get("part") == "stage alone" and r["m"] == micro_batches]
    if not (together and alone):
        raise ValueError(f"the stages were not timed alone and together at M = {micro_batches}.")
    return together[0], max(alone, key=lambda r: r["ms"])


def sharing_slowdown(rows, micro_batches: int) -> float:
    """How much slower every stage's work at M ran all at once (`sharing_rows`) than the
    slowest stage alone: the cost of sharing the machine (the cores' caches and memory, and
    this process driving every device at once), which part 4 of `gap_parts` includes. 0.1 is
    10% slower. Both are medians of noisy times: compare them with their spreads
    (`timing.verdict`) before reading a small figure."""
    together, slowest = sharing_rows(rows, micro_batches)
    return together["ms"] / slowest["ms"] - 1


# --- the case --------------------------------------------------------------------------------


def pipeline_vs_naive(
    devs, width=512, batch=2048, micro_batches=8, repeats=5, rounds=3, steps=4, gap=True, memory=True, traced_steps=3
):
    """A 2-stage MLP of equal stages: the naive split against the one-graph GPipe and 1F1B steps,
    data parallelism on the same devices, (with `gap`) the measurements of `gap_parts`, and
    (with `memory`) the rows of `memory_rows`, case "pipeline memory", after the timed ones.

    Variants are interleaved in `rounds` (each round measures every variant once, `repeats`
    calls, and keeps their median) so that a busy machine slows them alike; each row's figure
    is the median of its round medians, its spread their range. The main rows also carry
    `controller_cores`: the cores this process keeps busy while it drives the step
    (`timing.cores_used`), which it takes from the devices' cores when there is no spare one.
    The bubble of each plain GPipe and 1F1B row is read from traced steps (`idle_shares`):
    `idle_per_stage`, the share of a step each stage's device ran none of its ops (and
    `start_skew_ms`, how long after the step's earliest op the first stage started), and
    `bubble_measured`, the least of them: the idle share of the stage that sets the pace (the
    formula assumes equal stages; a faster stage also waits for the slower one, which is
    imbalance, not the schedule's bubble), and `bubble_parts`, its measured parts: the
    schedule's own idle share with this run's op times, the executor's gaps inside ops, and
    the rest (waiting for hand-offs and for the update). `bubble_from_times`, 1 - t_naive / (S t), reads it
    from the times instead, as if the naive split were S stages' work one after the other: it
    also counts what slows the two devices down together and the naive split's own overlaps.
    """
    pair, M = devs[:2], micro_batches
    stages = balanced_stages(pair, width)
    x, y = dense_batch(batch, input_width(width))
    variants, pipes = _schedule_variants(stages, pair, x, y, M, steps)
    # Every variant gets its batch where it is used (the input on the first stage, the labels on
    # the last; a replica's shard on its device), so that no step but the two "fed from here"
    # pays a copy from this process.
    resident = _resident(pair, x, y)
    variants["data parallel, ring"] = _data_parallel_variant(pair, width, x, y)
    if gap:
        variants.update(_gap_variants(stages, pair, _stage_inputs(stages, pair, x, y), M))
    rows = _interleaved("pipeline", variants, resident, rounds, repeats, devices=len(pair))
    for r in rows:  # this process's own CPU, which it takes from the devices' cores while it drives them
        if r["variant"] in ("naive split", f"gpipe, M={M}", f"1f1b, M={M}", "data parallel, ring"):
            r["controller_cores"] = timing.cores_used(variants[r["variant"]][0], *resident, repeats=repeats)
    rows = _with_ratios(rows, len(pair))
    for r in rows:  # after the timed rounds: a traced step is slower, and would disturb them
        if r["variant"] in pipes:
            r.update(idle_shares(pipes[r["variant"]], *resident, steps=traced_steps))
            r.update(_bubble_parts(r))
    return rows + (memory_rows(devs, width, batch, M) if memory else [])


def _bubble_parts(r) -> dict:
    """The bubble of a traced row: the idle share of the stage that sets the pace (the least
    idle), its busy time, and its idle share's parts (`idle_shares`): the schedule with this
    run's op times, gaps inside ops, and the rest (waiting for hand-offs and for the update)."""
    pace = min(range(len(r["idle_per_stage"])), key=lambda s: r["idle_per_stage"][s])
    measured, schedule, inside = r["idle_per_stage"][pace], r["idle_in_schedule"][pace], r["idle_inside_ops"][pace]
    return {
        "bubble_measured": measured,
        "busy_ms": r["busy_ms_per_stage"][pace],
        "bubble_parts": {"schedule": schedule, "inside ops": inside, "rest": measured - schedule - inside},
    }


def idle_shares(pipe, x, y, steps=3) -> dict:
    """Read from `steps` traced steps of `pipe`, each the average over the steps:

    - `idle_per_stage`: the share of a step during which each stage's device ran none of its
      ops. A step lasts from the first stage's first op, which starts the pipeline, to the
      step counter's update, its last op (`traced_ms`; `busy_ms_per_stage`, the time each
      stage ran an op). Waiting for another stage counts as idle; an op that the other device
      slows down counts as busy, so what slows ops down (smaller products, two devices at
      once) shows in the times (`bubble_from_times`), not here.
    - `start_skew_ms`: how long after the step's earliest op the first stage started. A later
      stage that starts first (reading its weights, splitting its labels) waits for this
      process to start the first stage: a cost of the call, not of the schedule.
    - `between_steps_ms`: from one step's last op to the next step's first, the steps called
      one after another from this process: the cost of a call that a wave saves.
    - the parts of the idle share, per stage: `idle_in_schedule`, the schedule's own idle
      share if every forward and backward took this run's mean time on its stage (`op_ms`,
      first op to last, reads of weights left out) and nothing else cost anything
      (`pipeline.simulated_idle`); `idle_inside_ops`, the share during which a forward or
      backward had begun and not ended but none of its stage's ops ran (the executor going
      from one op to the next). The rest is waiting beyond what the schedule needs: for
      outputs and gradients to arrive, and for the other stage before the update.

    The trace holds one step more, first, which is not read: a profiler slows the first step
    it records.
    """
    from . import pipeline, timeline

    steps = checks.whole_number(steps, "steps")  # before anything is traced
    concrete = [pipe._train.get_concrete_function(x, y)]
    events = timeline.trace(pipe.train_step, x, y, steps=steps + 1, placement_of=concrete)
    ends = sorted(e.end for e in events if e.type == "AssignAddVariableOp")  # one per step
    if len(ends) != steps + 1:
        raise RuntimeError(f"expected {steps + 1} step counter updates in the trace, found {len(ends)}.")
    readings = [_read_step(events, pipe.devices, before, end) for before, end in itertools.pairwise(ends)]

    def mean(key):
        return statistics.fmean(r[key] for r in readings)

    def mean_per_stage(key):
        return [statistics.fmean(per_step) for per_step in zip(*(r[key] for r in readings), strict=True)]

    idle, traced_ms = mean_per_stage("idle"), mean("window")
    op_ms = _mean_op_ms([r["spans"] for r in readings], len(idle))
    return {
        "idle_per_stage": idle,
        "start_skew_ms": mean("skew"),
        "between_steps_ms": mean("between"),
        "traced_ms": traced_ms,
        "busy_ms_per_stage": [traced_ms * (1 - share) for share in idle],
        "op_ms": op_ms,
        "idle_in_schedule": pipeline.simulated_idle(pipe.orders, op_ms["F"], op_ms["B"]),
        "idle_inside_ops": mean_per_stage("inside"),
    }


def _mean_op_ms(spans_per_step, stages) -> dict[str, list[float]]:
    """{"F": [...], "B": [...]}: each stage's mean forward and backward, first op to last (0
    where a stage has none, such as a backward of a stage without weights)."""
    times = {}
    for spans in spans_per_step:
        for (s, op, _), (a, b) in spans.items():
            times.setdefault((s, op), []).append(b - a)
    return {op: [statistics.fmean(times.get((s, op), [0.0])) for s in range(stages)] for op in "FB"}


def _read_step(events, devices, before, end) -> dict:
    """One traced step, from the first op after `before` (the last step's counter update) to
    `end` (its own): its window, the first stage's lateness, the gap since the last step, each
    stage's idle share and share of gaps inside ops, and the spans of its forwards and backwards."""
    firsts = []
    for d in devices:
        starts = [e.start for e in events if e.device == d and before < e.start <= end]
        if not starts:
            raise RuntimeError(f"device {d} ran no op in a traced step: is every stage on its device?")
        firsts.append(min(starts))
    start = firsts[0]  # the first stage starts the pipeline
    spans = _op_spans([e for e in events if start <= e.start <= end], devices)
    inside = [
        sum(b - a - _busy_between(events, d, a, b) for (stage, _, _), (a, b) in spans.items() if stage == s)
        for s, d in enumerate(devices)
    ]
    return {
        "window": end - start,
        "skew": start - min(firsts),
        "between": min(firsts) - before,
        "idle": [1 - _busy_between(events, d, start, end) / (end - start) for d in devices],
        "inside": [gaps / (end - start) for gaps in inside],
        "spans": spans,
    }


def _op_spans(events, devices) -> dict:
    """{(stage, "F" or "B", m): (start, end)} of each forward and backward in `events` (one
    step), from the first to the last of its ops on its stage's device. Reads of weights are
    left out: they run as soon as the op's turn comes, before its input has arrived."""
    from . import pipeline

    spans = {}
    for e in events:
        found = pipeline._OP_NAME.match(e.op)
        if found and e.type != "ReadVariableOp" and e.device == devices[int(found["stage"])]:
            key = (int(found["stage"]), "B" if found["tape"] or found["op"] == "B" else "F", int(found["m"]))
            a, b = spans.get(key, (e.start, e.end))
            spans[key] = (min(a, e.start), max(b, e.end))
    return spans


def _busy_between(events, device, start, end) -> float:
    """Milliseconds between `start` and `end` during which `device` ran at least one op."""
    from . import timeline

    spans = timeline._merged((e.start, e.end) for e in events if e.device == device)
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)


def _schedule_variants(stages, pair, x, y, M, steps) -> dict:
    """The timed variants: the naive split, GPipe and 1F1B at M, GPipe at 1, 2, 4, 1F1B at 2, 4
    (at M = 1 it is GPipe), GPipe with recomputation, `steps` batches fed from this process
    with and without `StagedInput`, and `steps` 1F1B steps on resident batches, a call each or
    all in one call (`Pipeline.train_steps`, a wave). And the plain pipelines by name, for
    `idle_shares`."""
    import tensorflow as tf

    from . import pipeline

    batch = int(x.shape[0])
    variants, pipes = {"naive split": (naive_step(stages, pair), None)}, {}
    sweep = [("gpipe", 1), ("gpipe", 2), ("1f1b", 2), ("gpipe", 4), ("1f1b", 4)]  # 1F1B at M = 1 is GPipe
    for kind, m in [("gpipe", M), ("1f1b", M), *sweep]:
        if m <= M and batch % m == 0 and f"{kind}, M={m}" not in variants:
            pipe = pipes[f"{kind}, M={m}"] = pipeline.Pipeline(stages, pair, m, learning_rate=0.0, schedule=kind)
            variants[f"{kind}, M={m}"] = (pipe.train_step, {"schedule": kind, "micro_batches": m})
    recompute = pipeline.Pipeline(stages, pair, M, learning_rate=0.0, schedule="gpipe", recompute=True)
    info = {"schedule": "gpipe", "micro_batches": M}
    variants[f"gpipe, M={M}, recompute"] = (recompute.train_step, {**info, "recompute": True})
    pipe = pipeline.Pipeline(stages, pair, M, learning_rate=0.0, schedule="gpipe")
    staged = pipeline.StagedInput(pipe)
    batches = [(tf.identity(x), tf.identity(y)) for _ in range(steps)]  # in this process, not on the devices
    feeds = {
        f"gpipe, M={M}, {steps} steps fed from here": lambda *_: [pipe.train_step(*b) for b in batches],
        f"gpipe, M={M}, {steps} steps, StagedInput": lambda *_: staged.run(batches),
    }
    for name, fn in feeds.items():
        variants[name] = (fn, {**info, "steps": steps})
    waved = pipeline.Pipeline(stages, pair, M, learning_rate=0.0, schedule="1f1b")
    info = {"schedule": "1f1b", "micro_batches": M, "steps": steps}
    variants[f"1f1b, M={M}, {steps} steps, a call each"] = (
        lambda x, y: [waved.train_step(x, y) for _ in range(steps)],
        info,
    )
    variants[f"1f1b, M={M}, {steps} steps, one wave"] = (
        lambda x, y: waved.train_steps([x] * steps, [y] * steps),
        {**info, "wave": True},
    )
    return variants, pipes


def _with_ratios(rows, S):
    """Per step: the time, the speedup over the naive split (range, verdict) and the bubble."""
    from . import pipeline

    for r in rows:  # every figure is the time of one step
        r["ms"], r["spread_ms"] = r["ms"] / r.get("steps", 1), r["spread_ms"] / r.get("steps", 1)
    naive_ms, naive = rows[0]["ms"], _timing(rows[0])
    for r in rows:
        if "part" not in r:
            r.update(compared(_timing(r), naive, "speedup_vs_naive"))
        if r.get("micro_batches"):
            r["bubble_from_times"] = 1 - naive_ms / (S * r["ms"])
            r["bubble_theory"] = pipeline.bubble_fraction(S, r["micro_batches"])
    return rows


def _timing(r) -> Timing:
    return Timing(r["ms"] / 1e3, r["spread_ms"] / 1e3)


def _resident(devs, x, y):
    import tensorflow as tf

    with tf.device(devs[0]):
        x = tf.identity(x)
    with tf.device(devs[-1]):
        y = tf.identity(y)
    return x, y


def _data_parallel_variant(devs, width, x, y):
    import tensorflow as tf

    from . import models

    replicas, shards = [], []
    for d, xs, ys in zip(devs, tf.split(x, len(devs)), tf.split(y, len(devs)), strict=True):
        with tf.device(d):
            replicas.append(models.Sequential(balanced_stages([d, d], width)))  # the same weights on each
            shards.append((tf.identity(xs), tf.identity(ys)))
    step = data_parallel_step(replicas, devs, 0.0)
    x_shards, y_shards = [s[0] for s in shards], [s[1] for s in shards]
    return (lambda *_: step(x_shards, y_shards)), {"replicas": len(devs)}


def _stage_inputs(stages, devs, x, y):
    """Per stage, on its device: its input for the whole batch and what follows it (the upstream
    gradient of its output, or the labels on the last stage)."""
    import tensorflow as tf

    inputs, h = [], x
    for s, (stage, d) in enumerate(zip(stages, devs, strict=True)):
        with tf.device(d):
            h = tf.identity(h)
            out = stage(h)
            after = tf.identity(y) if s == len(stages) - 1 else tf.ones_like(out)
        inputs.append((h, after))
        h = out
    return inputs


def _interleaved(case, variants, args, rounds, repeats, **extra):
    """One row per variant: the median over `rounds` of its median time, every variant once per
    round, so that a slow minute slows them all; the spread is the range of the round medians."""
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (fn, _) in variants.items():
            times[name].append(measure(fn, *args, repeats=repeats)[0])
    return [
        row(case, name, statistics.median(times[name]), max(times[name]) - min(times[name]), **extra, **(info or {}))
        for name, (_, info) in variants.items()
    ]


# --- memory: the activations each schedule keeps, read from a traced step --------------------


def kept_bytes(stage, h, recompute: bool = False) -> int:
    """Bytes a stage keeps for one micro-batch until its backward: its input and every layer's
    output (what a kept tape needs for the gradients), or only its input when the backward
    recomputes the forward. Measured on the tensors of a forward of the micro-batch `h`."""
    layers = getattr(stage, "layers", [stage])
    total = h.shape.num_elements() * h.dtype.size
    if recompute:
        return total
    for layer in layers:
        h = layer(h)
        total += h.shape.num_elements() * h.dtype.size
    return total


def memory_rows(devs, width=512, batch=2048, micro_batches=8):
    """Per schedule: the micro-batches each stage kept at once in a traced step (read from the
    run, `pipeline.stash_from_trace`), the bound of its order, and the bytes of activations that
    stash holds (`kept_bytes` of one micro-batch, times the stash)."""
    import tensorflow as tf

    from . import pipeline, timeline

    pair, M = devs[:2], micro_batches
    stages = balanced_stages(pair, width)
    x, y = _resident(pair, *dense_batch(batch, input_width(width)))
    inputs, h = [], x[: batch // M]
    for stage, d in zip(stages, pair, strict=True):
        with tf.device(d):
            inputs.append(h)
            h = stage(h)
    rows = []
    for kind, recompute in (("sequential", False), ("gpipe", False), ("1f1b", False), ("gpipe", True)):
        pipe = pipeline.Pipeline(stages, pair, M, learning_rate=0.0, schedule=kind, recompute=recompute)
        events = timeline.trace(
            pipe.train_step, x, y, placement_of=lambda p=pipe: [p._train.get_concrete_function(x, y)]
        )
        stash = pipeline.stash_from_trace(events, len(stages))
        per_mb = [kept_bytes(st, i, recompute) for st, i in zip(stages, inputs, strict=True)]
        rows.append(
            {
                "case": "pipeline memory",
                "variant": f"{kind}, M={M}" + (", recompute" if recompute else ""),
                "ms": None,
                "spread_ms": None,
                "devices": len(pair),
                "stash_measured": stash,
                "stash_bound": pipeline.stash_bound(pipe.orders),
                "kept_bytes_per_micro_batch": per_mb,
                "peak_kept_bytes": [n * b for n, b in zip(stash, per_mb, strict=True)],
            }
        )
    return rows
