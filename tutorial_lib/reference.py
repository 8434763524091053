"""The one-device reference every parallel method is checked against: a plain SGD step on the
whole batch, in training mode with the model's regularization losses, as a Keras loop does.
"""

from __future__ import annotations

import tensorflow as tf

from . import models


def loss_and_gradients(model, x, y):
    """The loss of `model` on the whole batch in training mode, its regularization losses included,
    and its gradients, one per trainable variable."""
    with tf.GradientTape() as tape:
        loss = models.cross_entropy(model(x, training=True), y) + sum(model.losses)
    return loss, tape.gradient(loss, model.trainable_variables)


def sgd_step(model, x, y, learning_rate: float):
    """One plain SGD step of `model` on the whole batch, each update on its variable's device (a None
    gradient leaves its variable alone); returns the loss before the update."""
    loss, grads = loss_and_gradients(model, x, y)
    for v, g in zip(model.trainable_variables, grads, strict=True):
        if g is not None:
            v.assign_sub(learning_rate * g)
    return loss


def make_sgd_step(model, learning_rate: float):
    """`sgd_step` as a `tf.function` of (x, y)."""
    return tf.function(lambda x, y: sgd_step(model, x, y, learning_rate))


def optimizer_losses(model, batches, optimizer) -> list[float]:
    """One step of a Keras `optimizer` on `model` per (x, y) of `batches`, on the whole batch: the
    reference for methods that keep an optimizer per device or stage. Returns each step's loss."""
    losses = []
    for x, y in batches:
        loss, grads = loss_and_gradients(model, x, y)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(float(loss))
    return losses
