"""Synchronized batch norm: normalize with the statistics of the global batch.

With N devices and a small per-device batch, each device's batch mean and variance are
noisy estimates. Sync BN all-reduces, per feature, the count, the sum and the sum of
squares of every device's batch (one all-reduce of 2C+1 numbers), so that every device
normalizes with the mean and variance of the whole global batch.

The sum of squares is accumulated around each device's own mean and combined in float64:
the textbook E[x^2] - E[x]^2 in float32 loses every digit when the mean is large next to
the spread (try a mean of 1e4 and a standard deviation of 1).
"""

from __future__ import annotations

import tensorflow as tf

from . import allreduce
from .devices import normalize


def _axes(x, axis: int):
    """The axes to reduce over: all but the feature axis."""
    rank = x.shape.rank
    if rank is None or not -rank <= axis < rank:
        raise ValueError(f"axis {axis} does not exist in a tensor of shape {x.shape}; "
                         "use -1 for the features of (batch, ..., features) tensors.")
    feature = axis % rank
    return [a for a in range(rank) if a != feature]


def local_sums(x, axis: int = -1):
    """(count, sum, centred sum of squares + count * mean^2) of one device's batch, in float64."""
    axes = _axes(x, axis)
    x64 = tf.cast(x, tf.float64)
    count = tf.cast(tf.reduce_prod([tf.shape(x)[a] for a in axes]), tf.float64)
    mean = tf.reduce_mean(x64, axes)
    centred = tf.reduce_sum(tf.square(x64 - tf.reshape(mean, _broadcast_shape(x, axis))), axes)
    return tf.concat([[count], count * mean, centred + count * tf.square(mean)], 0)


def _broadcast_shape(x, axis):
    shape = [1] * x.shape.rank
    shape[axis % x.shape.rank] = -1
    return shape


def moments_from_sums(sums, num_features: int):
    """Global mean and (biased) variance from the all-reduced sums."""
    count, total, squares = sums[0], sums[1 : 1 + num_features], sums[1 + num_features :]
    mean = total / count
    # squares = sum over devices of (centred_i + n_i mean_i^2); subtracting count * mean^2 in
    # float64 keeps the result exact to about 1e-16 of mean^2, far below float32's precision.
    variance = tf.maximum(squares / count - tf.square(mean), 0.0)
    return mean, variance


def global_moments(xs, axis: int = -1, devices=None, method: str = "ring"):
    """Mean and variance of the concatenation of `xs` (one tensor per device), on every device.

    One all-reduce of the per-device sums; returns one (mean, variance) pair per device,
    in the dtype of the inputs.
    """
    if not xs:
        raise ValueError("global_moments needs one tensor per device, got none.")
    for x in xs:
        _axes(x, axis)  # a clear error for an axis that does not exist
    features = {x.shape[axis % x.shape.rank] for x in xs}
    if len(features) != 1:
        raise ValueError(f"every device needs the same number of features on axis {axis}, got {sorted(features)}.")
    for i, x in enumerate(xs):
        if x.shape[0] == 0:
            raise ValueError(f"device {i} has an empty batch: there is nothing to normalize. "
                             "Drop the remainder (batch(..., drop_remainder=True)) or skip that device.")
    num_features = features.pop()
    places = [normalize(d) for d in devices] if devices else [x.device for x in xs]
    sums = []
    for x, device in zip(xs, places):
        with tf.device(device):
            sums.append(local_sums(x, axis))
    reduced = allreduce.allreduce_grads([[s] for s in sums], average=False, method=method, devices=places)
    out = []
    for (total,), x, device in zip(reduced, xs, places):
        with tf.device(device):
            mean, variance = moments_from_sums(total, num_features)
            out.append((tf.cast(mean, x.dtype), tf.cast(variance, x.dtype)))
    return out


class SyncBatchNorm(tf.Module):
    """Batch norm over the global batch, for hand-built towers and for `MirroredStrategy`.

    - `towers(xs, devices, training)`: a list of per-device tensors in, a list out.
    - `__call__(x, training)`: one tensor, inside `strategy.run` (the statistics are
      all-reduced through the replica context) or on a single device.
    With `synchronized=False` each device uses its own batch's statistics (plain BN per
    device), for comparison. In training the moving statistics are updated once per step
    with the global statistics, so they are the same on every device.
    """

    def __init__(self, num_features: int, momentum: float = 0.9, epsilon: float = 1e-3,
                 synchronized: bool = True, name=None):
        super().__init__(name=name)
        self.momentum, self.epsilon, self.synchronized = momentum, epsilon, synchronized
        self.num_features = num_features
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

    def _normalize(self, x, mean, variance):
        return tf.nn.batch_normalization(x, mean, variance, self.beta, self.gamma, self.epsilon)

    def _update_moving(self, mean, variance) -> None:
        m = self.momentum
        self.moving_mean.assign(m * self.moving_mean + (1 - m) * mean)
        self.moving_variance.assign(m * self.moving_variance + (1 - m) * variance)

    def towers(self, xs, devices, training: bool):
        """Normalize a list of per-device tensors; training uses the batch statistics."""
        devices = [normalize(d) for d in devices]
        if len(devices) != len(xs):
            raise ValueError(f"{len(xs)} tensors but {len(devices)} devices.")
        if not training:
            out = []
            for x, device in zip(xs, devices):
                with tf.device(device):
                    out.append(self._normalize(x, self.moving_mean, self.moving_variance))
            return out
        if self.synchronized:
            stats = global_moments(xs, devices=devices)
        else:
            stats = []
            for x, device in zip(xs, devices):
                with tf.device(device):
                    stats.append(tuple(tf.nn.moments(x, _axes(x, -1))))
        out = []
        for x, (mean, variance), device in zip(xs, stats, devices):
            with tf.device(device):
                out.append(self._normalize(x, mean, variance))
        # Moving statistics: once per step. Synchronized, every pair is the global one; per
        # device, the average of the devices' means (the global mean) and of their variances.
        mean = tf.add_n([m for m, _ in stats]) / len(stats)
        variance = tf.add_n([v for _, v in stats]) / len(stats)
        self._update_moving(mean, variance)
        return out

    def __call__(self, x, training: bool):
        if not training:
            return self._normalize(x, self.moving_mean, self.moving_variance)
        context = tf.distribute.get_replica_context()
        if self.synchronized and context is not None and context.num_replicas_in_sync > 1:
            sums = context.all_reduce(tf.distribute.ReduceOp.SUM, local_sums(x))
            mean, variance = moments_from_sums(sums, self.num_features)
            mean, variance = tf.cast(mean, x.dtype), tf.cast(variance, x.dtype)
        else:
            mean, variance = tf.nn.moments(x, _axes(x, -1))
        self._update_moving(mean, variance)
        return self._normalize(x, mean, variance)
