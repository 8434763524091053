import numpy as np
import tensorflow as tf

from tutorial_lib import data, models, reference, strategy


def test_mirrored_strategies_of_different_sizes_can_share_a_process(devs):
    for n in (4, 2, 3):
        mirrored = strategy.mirrored_strategy(devs[:n])

        @tf.function
        def total(mirrored=mirrored):
            ones = mirrored.run(lambda: tf.ones([2]))
            return mirrored.reduce(tf.distribute.ReduceOp.SUM, ones, axis=None)

        np.testing.assert_allclose(total(), [n, n])


def test_mirrored_train_step_equals_single_device_sgd(devs):
    (x, y), _ = data.load_digits()
    x, y = tf.constant(x[:32]), tf.constant(y[:32])
    mirrored = strategy.mirrored_strategy(devs)
    with mirrored.scope():
        net, sgd = models.MLP(seed=2), tf.keras.optimizers.SGD(0.5)
    single = models.MLP(seed=2)
    step = strategy.mirrored_train_step(mirrored, net, sgd, global_batch=32)
    dist = mirrored.experimental_distribute_values_from_function(
        lambda ctx: (tf.split(x, 4)[ctx.replica_id_in_sync_group], tf.split(y, 4)[ctx.replica_id_in_sync_group])
    )
    for _ in range(2):
        np.testing.assert_allclose(step(*dist), reference.sgd_step(single, x, y, 0.5), rtol=1e-5)
    for a, b in zip(net.trainable_variables, single.trainable_variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
