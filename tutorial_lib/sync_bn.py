"""Synchronized batch norm (notebook 04): the global batch's mean and variance from one all-reduce
of every device's (count, mean, centred sum of squares), merged by Chan et al.'s formula (the take-away's
`data_parallel.local_moments` and `combine_moments`), for hand-built towers and `MirroredStrategy`.
"""

from __future__ import annotations

import numbers

import data_parallel
import tensorflow as tf
from data_parallel import combine_moments

from . import allreduce, checks
from .devices import normalize


def _check_tensor(x) -> None:
    if not x.shape.rank:
        raise ValueError(f"batch norm needs tensors of shape (batch, ..., features), got shape {x.shape}.")
    if not x.dtype.is_floating:
        raise TypeError(
            f"batch norm normalizes floating-point tensors, got {x.dtype.name}; "
            "convert the input first, e.g. tf.cast(x, tf.float32)."
        )


def local_moments(x):
    """[count, mean (C), centred sum of squares (C)] of one device's batch over all but the last axis, in
    float64: the take-away's `data_parallel.local_moments` of the input in float64."""
    return data_parallel.local_moments(tf.cast(x, tf.float64))


def _in_slot(row, index, n: int):
    """`row` as row `index` of an n-row matrix of zeros: summing n of these gathers the rows,
    bit for bit (adding zeros is exact), as PyTorch's SyncBatchNorm gathers its statistics."""
    return tf.pad(row[None], [[index, n - 1 - index], [0, 0]])


def _check_batches(xs) -> None:
    """One feature count, floating dtypes, and at least one example in the global batch."""
    if not xs:
        raise ValueError("global_moments needs one tensor per device, got none.")
    for x in xs:
        _check_tensor(x)
    features = {x.shape[-1] for x in xs}
    if len(features) != 1:
        raise ValueError(f"every device needs the same number of features, got {sorted(features)}.")
    if all(x.shape.num_elements() == 0 for x in xs):
        raise ValueError(
            "every device's batch is empty: there is nothing to normalize. Give at least one "
            "device an example (an empty device batch is fine as long as another has some)."
        )


def _on_each(devices, fn, *per_device):
    """[fn(*args) run under devices[i], for args the i-th items of `per_device`]."""
    out = []
    for device, *args in zip(devices, *per_device, strict=True):
        with tf.device(device):  # without a scope, eager ops run on the first device
            out.append(fn(*args))
    return out


def _global_statistics(xs, places, method: str):
    """Per device, (count, mean, variance) of the global batch in float64: one all-reduce."""
    slots = _on_each(places, lambda i, x: _in_slot(local_moments(x), i, len(xs)), range(len(xs)), xs)
    return _on_each(places, combine_moments, allreduce.all_reduce(slots, method=method, devices=places))


def global_moments(xs, method: str = "auto"):
    """One (mean, variance) pair of the concatenation of `xs` (one tensor per device, each on its
    device) per device, by one all-reduce by `method` (see `allreduce.all_reduce`), in the input's
    dtype (float32 for 16-bit input). A device's batch may be empty; the global batch may not."""
    _check_batches(xs)
    places = [x.device for x in xs]

    def pair(x, stats):
        # float32 for 16-bit input: a variance of spread 300 (90,000) is past float16's largest value (65,504)
        dtype = x.dtype if x.dtype in (tf.float32, tf.float64) else tf.float32
        return tf.cast(stats[1], dtype), tf.cast(stats[2], dtype)

    return _on_each(places, pair, xs, _global_statistics(xs, places, method))


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_hyperparameters(momentum, epsilon) -> None:
    """Refuse a momentum that makes the moving statistics diverge and an epsilon that allows NaN."""
    if not _is_real(momentum) or not 0 <= momentum <= 1:  # `not 0 <= m <= 1` also catches NaN
        raise ValueError(
            f"momentum must be in [0, 1] (Keras uses 0.99), got {momentum!r}: it is the share of "
            "the old moving statistics kept at each step."
        )
    if not _is_real(epsilon) or not epsilon > 0:
        raise ValueError(
            f"epsilon must be > 0 (Keras uses 0.001), got {epsilon!r}: with 0 a feature of zero "
            "variance gives 0 / 0 = NaN."
        )


class SyncBatchNorm(tf.Module):
    """Batch norm over the global batch: `towers(xs, devices, training)` for hand-built towers,
    `__call__(x, training)` inside `strategy.run` or on one device. `synchronized=False`: each
    device normalizes with its own batch's statistics, for comparison. The moving statistics are
    updated once per step, the same on every device."""

    def __init__(
        self, num_features: int, momentum: float = 0.9, epsilon: float = 1e-3, synchronized: bool = True, name=None
    ):
        super().__init__(name=name)
        _check_hyperparameters(momentum, epsilon)
        self.momentum, self.epsilon, self.synchronized = momentum, epsilon, synchronized
        self.num_features = checks.whole_number(num_features, "num_features")
        with self.name_scope:
            self.gamma = tf.Variable(tf.ones([num_features]), name="gamma")
            self.beta = tf.Variable(tf.zeros([num_features]), name="beta")
            # MEAN aggregation: under MirroredStrategy every replica writes the same value.
            moving = dict(trainable=False, aggregation=tf.VariableAggregation.MEAN)
            self.moving_mean = tf.Variable(tf.zeros([num_features]), name="moving_mean", **moving)
            self.moving_variance = tf.Variable(tf.ones([num_features]), name="moving_variance", **moving)

    @property
    def trainable_variables(self):
        return (self.gamma, self.beta)

    def _check_input(self, x) -> None:
        _check_tensor(x)
        features = x.shape[-1] if x.shape.rank else None
        if features is not None and features != self.num_features:
            raise ValueError(
                f"this SyncBatchNorm was built for {self.num_features} features, but the input's "
                f"last axis has {features} (shape {x.shape}); build it with "
                f"SyncBatchNorm({features}) or feed tensors with {self.num_features} features."
            )

    def _normalize(self, x, mean, variance):
        """Normalize in float32 (float64 for float64 input) and return the input's dtype."""
        compute = tf.float64 if x.dtype == tf.float64 else tf.float32
        y = tf.nn.batch_normalization(
            *(tf.cast(t, compute) for t in (x, mean, variance, self.beta, self.gamma)), self.epsilon
        )
        return tf.cast(y, x.dtype)

    def _update_moving(self, count, mean, variance) -> None:
        # A NaN or Inf in one device's batch would stay in the moving statistics for good. Both are
        # checked before either assign, and the assigns read the checked tensor: in a graph too,
        # neither runs once the check fails.
        checked = tf.debugging.check_numerics(
            tf.stack([mean, variance]),
            f"SyncBatchNorm {self.name}: the batch statistics are not finite (a NaN or Inf in some "
            "device's batch); the moving statistics were left unchanged. Check the inputs or lower "
            "the learning rate.",
        )
        mean, variance = checked[0], checked[1]
        # A batch without examples carries no statistics: it leaves the moving ones as they are.
        for moving, batch in ((self.moving_mean, mean), (self.moving_variance, variance)):
            batch = tf.where(count > 0, tf.cast(batch, moving.dtype), moving)
            moving.assign(self.momentum * moving + (1 - self.momentum) * batch)

    def towers(self, xs, devices, training: bool, method: str = "auto"):
        """Normalize a list of per-device tensors; training uses the batch statistics, all-reduced
        by `method` (see `allreduce.all_reduce`; "auto": NCCL where it can run, else the ring)."""
        if method not in allreduce.METHODS:  # refused even where it is not used, so a typo shows at once
            raise ValueError(f"method must be one of {allreduce.METHODS}, got {method!r}.")
        devices = [normalize(d) for d in checks.device_list(devices)]
        checks.same_length("tensors", xs, "devices", devices)
        for x in xs:
            self._check_input(x)
        if not training:
            return _on_each(devices, lambda x: self._normalize(x, self.moving_mean, self.moving_variance), xs)
        _check_batches(xs)
        if self.synchronized:
            stats = _global_statistics(xs, devices, method)
        else:
            stats = _on_each(devices, lambda x: combine_moments(local_moments(x)[None]), xs)
        out = _on_each(devices, lambda x, s: self._normalize(x, s[1], s[2]), xs, stats)
        # Moving statistics, once per step: the count-weighted average of the devices' pairs. Synchronized,
        # every pair is the global one; per device, it is the global mean and the mean within-device variance.
        count = tf.add_n([n for n, _, _ in stats])
        mean = tf.math.divide_no_nan(tf.add_n([n * m for n, m, _ in stats]), count)
        variance = tf.math.divide_no_nan(tf.add_n([n * v for n, _, v in stats]), count)
        self._update_moving(count, mean, variance)
        return out

    def __call__(self, x, training: bool):
        self._check_input(x)
        if not training:
            return self._normalize(x, self.moving_mean, self.moving_variance)
        row = local_moments(x)
        context = tf.distribute.get_replica_context()
        replicas = context.num_replicas_in_sync if context is not None else 1
        if self.synchronized and replicas > 1:
            # One all-reduce that gathers every replica's row (see the module docstring).
            rows = context.all_reduce(
                tf.distribute.ReduceOp.SUM, _in_slot(row, context.replica_id_in_sync_group, replicas)
            )
        else:
            rows = row[None]
        count, mean, variance = combine_moments(rows)
        self._update_moving(count, mean, variance)
        return self._normalize(x, mean, variance)
