"""Data parallelism by hand: split the batch into towers, average their gradients.

This is the pattern of TensorFlow's classic `cifar10_multi_gpu_train.py`, in TF 2: one
set of variables (on a controller device), one tower per device computing the loss and
gradients of its share of the batch, and the averaged gradient applied once.
"""

from __future__ import annotations

import tensorflow as tf

from . import models


def split_batch(batch, n: int):
    """Split a tensor, or a tuple/dict of tensors, into n equal shards along axis 0."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (the number of towers) must be a whole number >= 1, got {n!r}.")
    leaves = [tf.convert_to_tensor(t) for t in tf.nest.flatten(batch)]
    sizes = {t.shape[0] for t in leaves}
    if None not in sizes and len(sizes) != 1:
        raise ValueError(f"every part of the batch needs the same number of examples, got {sorted(sizes)}.")
    size = sizes.pop() if len(sizes) == 1 else None  # None: unknown until run time
    if size is not None and size % n:
        raise ValueError(
            f"a batch of {size} examples does not split evenly into {n} towers "
            f"({size} = {n} x {size // n} + {size % n}). Use a batch size that is a multiple "
            f"of {n}, such as {max(n, size - size % n)}, or batch with drop_remainder=True."
        )
    parts = [tf.split(t, n) for t in leaves]
    return [tf.nest.pack_sequence_as(batch, [p[i] for p in parts]) for i in range(n)]


def average_gradients(tower_grads, device: str | None = None):
    """Average K towers' gradients (K lists of N) into N gradients, on `device`.

    A variable that no tower's loss uses has gradient None in every tower; it stays None.
    """
    _check_tower_grads(tower_grads)
    k = len(tower_grads)
    averaged = []
    with tf.device(device), tf.name_scope("average_gradients"):
        for per_tower in zip(*tower_grads):
            if per_tower[0] is None:
                averaged.append(None)
            else:
                averaged.append(tf.add_n(list(per_tower)) / tf.cast(k, per_tower[0].dtype))
    return averaged


def _check_tower_grads(tower_grads) -> None:
    if not tower_grads:
        raise ValueError("no towers: the gradient list is empty.")
    lengths = {len(g) for g in tower_grads}
    if len(lengths) != 1:
        raise ValueError(
            f"every tower must give one gradient per variable, got lengths {sorted(lengths)}.")
    for j, per_tower in enumerate(zip(*tower_grads)):
        missing = [g is None for g in per_tower]
        if any(missing) and not all(missing):
            raise ValueError(f"variable {j} has a gradient in some towers and None in others.")
        shapes = {tuple(g.shape) for g in per_tower if g is not None}
        if len(shapes) > 1:
            raise ValueError(f"variable {j} has gradients of different shapes across towers: {sorted(shapes)}.")


def tower_gradients(model, x, y, devices):
    """Per-tower losses and gradients: tower i runs `model` on shard i under devices[i]."""
    if not devices:
        raise ValueError("no devices: pass at least one device name.")
    losses, grads = [], []
    for i, (device, (xs, ys)) in enumerate(zip(devices, split_batch((x, y), len(devices)))):
        with tf.device(device), tf.name_scope(f"tower_{i}"):
            with tf.GradientTape() as tape:
                loss = models.cross_entropy(model(xs), ys)
            grads.append(tape.gradient(loss, model.trainable_variables))
            losses.append(loss)
    return losses, grads


def apply_sgd(variables, grads, learning_rate: float) -> None:
    """Plain SGD, each update on the device of its variable."""
    for v, g in zip(variables, grads):
        if g is not None:
            with tf.device(v.device):
                v.assign_sub(learning_rate * g)


def make_train_step(model, devices, learning_rate: float, controller: str | None = None):
    """A `tf.function` step: towers on `devices`, gradients averaged on `controller`.

    Returns the mean loss of the towers, which is the loss of the whole batch.
    """
    controller = controller or devices[0]

    @tf.function
    def step(x, y):
        losses, grads = tower_gradients(model, x, y, devices)
        apply_sgd(model.trainable_variables, average_gradients(grads, controller), learning_rate)
        with tf.device(controller):
            return tf.add_n(losses) / len(losses)

    return step
