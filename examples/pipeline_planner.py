"""Choose a pipeline for your model: which schedule, how many stages S (and chunks v), micro-batches M and whether
to recompute, under a memory limit per device. `plan` predicts each configuration's step with
pipeline_schedules.simulate and each device's peak activation memory along the schedule's order, drops those over
the limit and ranks the rest, fastest first. `measure_profile` times your model's layers on one device and sizes
what they keep; `measure_send` times a hand-off. A profile holds, per layer, for a micro-batch of `rows` examples:
seconds of its forward F, input gradient B, weights' gradient W and whole backward (cheaper than B and W apart);
bytes an F keeps until its B (read by the input's gradient only), until its W (read by the weights' gradient: a
Dense layer's input), and that a B leaves for its W (output gradients); its input's bytes (all a chunk keeps when
it recomputes) and its weights' (with their gradients and optimizer state). Left out: each op's fixed cost (the
executor's; between processes, their waits), which grows with v M per device: measure the first few choices.
"""

import itertools
import time
from collections import namedtuple

import numpy as np
import tensorflow as tf
from pipeline_schedules import EVERY_SCHEDULE, orders_of, placement_of, simulate, stages_of, whole_number

# Per layer, for a micro-batch of `rows` examples: seconds (forward ... backward), then bytes (until_b ... weights).
Profile = namedtuple("Profile", "rows forward input_grad weight_grad backward until_b until_w b_to_w inputs weights")
# A configuration: cut, the first layer of each chunk; step, seconds; peak, bytes per device; idle, the largest
# share of the step that a device idles.
Plan = namedtuple("Plan", "schedule S v M recompute cut step peak idle")


def check_profile(profile):
    """The profile, or a ValueError that says which field is wrong and how."""
    if not (n := len(profile.forward)):
        raise ValueError("the profile has no layers: measure_profile(layers, ...) with at least one layer.")
    for name in Profile._fields[1:]:
        values = getattr(profile, name)
        if len(values) != n:
            raise ValueError(f"profile.{name} has {len(values)} values for {n} layers: give one per layer.")
        if not all(np.isfinite(t) and t >= 0 for t in values):
            raise ValueError(f"profile.{name} must hold finite numbers >= 0, got {values}.")
    if not sum(profile.forward) > 0:
        raise ValueError("profile.forward is all zeros: a step takes some time; measure it (measure_profile).")
    return profile


def balanced_cut(cost, chunks):
    """The first layer of each of `chunks` contiguous chunks of layers whose largest total `cost` is the least."""
    n = len(cost)
    if chunks > n:
        raise ValueError(f"cannot cut {n} layers into {chunks} chunks: use fewer stages or chunks per device.")
    prefix = np.concatenate([[0.0], np.cumsum(cost)])
    best = {(0, 0): (0.0, ())}  # (layers used, chunks made) -> (largest chunk, starts)
    for k in range(1, chunks + 1):
        for end in range(k, n - (chunks - k) + 1):
            best[end, k] = min(
                (max(best[start, k - 1][0], prefix[end] - prefix[start]), (*best[start, k - 1][1], start))
                for start in range(k - 1, end)
                if (start, k - 1) in best
            )
    return best[n, chunks][1]


def chunk_sums(values, cut):  # per chunk, the sum over its layers
    bounds = (*cut, len(values))
    return [sum(values[a:b]) for a, b in zip(bounds, bounds[1:])]  # noqa: B905 (one shorter by design)


def device_times(profile, cut, placement, orders, recompute, hop=0.0):
    """Per device, (F, B, W) of one micro-batch through all its chunks; B of a device that does not split its
    backwards is the whole backward less W (simulate adds W back); recomputation adds F to B; an F or B whose
    output goes to another device takes `hop` more (its sender waits until it has arrived)."""
    fields = ("forward", "input_grad", "weight_grad", "backward")
    f, b, w, whole = (chunk_sums(getattr(profile, k), cut) for k in fields)
    times = [[0.0, 0.0, 0.0] for _ in orders]
    for k, d in enumerate(placement):
        split = any(op[0] == "W" for op in orders[d])
        down, up = (0 <= j < len(placement) and placement[j] != d for j in (k + 1, k - 1))
        times[d][0] += f[k] + hop * down
        times[d][1] += (b[k] if split else whole[k] - w[k]) + (f[k] if recompute else 0.0) + hop * up
        times[d][2] += w[k]
    return [list(t) for t in zip(*times)]  # noqa: B905


def peak_memory(profile, cut, orders, placement, recompute):
    """Per device, the most bytes it holds along its order: each chunk's weights, and per micro-batch what each F
    keeps until its B or W (its chunk's input among them) and what a B keeps until its W; recomputing, only the
    chunk's input from F on, and what the forward rerun in B keeps from B on."""
    fb, fw, bw = (chunk_sums(getattr(profile, k), cut) for k in ("until_b", "until_w", "b_to_w"))
    stage, peaks = stages_of(orders, placement), []
    for d, order in enumerate(orders):
        split = any(op[0] == "W" for op in order)
        spans, where = [], {(op[0], op[1], op[2] if len(op) > 2 else 0): i for i, op in enumerate(order)}
        for (kind, m, c), i in where.items():
            if kind != "F":
                continue
            k = stage[d, c]
            b, w = where["B", m, c], where.get(("W", m, c), where["B", m, c])
            kept = [(fb[k], i, b), (fw[k], i, w)] if not recompute else [(fb[k], b, b), (fw[k], b, w)]  # rerun in B
            spans += [*kept, (profile.inputs[cut[k]], i, w), (bw[k] * split, b, w)]
        held = np.zeros(len(order))
        for nbytes, first, last in spans:
            held[first : last + 1] += nbytes
        weights = sum(chunk_sums(profile.weights, cut)[k] for (dev, _), k in stage.items() if dev == d)
        peaks.append(float(held.max() + weights))
    return tuple(peaks)


def configurations(n_layers, devices, micro_batches, max_v=4):
    """(schedule, S, v, M) of every pipeline that can run: S from 1 to `devices` (S = 1 is one device, "1f1b");
    interleaved with v in 2..max_v and M a multiple of S; ZB-V with v = 2; never more chunks than layers."""
    for S, M in itertools.product(range(1, devices + 1), micro_batches):
        kinds = [("1f1b", 1)] if S == 1 else [(k, 1) for k in ("gpipe", "1f1b", "zb_h1")] + [("zb_v", 2)]
        kinds += [("interleaved", v) for v in range(2, max_v + 1) if S > 1 and M % S == 0]
        yield from ((kind, S, v, M) for kind, v in kinds if S * v <= n_layers)


def plan(profiles, batch, devices, memory_limit=float("inf"), t_send=0.0, schedules=EVERY_SCHEDULE, max_v=4,
         sender_waits=True):  # fmt: skip
    """Every configuration that fits `memory_limit` bytes per device, fastest predicted step first (then least
    memory). `profiles`: {rows: Profile} for each micro-batch size worth trying (M = batch / rows); `t_send`:
    seconds for a hand-off between two devices (measure_send), or a function of the bytes handed off (the largest
    input of a chunk); `sender_waits`: an op that hands off ends once it has arrived (pipeline_parallel's
    wait_for_arrival, on by default on CPUs), else only the receiver waits; `schedules`: those to try."""
    batch, devices = check_plan(profiles, batch, devices, memory_limit, t_send, schedules)
    n, found = len(next(iter(profiles.values())).forward), []
    for kind, S, v, M in configurations(n, devices, [batch // r for r in profiles], max_v):
        if kind in schedules or S == 1:
            for recompute in (False, True):
                found.append(predict(profiles[batch // M], kind, S, v, M, recompute, t_send, sender_waits))
    fits = [p for p in found if max(p.peak) <= memory_limit]
    if not fits:
        least = min(max(p.peak) for p in found)
        raise ValueError(f"nothing fits {memory_limit:.4g} bytes per device (the least needs {least:.4g}): allow "
                         "more memory, more devices or smaller micro-batches (profiles of fewer rows).")  # fmt: skip
    return sorted(fits, key=lambda p: (p.step, max(p.peak)))


def predict(profile, kind, S, v, M, recompute, t_send, sender_waits=True):
    """The Plan of one configuration: its layers cut into S v chunks of balanced F + backward, simulated."""
    orders, placement = orders_of(kind, S, M, v), placement_of(kind, S, v)
    cut = balanced_cut(np.add(profile.forward, profile.backward), S * v)
    if callable(t_send):  # the largest tensor handed from chunk to chunk
        t_send = t_send(max(profile.inputs[c] for c in cut[1:])) if S * v > 1 else 0.0
    times = device_times(profile, cut, placement, orders, recompute, t_send if sender_waits else 0.0)
    boxes = simulate(orders, *times, 0.0 if sender_waits else t_send, placement)
    step = max(start + took for *_, start, took in boxes)
    busy = [sum(took for dev, *_, took in boxes if dev == d) for d in range(S)]
    peak = peak_memory(profile, cut, orders, placement, recompute)
    return Plan(kind, S, v, M, recompute, cut, step, peak, 1 - min(busy) / step)


def check_plan(profiles, batch, devices, memory_limit, t_send, schedules):
    """(batch, devices) as whole numbers, or a ValueError that says what to give instead."""
    batch, devices = whole_number(batch, "batch"), whole_number(devices, "devices")
    if not profiles:
        raise ValueError("no profiles: give {rows: measure_profile(...)} for at least one micro-batch size.")
    for rows, profile in profiles.items():
        if check_profile(profile).rows != rows or batch % rows:
            raise ValueError(f"profile keyed {rows}: it was measured at {profile.rows} rows, and the batch {batch} "
                             "must be a multiple of its rows: key each profile by its rows.")  # fmt: skip
    if len({len(p.forward) for p in profiles.values()}) > 1:
        raise ValueError("the profiles have different numbers of layers: measure one model at every size.")
    if not memory_limit > 0 or not (callable(t_send) or 0 <= t_send < float("inf")):
        raise ValueError(f"memory_limit must be > 0 bytes, t_send a finite time >= 0 (or a function of bytes): got "
                         f"{memory_limit}, {t_send}.")  # fmt: skip
    unknown = set(schedules) - set(EVERY_SCHEDULE)
    if unknown:
        raise ValueError(f"unknown schedules {sorted(unknown)}: choose from {EVERY_SCHEDULE}.")
    return batch, devices


def _each(op, hs, repeats):
    """Median seconds of op(h) for one h of `hs`: op on each in ONE call, which shares out the call's own cost (a
    round trip to a core device), one number sent back; after one untimed call (tracing)."""
    fn = tf.function(lambda hs: tf.add_n([tf.reduce_sum(t) for h in hs for t in tf.nest.flatten(op(h))]))
    fn(hs).numpy()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(hs).numpy()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) / len(hs)


def measure_profile(layers, x, y, loss_fn, device, rows, repeats=7, optimizer_slots=2, copies=8):
    """A Profile of `layers` (callables in order, each with its `trainable_variables`; the last one's output goes
    to `loss_fn(out, y)`) at micro-batches of `rows` examples of x, timed on `device`: F, and F with B, with W and
    with both, less F, each on `copies` inputs per call. Bytes from the tensors' sizes: each layer's output is kept
    from F until W (the next layer's W reads it as its input), its output gradient from B to W if it has weights;
    its weights are counted 2 + `optimizer_slots` times (weights, summed gradient, Adam's two moments)."""
    rows = whole_number(rows, "rows")
    if rows > int(x.shape[0]):
        raise ValueError(f"rows={rows} is more than the {x.shape[0]} examples given: give a batch of at least rows.")
    times, sizes = {k: [] for k in ("F", "B", "W", "BW")}, {k: [] for k in ("out", "in", "grad", "weights")}
    nbytes = lambda t: int(np.prod(t.shape)) * t.dtype.size  # noqa: E731
    with tf.device(device):
        h, labels = tf.identity(x[:rows]), tf.identity(y[:rows])
        for i, layer in enumerate(layers):
            hs = [h * (1 + j / 64) for j in range(copies)]  # distinct inputs: no op is computed once for all
            last = i == len(layers) - 1
            run = (lambda h, layer=layer: loss_fn(layer(h), labels)) if last else layer
            variables = list(getattr(layer, "trainable_variables", ()))
            forward = _each(run, hs, repeats)
            times["F"].append(max(forward - _each(tf.identity, hs, repeats), 0.0))  # less reading the input
            for kind, with_input, wrt in (("B", True, []), ("W", False, variables), ("BW", True, variables)):
                with_input = with_input and i > 0  # the first layer's input is data: no gradient
                grads = lambda h, run=run, a=with_input, wrt=wrt: _gradients(run, h, wrt, a)  # noqa: E731
                times[kind].append(_each(grads, hs, repeats) - forward if with_input or wrt else 0.0)
            out = run(h)
            sizes["in"].append(nbytes(h))
            sizes["out"].append(0 if last else nbytes(out))
            sizes["grad"].append(nbytes(out) if variables and not last else 0)
            sizes["weights"].append(sum(nbytes(v) for v in variables) * (2 + optimizer_slots))
            h = out
    clip = lambda ts: tuple(max(t, 0.0) for t in ts)  # noqa: E731 (a difference of medians can dip below 0)
    return Profile(rows, tuple(times["F"]), clip(times["B"]), clip(times["W"]), clip(times["BW"]),
                   (0,) * len(layers), tuple(sizes["out"]), tuple(sizes["grad"]), tuple(sizes["in"]),
                   tuple(sizes["weights"]))  # fmt: skip


def _gradients(run, h, variables, with_input):
    """The gradients of run(h) with respect to h (if `with_input`) and `variables`."""
    with tf.GradientTape() as tape:
        tape.watch(h)
        out = run(h)
    return tape.gradient(out, [h] * with_input + list(variables), unconnected_gradients=tf.UnconnectedGradients.ZERO)


def measure_send(shape, source, target, repeats=9, hops=16):
    """Seconds to hand a float32 tensor of `shape` between devices `source` and `target` inside one graph, as a
    pipeline does: a chain of `hops` ops alternately on each, less the same chain all on `source`, per hop."""
    with tf.device(source):
        t = tf.random.normal(shape)
    there, home = (_each(lambda t, p=p: _chain(t, p, hops), [t], repeats) for p in ([target, source], [source]))
    return max(there - home, 0.0) / hops


def _chain(t, path, hops):  # t through `hops` ops placed in turn on the devices of `path`
    for i in range(hops):
        with tf.device(path[i % len(path)]):
            t = t + 1.0
    return tf.reduce_max(t)
