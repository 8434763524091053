import numpy as np
import tensorflow as tf

from tutorial_lib import strategy


def test_mirrored_strategies_of_different_sizes_can_share_a_process(devs):
    for n in (4, 2, 3):
        mirrored = strategy.mirrored_strategy(devs[:n])

        @tf.function
        def total(mirrored=mirrored):
            ones = mirrored.run(lambda: tf.ones([2]))
            return mirrored.reduce(tf.distribute.ReduceOp.SUM, ones, axis=None)

        np.testing.assert_allclose(total(), [n, n])
