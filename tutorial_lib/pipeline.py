"""The pipelined training step as an object: `Pipeline` builds notebook 05's step, the take-away's
`pipeline_parallel` (examples/, the one copy of the method), from any schedule of `schedules`, with the checks of
`pipeline_checks` around it; and notebook 01's naive split `staged_gradients`, the baseline the benchmark times
against.
"""

from __future__ import annotations

import keras
import numpy as np
import pipeline_parallel as pp
import tensorflow as tf
from pipeline_parallel import (  # noqa: F401 (the package's names for them)
    added_losses,
    one_optimizer_per_stage,
    pipelined_gradients,
    run_stage,
    update_stages,
)

from . import checks, models, pipeline_checks, schedules
from .devices import normalize


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
    `schedule` gives ("sequential", "gpipe", "1f1b" or "zb_h1"), by plain SGD (`learning_rate`) or one
    copy per stage of a Keras `optimizer`. `loss_fn` returns the MEAN over its micro-batch; a Keras
    stage's `losses` are added to it. `recompute=True` keeps only each stage's input from its F to its
    backward, which reruns the forward (refused for stages that hold state or draw random numbers).

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
        recompute: bool = False,
    ):
        stages, devices = list(stages), [normalize(d) for d in checks.device_list(devices)]
        pipeline_checks.check_stages(stages, devices, learning_rate, optimizer, recompute)
        self.stages, self.devices, self.loss_fn, self.recompute = stages, devices, loss_fn, bool(recompute)
        self.micro_batches = checks.whole_number(micro_batches, "micro_batches")
        if schedule == "interleaved":
            raise ValueError("interleaving runs v chunks on each device: use pipeline_split.SplitPipeline(chunks, "
                             "devices, micro_batches, schedule='interleaved') with S * v chunks.")  # fmt: skip
        self.kind, self.orders = schedule, schedules.orders_of(schedule, len(stages), self.micro_batches)
        self.physical = devices  # the device of each lane of `orders` (SplitPipeline: each device of v chunks)
        self.learning_rate, self._template, self.optimizers = learning_rate, optimizer, None
        self.wait_for_arrival = (
            pipeline_checks.all_cpus(devices) if wait_for_arrival is None else bool(wait_for_arrival)
        )
        self._checked = set()  # (shapes, dtypes) of the batches already checked
        with tf.init_scope(), tf.device(devices[0]):
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="pipeline_step")
        self.traced_step = tf.function(lambda x, y: self.build_steps([x], [y])[0], autograph=False)
        self._wave = tf.function(lambda xs, ys: tf.stack(self.build_steps(xs, ys)), autograph=False)

    def scopes(self):
        """(name scope, device) of each F, B and W of a step, in the order the step builds them (`unroll`)."""
        S = len(self.orders)
        return [(f"stage{c * S + d}/{kind}{m}", self.physical[d]) for d, kind, m, c in schedules.unroll(self.orders)]

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
            loss, grads = pp.pipelined_gradients(self.stages, self.devices, self.orders, x, y, self.loss_fn,
                                                 self.recompute, self.wait_for_arrival, applied)  # fmt: skip
            updates = pp.update_stages(self.stages, self.devices, grads, self.learning_rate, self.optimizers)
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
                if self.recompute:
                    pipeline_checks.refuse_random(self.stages, self.devices, x, self.micro_batches)
                if self._template is not None and self.optimizers is None:  # every stage has its weights now
                    self.optimizers = pp.one_optimizer_per_stage(
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
