"""Pipelined model parallelism in ONE `tf.function` per training step.

The model is cut into S stages, stage s on devices[s]. A step cuts the batch into M
micro-batches; each stage runs a forward ("F", m) and a backward ("B", m) for every
micro-batch, in the order its *schedule* gives. The whole schedule is unrolled when the
step is traced: one graph holds every forward and backward of the step, and
`tf.control_dependencies` chains each stage's ops in its order. Nothing else is ordered,
so stage 0 can run ("F", 1) while stage 1 runs ("F", 0): the devices work at once, and
no Python runs between them. A forward's output is copied to the next stage's device inside
its op, and the stage's next op waits for that copy (`_arrived`): otherwise TensorFlow may
send it only when the stage runs out of work.

- "sequential": the naive split, micro-batched; one micro-batch at a time, forward and back.
- "gpipe": every forward, then every backward. Each stage keeps all M micro-batches'
  activations until their backward.
- "1f1b" (PipeDream-Flush): stage s runs S-1-s warm-up forwards, then alternates one
  forward and one backward. Stage s keeps at most S - s micro-batches in flight, whatever
  M is. The bubble is the same as GPipe's at the same M, (S-1)/(M+S-1): 1F1B saves memory,
  not time.

The forward's tape is kept until the backward (no recomputation); `recompute=True` keeps
only each stage's input and runs the forward again in the backward, as GPipe does to save
memory. A step has no state outside its call: gradients are summed inside the graph and
the update runs only after every gradient of every stage exists, so an interrupted or
failed step leaves the weights as they were.

The update is plain SGD (`learning_rate`) or a Keras optimizer (`optimizer`), of which
`stage_optimizers` builds one copy per stage, on its stage's device. `global_clipnorm` needs
the norm of every stage's gradients together: the pipeline clips by it before the copies
apply (`clip_by_global_norm`). Loss scaling is refused.

`train_steps(xs, ys)` runs a wave: K steps in one call, each step's first ops waiting for
the step before to be applied, so no call separates them. It saves the call, not the bubble:
synchronous SGD drains the pipeline at every update.

`stash_bound(orders)` gives the most micro-batches a stage keeps, from its order;
`stash_from_trace(events, S)` reads the same from a profiler trace of a step (op names
carry `stage{s}/F{m}` and `B{m}`). `Dropout` draws its mask from (seed, step, micro-batch),
so a recomputed forward drops the same units. A Keras layer or model works as a stage: it is
called with `training=True` (or its Dropout would not drop), and a Keras layer that draws
random numbers is refused under `recompute=True`.

`StagedInput` adds what `tf_cnn_benchmarks` used `StagingArea` for: each step's call puts
the NEXT step's batch on the first stage's device while the stages work on this one.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import threading

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import data_flow_ops  # PRIVATE API: StagingArea (see StagedInput)

from . import checks, models
from .devices import normalize

SCHEDULES = ("sequential", "gpipe", "1f1b")
_ids = itertools.count()


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle share of a GPipe (or 1F1B) step with balanced stages: (S-1)/(M+S-1)."""
    S, M = checks.whole_number(stages, "stages"), checks.whole_number(micro_batches, "micro_batches")
    return (S - 1) / (M + S - 1)


# --- the schedule: one order of ("F", m) / ("B", m) per stage -------------------------------


def schedule(stages: int, micro_batches: int, kind: str = "gpipe") -> list[list[tuple[str, int]]]:
    """The order in which each stage runs its forwards ("F", m) and backwards ("B", m)."""
    S, M = checks.whole_number(stages, "stages"), checks.whole_number(micro_batches, "micro_batches")
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {kind!r}.")
    if kind == "sequential":
        return [[op for m in range(M) for op in (("F", m), ("B", m))] for _ in range(S)]
    if kind == "gpipe":
        return [[("F", m) for m in range(M)] + [("B", m) for m in range(M)] for _ in range(S)]
    orders = []
    for s in range(S):  # 1F1B: warm up, then one forward and one backward, then drain
        warmup = min(S - 1 - s, M)
        order = [("F", m) for m in range(warmup)]
        for m in range(M - warmup):
            order += [("F", warmup + m), ("B", m)]
        orders.append(order + [("B", m) for m in range(M - warmup, M)])
    return orders


_schedule = schedule  # Pipeline's argument `schedule` hides the function


def in_flight(order) -> list[int]:
    """Micro-batches whose activations a stage keeps after each op of its order (F adds, B frees)."""
    return list(itertools.accumulate(1 if op == "F" else -1 for op, _ in order))


def stash_bound(orders) -> list[int]:
    """The most micro-batches each stage keeps at once, from its order."""
    return [max(in_flight(order)) for order in orders]


def unroll(orders) -> list[tuple[int, str, int]]:
    """One global order of (stage, op, micro-batch) in which every op comes after its inputs.

    ("F", m) on stage s needs stage s-1's ("F", m); ("B", m) needs its own ("F", m) and stage
    s+1's ("B", m). Orders that wait on each other in a cycle would block forever: refused.
    """
    S, done, plan = len(orders), set(), []
    position = [0] * S

    def ready(s, op, m):
        if op == "F":
            return s == 0 or (s - 1, "F", m) in done
        return (s, "F", m) in done and (s == S - 1 or (s + 1, "B", m) in done)

    while len(plan) < sum(map(len, orders)):
        progressed = False
        for s in range(S):
            while position[s] < len(orders[s]) and ready(s, *orders[s][position[s]]):
                done.add((s, *orders[s][position[s]]))
                plan.append((s, *orders[s][position[s]]))
                position[s], progressed = position[s] + 1, True
        if not progressed:
            waiting = {s: orders[s][position[s]] for s in range(S) if position[s] < len(orders[s])}
            raise ValueError(f"these stage orders wait on each other forever: next ops {waiting}.")
    return plan


def simulated_idle(orders, t_forward, t_backward) -> list[float]:
    """Each stage's idle share of a step in which every op starts as soon as its inputs and its
    stage are free and takes its stage's time: `t_forward` and `t_backward` are one time for
    every stage or a list of one per stage. The schedule's own bubble, with no cost to hand an
    output over and none between ops (notebook 05's `simulated_bubble` is the mean over stages)."""
    S = len(orders)
    t_f = list(t_forward) if isinstance(t_forward, list | tuple) else [t_forward] * S
    t_b = list(t_backward) if isinstance(t_backward, list | tuple) else [t_backward] * S
    if len(t_f) != S or len(t_b) != S:
        raise ValueError(f"need one forward and one backward time per stage ({S}), got {len(t_f)} and {len(t_b)}.")
    end, free, busy = {}, [0.0] * S, [0.0] * S
    for s, op, m in unroll(orders):
        if op == "F":
            ready, took = end.get((s - 1, "F", m), 0.0), t_f[s]
        else:
            ready, took = max(end[s, "F", m], end.get((s + 1, "B", m), 0.0)), t_b[s]
        end[s, op, m] = free[s] = max(free[s], ready) + took
        busy[s] += took
    return [1 - b / max(free) for b in busy]


# --- the step --------------------------------------------------------------------------------


class Pipeline:
    """Train `stages` (callables with `trainable_variables`), stage s on devices[s].

    The update is plain SGD with `learning_rate`, or a Keras `optimizer` (Adam, ...). The
    optimizer given is a template: with the first batch (or `build(x, y)`) the pipeline
    builds one copy of it per stage, on the stage's device, and those copies
    (`self.optimizers`) are the ones that step. A float learning rate is a variable of each
    copy and can be changed there; other settings are fixed once a step is traced.
    `checkpoint()` saves and restores the copies with the weights and the step counter.

    `loss_fn(logits, labels)` must return the MEAN loss over its micro-batch (a scalar), as
    `models.cross_entropy` does: the step's loss is the mean of the M micro-batch losses,
    equal to the whole batch's mean. A sum-reduced loss is refused when the step is built.
    """

    def __init__(
        self,
        stages,
        devices,
        micro_batches: int,
        learning_rate: float | None = None,
        schedule: str = "gpipe",
        loss_fn=models.cross_entropy,
        recompute: bool = False,
        optimizer: keras.optimizers.Optimizer | None = None,
    ):
        stages, devices = list(stages), list(devices)
        if not stages or len(stages) != len(devices):
            raise ValueError(f"need one device per stage, got {len(stages)} stages and {len(devices)} devices.")
        if (learning_rate is None) == (optimizer is None):
            raise ValueError(
                "give either learning_rate (plain SGD) or optimizer (a Keras optimizer, copied once per stage), "
                "not both and not neither."
            )
        self.stages, self.devices = stages, [normalize(d) for d in devices]
        self.micro_batches = checks.whole_number(micro_batches, "micro_batches")
        self.orders = _schedule(len(stages), micro_batches, schedule)
        self.plan = unroll(self.orders)
        self.kind, self.learning_rate, self.loss_fn, self.recompute = schedule, learning_rate, loss_fn, recompute
        self.clip_norm = None  # global_clipnorm, applied here over every stage
        if optimizer is not None:
            check_optimizer(optimizer)
            _refuse_shared_variables(stages)
            if optimizer.global_clipnorm:  # a copy would clip over its own stage only: the copies clip nothing
                self.clip_norm = optimizer.global_clipnorm
                with tf.init_scope():
                    optimizer = _copy(optimizer, {**optimizer.get_config(), "global_clipnorm": None})
        self._template, self.optimizers, self._checkpoint = optimizer, None, None  # built by `build`
        if recompute:
            _refuse_keras_randomness(stages)
        self._checked = set()  # (shapes, dtypes) of the batches the stages were checked with
        self._building = threading.Lock()  # one thread checks a new shape and builds the optimizers
        with tf.init_scope(), tf.device(self.devices[0]):  # the step number seeds dropout masks
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="pipeline_step")
        self._train = tf.function(lambda x, y: self._train_steps([x], [y])[0], autograph=False)
        self._wave = tf.function(lambda xs, ys: tf.stack(self._train_steps(xs, ys)), autograph=False)
        self._gradients = tf.function(self._gradients_graph, autograph=False)

    def train_step(self, x, y):
        """One pipelined training step as one `tf.function` call; returns the batch's mean loss."""
        x, y = self._checked_batch(x, y)
        return self._train(x, y)

    def train_steps(self, xs, ys):
        """A wave: one training step per batch (xs[k], ys[k]), all in ONE `tf.function` call; returns
        the K losses. Step k+1 starts on every stage once step k is applied on every stage (its
        step counter update), with no call from this process in between; the result equals K
        calls of `train_step`.

        Each wave size K is its own graph (K steps unrolled). If a step fails, the steps before
        it stay applied, each whole, and `pipeline.step` counts them; their losses are lost
        with the call.
        """
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
        pairs = [self._checked_batch(x, y) for x, y in zip(xs, ys, strict=True)]
        return self._wave(tuple(x for x, _ in pairs), tuple(y for _, y in pairs))

    def gradients(self, x, y):
        """(loss, gradients of every stage's variables, in order), without an update."""
        x, y = self._checked_batch(x, y)
        return self._gradients(x, y)

    def build(self, x, y) -> None:
        """Check a batch as the first step does, and build what the first step builds: a Keras
        stage's weights (if it creates them at its first call) and the optimizers. Runs every
        stage once in inference mode on one micro-batch: no weight, statistic or step changes."""
        self._checked_batch(x, y)

    def checkpoint(self) -> tf.train.Checkpoint:
        """One `tf.train.Checkpoint` (the same object at every call, so that its saves count on)
        of all the state a step reads and writes: the stages' weights, each stage's optimizer,
        the step counter (which seeds `pipeline.Dropout`'s masks) and the random state of Keras
        layers (Keras `Dropout`'s seed). Restoring the weights alone would restart Adam's
        moments and count, and draw other dropout masks."""
        if self._template is not None and self.optimizers is None:
            raise RuntimeError(
                "the optimizers are built with the first batch: call pipeline.build(x, y) with a batch (it changes "
                "nothing), or run a step, before checkpoint()."
            )
        if self._checkpoint is None:
            keras_state = [v for stage in self.stages if isinstance(stage, keras.Layer) for v in stage.variables]
            self._checkpoint = tf.train.Checkpoint(
                stages=self.stages, optimizers=self.optimizers or [], step=self.step, keras_state=keras_state
            )
        return self._checkpoint

    @property
    def variables(self):
        return [v for stage in self.stages for v in stage.trainable_variables]

    def _train_steps(self, xs, ys):
        """Steps one after another in one graph; the losses. A step's first ops wait for the step
        before to be applied (its counter update), not for this process: no call in between."""
        with tf.device(self.devices[0]):
            first = self.step.read_value()
        applied, losses = [], []
        for k, (x, y) in enumerate(zip(xs, ys, strict=True)):
            loss, grads = self._step(x, y, first + k, [applied] * len(self.stages))
            applied = [self._update(grads)]
            losses.append(loss)
        return losses

    def _gradients_graph(self, x, y):
        with tf.device(self.devices[0]):
            step = self.step.read_value()
        loss, grads = self._step(x, y, step, [[] for _ in self.stages])
        return loss, [g for per_stage in grads for g in per_stage]

    def _step(self, x, y, step, after):
        """The unrolled schedule of one step: every op on its stage's device, chained in its
        stage's order; stage s's first op waits for `after[s]`. (loss, gradients per stage)."""
        M, S = self.micro_batches, len(self.stages)
        with tf.device(self.devices[0]):
            inputs = dict(enumerate(tf.split(x, M)))  # micro-batch m's input to the current stage
        with tf.device(self.devices[-1]):
            labels = tf.split(y, M)
        last_op = [list(ops) for ops in after]  # each stage's latest outputs: its next op waits for them
        kept, upstream, grads, losses = {}, {}, [[] for _ in range(S)], []
        for s, op, m in self.plan:
            with tf.device(self.devices[s]), tf.name_scope(f"stage{s}/{op}{m}"), micro_batch(step, m):
                with tf.control_dependencies(last_op[s]):
                    if op == "F":
                        h = tf.identity(inputs.pop((s, m)) if s else inputs.pop(m))
                        kept[s, m], out = self._forward(s, h, labels[m])
                        if s == S - 1:
                            losses.append(out)
                        else:  # this stage's next op waits until the output is on the next stage
                            out = _arrived(out, self.devices[s + 1])
                            inputs[s + 1, m] = out
                        last_op[s] = [out]
                    else:
                        g_in, g_vars = self._backward(s, kept.pop((s, m)), upstream.pop((s, m), None), labels[m])
                        # A running sum: one gradient buffer per variable, not M kept to the end.
                        grads[s] = [a + g for a, g in zip(grads[s], g_vars, strict=True)] if grads[s] else list(g_vars)
                        if s:
                            upstream[s - 1, m] = g_in
                        last_op[s] = [g_in, *g_vars] if s else list(g_vars)
        with tf.device(self.devices[-1]):
            return tf.add_n(losses) / M, grads

    def _forward(self, s, h, labels):
        """(what the backward needs, the output): the tape, or only the input to recompute from."""
        if self.recompute:
            out = self._run_stage(s, h)
            return h, self.loss_fn(out, labels) if s == len(self.stages) - 1 else out
        with tf.GradientTape() as tape:
            tape.watch(h)
            out = self._run_stage(s, h)
            if s == len(self.stages) - 1:
                out = self.loss_fn(out, labels)
        return (tape, h, out), out

    def _backward(self, s, kept, upstream, labels):
        """Gradients of the input (for stage s-1) and of stage s's variables, for one micro-batch."""
        if self.recompute:
            h = kept
            with tf.GradientTape() as tape:  # the forward again, from the kept input
                tape.watch(h)
                out = self._run_stage(s, h)
                if s == len(self.stages) - 1:
                    out = self.loss_fn(out, labels)
        else:
            tape, h, out = kept
        if upstream is None:  # the last stage: d(mean of M losses) / d(this loss) = 1/M
            upstream = tf.constant(1 / self.micro_batches, out.dtype)
        variables = list(self.stages[s].trainable_variables)
        if s == 0:  # nothing needs the gradient of the batch itself: do not compute it
            return None, tape.gradient(out, variables, output_gradients=upstream)
        g = tape.gradient(out, [h, *variables], output_gradients=upstream)
        return g[0], g[1:]

    def _run_stage(self, s, h):
        """Stage s on `h`. A Keras layer or model is told that it trains: otherwise its Dropout
        passes everything through (Keras's `training` defaults to False outside `fit`)."""
        stage = self.stages[s]
        return stage(h, training=True) if isinstance(stage, keras.Layer) else stage(h)

    def _update(self, grads):
        """Each stage's update on its device once every gradient of the step exists, then the
        step counter: all or nothing, no stage updates alone. Returns the counter's update,
        the step's last op."""
        updates = []
        if self.clip_norm is not None:
            grads = clip_by_global_norm(grads, self.clip_norm, self.devices)
        with tf.control_dependencies([g for per_stage in grads for g in per_stage]):
            for s, (stage, device, per_stage) in enumerate(zip(self.stages, self.devices, grads, strict=True)):
                variables = stage.trainable_variables
                with tf.device(device), tf.name_scope("update"):
                    if self.learning_rate is not None:
                        updates += [
                            v.assign_sub(self.learning_rate * g) for v, g in zip(variables, per_stage, strict=True)
                        ]
                    elif variables:
                        optimizer = self.optimizers[s]
                        optimizer.apply(list(per_stage), list(variables))
                        # Keras gives no op that ends with every write. A read of a variable comes
                        # after its writes (tf.function orders the ops on one variable as the program
                        # does), so reading every variable it may write ends with all of them.
                        updates += [tf.identity(v) for v in (*variables, *optimizer.variables)]
        with tf.control_dependencies(updates), tf.device(self.devices[0]):
            return self.step.assign_add(1)  # it counts the steps applied

    # --- checks, made once on the first batch: clear errors instead of TensorFlow's --------

    def _checked_batch(self, x, y):
        x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
        M = self.micro_batches
        if x.shape.rank is None or x.shape[0] is None or x.shape[0] % M or x.shape[0] != y.shape[0]:
            raise ValueError(
                f"a batch of {x.shape[0]} examples (and {y.shape[0]} labels) does not split into {M} equal "
                f"micro-batches. Use a batch size that is a multiple of {M}, or batch with drop_remainder=True."
            )
        key = (tuple(x.shape), x.dtype, tuple(y.shape), y.dtype)
        if key in self._checked:
            return x, y
        with self._building:  # two threads' first calls would otherwise build two sets of optimizers
            if key not in self._checked:
                check_labels(self.loss_fn, y)
                with tf.init_scope():  # eager even inside a user's tf.function
                    self._dry_run(x, y)
                    if self._template is not None and self.optimizers is None:  # every stage's weights exist now
                        self.optimizers = stage_optimizers(self._template, self.stages, self.devices)
                self._checked.add(key)
        return x, y

    def _dry_run(self, x, y) -> None:
        """One micro-batch through the stages: shapes and dtypes that fit, a mean-reduced loss."""
        mb = x.shape[0] // self.micro_batches
        h = x[:mb] if isinstance(x, tf.__internal__.EagerTensor) else _sample(x.shape, x.dtype, mb)
        labels = y[:mb] if isinstance(y, tf.__internal__.EagerTensor) else tf.zeros([mb, *y.shape[1:]], y.dtype)
        for s, (stage, device) in enumerate(zip(self.stages, self.devices, strict=True)):
            try:
                with tf.device(device):
                    h = stage(h)
            except (tf.errors.InvalidArgumentError, ValueError, TypeError) as err:
                what = f"the output of stage {s - 1}" if s else "the micro-batch"
                hint = _dtype_hint(stage, h)
                raise ValueError(
                    f"stage {s} cannot take {what} (shape {h.shape}, {h.dtype.name}): {str(err).splitlines()[0]}{hint}"
                ) from None
        check_mean_reduced(self.loss_fn, h, labels)


def check_optimizer(optimizer) -> None:
    """Refuse what one copy of the optimizer per stage cannot do as one optimizer would."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"optimizer must be a Keras optimizer such as keras.optimizers.Adam(1e-3), got {type(optimizer).__name__}; "
            "for plain SGD pass learning_rate instead."
        )
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or optimizer.loss_scale_factor is not None:
        raise ValueError(
            "loss scaling is not supported: the pipeline does not scale the loss, and each stage's copy would check "
            "only its own gradients for overflow and could skip its update while the other stages apply theirs."
        )
    if optimizer.global_clipnorm and optimizer.gradient_accumulation_steps:
        raise ValueError(
            "global_clipnorm with gradient_accumulation_steps is not supported: Keras clips the accumulated "
            "gradients, and the pipeline clips each step's gradients before the copies accumulate them."
        )
    if optimizer.built:
        raise ValueError(
            "this optimizer is already built on some variables, and its state would not carry over to the copies "
            "the pipeline makes, one per stage: pass a new one, e.g. keras.optimizers.Adam(1e-3)."
        )


def stage_optimizers(optimizer, stages, devices) -> list:
    """One fresh copy of the Keras `optimizer` per stage, built under its stage's device.

    Each copy counts one iteration per step, and its step count and learning rate sit on its
    stage's device (Keras puts the moments beside their weights in any case). One optimizer
    applied once per stage goes wrong: Keras 3 refuses the variables of a stage it was not
    built on ("Unknown variable"), and one built on every stage counts S iterations per step,
    so Adam's bias correction, which reads that count, is wrong for every apply after the
    first (notebook 05 reproduces it).

    A copy would clip by `global_clipnorm` over its own stage only: it is refused here, and
    `Pipeline` clips over every stage (`clip_by_global_norm`) and gives the copies none.
    """
    check_optimizer(optimizer)
    if optimizer.global_clipnorm:
        raise ValueError(
            "global_clipnorm clips by the norm of the gradients of one apply, and each stage's copy sees only its own "
            "stage: use Pipeline(optimizer=...), which clips over every stage, or clipnorm (per weight)."
        )
    copies = []
    for stage, device in zip(stages, devices, strict=True):
        with tf.init_scope(), tf.device(device):  # its variables on the stage's device, even if traced
            copy = _copy(optimizer, optimizer.get_config())
            copy.build(list(stage.trainable_variables))
        copies.append(copy)
    return copies


def _copy(optimizer, config):
    """A fresh optimizer of `optimizer`'s class from `config`, with its weight-decay exclusions."""
    try:
        copy = type(optimizer).from_config(config)
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"cannot make one copy of {type(optimizer).__name__} per stage from its get_config() ({err}). Give a "
            "custom optimizer a get_config that returns every argument of its constructor, and a learning rate "
            "that is a number or a registered LearningRateSchedule (keras.saving.register_keras_serializable), "
            "not a lambda."
        ) from None
    for name in ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern"):
        if hasattr(optimizer, name):  # PRIVATE Keras state that get_config leaves out
            setattr(copy, name, getattr(optimizer, name))
    return copy


def clip_by_global_norm(grads, clip_norm: float, devices):
    """Every stage's gradients times clip_norm / max(norm, clip_norm), the norm taken over the
    gradients of every stage: Keras's `global_clipnorm` (`clip_by_global_norm` in
    keras/src/optimizers/base_optimizer.py) for gradients on S devices, except that the norm is
    taken in float32 whatever the gradients' dtype."""
    squares = []  # each stage's sum of squares, on its own device: only S scalars move
    for device, per_stage in zip(devices, grads, strict=True):
        if per_stage:
            with tf.device(device):
                squares.append(tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in per_stage]))
    if not squares:  # no stage has weights: nothing to clip
        return [list(per_stage) for per_stage in grads]
    with tf.device(devices[0]):
        norm = tf.sqrt(tf.add_n(squares))
        scale = clip_norm * tf.minimum(1.0 / norm, 1.0 / clip_norm) + (norm - norm)  # NaN if the norm is, as Keras
    clipped = []
    for device, per_stage in zip(devices, grads, strict=True):
        with tf.device(device):
            clipped.append([g * tf.cast(scale, g.dtype) for g in per_stage])
    return clipped


def _refuse_shared_variables(stages) -> None:
    """A variable in two stages would get two optimizer copies, each with its own state, and
    two updates per step: one optimizer on one device updates it once, from both gradients."""
    owner = {}  # id of a variable (alive: its stage holds it) -> the first stage that has it
    for s, stage in enumerate(stages):
        for v in stage.trainable_variables:
            first = owner.setdefault(id(v), s)
            if first != s:
                raise ValueError(
                    f"the variable {v.name!r} belongs to stages {first} and {s}: with an optimizer per stage it would "
                    "be updated twice per step, with two states. Give each stage its own variables, or use "
                    "learning_rate (plain SGD adds the two updates, as one device does)."
                )


def _refuse_keras_randomness(stages) -> None:
    """Under recomputation a Keras layer that draws random numbers (Dropout, GaussianNoise...)
    would draw them again in the backward: its gradient would belong to another network."""
    for s, stage in enumerate(stages):
        for layer in _keras_layers(stage):
            if getattr(layer, "seed_generator", None) is not None:  # Keras 3's random layers keep one
                raise ValueError(
                    f"stage {s} has the Keras layer {layer.name!r} ({type(layer).__name__}), which draws new random "
                    "numbers each call: with recompute=True the backward would use another mask than the forward. "
                    "Use pipeline.Dropout (its mask depends only on the seed, the step and the micro-batch), or "
                    "recompute=False."
                )


def _keras_layers(layer):
    """`layer` and every layer inside it, for Keras layers and models; nothing for other stages."""
    if not isinstance(layer, keras.Layer):
        return []
    return [layer] + [inner for child in getattr(layer, "layers", []) for inner in _keras_layers(child)]


def _arrived(out, device):
    """`out`, copied to `device`: the stage's next op waits for this copy, not only for `out`.

    Without the wait, the send may run only once the stage runs out of ready work. Measured on
    core devices (a trace of the workers' `_Send` ops): GPipe's eight forward sends of stage 0
    ran together after its eighth forward, last first, and stage 1 waited for the whole forward
    phase; notebook 05 traces when stage 1 starts. That fits TensorFlow's executor, where a
    thread that has cheap ready ops to run hands a ready op it counts as expensive (on a CPU
    device, one whose measured cost is above a threshold, the send here) to the thread pool
    (`ExecutorState::ScheduleReady` and `KernelStats` in executor.cc); why neither inter-op
    thread of the worker ran it sooner, we did not establish.
    """
    with tf.device(device):
        return tf.identity(out)


def _sample(shape, dtype, rows):
    rng = np.random.default_rng(0)
    return (
        tf.constant(rng.normal(size=(rows, *shape[1:])), dtype)
        if dtype.is_floating
        else tf.zeros([rows, *shape[1:]], dtype)
    )


def _dtype_hint(stage, h) -> str:
    dtypes = {v.dtype for v in stage.trainable_variables}
    if len(dtypes) == 1 and h.dtype not in dtypes:
        (want,) = dtypes
        return f". The stage's variables are {want.name}: cast the input with tf.cast(x, tf.{want.name})."
    return ""


def check_labels(loss_fn, y) -> None:
    """The default loss takes integer class ids of shape (B,): say how to fix anything else."""
    if loss_fn is not models.cross_entropy:
        return
    if y.dtype.is_integer and y.shape.rank == 2 and y.shape[1] == 1:
        raise ValueError(f"labels of shape {y.shape} have an extra axis: pass tf.squeeze(y, axis=-1).")
    if y.dtype.is_floating and y.shape.rank == 2:
        raise ValueError(
            f"labels of shape {y.shape} and dtype {y.dtype.name} look one-hot; models.cross_entropy takes class "
            "ids: pass tf.argmax(y, axis=-1, output_type=tf.int32), or a loss_fn for one-hot labels."
        )
    if not y.dtype.is_integer or y.shape.rank != 1:
        raise ValueError(f"labels must be integer class ids of shape (batch,), got {y.shape} {y.dtype.name}.")


def check_mean_reduced(loss_fn, logits, labels) -> None:
    """Refuse a loss that is not a scalar or that sums over the examples: a micro-batch
    repeated twice has the same mean loss, but twice the sum."""
    one = loss_fn(logits, labels)
    if one.shape.rank != 0:
        raise ValueError(f"loss_fn must return a scalar (the mean over the micro-batch), got shape {one.shape}.")
    two = loss_fn(tf.concat([logits, logits], 0), tf.concat([labels, labels], 0))
    one, two = float(one), float(two)
    if abs(one) > 1e-6 and abs(two - 2 * one) <= 1e-3 * abs(one):
        raise ValueError(
            "loss_fn sums over the examples (twice the micro-batch gives twice the loss); the pipeline "
            "averages the M micro-batch losses, so return the mean over the micro-batch (tf.reduce_mean)."
        )


# --- dropout whose mask a recomputed forward repeats ------------------------------------------

_running = threading.local()  # (step, micro-batch) of the op being built, for Dropout


@contextlib.contextmanager
def micro_batch(step, m: int):
    """Dropout built in this context draws the mask of (step, micro-batch m). The pipeline
    enters it for every forward and backward; a reference loop enters it to draw the same."""
    outer = getattr(_running, "key", None)
    _running.key = (step, m)
    try:
        yield
    finally:
        _running.key = outer


class Dropout(tf.Module):
    """Inverted dropout with a stateless mask: a function of (seed, step, micro-batch) only,
    so the forward and its recomputation in the backward drop the same units. Outside
    `micro_batch` (inference) it passes its input through."""

    trainable_variables = ()

    def __init__(self, rate: float, seed: int = 0, name=None):
        super().__init__(name=name)
        if not 0 <= rate < 1:
            raise ValueError(f"dropout rate must lie in [0, 1), got {rate}.")
        self.rate, self.seed = rate, seed

    def __call__(self, x):
        key = getattr(_running, "key", None)
        if key is None or self.rate == 0:
            return x
        step, m = key
        seed = tf.stack([tf.cast(step, tf.int64), tf.constant(self.seed * 100_003 + m, tf.int64)])
        return tf.nn.experimental.stateless_dropout(x, self.rate, seed=seed)


class StagedInput:
    """Feed a `Pipeline` as `tf_cnn_benchmarks` fed its towers: through a `StagingArea`.

    `run(batches)` puts the first batch into a StagingArea on the first stage's device (the
    warm-up put); then each step's call gets this step's batch from the area, runs the
    pipelined step on it, and puts the NEXT batch, so that its copy to the device overlaps
    this step's work; the last call only gets (the drain). The area holds at most one batch.

    `StagingArea` is a PRIVATE TensorFlow API (`tensorflow.python.ops.data_flow_ops`); its
    public route is `tf.data`: `dataset.apply(tf.data.experimental.prefetch_to_device(device))`.
    A `get` from an empty area waits forever and cannot be cancelled (stage_op.cc), so the
    area is only used inside `run`, which puts before it gets and clears the area when a step
    fails or is interrupted.
    """

    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline
        self.device = pipeline.devices[0]
        self.shared_name = f"staged_input_{next(_ids)}"  # one buffer, seen by every traced graph
        self._spec = None
        self._put = tf.function(self._put_graph, autograph=False)
        self._step = tf.function(self._step_graph, autograph=False)
        self._drain = tf.function(lambda: self._step_graph(None, None), autograph=False)
        self._size = tf.function(lambda: self._area().size(), autograph=False)
        self._clear = tf.function(self._clear_graph, autograph=False)

    def _area(self):
        # Each traced graph needs its own StagingArea object: the shared name makes them one.
        (x_shape, x_dtype), (y_shape, y_dtype) = self._spec
        with tf.device(self.device):
            return data_flow_ops.StagingArea(
                [x_dtype, y_dtype], shapes=[x_shape, y_shape], capacity=1, shared_name=self.shared_name
            )

    def _put_graph(self, x, y):
        self._area().put([x, y])

    def _clear_graph(self):
        self._area().clear()

    def _step_graph(self, x_next, y_next):
        area = self._area()
        with tf.device(self.device):
            x, y = area.get()
        loss = self.pipeline._train_steps([x], [y])[0]
        if x_next is not None:  # created last: nothing in the step waits for the next batch
            area.put([x_next, y_next])
        return loss

    def size(self) -> int:
        """Batches in the area now (0 between runs)."""
        with tf.device(self.device):
            return int(self._size()) if self._spec else 0

    def run(self, batches) -> list:
        """Train on every (x, y) of `batches` in turn; returns the losses of the steps."""
        if tf.inside_function():
            raise RuntimeError(
                "StagedInput.run puts and gets in Python-driven order and cannot be traced into a "
                "tf.function; call it eagerly, or use Pipeline.train_step inside your tf.function."
            )
        losses, batches = [], iter(batches)
        first = next(batches, None)
        if first is None:
            return losses
        try:
            self._put(*self._checked(*first))  # warm-up: the first batch goes to the device
            for x, y in batches:
                losses.append(self._step(*self._checked(x, y)))
            losses.append(self._drain())
        except BaseException:
            with tf.device(self.device):  # a later run must not get a stale batch
                self._clear()
            raise
        return losses

    def _checked(self, x, y):
        x, y = self.pipeline._checked_batch(x, y)
        spec = ((x.shape, x.dtype), (y.shape, y.dtype))
        if self._spec is None:
            self._spec = spec
        elif spec != self._spec:
            raise ValueError(f"every batch must have the shapes and dtypes of the first, {self._spec}; got {spec}.")
        return x, y


def stash_from_trace(events, stages: int) -> list[int]:
    """The most micro-batches each stage kept at once in a traced step, read from the run.

    Micro-batch m is in flight on stage s from the start of its forward's first op to the
    end of its backward's last op (the op names carry `stage{s}/F{m}` and `B{m}`).
    """
    spans = {}
    for e in events:
        found = _OP_NAME.match(e.op)
        if found:
            backward = bool(found["tape"]) or found["op"] == "B"
            key = (int(found["stage"]), int(found["m"]))
            start, end = spans.get(key, (np.inf, -np.inf))
            spans[key] = (min(start, e.start) if not backward else start, max(end, e.end) if backward else end)
    peaks = []
    for s in range(stages):
        edges = sorted((t, d) for (stage, _), (a, b) in spans.items() if stage == s for t, d in ((a, 1), (b, -1)))
        peaks.append(max(itertools.accumulate(d for _, d in edges), default=0))
    return peaks


_OP_NAME = re.compile(r"(?P<tape>gradient_tape/)?stage(?P<stage>\d+)/(?P<op>[FB])(?P<m>\d+)/")


def sequential_gradients(stages, devices, x, y, loss_fn=models.cross_entropy):
    """The naive split: the whole batch through the stages one after another, each
    stage's gradients computed on its own device (notebook 01). Returns (loss, gradients)."""
    tapes, inputs, outputs = [], [], []
    h = x
    for s, (stage, device) in enumerate(zip(stages, devices, strict=True)):
        with tf.device(device), tf.GradientTape() as tape:
            tape.watch(h)
            inputs.append(h)
            h = stage(h)
            if s == len(stages) - 1:
                h = loss_fn(h, y)
        tapes.append(tape)
        outputs.append(h)
    grads, upstream = [], None
    for s in reversed(range(len(stages))):
        with tf.device(devices[s]):
            g = tapes[s].gradient(outputs[s], [inputs[s], *stages[s].trainable_variables], output_gradients=upstream)
        grads = list(g[1:]) + grads
        upstream = g[0]
    return outputs[-1], grads
