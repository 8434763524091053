"""A model split over devices that keeps them all busy: a pipeline schedule run as ONE tf.function per step, each
chunk's forwards, backwards and optimizer on its own device, the next batch staged on the first device by a
StagingArea. Notebook 05 teaches the functions below their `# lesson:` lines; pipeline_schedules.py gives the orders
(sequential, GPipe, 1F1B, ZB-H1, interleaved).

The step is built when it is traced. `unroll` lists the schedule's ops; each is built under its chunk's device and
waits for everything its device's previous op made: that, and nothing else, imposes each device's order, so the
devices work at once. A forward keeps one GradientTape per layer until its backward, which is whole, or split into
B (the input's gradient, which the chunk before waits for) and W (the weights', which can wait); `recompute` keeps
only each chunk's input and reruns its forward in the backward.
"""

from types import SimpleNamespace

import keras
import tensorflow as tf
from pipeline_schedules import unroll
from tensorflow.python.ops import data_flow_ops  # PRIVATE API: StagingArea (public route: prefetch_to_device)


# lesson: 05_staging_pipeline
def run_stage(stage, h):
    """A Keras stage is told that it trains: otherwise its Dropout passes everything through."""
    return stage(h, training=True) if isinstance(stage, keras.Layer) else stage(h)


# lesson: 05_staging_pipeline
def added_losses(stage):
    """What a Keras stage adds to the loss in its last call (weight regularizers, add_loss); 0 for others."""
    losses = list(getattr(stage, "losses", []))
    return tf.add_n(losses) if losses else tf.constant(0.0)


def mean_cross_entropy(logits, labels):
    """The loss each micro-batch ends with: the mean over it, from LOGITS (the model ends without a softmax)."""
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


# lesson: 05_staging_pipeline
def layers_of(chunk):
    """The layers a chunk calls one after another, each to be taped alone: a Sequential's (Keras', or any with a
    `layers` list), else the chunk as one layer (a functional Keras model, a plain function)."""
    layers = getattr(chunk, "layers", None)
    if not layers or isinstance(chunk, keras.Model) and not isinstance(chunk, keras.Sequential):
        return [chunk]
    return list(layers)


# lesson: 05_staging_pipeline
def taped_forward(layers, h, finish=None, persistent=False):
    """h through `layers`, each under a tape (and a name scope) of its own. Returns (the output, one (tape, input,
    output, added loss) per layer); `finish(out)` (the loss, on the last chunk) goes on the last layer's tape. A
    split backward asks each tape twice, B then W: `persistent=True`."""
    taped = []
    for i, layer in enumerate(layers):
        with tf.name_scope(f"layer{i}"), tf.GradientTape(persistent=persistent) as tape:
            tape.watch(h)
            out = run_stage(layer, h)
            if finish is not None and i == len(layers) - 1:
                out = finish(out)
            added = added_losses(layer)
        taped.append((tape, h, out, added))
        h = out
    return h, taped


# lesson: 05_staging_pipeline
def layer_gradients(taped_layer, wrt, g, scale):
    """One layer's tape asked for the gradients of `wrt`, given its output's gradient g and the weight `scale` of
    its added losses (1/M: the loss is the mean of M micro-batches' losses)."""
    tape, _, out, added = taped_layer
    given = [tf.convert_to_tensor(g, out.dtype), tf.convert_to_tensor(scale, added.dtype)]  # exact: no float32 1/M
    return tape.gradient([out, added], wrt, given, unconnected_gradients=tf.UnconnectedGradients.ZERO)


# lesson: 05_staging_pipeline
def whole_backward(layers, taped, g, scale, need_input=True):
    """The chunk's backward at once (B and W together), last layer first, from g, its output's gradient: one call
    per layer's tape. Returns (the gradient of the chunk's input, or None where nobody needs it; its weights')."""
    grads = []
    for i in reversed(range(len(taped))):
        inputs = [taped[i][1]] if i or need_input else []  # the first chunk's input is data: no gradient
        got = layer_gradients(taped[i], inputs + list(getattr(layers[i], "trainable_variables", ())), g, scale)
        if inputs:
            g, got = got[0], got[1:]
        grads = list(got) + grads
    return (g if need_input else None), grads


# lesson: 05_staging_pipeline
def input_gradients(taped, g, scale, need_input=True):
    """B: the chunk's backward along its inputs only, last layer first, from g. Returns (the gradient of the
    chunk's input, or None where nobody needs it; each layer's output gradient, which its W will need)."""
    g_outs = [None] * len(taped)
    for i in reversed(range(len(taped))):
        g_outs[i] = g
        if i or need_input:
            g = layer_gradients(taped[i], taped[i][1], g, scale)
    return (g if need_input else None), g_outs


# lesson: 05_staging_pipeline
def weight_gradients(layers, taped, g_outs, scale):
    """W: each layer's weight gradients from its kept tape and its output's gradient (from B), the chunk's weights
    in order. It repeats part of B's work (an activation's backward inside a layer, such as a Dense layer's ReLU,
    is needed by both): the price of the split."""
    grads = []
    for layer, taped_layer, g in zip(layers, taped, g_outs, strict=True):
        variables = list(getattr(layer, "trainable_variables", ()))
        grads += layer_gradients(taped_layer, variables, g, scale) if variables else []
    return grads


# lesson: 05_staging_pipeline
def handed_off(t, device, wait_for_arrival):
    """`t` copied to `device` inside the op being built, so that the device's next op waits until it has arrived
    (`wait_for_arrival`; notebook 05, section 9); else `t`, copied whenever the receiver reads it."""
    if not wait_for_arrival:
        return t
    with tf.device(device):
        return tf.identity(t)


# lesson: 05_staging_pipeline
def forward_op(run, k, m):
    """F: micro-batch m through chunk k, each layer's tape kept for the backward (only the chunk's input, where
    it recomputes), the output handed to the next chunk's device. Returns what the op made."""
    h = tf.identity(run.inputs.pop((k, m)))
    out, taped = taped_forward(layers_of(run.chunks[k]), h, run.finish(k, m), run.split[k % len(run.split)])
    run.kept[k, m] = h if run.recompute else taped
    run.added.extend(t[3] for t in taped)
    if k == len(run.chunks) - 1:
        run.losses.append(out)
    else:  # the output moves to the next chunk's device inside this op
        out = run.inputs[k + 1, m] = handed_off(out, run.devices[k + 1], run.wait_for_arrival)
    return [out, *(t[3] for t in taped)]


# lesson: 05_staging_pipeline
def backward_op(run, k, m):
    """B: chunk k's backward for micro-batch m, from its output's gradient (1/M on the last chunk: the loss is a
    mean of M): whole, or the input's gradient alone where the device splits its backwards (W follows). The
    input's gradient is handed to the chunk before. Returns what the op made."""
    taped, split = run.kept.pop((k, m)), run.split[k % len(run.split)]
    if run.recompute:
        with tf.name_scope("recompute"):
            _, taped = taped_forward(layers_of(run.chunks[k]), taped, run.finish(k, m), split)
    scale = 1 / run.M
    g = run.upstream.pop((k, m)) if k < len(run.chunks) - 1 else scale
    if split:  # B alone; W later, from the tapes and each layer's output gradient
        g_in, g_outs = input_gradients(taped, g, scale, need_input=k > 0)
        run.waiting[k, m], made = (taped, g_outs), g_outs[:-1]
    else:
        g_in, g_vars = whole_backward(layers_of(run.chunks[k]), taped, g, scale, need_input=k > 0)
        made = summed(run, k, g_vars)
    if k:  # the input's gradient moves to the chunk before inside this op, as a forward's output does
        run.upstream[k - 1, m] = handed_off(g_in, run.devices[k - 1], run.wait_for_arrival)
        made = [*made, run.upstream[k - 1, m]]
    return made


# lesson: 05_staging_pipeline
def weight_op(run, k, m):
    """W: chunk k's weight gradients for micro-batch m, from the tapes and output gradients its B left."""
    taped, g_outs = run.waiting.pop((k, m))
    return summed(run, k, weight_gradients(layers_of(run.chunks[k]), taped, g_outs, 1 / run.M))


# lesson: 05_staging_pipeline
def summed(run, k, g_vars):
    """A micro-batch's weight gradients added to chunk k's sum. Returns both: what the op made."""
    run.grads[k] = [a + b for a, b in zip(run.grads[k], g_vars, strict=True)] if run.grads[k] else list(g_vars)
    return [*g_vars, *run.grads[k]]


# lesson: 05_staging_pipeline
def pipelined_gradients(chunks, devices, orders, x, y, loss_fn, recompute=False, wait_for_arrival=True,
                        start_after=()):  # fmt: skip
    """Build one step in the graph being traced: chunk k, on devices[k], runs its F, B and W ops in the sequence
    of `unroll(orders)`, each after EVERYTHING its device's previous op made. Returns (the batch's mean loss, per
    chunk its weight gradients summed over the M micro-batches). A device whose order holds W ops splits its
    backwards into B and W. Every device's first op waits for `start_after`."""
    S, K, M = len(orders), len(chunks), len({op[1] for op in orders[0]})
    with tf.device(devices[0]):
        inputs = {(0, m): xm for m, xm in enumerate(tf.split(x, M))}
    with tf.device(devices[-1]):
        labels = tf.split(y, M)
    run = SimpleNamespace(chunks=chunks, devices=devices, M=M, inputs=inputs, recompute=recompute,
                          wait_for_arrival=wait_for_arrival, split=[any(op[0] == "W" for op in o) for o in orders],
                          kept={}, upstream={}, waiting={}, grads=[[] for _ in chunks], losses=[], added=[],
                          finish=lambda k, m: (lambda h: loss_fn(h, labels[m])) if k == K - 1 else None)  # fmt: skip
    after = [list(start_after) for _ in range(S)]  # what each device's previous op made: its next op waits for it
    for d, kind, m, c in unroll(orders):
        k = c * S + d
        with tf.device(devices[k]), tf.name_scope(f"stage{k}/{kind}{m}"):
            with tf.control_dependencies(after[d]):
                start = tf.no_op(name="start")  # every op of this F, B or W waits for it
            with tf.control_dependencies([start]):
                after[d] = {"F": forward_op, "B": backward_op, "W": weight_op}[kind](run, k, m)
    with tf.device(devices[-1]):  # the mean of the M losses, and what the layers added
        return (tf.add_n(run.losses) + tf.add_n([tf.cast(a, run.losses[0].dtype) for a in run.added])) / M, run.grads


# lesson: 05_staging_pipeline
def update_stages(stages, devices, grads, learning_rate=None, optimizers=None):
    """Each stage's update on its own device, once every gradient of the step exists: SGD with
    `learning_rate`, or `optimizers[s]` for stage s. Returns ops that end with every write."""
    updates = []
    with tf.control_dependencies([g for per_stage in grads for g in per_stage]):  # no stage updates alone
        for s, (stage, device) in enumerate(zip(stages, devices, strict=True)):
            variables = list(stage.trainable_variables)
            with tf.device(device), tf.name_scope(f"update{s}"):
                if optimizers is None:
                    updates += [v.assign_sub(learning_rate * g) for v, g in zip(variables, grads[s], strict=True)]
                elif variables:
                    optimizers[s].apply(grads[s], variables)
                    # apply gives no op to wait for. A read of a variable runs after its writes (a
                    # tf.function keeps the program's order on one variable): read them all.
                    updates += [tf.identity(v) for v in (*variables, *optimizers[s].variables)]
    return updates


# lesson: 05_staging_pipeline
def one_optimizer_per_stage(stages, devices, make_optimizer):
    """`make_optimizer()` once per stage, created and built on the stage's weights under its device."""
    optimizers = []
    for stage, device in zip(stages, devices, strict=True):
        with tf.device(device):  # its step count and learning rate here; Keras puts the moments beside the weights
            optimizer = make_optimizer()
            optimizer.build(list(stage.trainable_variables))
        optimizers.append(optimizer)
    return optimizers


# lesson: 05_staging_pipeline
def make_train_steps(chunks, devices, orders, loss_fn, learning_rate=None, optimizers=None, recompute=False,
                     wait_for_arrival=True):  # fmt: skip
    """A `tf.function` of (xs, ys), lists of K batches: K steps in ONE call (a wave), step k+1
    starting on every device once step k is applied. Returns the K losses. Chunk k runs on devices[k]."""

    @tf.function(autograph=False)
    def train_steps(xs, ys):
        losses, applied = [], []
        for x, y in zip(xs, ys, strict=True):  # unrolled when traced: K steps in one graph
            loss, grads = pipelined_gradients(chunks, devices, orders, x, y, loss_fn, recompute, wait_for_arrival,
                                              applied)  # fmt: skip
            applied = update_stages(chunks, devices, grads, learning_rate, optimizers)  # the next step waits for these
            losses.append(loss)
        with tf.device(devices[-1]):  # where the losses are
            return tf.stack(losses)

    return train_steps


# lesson: 05_staging_pipeline
def staged_step(area, build_step, x_next=None, y_next=None):
    """Build, in the graph being traced: this step's batch taken from `area`, the step on it
    (`build_step(x, y)` returns its loss), and the put of the next batch, if any."""
    x, y = area.get()
    loss = build_step(x, y)
    if x_next is not None:  # built after the step, which does not wait for it: the copy overlaps the step
        area.put([x_next, y_next])
    return loss


class StagedFeed:
    """Steps fed through a StagingArea on `device`, as tf_cnn_benchmarks fed its towers: `start()` puts the first
    batch of `dataset` (built once, before any timing; batches of one fixed size); each `step()` is ONE tf.function
    call that gets the batch put before, runs `build_step(x, y)` on it and puts the next, which tf.data reads and
    copies while the step runs; `stop()` empties the area. A get from an empty area would wait forever: only
    `step` gets, after `start` has put."""

    def __init__(self, dataset, device, build_step):
        self.iterator, self.device, self.specs = iter(dataset), device, tf.nest.flatten(dataset.element_spec)
        self.name = f"staged_input_{id(self)}"  # one buffer, reached by each traced graph's own StagingArea object
        self.start = tf.function(self._put_first, autograph=False)
        self.step = tf.function(lambda: staged_step(self.area(), build_step, *next(self.iterator)), autograph=False)
        self._clear = tf.function(self._clear_area, autograph=False)

    def _put_first(self):
        self.area().put(next(self.iterator))

    def _clear_area(self):
        self.area().clear()

    def area(self):
        with tf.device(self.device):
            dtypes, shapes = [s.dtype for s in self.specs], [s.shape for s in self.specs]
            return data_flow_ops.StagingArea(dtypes, shapes=shapes, capacity=1, shared_name=self.name)

    def stop(self):
        with tf.device(self.device):  # clear() empties the buffer of the device it runs on
            self._clear()
