"""Optimizers with state (Adam) on replicated variables: one optimizer per replica.

The seed's script all-reduces the gradients and then calls `apply_gradients` once per tower
on ONE set of shared variables, so Adam steps K times per batch. With replicated variables
each replica must apply the averaged gradient once, with an optimizer of its own: a Keras 3
optimizer builds its slot variables (Adam's m and v) for the variables of its first
`apply` and refuses any other ("Unknown variable").

- `make_replicated_step`: a tape per replica, `allreduce_grads`, one apply per replica;
  the tested copy of the step notebook 03 writes in cells.
- `update_ratio`, `update_gap`: how far weights moved, compared with a reference's move
  (notebook 03 measures the seed's bug and checks the fixes with them).
- `real_global_batch`: how many examples a distributed batch really holds, the
  denominator that makes a short last batch match one device.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from . import allreduce, checks, models
from .towers import split_batch


def check_own_optimizers(replicas, optimizers) -> None:
    """Refuse anything but one distinct optimizer per replica."""
    checks.same_length("replicas", replicas, "optimizers", optimizers)
    if len({id(o) for o in optimizers}) != len(optimizers):
        raise ValueError(
            "each replica needs its own optimizer: a Keras 3 optimizer keeps its slot variables "
            "(Adam's m and v) for the variables of its first apply and refuses any others "
            "('Unknown variable'). Create one per replica, e.g. "
            "[tf.keras.optimizers.Adam(lr) for _ in replicas]."
        )


def make_replicated_step(replicas, optimizers, devices, method: str = "ring", loss_fn=models.cross_entropy):
    """A `tf.function` of (x, y): every replica's gradient on its share, averaged, applied once per replica.

    Replica k and its optimizer's slots live on devices[k]; the replicas must start equal.
    """
    devices = checks.device_list(devices)
    checks.same_length("replicas", replicas, "devices", devices)
    check_own_optimizers(replicas, optimizers)
    for device, replica, optimizer in zip(devices, replicas, optimizers, strict=True):
        with tf.device(device):
            optimizer.build(list(replica.trainable_variables))  # its slots, beside its replica

    @tf.function
    def step(x, y):
        all_grads = []
        for device, replica, (xs, ys) in zip(devices, replicas, split_batch((x, y), len(devices)), strict=True):
            with tf.device(device):
                with tf.GradientTape() as tape:
                    loss = loss_fn(replica(xs), ys)
                all_grads.append(tape.gradient(loss, replica.trainable_variables))
        all_grads = allreduce.allreduce_grads(all_grads, average=True, method=method, devices=devices)
        for device, replica, optimizer, grads in zip(devices, replicas, optimizers, all_grads, strict=True):
            with tf.device(device):
                optimizer.apply_gradients(zip(grads, replica.trainable_variables, strict=True))

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


def real_global_batch(strategy, per_replica) -> int:
    """The number of examples in a distributed batch: the sum over replicas (a short batch holds fewer)."""
    return sum(int(tf.shape(t)[0]) for t in strategy.experimental_local_results(per_replica))
