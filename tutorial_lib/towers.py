"""Data parallelism by hand: split the batch into towers, average their gradients.

This is the pattern of TensorFlow's classic `cifar10_multi_gpu_train.py`, in TF 2: one
set of variables (on a controller device), one tower per device computing the loss and
gradients of its share of the batch, and the averaged gradient applied once.

Tower gradients come in either of two shapes, K towers x N variables each: plain
gradients, or cifar10's `(gradient, variable)` pairs from `optimizer.compute_gradients`.
"""

from __future__ import annotations

import tensorflow as tf

from . import checks, models
from .reference import apply_sgd  # also towers.apply_sgd, the name the notebooks use


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


def _is_pair(entry) -> bool:
    return isinstance(entry, tuple) and len(entry) == 2  # a gradient itself is never a tuple


def unzip_tower_grads(tower_grads):
    """Check K towers of N gradients each; return (K lists of gradients, K lists of variables).

    Towers of plain gradients come back as lists, with None for the variables. Towers of
    cifar10's `(gradient, variable)` pairs are split in two; a mix of both kinds is refused.
    """
    kinds = {_is_pair(entry) for tower in tower_grads for entry in tower}
    if len(kinds) > 1:
        raise ValueError(
            "tower gradients mix (gradient, variable) pairs and plain gradients: "
            "give every tower the same kind, e.g. all from optimizer.compute_gradients."
        )
    if kinds == {True}:
        grads = [[g for g, _ in tower] for tower in tower_grads]
        variables = [[v for _, v in tower] for tower in tower_grads]
    else:
        grads, variables = [list(tower) for tower in tower_grads], None
    _check_tower_grads(grads)
    return grads, variables


def average_gradients(tower_grads, device: str | None = None):
    """Average K towers' gradients (K lists of N) into N gradients, on `device`.

    A variable that no tower's loss uses has gradient None in every tower; it stays None.
    Given cifar10's `(gradient, variable)` pairs, returns N pairs, each with tower 0's
    variable (the towers share their variables there).
    """
    grads, variables = unzip_tower_grads(tower_grads)
    k = len(grads)
    averaged = []
    with tf.device(device), tf.name_scope("average_gradients"):
        for per_tower in zip(*grads, strict=True):
            if per_tower[0] is None:
                averaged.append(None)
            else:
                averaged.append(tf.add_n(list(per_tower)) / tf.cast(k, per_tower[0].dtype))
    return averaged if variables is None else list(zip(averaged, variables[0], strict=True))


def _check_tower_grads(tower_grads) -> None:
    if not tower_grads:
        raise ValueError("no towers: the gradient list is empty.")
    lengths = {len(g) for g in tower_grads}
    if len(lengths) != 1:
        raise ValueError(f"every tower must give one gradient per variable, got lengths {sorted(lengths)}.")
    for j, per_tower in enumerate(zip(*tower_grads, strict=True)):
        missing = [g is None for g in per_tower]
        if any(missing) and not all(missing):
            raise ValueError(f"variable {j} has a gradient in some towers and None in others.")
        kinds = {(tuple(g.shape), g.dtype.name) for g in per_tower if g is not None}
        if len(kinds) > 1:
            raise ValueError(
                f"variable {j} has gradients of different shapes or dtypes across towers: {sorted(kinds)}."
            )


def tower_gradients(model, x, y, devices):
    """Per-tower losses and gradients: tower i runs `model` on shard i under devices[i]."""
    devices = checks.device_list(devices)
    losses, grads = [], []
    shards = split_batch((x, y), len(devices))
    for i, (device, (xs, ys)) in enumerate(zip(devices, shards, strict=True)):
        with tf.device(device), tf.name_scope(f"tower_{i}"):
            with tf.GradientTape() as tape:
                loss = models.cross_entropy(model(xs), ys)
            grads.append(tape.gradient(loss, model.trainable_variables))
            losses.append(loss)
    return losses, grads


def make_train_step(model, devices, learning_rate: float, controller: str | None = None):
    """A `tf.function` step: towers on `devices`, gradients averaged on `controller`.

    Returns the mean loss of the towers, which is the loss of the whole batch.
    """
    devices = checks.device_list(devices)
    controller = controller or devices[0]

    @tf.function
    def step(x, y):
        losses, grads = tower_gradients(model, x, y, devices)
        apply_sgd(model.trainable_variables, average_gradients(grads, controller), learning_rate)
        with tf.device(controller):
            return tf.add_n(losses) / len(losses)

    return step
