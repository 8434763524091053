"""Replicated data parallelism (notebook 03's lessons): a model copy per device (the take-away's
`make_replicas` and `replica_optimizers`), gradients all-reduced by tensorpack's `allreduce_grads`, every
copy updated; `update_ratio`/`update_gap` compare a move with a reference's.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from data_parallel import make_replicas, replica_optimizers  # noqa: F401 (the take-away's: one copy)

from . import checks, models
from .allreduce import allreduce_grads


# lesson: 03_nccl_allreduce
def make_train_step(
    replicas, devices, *, learning_rate=None, optimizers=None, method="ring", loss_fn=models.cross_entropy
):
    """A tf.function of (x, y): each replica's gradient on its share of the batch, all-reduced, and each
    replica updated on its device, by plain SGD at `learning_rate` or by its own optimizer. Returns the
    replicas' losses: their mean is the batch's loss."""
    k = len(devices)

    @tf.function
    def step(x, y):
        all_grads, losses = [], []  # K x N gradients, K losses
        for device, replica, xs, ys in zip(devices, replicas, tf.split(x, k), tf.split(y, k), strict=True):
            with tf.device(device):  # forward and backward on the replica's device
                with tf.GradientTape() as tape:
                    loss = loss_fn(replica(xs, training=True), ys) + sum(replica.losses)  # its regularizers too
                all_grads.append(tape.gradient(loss, replica.trainable_variables))
                losses.append(loss)
        all_grads = allreduce_grads(all_grads, average=True, method=method, devices=devices)
        for i, (device, replica, grads) in enumerate(zip(devices, replicas, all_grads, strict=True)):
            with tf.device(device):  # each replica updates itself, on its device
                pairs = [(g, v) for g, v in zip(grads, replica.trainable_variables, strict=True) if g is not None]
                if optimizers is None:
                    for g, v in pairs:
                        v.assign_sub(learning_rate * g)
                else:
                    optimizers[i].apply_gradients(pairs)
        return losses

    return step


def _moves(start, weights, reference):
    """(weights - start, reference - start) per variable, all as float64 arrays."""
    start, weights, reference = list(start), list(weights), list(reference)
    checks.same_length("start values", start, "weights", weights)
    checks.same_length("start values", start, "reference weights", reference)
    moves = []
    for s, w, r in zip(start, weights, reference, strict=True):
        s, w, r = (np.asarray(a, dtype=np.float64) for a in (s, w, r))
        if not s.shape == w.shape == r.shape:
            raise ValueError(f"shapes differ: start {s.shape}, weights {w.shape}, reference {r.shape}.")
        moves.append((w - s, r - s))
    if not any(np.any(r) for _, r in moves):
        raise ValueError("the reference did not move from the start values: nothing to compare the move with.")
    return moves


def update_ratio(start, weights, reference) -> float:
    """How far `weights` moved from `start`, as a multiple of how far `reference` moved (norms)."""
    moves = _moves(start, weights, reference)
    moved = np.sqrt(sum(np.sum(w**2) for w, _ in moves))
    reference_moved = np.sqrt(sum(np.sum(r**2) for _, r in moves))
    return float(moved / reference_moved)


def update_gap(start, weights, reference) -> float:
    """Largest difference between the two moves, relative to the reference's largest move."""
    moves = _moves(start, weights, reference)
    largest = max(float(np.max(np.abs(r))) for _, r in moves)
    return max(float(np.max(np.abs(w - r))) for w, r in moves) / largest
