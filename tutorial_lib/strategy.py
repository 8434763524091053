"""TensorFlow's own route: `MirroredStrategy` in a custom training loop (notebook 03's step, which
`multi_worker` also runs), and `mirrored_strategy`, which lets several strategies share a process.
"""

from __future__ import annotations

import tensorflow as tf


def mirrored_strategy(devices, cross_device_ops=None) -> tf.distribute.MirroredStrategy:
    """A `MirroredStrategy` whose collective keys cannot collide with an earlier one's ("... is joining
    a group with size 2, but that group has size 4"), by the PRIVATE `_collective_key_base`, as
    TensorFlow's own tests do; the public route is one strategy per process."""
    tf.distribute.MirroredStrategy._collective_key_base += 100_000
    return tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops)


# lesson: 03_nccl_allreduce
def mirrored_train_step(strategy, model, optimizer):
    """A tf.function of a distributed batch (x, y) under `strategy`: one training step, the batch's loss back.

    Each replica divides its summed loss by the examples the whole batch holds (a short last batch
    holds fewer), and its regularization losses by the number of replicas: the replicas' gradients
    are summed inside apply_gradients, so the sum is the gradient of the batch's loss."""

    @tf.function
    def step(dist_x, dist_y):
        def replica_step(x, y):
            context = tf.distribute.get_replica_context()
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
                examples = context.all_reduce("SUM", tf.cast(tf.shape(y)[0], per_example.dtype))  # every replica's
                loss = tf.reduce_sum(per_example) / examples + sum(model.losses) / context.num_replicas_in_sync
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        losses = strategy.run(replica_step, args=(dist_x, dist_y))
        return strategy.reduce("SUM", losses, axis=None)

    return step
