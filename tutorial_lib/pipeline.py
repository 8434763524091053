"""Pipelined model parallelism: micro-batches flow through stages on their own devices.

The model is cut into S stages, stage s on devices[s]. A training step cuts the batch into
M micro-batches and runs a *schedule* of ticks. In one tick every active stage takes one
item from a `StagingArea` buffer that an earlier tick filled, computes, and puts its
result into the next buffer; the stages of one tick are independent, so they run at the
same time on their devices. Forward activations move down the stages, gradients move
back up, each stage accumulates its own gradients on its own device, and one update per
step applies them.

- GPipe: all forward ticks, then all backward ticks. Idle share (S-1)/(M+S-1); every
  stage stashes the inputs of all M micro-batches until their backward tick.
- 1F1B: once the pipeline is full, each stage does one forward and one backward per tick,
  so a stage stashes only the micro-batches still in flight, whatever M is.

A backward tick recomputes the stage's forward pass from its stashed input (GPipe's
re-materialization): a tape cannot outlive the `tf.function` call that recorded it.
"""

from __future__ import annotations

import itertools

import tensorflow as tf
from tensorflow.python.ops import data_flow_ops

from . import checks, models
from .devices import normalize

SCHEDULES = ("sequential", "gpipe", "1f1b")
_ids = itertools.count()


class PipelineError(RuntimeError):
    """A pipeline was used in a way that would block forever; the message says how to fix it."""


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle share of a GPipe step with balanced stages: (S-1)/(M+S-1)."""
    S, M = checks.whole_number(stages, "stages"), checks.whole_number(micro_batches, "micro_batches")
    return (S - 1) / (M + S - 1)


def schedule(stages: int, micro_batches: int, kind: str = "gpipe"):
    """The ticks of one step: for each tick, (stages running a forward, stages running a backward).

    "sequential" is the naive split run through the same machinery: each micro-batch goes
    forward through every stage and back before the next one starts, one stage at a time.
    In the others, stage s runs the forward of micro-batch m at tick m + s. GPipe runs every backward
    after every forward, the last stage first; 1F1B runs the backward of micro-batch m on
    stage s at tick m + 2(S-1) - s, as soon as its gradient has arrived, so the last stage
    runs the forward and the backward of a micro-batch in the same tick.
    """
    S, M = checks.whole_number(stages, "stages"), checks.whole_number(micro_batches, "micro_batches")
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {kind!r}.")

    def active(t, offset):  # stages s with 0 <= t - offset(s) < M
        return frozenset(s for s in range(S) if 0 <= t - offset(s) < M)

    if kind == "sequential":  # the naive split: one micro-batch, one stage at a time
        down = [(frozenset([s]), frozenset()) for s in range(S)]
        up = [(frozenset(), frozenset([s])) for s in reversed(range(S))]
        return (down + up) * M
    if kind == "gpipe":
        forward = [(active(t, lambda s: s), frozenset()) for t in range(M + S - 1)]
        backward = [(frozenset(), active(u, lambda s: S - 1 - s)) for u in range(M + S - 1)]
        return forward + backward
    return [(active(t, lambda s: s), active(t, lambda s: 2 * S - 2 - s)) for t in range(M + 2 * S - 2)]


class Buffer:
    """A `StagingArea` on one device, plus a count of its items kept in Python.

    A `get` from an empty StagingArea waits forever and a `put` into a full one waits for
    a `get`; the count lets the pipeline refuse both with an error before they happen.
    """

    def __init__(self, name: str, device: str, dtype, shape, capacity: int):
        self.name, self.device, self.capacity = name, device, capacity
        self.dtype, self.shape = dtype, shape
        self.shared_name = f"{name}_{next(_ids)}"  # one buffer per pipeline, across calls
        self.count = 0
        self._size = tf.function(lambda: self._area().size())

        def clear():
            self._area().clear()

        self._clear = tf.function(clear)

    def _area(self):
        # Each graph needs its own StagingArea object; the shared name makes them one buffer.
        with tf.device(self.device):
            return data_flow_ops.StagingArea(
                [self.dtype], shapes=[self.shape], capacity=self.capacity, shared_name=self.shared_name
            )

    def put_op(self, value):
        with tf.device(self.device), tf.name_scope(self.name):
            return self._area().put([value])

    def get_op(self):
        with tf.device(self.device), tf.name_scope(self.name):
            items = self._area().get()
        return items[0] if isinstance(items, (list, tuple)) else items

    def will_get(self) -> None:
        if self.count == 0:
            raise PipelineError(
                f"buffer '{self.name}' on {self.device} is empty: a get would wait forever. "
                "Run the ticks of the schedule in order, starting from a put."
            )
        self.count -= 1

    def will_put(self) -> None:
        if self.count == self.capacity:
            raise PipelineError(
                f"buffer '{self.name}' on {self.device} is full ({self.capacity} items): a put "
                "would wait for a get that never comes. Give it a larger capacity."
            )
        self.count += 1

    def size(self) -> int:
        """Items in the StagingArea now, as TensorFlow counts them (not the Python count)."""
        with tf.device(self.device):
            return int(self._size())

    def clear(self) -> None:
        with tf.device(self.device):
            self._clear()
        self.count = 0


class Pipeline:
    """Train `stages` (callables with `trainable_variables`), stage s on devices[s].

    `train_step(x, y)` runs one step of the chosen schedule over `micro_batches` equal
    micro-batches of the batch and applies plain SGD once; it returns the batch's mean loss.
    `gradients(x, y)` runs the same ticks without the update.
    """

    def __init__(
        self,
        stages,
        devices,
        micro_batches: int,
        learning_rate: float,
        schedule_kind: str = "gpipe",
        loss_fn=models.cross_entropy,
    ):
        if not stages or len(stages) != len(devices):
            raise ValueError(f"need one device per stage, got {len(stages)} stages and {len(devices)} devices.")
        self.ticks = schedule(len(stages), micro_batches, schedule_kind)
        self.stages, self.devices = list(stages), [normalize(d) for d in devices]
        self.micro_batches, self.learning_rate, self.loss_fn = micro_batches, learning_rate, loss_fn
        self.schedule_kind = schedule_kind
        self._functions: dict = {}
        self._batch_shape = None

    # --- building, on the first batch ---------------------------------------------------

    def _build(self, x, y) -> None:
        S, M = len(self.stages), self.micro_batches
        mb = x.shape[0] // M
        inputs = [tf.TensorShape([mb, *x.shape[1:]])]  # input shape of each stage, found by a dry run
        h = tf.zeros(inputs[0], x.dtype)
        for s, (stage, device) in enumerate(zip(self.stages, self.devices, strict=True)):
            try:
                with tf.device(device):
                    h = stage(h)
            except (tf.errors.InvalidArgumentError, ValueError) as err:
                after = f"the output of stage {s - 1}" if s else "the micro-batch"
                raise ValueError(
                    f"stage {s} cannot take {after}, of shape {h.shape}: {str(err).splitlines()[0]}"
                ) from None
            inputs.append(h.shape)
        self.x_buffer = Buffer("inputs", self.devices[0], x.dtype, inputs[0], M)
        self.y_buffer = Buffer("labels", self.devices[-1], y.dtype, [mb], M)
        self.forward = [Buffer(f"forward{s}", self.devices[s + 1], tf.float32, inputs[s + 1], 2) for s in range(S - 1)]
        self.backward = [Buffer(f"backward{s}", self.devices[s], tf.float32, inputs[s + 1], 2) for s in range(S - 1)]
        self.stash = [Buffer(f"stash{s}", self.devices[s], tf.float32, inputs[s], M) for s in range(S)]
        self.label_stash = Buffer("label_stash", self.devices[-1], y.dtype, [mb], M)
        self.accumulators = []
        for stage, device in zip(self.stages, self.devices, strict=True):
            with tf.device(device):
                self.accumulators.append(
                    [tf.Variable(tf.zeros_like(v), trainable=False) for v in stage.trainable_variables]
                )
        with tf.device(self.devices[-1]):
            self.loss_sum = tf.Variable(0.0, trainable=False)
        self._batch_shape = x.shape

    def buffers(self) -> list[Buffer]:
        return [self.x_buffer, self.y_buffer, *self.forward, *self.backward, *self.stash, self.label_stash]

    def concrete_functions(self):
        """Every graph the pipeline runs (for `timeline.trace(..., placement_of=...)`)."""
        return list(self._functions.values())

    def _function(self, key, build):
        if key not in self._functions:
            self._functions[key] = tf.function(build).get_concrete_function()
        return self._functions[key]

    # --- the work of one tick -------------------------------------------------------------

    def _tick_graph(self, forward, backward):
        last = len(self.stages) - 1
        fused = last in forward and last in backward  # 1F1B: the last stage's forward and backward at once
        # Gets first, puts last. tf.function keeps stateful ops such as these in program
        # order, and a put waits for its stage's compute: a get written after another
        # stage's put would make the two stages of this tick run one after the other.
        got = self._tick_gets(forward, backward, fused)
        puts, accumulate = self._tick_forwards(forward, got, fused)
        for s in sorted(backward):
            self._tick_backward(s, got, fused, puts, accumulate)
        for buffer, value in puts:
            buffer.put_op(value)
        for s, grads, loss in accumulate:
            with tf.device(self.devices[s]), tf.name_scope(f"stage{s}/backward/accumulate"):
                if grads is not None:  # None: the last stage's loss, before its backward
                    for acc, g in zip(self.accumulators[s], grads, strict=True):
                        acc.assign_add(g)
                if loss is not None:
                    self.loss_sum.assign_add(loss)

    def _tick_gets(self, forward, backward, fused) -> dict:
        """Every get of a tick: inputs of the forwards, stashes and gradients of the backwards."""
        last, got = len(self.stages) - 1, {}
        for s in sorted(forward):
            got["in", s] = (self.x_buffer if s == 0 else self.forward[s - 1]).get_op()
            if s == last:
                got["labels"] = self.y_buffer.get_op()
        for s in sorted(backward):
            if s == last and fused:  # the forward of this very tick is the stash
                got["stash", s], got["stash labels"], got["grad", s] = got["in", s], got["labels"], None
                continue
            got["grad", s] = None if s == last else self.backward[s].get_op()
            got["stash", s] = self.stash[s].get_op()
            if s == last:
                got["stash labels"] = self.label_stash.get_op()
        return got

    def _tick_forwards(self, forward, got, fused):
        """The forwards of a tick; returns the puts they make and the losses to accumulate."""
        last, puts, accumulate = len(self.stages) - 1, [], []
        for s in sorted(forward):
            if s == last and fused:
                continue  # its backward computes the forward too
            h = got["in", s]
            with tf.device(self.devices[s]), tf.name_scope(f"stage{s}"):
                out = self.stages[s](h)
                if s == last:
                    accumulate.append((s, None, self.loss_fn(out, got["labels"])))  # a loss, no gradients yet
                    puts.append((self.label_stash, got["labels"]))
                else:
                    puts.append((self.forward[s], out))
            puts.append((self.stash[s], h))
        return puts, accumulate

    def _tick_backward(self, s, got, fused, puts, accumulate) -> None:
        """Stage s's backward: recompute its forward from the stash, then its gradients."""
        last, h, loss = len(self.stages) - 1, got["stash", s], None
        with tf.device(self.devices[s]), tf.name_scope(f"stage{s}/backward"):
            with tf.GradientTape() as tape:  # recompute the forward pass from the stashed input
                tape.watch(h)
                out = self.stages[s](h)
                if s == last:
                    out = loss = self.loss_fn(out, got["stash labels"])
            grads = tape.gradient(out, [h, *self.stages[s].trainable_variables], output_gradients=got["grad", s])
        accumulate.append((s, grads[1:], loss if fused and s == last else None))
        if s > 0:
            puts.append((self.backward[s - 1], grads[0]))

    def _buffers_of_tick(self, forward, backward):
        """(buffers the tick gets from, buffers it puts into), in the order of `_tick_graph`."""
        last = len(self.stages) - 1
        fused = last in forward and last in backward
        gets, puts = [], []
        for s in sorted(forward):
            gets += [self.x_buffer if s == 0 else self.forward[s - 1]] + ([self.y_buffer] if s == last else [])
            if not (s == last and fused):
                puts += [self.stash[s], self.label_stash] if s == last else [self.forward[s], self.stash[s]]
        for s in sorted(backward):
            if not (s == last and fused):
                gets += [self.stash[s], self.label_stash] if s == last else [self.backward[s], self.stash[s]]
            if s > 0:
                puts.append(self.backward[s - 1])
        return gets, puts

    def _run_tick(self, forward, backward) -> None:
        """Check that every get finds an item and every put finds room, then run the tick."""
        gets, puts = self._buffers_of_tick(forward, backward)
        for buffer in gets:
            buffer.will_get()
        for buffer in puts:
            buffer.will_put()
        self._function(("tick", forward, backward), lambda: self._tick_graph(forward, backward))()

    def _stage_inputs(self, x, y) -> None:
        """Put the M micro-batches into the input buffers: the copies to the devices happen here."""
        M = self.micro_batches

        def put_all(x, y):
            for xm, ym in zip(tf.split(x, M), tf.split(y, M), strict=True):
                self.x_buffer.put_op(xm)
                self.y_buffer.put_op(ym)

        key = ("inputs", tuple(x.shape), x.dtype, y.dtype)
        if key not in self._functions:
            self._functions[key] = tf.function(put_all).get_concrete_function(
                tf.TensorSpec(x.shape, x.dtype), tf.TensorSpec(y.shape, y.dtype)
            )
        for _ in range(M):
            self.x_buffer.will_put()
            self.y_buffer.will_put()
        self._functions[key](x, y)

    # --- a step -----------------------------------------------------------------------------

    def _run_schedule(self, x, y, after_tick=None) -> None:
        x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
        if x.shape[0] is None or x.shape[0] % self.micro_batches or x.shape[0] != y.shape[0]:
            raise ValueError(
                f"a batch of {x.shape[0]} examples (and {y.shape[0]} labels) does not split into "
                f"{self.micro_batches} equal micro-batches. Use a batch size that is a multiple of "
                f"{self.micro_batches}, or batch with drop_remainder=True."
            )
        if self._batch_shape is None:
            self._build(x, y)
        elif x.shape != self._batch_shape:
            raise ValueError(f"this pipeline was built for batches of shape {self._batch_shape}, got {x.shape}.")
        if any(b.count for b in self.buffers()):  # an earlier step was interrupted: start clean
            for b in self.buffers():
                b.clear()
        self._stage_inputs(x, y)
        for forward, backward in self.ticks:
            self._run_tick(forward, backward)
            if after_tick is not None:
                after_tick()

    def _finish(self, apply: bool):
        M, lr = self.micro_batches, self.learning_rate

        def finish():
            grads = []
            for stage, accs, device in zip(self.stages, self.accumulators, self.devices, strict=True):
                with tf.device(device), tf.name_scope("update"):
                    for v, acc in zip(stage.trainable_variables, accs, strict=True):
                        g = acc / M
                        if apply:
                            v.assign_sub(lr * g)
                        grads.append(g)
                        acc.assign(tf.zeros_like(acc))
            with tf.device(self.devices[-1]):
                loss = self.loss_sum / M
                self.loss_sum.assign(0.0)
            return loss, grads

        return self._function(("finish", apply), finish)()

    def train_step(self, x, y):
        """One pipelined step: the schedule's ticks, then one SGD update per stage. Returns the loss."""
        self._run_schedule(x, y)
        return self._finish(apply=True)[0]

    def gradients(self, x, y):
        """The loss and the gradients of the whole batch (stage by stage), without updating."""
        self._run_schedule(x, y)
        return self._finish(apply=False)

    def stash_profile(self, x, y) -> list[list[int]]:
        """Items in each stage's stash after every tick, read from the StagingAreas themselves."""
        sizes = []
        self._run_schedule(x, y, after_tick=lambda: sizes.append([b.size() for b in self.stash]))
        self._finish(apply=False)
        return sizes


def sequential_gradients(stages, devices, x, y, loss_fn=models.cross_entropy):
    """Reference: the whole batch through the stages one after another, each stage's
    gradients computed on its own device (notebook 01). Returns (loss, gradients)."""
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
