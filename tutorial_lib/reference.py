"""The one-device reference every parallel method is checked against: a plain SGD step on the
whole batch, in training mode with the model's regularization losses, as a Keras loop does.
"""

from __future__ import annotations

import tensorflow as tf

from . import checks, models


def apply_sgd(variables, grads, learning_rate: float) -> None:
    """Plain SGD, each update on its variable's device (`assign_sub` runs there); a None gradient
    leaves its variable alone."""
    variables, grads = list(variables), list(grads)
    checks.same_length("variables", variables, "gradients", grads)  # zip would skip the extra variables
    for v, g in zip(variables, grads, strict=True):
        if g is not None:
            v.assign_sub(learning_rate * g)


def loss_and_gradients(model, x, y, loss_fn=models.cross_entropy):
    """The loss of `model` on the whole batch in training mode, its regularization losses included,
    and its gradients, one per trainable variable."""
    with tf.GradientTape() as tape:
        loss = loss_fn(model(x, training=True), y) + sum(model.losses)
    return loss, tape.gradient(loss, model.trainable_variables)


def sgd_step(model, x, y, learning_rate: float, loss_fn=models.cross_entropy):
    """One plain SGD step of `model` on the whole batch; returns the loss before the update."""
    loss, grads = loss_and_gradients(model, x, y, loss_fn)
    apply_sgd(model.trainable_variables, grads, learning_rate)
    return loss


def make_sgd_step(model, learning_rate: float, loss_fn=models.cross_entropy):
    """`sgd_step` as a `tf.function` of (x, y)."""
    return tf.function(lambda x, y: sgd_step(model, x, y, learning_rate, loss_fn))
