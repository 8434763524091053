"""Sharding (notebook 08's lessons, copied here): ZeRO stages 1-3 built from the ring's two halves
on an MLP whose layers are flat vectors, and Megatron's f and g operators; each step adds the
bytes each device sends to `traffic`.

The package's `zero_step`, `zero3_by_layer` and `memory_per_device` are the lessons with their arguments checked
first (the guard rails at the end, beside the lesson code, never inside it).
"""

from __future__ import annotations

import functools
import math

import tensorflow as tf

from . import checks
from . import devices as _devices
from .allreduce import all_gather, reduce_scatter, ring_all_reduce


# lesson: 08_sharding
def shard_sizes(size, n):
    """How the ring cuts `size` elements into n chunks: as equal as possible, the first ones one longer."""
    return [size // n + (1 if c < size % n else 0) for c in range(n)]


# lesson: 08_sharding
def apply_layer(flat, x, widths, k):
    """Layer k: weights and bias kept as ONE flat vector (as FSDP keeps a layer), ReLU after all but the last."""
    fan_in, units = widths[k], widths[k + 1]
    w, b = tf.split(flat, [fan_in * units, units])
    x = x @ tf.reshape(w, [fan_in, units]) + b
    return tf.nn.relu(x) if k < len(widths) - 2 else x


# lesson: 08_sharding
def forward(flats, x, widths):
    """The MLP: its layers one after the other."""
    for k, flat in enumerate(flats):
        x = apply_layer(flat, x, widths, k)
    return x


# lesson: 08_sharding
def adam_update(p, g, m, v, step, lr=1e-2, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """Keras's Adam on any slice of the parameters: every operation is elementwise."""
    m = m + (g - m) * (1 - beta_1)
    v = v + (tf.square(g) - v) * (1 - beta_2)
    alpha = lr * math.sqrt(1 - beta_2**step) / (1 - beta_1**step)
    return p - alpha * m / (tf.sqrt(v) + epsilon), m, v


# lesson: 08_sharding
SHARDED = {0: (), 1: ("m", "v"), 2: ("grads", "m", "v"), 3: ("params", "grads", "m", "v")}


# lesson: 08_sharding
def make_state(flats, devices, stage):
    """What each device holds, as variables on it: per layer the whole vector, or, for what the
    stage shards (SHARDED[stage]), only device i's chunk i."""
    state = []
    for i, d in enumerate(devices):
        held = {"params": [], "grads": [], "m": [], "v": []}
        for flat in flats:
            chunk = tf.split(flat, shard_sizes(flat.shape[0], len(devices)))[i]
            for kind in held:
                piece = chunk if kind in SHARDED[stage] else flat
                with tf.device(d):
                    held[kind].append(tf.Variable(piece if kind == "params" else tf.zeros_like(piece)))
        state.append(held)
    return state


# lesson: 08_sharding
def memory_per_device(state, devices):
    """Bytes of params, grads and Adam's m and v on each device, read from where each variable lives."""
    table = {d: {"params": 0, "grads": 0, "optimizer": 0} for d in devices}
    for held in state:
        for kind, variables in held.items():
            for v in variables:
                key = "optimizer" if kind in ("m", "v") else kind
                where = next(d for d in devices if v.device.endswith(d))  # '/job:localhost/.../device:CPU:1'
                table[where][key] += v.shape.num_elements() * v.dtype.size
    return table


# lesson: 08_sharding
def counted(collective, tensors, devices, traffic):
    """Run one ring half and add the bytes each device sent to `traffic`."""
    stats = {}
    out = collective(tensors, devices, stats)
    for i, sent in enumerate(stats["bytes_sent"]):
        traffic[i] += sent
    return out


# lesson: 08_sharding
def gather_weights(state, devices, traffic):
    """Stage 3: every layer's whole weights on every device, all-gathered from the chunks."""
    layers = [
        counted(all_gather, [h["params"][k] for h in state], devices, traffic) for k in range(len(state[0]["params"]))
    ]
    return [list(per_device) for per_device in zip(*layers, strict=True)]


# lesson: 08_sharding
def local_loss(flats, x, y, widths):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, forward(flats, x, widths)))


# lesson: 08_sharding
def update_layer(state, devices, k, per_device, stage, step, traffic):
    """Layer k's gradients (one per device) summed by the ring, then Adam: on the whole layer on
    every device (stage 0), or on chunk i only on device i (stages 1-3)."""
    n = len(devices)
    if stage == 0:  # all-reduce = reduce-scatter + all-gather; every device updates everything
        summed = counted(all_gather, counted(reduce_scatter, per_device, devices, traffic), devices, traffic)
        for held, d, g in zip(state, devices, summed, strict=True):
            with tf.device(d):
                p, m, v = adam_update(held["params"][k], g, held["m"][k], held["v"][k], step)
            held["grads"][k].assign(g), held["params"][k].assign(p), held["m"][k].assign(m), held["v"][k].assign(v)
        return
    shards = counted(reduce_scatter, per_device, devices, traffic)  # device i: chunk i of the sum
    updated = []
    for i, (held, d) in enumerate(zip(state, devices, strict=True)):
        held["grads"][k].assign(per_device[i] if stage == 1 else shards[i])  # stage 1 holds it whole
        with tf.device(d):  # the split too: outside, device i's weights would be split on the default device
            mine = held["params"][k]
            if stage < 3:
                mine = tf.split(mine, shard_sizes(mine.shape[0], n))[i]
            p, m, v = adam_update(mine, shards[i], held["m"][k], held["v"][k], step)
        held["m"][k].assign(m), held["v"][k].assign(v)
        updated.append(p)
    if stage < 3:  # stages 1-2: the updated chunks, gathered back into every device's whole weights
        updated = counted(all_gather, updated, devices, traffic)
    for held, p in zip(state, updated, strict=True):
        held["params"][k].assign(p)


# lesson: 08_sharding
def zero_step(state, devices, x, y, widths, stage, step, traffic):
    """One step of ZeRO stage 1, 2 or 3 (0: plain data parallelism) on the global batch x, y;
    returns the mean loss. Each device sees 1/N of the batch."""
    n = len(devices)
    xs, ys = tf.split(x, n), tf.split(y, n)
    if stage == 3:  # forward: gather the weights, use them, drop them (only the loss is kept)
        weights = gather_weights(state, devices, traffic)
        losses = [local_loss(w, a, b, widths) for w, a, b in zip(weights, xs, ys, strict=True)]
        weights = gather_weights(state, devices, traffic)  # backward: gather again, recompute
    else:
        weights = [held["params"] for held in state]
    grads, tape_losses = [], []
    for d, w, a, b in zip(devices, weights, xs, ys, strict=True):
        with tf.device(d), tf.GradientTape() as tape:
            tape.watch(w)
            loss = local_loss(w, a, b, widths)
        grads.append([g / n for g in tape.gradient(loss, w)])  # the mean over devices, once summed
        tape_losses.append(loss)
    losses = losses if stage == 3 else tape_losses
    for k in range(len(widths) - 1):
        update_layer(state, devices, k, [g[k] for g in grads], stage, step, traffic)
    return float(tf.add_n([tf.identity(v) for v in losses]) / n)


# lesson: 08_sharding
def gather_layer(state, devices, k, traffic):
    """Stage 3, one layer: layer k's whole weights on every device, all-gathered from its chunks."""
    return counted(all_gather, [h["params"][k] for h in state], devices, traffic)


# lesson: 08_sharding
def note_peak(gathered, peak):
    """peak[i]: the most bytes of whole weights device i has held at once, counted from the tensors
    the code keeps (`gathered`: layer -> its copies, one per device)."""
    for i in range(len(peak)):
        now = sum(copies[i].shape.num_elements() * copies[i].dtype.size for copies in gathered.values())
        peak[i] = max(peak[i], now)


# lesson: 08_sharding
def forward_by_layer(state, devices, xs, widths, traffic, peak):
    """Each layer gathered just before its forward, the next one's gather issued first (prefetch),
    dropped after use. Returns the outputs and each layer's inputs (kept for the backward)."""
    layers, inputs = len(widths) - 1, []
    gathered = {0: gather_layer(state, devices, 0, traffic)}
    for k in range(layers):
        if k + 1 < layers:
            gathered[k + 1] = gather_layer(state, devices, k + 1, traffic)  # prefetch
        note_peak(gathered, peak)
        weights, outputs = gathered.pop(k), []  # layer k: used once, then dropped
        for d, w, a in zip(devices, weights, xs, strict=True):
            with tf.device(d):
                outputs.append(apply_layer(w, a, widths, k))
        inputs.append(xs)
        xs = outputs
        del weights
    return xs, inputs


# lesson: 08_sharding
def backward_by_layer(state, devices, inputs, upstream, widths, step, traffic, peak):
    """From the last layer down: gather it again (prefetching the one below), recompute this one
    layer from its kept input under a tape, take both gradients, drop the weights, and
    reduce-scatter the weights' gradient into each device's chunk at once, then Adam on it."""
    layers = len(widths) - 1
    gathered = {layers - 1: gather_layer(state, devices, layers - 1, traffic)}
    for k in reversed(range(layers)):
        if k > 0:
            gathered[k - 1] = gather_layer(state, devices, k - 1, traffic)  # prefetch
        note_peak(gathered, peak)
        weights, grads, below = gathered.pop(k), [], []
        for d, w, a, g in zip(devices, weights, inputs[k], upstream, strict=True):
            with tf.device(d), tf.GradientTape() as tape:
                tape.watch([w, a])
                out = apply_layer(w, a, widths, k)
            grad_w, grad_a = tape.gradient(out, [w, a], output_gradients=g)
            grads.append(grad_w)
            below.append(grad_a)
        del weights
        update_layer(state, devices, k, grads, 3, step, traffic)  # reduce-scatter, Adam on my chunk
        upstream = below


# lesson: 08_sharding
def zero3_by_layer(state, devices, x, y, widths, step, traffic, peak):
    """One ZeRO-3 step as FSDP runs it, one layer's weights at a time (plus the next, prefetched);
    returns the mean loss and raises peak[i] to the most bytes of whole weights device i held."""
    n = len(devices)
    ys = tf.split(y, n)
    logits, inputs = forward_by_layer(state, devices, tf.split(x, n), widths, traffic, peak)
    losses, upstream = [], []
    for d, z, labels in zip(devices, logits, ys, strict=True):
        with tf.device(d), tf.GradientTape() as tape:
            tape.watch(z)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, z))
        upstream.append(tape.gradient(loss, z) / n)  # the mean over devices, once summed
        losses.append(loss)
    backward_by_layer(state, devices, inputs, upstream, widths, step, traffic, peak)
    return float(tf.add_n([tf.identity(v) for v in losses]) / n)


# lesson: 08_sharding
def placed(tensors, devices):
    """tensors[i] on devices[i] (tf.custom_gradient returns its outputs on the default device)."""
    out = []
    for t, d in zip(tensors, devices, strict=True):
        with tf.device(d):
            out.append(tf.identity(t))
    return out


# lesson: 08_sharding
def g_operator(parts, devices, traffic):
    """Megatron's g: all-reduce in the forward (the sum of the devices' partial outputs), identity backward."""

    @tf.custom_gradient
    def g(*tensors):
        return counted(ring_all_reduce, list(tensors), devices, traffic), lambda *upstream: list(upstream)

    return placed(g(*parts), devices)


# lesson: 08_sharding
def f_operator(copies, devices, traffic):
    """Megatron's f: identity in the forward, all-reduce of the input's gradient in the backward."""

    @tf.custom_gradient
    def f(*tensors):
        return placed(tensors, devices), lambda *upstream: counted(ring_all_reduce, list(upstream), devices, traffic)

    return placed(f(*copies), devices)


# lesson: 08_sharding
def megatron_mlp(x_copies, a_parts, b_parts, devices, traffic):
    """Z = relu(X A) B with A split by columns and B by rows: device i computes relu(X A_i) B_i,
    its part of Z, with no communication; g sums the parts, f all-reduces X's gradient."""
    x_copies = f_operator(x_copies, devices, traffic)
    parts = []
    for x, a, b, d in zip(x_copies, a_parts, b_parts, devices, strict=True):
        with tf.device(d):
            parts.append(tf.nn.relu(x @ a) @ b)
    return g_operator(parts, devices, traffic)


# --- guard rails: the lessons' public names check their arguments before any write -----------


def check_zero_step(state, devices, x, y, widths, stage, step, traffic) -> None:
    """Refuse what zero_step cannot do right, before it writes `traffic` or any variable."""
    checks.whole_number(step, "step")  # Adam's bias correction divides by 1 - beta_1**step: 0 at step 0
    if stage not in SHARDED:
        raise ValueError(f"stage must be one of {sorted(SHARDED)} (0: plain data parallelism), got {stage!r}.")
    devices = checks.device_list(devices)
    checks.same_length("devices", devices, "device states", state)
    checks.same_length("devices", devices, "traffic counters", traffic)
    if len(widths) - 1 != len(state[0]["params"]):
        raise ValueError(f"widths {tuple(widths)} make {len(widths) - 1} layers, the state holds "
                         f"{len(state[0]['params'])}: pass the widths the state was made for.")  # fmt: skip
    if x.shape[0] != y.shape[0] or x.shape[0] % len(devices):
        raise ValueError(f"{x.shape[0]} examples and {y.shape[0]} labels on {len(devices)} devices: give as "
                         f"many labels as examples, a multiple of {len(devices)} (each device gets 1/N).")  # fmt: skip


def check_zero3_by_layer(state, devices, x, y, widths, step, traffic, peak) -> None:
    """Refuse what zero3_by_layer cannot do right: zero_step's checks, one peak per device, and a
    state whose weights are chunks (stage 3), not whole copies that all-gather would repeat N times."""
    check_zero_step(state, devices, x, y, widths, 3, step, traffic)
    checks.same_length("devices", devices, "peak counters", peak)
    for k in range(len(widths) - 1):
        size, held = widths[k] * widths[k + 1] + widths[k + 1], sum(h["params"][k].shape[0] for h in state)
        if held != size:
            raise ValueError(f"layer {k} has {size} numbers but the devices hold {held} of its weights: "
                             "zero3_by_layer needs a stage-3 state, make_state(flats, devices, 3).")  # fmt: skip


def _checked(lesson, check):
    """`lesson`, with `check` run on its arguments first."""

    @functools.wraps(lesson)
    def checked(*args, **kwargs):
        check(*args, **kwargs)
        return lesson(*args, **kwargs)

    return checked


def _memory_per_device(lesson):
    """`lesson` (memory_per_device) for device names in any form ('/CPU:0'): it matches the ends of
    the variables' full names, so it is given the canonical names, and the table keeps the names given."""

    @functools.wraps(lesson)
    def memory(state, devices):
        full = [_devices.normalize(d) for d in checks.device_list(devices)]
        if len(set(full)) < len(full):
            raise ValueError(f"devices {list(devices)} name a device twice; name each once.")
        for v in (v for held in state for variables in held.values() for v in variables):
            if not any(v.device.endswith(d) for d in full):
                raise ValueError(f"a variable lives on {v.device}, not one of {list(devices)}: "
                                 "pass the devices the state was made on (make_state).")  # fmt: skip
        return dict(zip(devices, lesson(state, full).values(), strict=True))

    return memory


zero_step = _checked(zero_step, check_zero_step)
zero3_by_layer = _checked(zero3_by_layer, check_zero3_by_layer)
memory_per_device = _memory_per_device(memory_per_device)
