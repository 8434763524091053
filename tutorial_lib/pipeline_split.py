"""Schedules past GPipe's bound, run in TensorFlow (notebook 05's deep dive "Past GPipe's bound").

`SplitPipeline` runs the orders of `schedules.zb_h1` (zero bubble, Qi et al., ICLR 2024), of
`schedules.interleaved` (v model chunks per device, Narayanan et al., SC'21), and GPipe and 1F1B
for comparison, in ONE graph per step like `pipeline.Pipeline`. Each chunk keeps one tape per layer
per micro-batch, so its backward can be cut in two: B, the gradient of the chunk's input (which the
chunk before waits for), and W, the gradient of its weights (which can wait and fill idle slots).
`recompute=True` keeps only each chunk's input and reruns its forward in its backward.
`kept_bytes` reads from the traced step the activation bytes each device holds at its peak.
"""

from __future__ import annotations

import tensorflow as tf

from . import checks, models, pipeline, schedules
from .devices import normalize
from .pipeline import added_losses, run_stage

SPLIT_SCHEDULES = ("gpipe", "1f1b", "zb_h1", "interleaved")


# lesson: 05_staging_pipeline
def taped_forward(layers, h, finish=None, persistent=False):
    """h through `layers`, each under a tape of its own. Returns (the output, one (tape, input,
    output, added loss) per layer); `finish(out)` (the loss, on the last chunk) goes on the last
    layer's tape. A W needs a second call on each tape: `persistent=True`."""
    taped = []
    for i, layer in enumerate(layers):
        with tf.GradientTape(persistent=persistent) as tape:
            tape.watch(h)
            out = run_stage(layer, h)
            if finish is not None and i == len(layers) - 1:
                out = finish(out)
            added = added_losses(layer)
        taped.append((tape, h, out, added))
        h = out
    return h, taped


# lesson: 05_staging_pipeline
def input_gradients(taped, g, scale, need_input=True):
    """B: the chunk's backward along its inputs only, last layer first, from g, the gradient of
    its output. Returns (the gradient of the chunk's input, or None where nobody needs it; each
    layer's output gradient, which its W will need)."""
    g_outs = [None] * len(taped)
    for i in reversed(range(len(taped))):
        tape, h, out, added = taped[i]
        g_outs[i] = g
        if i or need_input:  # the first chunk's input is data: its gradient would be wasted work
            g = tape.gradient([out, added], h, [g, scale], unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return (g if need_input else None), g_outs


# lesson: 05_staging_pipeline
def weight_gradients(layers, taped, g_outs, scale):
    """W: each layer's weight gradients from its kept tape and its output's gradient (from B);
    the chunk's weights in order. It repeats part of B's work (an activation's backward, such as
    ReLU's, is needed by both): the price of the split."""
    grads = []
    for layer, (tape, _, out, added), g in zip(layers, taped, g_outs, strict=True):
        variables = list(getattr(layer, "trainable_variables", ()))
        if variables:
            grads += tape.gradient([out, added], variables, [g, scale],
                                   unconnected_gradients=tf.UnconnectedGradients.ZERO)  # fmt: skip
    return grads


def whole_backward(layers, taped, g, scale, need_input=True):
    """B and W at once (GPipe, 1F1B, interleaved): one gradient call per layer for its input and its
    weights. Returns (the gradient of the chunk's input or None, the chunk's weight gradients)."""
    grads = []
    for i in reversed(range(len(taped))):
        tape, h, out, added = taped[i]
        inputs = [h] if i or need_input else []
        got = tape.gradient([out, added], inputs + list(getattr(layers[i], "trainable_variables", ())), [g, scale],
                            unconnected_gradients=tf.UnconnectedGradients.ZERO)  # fmt: skip
        if inputs:
            g, got = got[0], got[1:]
        grads = list(got) + grads
    return (g if need_input else None), grads


def layers_of(chunk) -> list:
    """A chunk's layers (a `models.Sequential`'s or a Keras model's), or the chunk itself as one layer."""
    layers = getattr(chunk, "layers", None)
    return list(layers) if layers else [chunk]


def handed_off(t, device, wait_for_arrival):
    """`t` copied to `device` inside the op being built, so that the device's next op waits until it
    has arrived (`wait_for_arrival`, section 9 of notebook 05); else `t`, copied when it is read."""
    if not wait_for_arrival:
        return t
    with tf.device(device):
        return tf.identity(t)


def split_gradients(chunks, devices, orders, x, y, loss_fn, recompute=False, wait_for_arrival=True, start_after=()):
    """Build one step in the graph being traced: chunk k (on devices[k]) runs its F, B and W ops in
    the orders of `schedules.unroll_split`. Returns (the batch's mean loss, per chunk its weight
    gradients summed over the micro-batches). A device whose order has W ops splits its backwards."""
    S, K = len(orders), len(chunks)
    M = len({op[1] for op in orders[0]})
    split = [any(op[0] == "W" for op in order) for order in orders]
    with tf.device(devices[0]):
        inputs = {(0, m): xm for m, xm in enumerate(tf.split(x, M))}
    with tf.device(devices[-1]):
        labels = tf.split(y, M)
    after = [list(start_after) for _ in range(S)]  # each device's latest outputs: its next op waits for them
    kept, upstream, waiting, grads, losses = {}, {}, {}, [None] * K, []
    for d, kind, m, c in schedules.unroll_split(orders):
        k = c * S + d
        layers, scale = layers_of(chunks[k]), tf.constant(1 / M)
        finish = (lambda out, m=m: loss_fn(out, labels[m])) if k == K - 1 else None
        with tf.device(devices[k]), tf.name_scope(f"stage{k}/{kind}{m}"), tf.control_dependencies(after[d]):
            tf.no_op(name="start")  # marks where this op's part of the graph begins (a tape's ops take other names)
            if kind == "F":
                h = tf.identity(inputs.pop((k, m)))
                out, taped = taped_forward(layers, h, finish, persistent=split[d])
                kept[k, m] = h if recompute else taped  # recomputation keeps the chunk's input alone
                losses.append(tf.add_n([t[3] for t in taped]) + (out if k == K - 1 else 0.0))
                if k < K - 1:
                    out = inputs[k + 1, m] = handed_off(out, devices[k + 1], wait_for_arrival)
                after[d] = [out]
                continue
            if kind == "B":
                taped = kept.pop((k, m))
                if recompute:
                    with tf.name_scope("recompute"):
                        _, taped = taped_forward(layers, taped, finish, persistent=split[d])
                g = upstream.pop((k, m)) if k < K - 1 else scale  # d(mean of M)/d(loss m)
                if split[d]:
                    g_in, g_outs = input_gradients(taped, g, scale, need_input=k > 0)
                    waiting[k, m] = (taped, g_outs)  # for W: the tapes and each layer's output gradient
                    g_vars = []
                else:
                    g_in, g_vars = whole_backward(layers, taped, g, scale, need_input=k > 0)
                if k:  # also the gradient moves inside this op: a W run next would otherwise hold it back
                    g_in = upstream[k - 1, m] = handed_off(g_in, devices[k - 1], wait_for_arrival)
                after[d] = [g_in] if k else g_vars or [g_outs[0]]
            else:
                taped, g_outs = waiting.pop((k, m))
                g_vars = weight_gradients(layers, taped, g_outs, scale)
                after[d] = list(g_vars)
            if g_vars:
                grads[k] = g_vars if grads[k] is None else [a + b for a, b in zip(grads[k], g_vars, strict=True)]
    tf.no_op(name="schedule_end")
    with tf.device(devices[-1]):
        return tf.add_n(losses) / M, grads


def split_orders(S, M, kind, v=1):
    """Each device's order for `kind` (one of SPLIT_SCHEDULES) with v chunks per device."""
    if kind not in SPLIT_SCHEDULES:
        raise ValueError(f"schedule must be one of {SPLIT_SCHEDULES}, got {kind!r}.")
    if kind == "interleaved":
        if v < 2:
            raise ValueError(f"interleaving needs v >= 2 chunks per device, got {v} (one chunk is 1F1B): "
                             f"give {2 * S} chunks for {S} devices, or schedule='1f1b'.")  # fmt: skip
        return schedules.interleaved(S, M, v)
    if v != 1:
        raise ValueError(f"{kind} runs one chunk per device, got {v} per device: give {S} chunks, or "
                         "schedule='interleaved' for several chunks per device.")  # fmt: skip
    return schedules.zb_h1(S, M) if kind == "zb_h1" else schedules.schedule(S, M, kind)


class SplitPipeline(pipeline.Pipeline):
    """Train `chunks` on `devices` (S of them): chunk k on devices[k % S], so S * v chunks give v
    per device. `schedule`: "zb_h1" (backwards split into B and W, W deferred), "interleaved"
    (v >= 2), or "gpipe" / "1f1b". `recompute=True` keeps only each chunk's input between its F
    and its backward. The rest is `pipeline.Pipeline`'s: SGD or an optimizer copied per chunk."""

    def __init__(self, chunks, devices, micro_batches, learning_rate=None, schedule="zb_h1",
                 loss_fn=models.cross_entropy, optimizer=None, recompute=False, wait_for_arrival=None):  # fmt: skip
        chunks, devices = list(chunks), [normalize(d) for d in checks.device_list(devices)]
        S = len(devices)
        if not chunks or len(chunks) % S:
            raise ValueError(f"got {len(chunks)} chunks for {S} devices: give v chunks per device (S * v chunks, "
                             "chunk k on device k mod S), e.g. make_chunks(...) with v=1 or v=2.")  # fmt: skip
        v = len(chunks) // S
        orders = split_orders(S, checks.whole_number(micro_batches, "micro_batches"), schedule, v)
        if recompute:
            refuse_state(chunks)
        # Pipeline's checks, optimizer copies and step counter, per chunk; build_steps below runs `orders`.
        super().__init__(chunks, [devices[k % S] for k in range(len(chunks))], micro_batches, learning_rate,
                         "gpipe", loss_fn, optimizer, wait_for_arrival)  # fmt: skip
        self.kind, self.orders, self.v, self.recompute, self.physical = schedule, orders, v, bool(recompute), devices

    def build_steps(self, xs, ys):
        """As `Pipeline.build_steps`, each step from `split_gradients`."""
        losses, applied = [], []
        for x, y in zip(xs, ys, strict=True):
            loss, grads = split_gradients(self.stages, self.devices, self.orders, x, y, self.loss_fn,
                                          self.recompute, self.wait_for_arrival, applied)  # fmt: skip
            updates = pipeline.update_stages(self.stages, self.devices, grads, self.learning_rate, self.optimizers)
            with tf.control_dependencies(updates), tf.device(self.devices[0]):
                applied = [self.step.assign_add(1)]
            losses.append(loss)
        return losses

    def scopes(self):
        """(name scope, device) of each op of a step, in the executed order of `unroll_split`."""
        S = len(self.physical)
        return [(f"stage{c * S + d}/{kind}{m}", self.physical[d]) for d, kind, m, c in
                schedules.unroll_split(self.orders)]  # fmt: skip


def refuse_state(chunks) -> None:
    """Recomputation runs each forward twice: refuse layers whose forward changes state."""
    for k, chunk in enumerate(chunks):
        trainable = {id(v) for v in getattr(chunk, "trainable_variables", ())}
        state = [v for v in getattr(chunk, "variables", ()) if id(v) not in trainable]
        if state:
            name = getattr(state[0], "path", getattr(state[0], "name", "?"))
            raise ValueError(
                f"chunk {k} holds the non-trainable variable {name!r} (a Dropout seed or moving statistics): "
                "recompute=True would run its forward twice and change that state twice, so the backward would "
                "not match the forward. Use recompute=False, or layers without state."
            )


def make_chunks(make_layer, n_layers, devices, v=1):
    """`n_layers` layers cut into S * v chunks (`models.Sequential`), chunk k's layers made by
    `make_layer(i)` under devices[k % S], so that their weights live there."""
    devices, n_layers = checks.device_list(devices), checks.whole_number(n_layers, "n_layers")
    n = len(devices) * checks.whole_number(v, "v")
    if n_layers % n:
        fits = n_layers + n - n_layers % n
        raise ValueError(f"{n_layers} layers do not cut into {len(devices)} devices x {v} chunks = {n} equal "
                         f"chunks: use a multiple of {n} layers (e.g. {fits}) or another v.")  # fmt: skip
    per, chunks = n_layers // n, []
    for k in range(n):
        with tf.device(devices[k % len(devices)]):
            chunks.append(models.Sequential([make_layer(i) for i in range(k * per, (k + 1) * per)]))
    return chunks


# --- memory read from the traced step ---

_NOT_ACTIVATIONS = ("ReadVariableOp", "Const", "VarHandleOp", "Placeholder", "NoOp")


def op_steps(pipe, x, y) -> dict[str, int]:
    """{op name: index in `pipe.scopes()` of the F, B or W op of the schedule that built it} for one
    traced step. A tape names its gradient ops after the forward (`gradient_tape/stage0/F1/...`),
    whether B or W built them, so the graph's creation order decides: each of the schedule's ops
    starts with a `start` marker, and the ops after `schedule_end` (the update) belong to none."""
    if not isinstance(pipe, SplitPipeline):
        raise TypeError(f"op_steps and kept_bytes read a SplitPipeline's step, got {type(pipe).__name__}: "
                        "build it as SplitPipeline(chunks, devices, M, schedule='gpipe' or '1f1b' ...).")  # fmt: skip
    x, y = pipe.check_batch(x, y)
    index = {scope: i for i, (scope, _) in enumerate(pipe.scopes())}
    found, step = {}, None
    for op in pipe.traced_step.get_concrete_function(x, y).graph.get_operations():
        if op.type == "NoOp" and op.name.endswith("/start"):
            step = index[op.name.rpartition("/")[0]]
        elif op.type == "NoOp" and op.name.startswith("schedule_end"):
            step = None
        if step is not None:
            found[op.name] = step
    return found


def kept_bytes(pipe, x, y) -> dict[str, int]:
    """{device: the most activation bytes it holds at once during one step of `pipe`} (a
    `SplitPipeline`), read from the step's traced graph along the executed order (`scopes`).

    It counts every floating tensor that a forward op of the step makes and that a backward reads
    or a later op takes (a layer's input and output, the copy of a micro-batch that arrives, a
    forward recomputed in a backward), from the F, B or W that makes it to the last one that reads
    it, both included, and every gradient that one of them leaves to a later one (W's output
    gradients from B, a gradient on its way to the chunk before). It leaves out weights, optimizer
    state, the summed weight gradients (one set per device in every schedule), the temporaries
    that one op makes and frees (as a layer's product before its bias), and TensorFlow's own
    buffers; what one op holds at once is counted whole at that op. It is not the process's
    peak: on a GPU or TPU (it raises on a CPU), `tf.config.experimental.get_memory_info(device)["peak"]`
    gives the bytes TensorFlow used at most since `reset_memory_stats`, all of the above included."""
    where = op_steps(pipe, x, y)
    steps = pipe.scopes()
    graph = pipe.traced_step.get_concrete_function(*pipe.check_batch(x, y)).graph
    held = {d: [0] * len(steps) for d in pipe.physical}

    def gradient(op):
        return "gradient_tape/" in op.name

    def forward(op):  # an F's own ops, or a forward recomputed in a backward
        return not gradient(op) and (steps[where[op.name]][0].split("/")[1][0] == "F" or "/recompute/" in op.name)

    def summing(op):  # adds up weight gradients (a B's or W's own op), or runs after the schedule
        return op.name not in where or not gradient(op) and not forward(op)

    for op in graph.get_operations():
        if op.name not in where or op.type in _NOT_ACTIVATIONS or summing(op):
            continue
        i = where[op.name]
        for t in op.outputs:
            last = _last_read(t, i, forward(op), where, summing, gradient)
            for j in range(i, i - 1 if last is None else last + 1):
                held[normalize(op.device)][j] += t.shape.num_elements() * t.dtype.size
    return {d: max(per_step) for d, per_step in held.items()}


def _last_read(t, i, forward, where, summing, gradient):
    """The index of the last op of the schedule that reads `t` (made by op i), or None if `t` is not
    counted: not floating or of unknown size, a weight gradient, or a temporary inside one op."""
    if not t.dtype.is_floating or t.shape.num_elements() is None:
        return None
    readers = t.consumers()
    if not forward and (not readers or all(summing(c) for c in readers)):
        return None  # a weight gradient, or a gradient read by nobody
    last = max([i] + [where[c.name] for c in readers if c.name in where])
    if last == i and (not forward or not any(gradient(c) for c in readers)):
        return None  # a gradient's, or a forward's, temporary: freed inside the op that made it
    return last
