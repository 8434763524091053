import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import models


def test_mlp_shapes_and_seeded_initialisation():
    x = tf.random.stateless_uniform([5, 8, 8, 1], seed=[1, 2])
    a, b, c = models.MLP(seed=0), models.MLP(seed=0), models.MLP(seed=1)
    assert a(x).shape == (5, 10)
    np.testing.assert_array_equal(a(x), b(x))
    assert not np.allclose(a(x), c(x))
    assert [v.shape.as_list() for v in a.trainable_variables] == [[64, 128], [128], [128, 10], [10]]


def test_mlp_logits_are_not_clipped_by_relu():
    # The seed applied ReLU to its logits, which zeroes every negative score.
    logits = models.MLP(seed=0)(tf.random.stateless_normal([64, 8, 8, 1], seed=[3, 4]))
    assert tf.reduce_min(logits) < 0


def test_cnn_stages_chain_and_live_on_their_devices(devs):
    stages = models.cnn_stages(devices=devs[:3])
    h = tf.zeros([2, 8, 8, 1])
    shapes = []
    for stage in stages:
        h = stage(h)
        shapes.append(h.shape.as_list())
    assert shapes == [[2, 4, 4, 64], [2, 1, 1, 64], [2, 10]]
    for stage, device in zip(stages, devs[:3], strict=True):
        assert {v.device.split("/")[-1] for v in stage.trainable_variables} == {device.split("/")[-1]}


def test_cnn_adapts_to_mnist_sized_images():
    stages = models.cnn_stages(input_shape=(28, 28, 1))
    h = tf.zeros([1, 28, 28, 1])
    for stage in stages:
        h = stage(h)
    assert h.shape == (1, 10)


def test_cnn_errors(devs):
    with pytest.raises(ValueError, match="3 stages but 2 devices"):
        models.cnn_stages(devices=devs[:2])
    with pytest.raises(ValueError, match="at least 8x8"):
        models.cnn_stages(input_shape=(4, 4, 1))


def test_cross_entropy_and_accuracy_match_keras():
    logits = tf.constant([[2.0, 0.5, -1.0], [0.1, 0.2, 3.0], [1.0, 1.5, 0.0]])
    labels = tf.constant([0, 2, 0])
    expected = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)(labels, logits)
    np.testing.assert_allclose(models.cross_entropy(logits, labels), expected, rtol=1e-6)
    assert float(models.accuracy(logits, labels)) == pytest.approx(2 / 3)


def test_sequential_runs_keras_layers_in_training_mode_and_gathers_their_losses():
    import keras

    dropout = keras.layers.Dropout(0.5, seed=0)
    dense = keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(1.0))
    net = models.Sequential([models.Flatten(), dropout, dense])
    x = tf.ones([4, 2, 2, 1])
    np.testing.assert_array_equal(net(x, training=False), dense(tf.ones([4, 4])))
    assert np.any(net(x, training=True).numpy() != net(x, training=False).numpy())  # dropout dropped
    (penalty,) = net.losses
    np.testing.assert_allclose(penalty, tf.reduce_sum(tf.square(dense.kernel)), rtol=1e-6)
    assert models.MLP().losses == []
