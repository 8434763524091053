"""TensorFlow's own route: MirroredStrategy helpers.

Notebook 03 writes the all-reduce by hand; these let the same custom training loop (no
Keras `fit`) run under `tf.distribute`, which does the all-reduce inside
`apply_gradients`. `multi_worker` uses the same step under `MultiWorkerMirroredStrategy`.
"""

from __future__ import annotations

import tensorflow as tf


def mirrored_strategy(devices, cross_device_ops=None) -> tf.distribute.MirroredStrategy:
    """A `MirroredStrategy` whose collective keys cannot collide with an earlier one's.

    Every `MirroredStrategy` numbers its collective groups from the same base. A second
    strategy over a different number of devices in the same process then reuses a group key
    with another size and fails with "... is joining a group with size 2, but that group has
    size 4". TensorFlow's own tests move the base between strategies; so does this.
    """
    tf.distribute.MirroredStrategy._collective_key_base += 100_000
    return tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops)


def mirrored_train_step(strategy, model, optimizer, global_batch: int):
    """Notebook 03's custom step under a `tf.distribute` strategy; returns the batch's loss.

    Each replica divides its summed loss by the global batch, so that the gradients, summed
    across replicas inside `apply_gradients`, are those of the global mean.
    """

    @tf.function
    def step(dist_x, dist_y):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=model(x))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        losses = strategy.run(replica_step, args=(dist_x, dist_y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    return step
