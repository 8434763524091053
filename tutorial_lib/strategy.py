"""TensorFlow's own route: `MirroredStrategy` in a custom training loop (notebook 03's step, which
`multi_worker` also runs), and `mirrored_strategy`, which lets several strategies share a process.
"""

from __future__ import annotations

import itertools
import threading

import tensorflow as tf

# Collective group keys are int32 and process-wide: two strategies that number their groups from
# the same base meet in the same group ("... is joining a group with size 3, but that group has
# size 4"). A plain MirroredStrategy numbers from its class's base, 0 unless changed, and takes a
# few keys above it; each strategy of `mirrored_strategy` gets a range of _KEYS_PER_STRATEGY keys
# of its own, from high in the int32 range, far from the small bases that tests set by hand.
_FIRST_BASE = 1 << 30
_KEYS_PER_STRATEGY = 100_000
_LAST_BASE = (1 << 31) - 1 - _KEYS_PER_STRATEGY
_next_range = itertools.count()
_base_lock = threading.Lock()  # one helper call at a time sets and restores the class's base


def mirrored_strategy(devices, cross_device_ops=None) -> tf.distribute.MirroredStrategy:
    """A `MirroredStrategy` over `devices` whose collective keys no other strategy of this process uses.

    Without it, a second strategy over another number of devices fails inside its first step with
    "... is joining a group with size 3, but that group has size 4". The base of the keys is the
    PRIVATE class attribute `MirroredStrategy._collective_key_base` (TensorFlow's own tests bump it),
    which the strategy's constructor reads, and only it: this sets it for the one construction and
    puts the old value back, so a plain `MirroredStrategy` built later is left as it would have been.
    The public route is one strategy per process (a new process, or a restarted kernel, for another
    device count)."""
    base = _FIRST_BASE + next(_next_range) * _KEYS_PER_STRATEGY
    if base > _LAST_BASE:
        raise RuntimeError(
            f"mirrored_strategy: this process has built {(base - _FIRST_BASE) // _KEYS_PER_STRATEGY} strategies, "
            "all the collective key ranges it has; restart the process (or the kernel) to build more."
        )
    with _base_lock:
        saved = tf.distribute.MirroredStrategy._collective_key_base
        tf.distribute.MirroredStrategy._collective_key_base = base
        try:
            return tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops)
        finally:
            tf.distribute.MirroredStrategy._collective_key_base = saved


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
