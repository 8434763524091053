"""Data parallelism by hand, as in `cifar10_multi_gpu_train.py`: towers that share one set of
variables, their gradients averaged on a controller (notebook 02's lessons), and `split_batch`.
"""

from __future__ import annotations

import tensorflow as tf

from . import checks, models


def split_batch(batch, n: int):
    """Split a tensor, or a tuple/dict of tensors, into n equal shards along axis 0."""
    n = checks.whole_number(n, "n (the number of towers)")
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


# lesson: 02_tower_averaging
def tower_gradients(model, x, y, devices):
    """Tower i runs `model` on shard i of the batch, under devices[i]: the towers' losses and gradients."""
    n = len(devices)
    tower_losses, tower_grads = [], []
    for i, (device, xs, ys) in enumerate(zip(devices, tf.split(x, n), tf.split(y, n), strict=True)):
        with tf.device(device), tf.name_scope(f"tower_{i}"):
            with tf.GradientTape() as tape:
                loss = models.cross_entropy(model(xs, training=True), ys) + sum(model.losses)  # mean over the shard
            tower_grads.append(tape.gradient(loss, model.trainable_variables))
            tower_losses.append(loss)
    return tower_losses, tower_grads


# lesson: 02_tower_averaging
def average_gradients(tower_grads, device=None):
    """K towers x N variables -> N averaged gradients, computed on `device` (the controller); None stays None."""
    with tf.device(device), tf.name_scope("average_gradients"):
        return [
            None if grads[0] is None else tf.add_n(list(grads)) / len(grads) for grads in zip(*tower_grads, strict=True)
        ]


# lesson: 02_tower_averaging
def make_train_step(model, devices, learning_rate, controller=None):
    """A tf.function of (x, y): towers on `devices`, their gradients averaged and applied by SGD on the
    controller (the first device unless given). Returns the towers' mean loss, the whole batch's loss."""
    controller = controller or devices[0]

    @tf.function
    def step(x, y):
        losses, grads = tower_gradients(model, x, y, devices)
        with tf.device(controller):
            for v, g in zip(model.trainable_variables, average_gradients(grads, controller), strict=True):
                if g is not None:
                    v.assign_sub(learning_rate * g)
            return tf.add_n(losses) / len(losses)

    return step
