"""The single-device reference that every parallel method is checked against.

One plain SGD step of one model on the whole batch: towers, all-reduce, pipelines and
strategies are right when they end with the same loss and the same weights as this.
"""

from __future__ import annotations

import tensorflow as tf

from . import checks, models


def apply_sgd(variables, grads, learning_rate: float) -> None:
    """Plain SGD, each update on the device of its variable; a None gradient leaves its variable alone."""
    variables, grads = list(variables), list(grads)
    checks.same_length("variables", variables, "gradients", grads)  # zip would skip the extra variables
    for v, g in zip(variables, grads, strict=True):
        if g is not None:
            with tf.device(v.device):
                v.assign_sub(learning_rate * g)


def loss_and_gradients(model, x, y, loss_fn=models.cross_entropy):
    """The loss of `model` on the whole batch and its gradients, one per trainable variable."""
    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    return loss, tape.gradient(loss, model.trainable_variables)


def sgd_step(model, x, y, learning_rate: float, loss_fn=models.cross_entropy):
    """One plain SGD step of `model` on the whole batch; returns the loss before the update."""
    loss, grads = loss_and_gradients(model, x, y, loss_fn)
    apply_sgd(model.trainable_variables, grads, learning_rate)
    return loss


def make_sgd_step(model, learning_rate: float, loss_fn=models.cross_entropy):
    """`sgd_step` as a `tf.function` of (x, y)."""
    return tf.function(lambda x, y: sgd_step(model, x, y, learning_rate, loss_fn))
