"""`StagedInput`: feed a `Pipeline` through a `StagingArea`, as `tf_cnn_benchmarks` fed its towers: the batches
of a list or a dataset, each checked before anything is put (the take-away's `pipeline_parallel.StagedFeed` feeds
a repeating tf.data pipeline without these checks).

`StagingArea` is PRIVATE (the public route is `tf.data.experimental.prefetch_to_device`). A `get`
from an empty area waits forever: only `run` uses it, putting before it gets, emptying it on failure.
"""

from __future__ import annotations

import itertools

import tensorflow as tf
from pipeline_parallel import staged_step  # the take-away's step (notebook 05's lesson): get, step, put the next
from tensorflow.python.ops import data_flow_ops  # PRIVATE API: StagingArea

_ids = itertools.count()


class StagedInput:
    """`StagedInput(pipeline).run(batches)` trains on each (x, y) of `batches`, each step putting
    the next batch while it runs, and returns the losses (on failure, in the error's `losses`)."""

    def __init__(self, pipeline):
        self.pipeline = pipeline
        self.device = pipeline.devices[0]
        self.shared_name = f"staged_input_{next(_ids)}"  # one buffer, seen by every traced graph
        self._spec = None  # ((x dtype, x shape), (y dtype, y shape)), the batch size left open
        self._put = tf.function(self._put_graph, autograph=False)
        self._step = tf.function(self._step_graph, autograph=False)
        self._drain = tf.function(lambda: self._step_graph(None, None), autograph=False)
        self._size = tf.function(lambda: self._area().size(), autograph=False)
        self._clear = tf.function(self._clear_graph, autograph=False)

    def _area(self):
        # Each traced graph needs its own StagingArea object: the shared name makes them one buffer.
        (x_dtype, x_shape), (y_dtype, y_shape) = self._spec
        with tf.device(self.device):
            return data_flow_ops.StagingArea(
                [x_dtype, y_dtype], shapes=[x_shape, y_shape], capacity=1, shared_name=self.shared_name
            )

    def _put_graph(self, x, y):
        self._area().put([x, y])

    def _clear_graph(self):
        self._area().clear()

    def _step_graph(self, x_next, y_next):
        return staged_step(self._area(), lambda x, y: self.pipeline.build_steps([x], [y])[0], x_next, y_next)

    def size(self) -> int:
        """Batches in the area now (0 between runs)."""
        if self._spec is None:
            return 0
        with tf.device(self.device):  # size() counts the buffer of the device it runs on
            return int(self._size())

    def run(self, batches) -> list:
        if tf.inside_function():
            raise RuntimeError(
                "StagedInput.run puts and gets in Python-driven order and cannot be traced into a "
                "tf.function; call it eagerly, or use Pipeline.train_step inside your tf.function."
            )
        _refuse_unfixed_batches(batches)
        if isinstance(batches, list | tuple):  # every batch checked before any step
            batches = [self._checked(batch, k) for k, batch in enumerate(batches)]
        batches, losses = iter(batches), []
        first = next(batches, None)
        if first is None:
            return losses
        x, y = self._checked(first, 0)  # a bad first batch fails here, before anything is put
        self._put(x, y)
        try:
            for k, batch in enumerate(batches, start=1):
                try:
                    x, y = self._checked(batch, k)
                except (TypeError, ValueError):
                    losses.append(self._drain())  # the batch staged before this one is trained, then the error
                    raise
                losses.append(self._step(x, y))
            losses.append(self._drain())
        except BaseException as err:  # Ctrl-C too: a later run must not find a stale batch
            with tf.device(self.device):
                self._clear()
            err.losses = losses
            raise
        return losses

    def _checked(self, batch, k: int):
        if isinstance(batch, dict) or not isinstance(batch, tuple | list) or len(batch) != 2:
            raise TypeError(
                f"batch {k} is a {type(batch).__name__}, not an (x, y) pair: give StagedInput.run pairs of inputs "
                "and labels; map a dataset of dicts first, e.g. dataset.map(lambda d: (d['image'], d['label']))."
            )
        x, y = self.pipeline.check_batch(*batch)
        spec = ((x.dtype, [None, *x.shape[1:]]), (y.dtype, [None, *y.shape[1:]]))
        if self._spec is None:
            self._spec = spec
        elif spec != self._spec:
            raise ValueError(
                f"batch {k} has dtypes and shapes {_shown(spec)}, the first batch {_shown(self._spec)}: every batch "
                "needs the first's, but for its number of examples."
            )
        return x, y


def _refuse_unfixed_batches(batches) -> None:
    """A dataset batched without drop_remainder may end in a batch that M does not divide."""
    if not isinstance(batches, tf.data.Dataset):
        return
    first = tf.nest.flatten(batches.element_spec)[0]
    if first.shape.rank and first.shape[0] is None:
        raise ValueError(
            "this dataset's batches have no fixed size, so its last batch may be short and not split into the "
            "pipeline's micro-batches: batch it with drop_remainder=True (dataset.batch(n, drop_remainder=True))."
        )


def _shown(spec) -> str:
    return ", ".join(f"{dtype.name} {shape}" for dtype, shape in spec)
