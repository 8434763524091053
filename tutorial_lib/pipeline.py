"""The pipelined training step, built from a schedule into ONE graph per step (or wave of steps):
notebook 05's cells, `Pipeline` (the step as an object, checked by `pipeline_checks`), and
notebook 01's naive split `staged_gradients`, the baseline the benchmark times against.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from . import checks, models, pipeline_checks
from .devices import normalize
from .schedules import schedule as make_schedule
from .schedules import unroll


# lesson: 05_staging_pipeline
def run_stage(stage, h):
    """A Keras stage is told that it trains: otherwise its Dropout passes everything through."""
    return stage(h, training=True) if isinstance(stage, keras.Layer) else stage(h)


# lesson: 05_staging_pipeline
def added_losses(stage):
    """What a Keras stage adds to the loss in its last call (weight regularizers, add_loss); 0 for others."""
    losses = list(getattr(stage, "losses", []))
    return tf.add_n(losses) if losses else tf.constant(0.0)


# lesson: 05_staging_pipeline
def pipelined_gradients(stages, devices, orders, x, y, loss_fn, wait_for_arrival=True, start_after=()):
    """Build one step's forwards and backwards in the graph being traced, in the stages' orders.
    Returns (the batch's mean loss, for each stage the gradients of its weights summed over the
    micro-batches). Every stage's first op waits for `start_after`."""
    S, M = len(stages), len(orders[0]) // 2
    with tf.device(devices[0]):
        inputs = {(0, m): xm for m, xm in enumerate(tf.split(x, M))}
    with tf.device(devices[-1]):
        labels = tf.split(y, M)
    after = [list(start_after) for _ in range(S)]  # each stage's latest outputs: its next op waits for them
    tapes, upstream, grads, losses = {}, {}, [None] * S, []
    for s, op, m in unroll(orders):
        with tf.device(devices[s]), tf.name_scope(f"stage{s}/{op}{m}"), tf.control_dependencies(after[s]):
            if op == "F":
                h = tf.identity(inputs.pop((s, m)))
                with tf.GradientTape() as tape:
                    tape.watch(h)
                    out = run_stage(stages[s], h)
                    if s == S - 1:
                        out = loss_fn(out, labels[m])  # the MEAN over the micro-batch
                    added = added_losses(stages[s])
                tapes[s, m] = (tape, h, out, added)
                losses.append(added if s < S - 1 else out + added)
                if s < S - 1:
                    if wait_for_arrival:  # the output moves to the next stage inside this op
                        with tf.device(devices[s + 1]):
                            out = tf.identity(out)
                    inputs[s + 1, m] = out
                after[s] = [out]  # with the copy: the stage goes on once its output has arrived
            else:
                tape, h, out, added = tapes.pop((s, m))
                g_out = upstream.pop((s, m)) if s < S - 1 else tf.constant(1 / M)  # d(mean of M)/d(loss m)
                wrt = ([h] if s else []) + list(stages[s].trainable_variables)  # stage 0: weights only
                g = tape.gradient([out, added], wrt, output_gradients=[g_out, tf.constant(1 / M)])
                if s:
                    upstream[s - 1, m] = g[0]
                g_vars = g[1:] if s else g
                grads[s] = g_vars if grads[s] is None else [a + b for a, b in zip(grads[s], g_vars, strict=True)]
                after[s] = list(g)
    with tf.device(devices[-1]):
        return tf.add_n(losses) / M, grads


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


def copy_optimizer(template):
    """A fresh optimizer of `template`'s class and settings (with AdamW's weight-decay exclusions)."""
    try:
        copy = type(template).from_config(template.get_config())
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"cannot make one copy of {type(template).__name__} per stage from its get_config() ({err}). Give a "
            "custom optimizer a get_config that returns every argument of its constructor, and a learning rate "
            "that is a number or a registered LearningRateSchedule, not a lambda."
        ) from None
    for name in ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern"):
        if hasattr(template, name):  # PRIVATE Keras state that get_config leaves out
            setattr(copy, name, getattr(template, name))
    return copy


class Pipeline:
    """Train `stages`, stage s on devices[s], on batches cut into `micro_batches`, in the order
    `schedule` gives, by plain SGD (`learning_rate`) or one copy per stage of a Keras `optimizer`.
    `loss_fn` returns the MEAN over its micro-batch; a Keras stage's `losses` are added to it.

    `wait_for_arrival` (default: on CPUs) makes a stage go on only once its output has reached the
    next device: a CPU may otherwise send it only when the stage runs out of work (notebook 05),
    while on a GPU waiting would drain the stream. `step` counts the steps applied whole.
    """

    def __init__(
        self,
        stages,
        devices,
        micro_batches: int,
        learning_rate: float | None = None,
        schedule: str = "gpipe",
        loss_fn=models.cross_entropy,
        optimizer: keras.optimizers.Optimizer | None = None,
        wait_for_arrival: bool | None = None,
    ):
        stages, devices = list(stages), [normalize(d) for d in checks.device_list(devices)]
        pipeline_checks.check_stages(stages, devices, learning_rate, optimizer)
        self.stages, self.devices, self.loss_fn = stages, devices, loss_fn
        self.micro_batches = checks.whole_number(micro_batches, "micro_batches")
        self.kind, self.orders = schedule, make_schedule(len(stages), self.micro_batches, schedule)
        self.learning_rate, self._template, self.optimizers = learning_rate, optimizer, None
        self.wait_for_arrival = (
            pipeline_checks.all_cpus(devices) if wait_for_arrival is None else bool(wait_for_arrival)
        )
        self._checked = set()  # (shapes, dtypes) of the batches already checked
        with tf.init_scope(), tf.device(devices[0]):
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="pipeline_step")
        self.traced_step = tf.function(lambda x, y: self.build_steps([x], [y])[0], autograph=False)
        self._wave = tf.function(lambda xs, ys: tf.stack(self.build_steps(xs, ys)), autograph=False)

    @property
    def variables(self):
        return [v for stage in self.stages for v in stage.trainable_variables]

    def train_step(self, x, y):
        """One pipelined training step as one `tf.function` call; returns the batch's mean loss."""
        return self.traced_step(*self.check_batch(x, y))

    def train_steps(self, xs, ys):
        """A wave: one step per batch (xs[k], ys[k]) in ONE call, as K calls of `train_step`; the K losses."""
        if any(isinstance(batches, tf.Tensor | np.ndarray) for batches in (xs, ys)):
            raise TypeError(
                "train_steps takes a list of input batches and a list of label batches, not one tensor: "
                "pass [x0, x1, ...] and [y0, y1, ...] (or tf.unstack a stacked tensor)."
            )
        xs, ys = list(xs), list(ys)
        if len(xs) != len(ys) or not xs:
            raise ValueError(
                f"train_steps needs at least one batch, and as many label batches as input batches: got "
                f"{len(xs)} input batches and {len(ys)} label batches."
            )
        pairs = [self.check_batch(x, y) for x, y in zip(xs, ys, strict=True)]
        return self._wave(tuple(x for x, _ in pairs), tuple(y for _, y in pairs))

    def build_steps(self, xs, ys):
        """Build K steps into the graph being traced (inside a `tf.function`), each starting once the
        one before is applied; returns their losses. The batches must have passed `check_batch`."""
        losses, applied = [], []
        for x, y in zip(xs, ys, strict=True):
            loss, grads = pipelined_gradients(
                self.stages, self.devices, self.orders, x, y, self.loss_fn, self.wait_for_arrival, applied
            )
            updates = update_stages(self.stages, self.devices, grads, self.learning_rate, self.optimizers)
            with tf.control_dependencies(updates), tf.device(self.devices[0]):
                applied = [self.step.assign_add(1)]  # the step's last op: it counts the steps applied whole
            losses.append(loss)
        return losses

    def check_batch(self, x, y):
        """(x, y) as tensors, checked once per shape; the first batch also builds a Keras stage's
        weights and the optimizer copies."""
        x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
        pipeline_checks.check_split(x, y, self.micro_batches)
        key = (tuple(x.shape), x.dtype, tuple(y.shape), y.dtype)
        if key not in self._checked:
            pipeline_checks.check_labels(self.loss_fn, y)
            with tf.init_scope():  # eager, even inside a user's tf.function
                pipeline_checks.dry_run(self.stages, self.devices, x, y, self.micro_batches, self.loss_fn)
                if self._template is not None and self.optimizers is None:  # every stage has its weights now
                    self.optimizers = one_optimizer_per_stage(
                        self.stages, self.devices, lambda: copy_optimizer(self._template)
                    )
            self._checked.add(key)
        return x, y


# lesson: 01_naive_placement
def staged_gradients(stages, devices, x, y, loss_fn=models.cross_entropy):
    """The naive split: the whole batch through the stages one after another, each stage's
    gradients computed on its own device from its own tape. Returns (loss, gradients)."""
    tapes, inputs, outputs = [], [], []
    for i, (device, stage) in enumerate(zip(devices, stages, strict=True)):
        with tf.device(device), tf.GradientTape() as tape:
            tape.watch(x)
            inputs.append(x)
            x = stage(x)
            if i == len(stages) - 1:  # the last stage ends with the loss
                x = loss_fn(x, y)
        tapes.append(tape)
        outputs.append(x)
    grads, upstream = [], None  # upstream: d(loss)/d(this stage's output)
    for i in reversed(range(len(stages))):
        with tf.device(devices[i]):
            variables = list(stages[i].trainable_variables)
            wrt = variables + ([inputs[i]] if i > 0 else [])  # stage 0's input is data
            g = tapes[i].gradient(outputs[i], wrt, output_gradients=upstream)
        grads = g[: len(variables)] + grads
        upstream = g[-1] if i > 0 else None  # d(loss)/d(input): what stage i - 1 receives
    return outputs[-1], grads
