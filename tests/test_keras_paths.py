"""Every data-parallel path takes a reader's Keras model, checked against a one-device Keras loop:
called in training mode (BatchNormalization's moving statistics move, Dropout drops) and with
`model.losses` (an L2 penalty) in the loss."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import data, reference, replicated, strategy, towers

LR = 0.1


def keras_model(seed=0, batch_norm=True, dropout=True, synchronized=False):
    init = keras.initializers.GlorotUniform(seed)
    layers = [keras.Input((8, 8, 1)), keras.layers.Flatten()]
    layers.append(keras.layers.Dense(16, kernel_initializer=init, kernel_regularizer=keras.regularizers.L2(0.05)))
    if batch_norm:
        layers.append(keras.layers.BatchNormalization(momentum=0.9, synchronized=synchronized))
    layers.append(keras.layers.ReLU())
    if dropout:
        layers.append(keras.layers.Dropout(0.5, seed=seed))
    layers.append(keras.layers.Dense(10, kernel_initializer=init))
    return keras.Sequential(layers)


@pytest.fixture(scope="module")
def batches():
    (x, y), _ = data.load_digits()
    return [(tf.constant(x[i : i + 16]), tf.constant(y[i : i + 16])) for i in range(0, 32, 16)]


def one_device_loop(model, batches, shards=1):
    """A hand-written Keras loop on one device: each batch's `shards` parts in turn, in training mode,
    their mean loss plus the model's losses, plain SGD. Returns each batch's loss, before its update."""
    losses = []
    for x, y in batches:
        with tf.GradientTape() as tape:
            parts = [
                keras.losses.sparse_categorical_crossentropy(ys, model(xs, training=True), from_logits=True)
                for xs, ys in zip(tf.split(x, shards), tf.split(y, shards), strict=True)
            ]
            loss = tf.add_n([tf.reduce_mean(p) for p in parts]) / shards + tf.add_n(model.losses)
        for v, g in zip(model.trainable_variables, tape.gradient(loss, model.trainable_variables), strict=True):
            v.assign_sub(LR * g)
        losses.append(float(loss))
    return losses


def assert_same_state(model, expected):
    """Same trainable weights and BatchNormalization statistics as `expected`."""
    for a, b in zip(model.variables, expected.variables, strict=True):
        if "seed_generator" not in a.path:
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=a.path)


def test_reference_sgd_step_is_the_one_device_keras_loop(batches):
    model, expected = keras_model(), keras_model()
    step = reference.make_sgd_step(model, LR)
    losses = [float(step(x, y)) for x, y in batches]
    np.testing.assert_allclose(losses, one_device_loop(expected, batches), rtol=1e-5)
    assert_same_state(model, expected)
    moving_mean = model.layers[2].moving_mean.numpy()
    assert np.abs(moving_mean).max() > 1e-3  # BN's statistics moved (they stayed 0 without training=True)


def test_towers_are_the_one_device_loop_over_their_shards(devs, batches):
    """Towers share one model: BN normalizes each shard on its own (its statistics move once per tower),
    Dropout draws a mask per tower, the L2 penalty counts once: as one device looping over the shards."""
    with tf.device(devs[0]):
        model = keras_model()
    expected = keras_model()
    step = towers.make_train_step(model, devs[:2], LR)
    losses = [float(step(x, y)) for x, y in batches]
    np.testing.assert_allclose(losses, one_device_loop(expected, batches, shards=2), rtol=1e-5)
    assert_same_state(model, expected)


def test_replicated_step_trains_keras_replicas_like_one_device(devs, batches):
    """BN per replica on its share (its moving statistics are its share's), the L2 penalty in every
    replica's loss and once in the averaged gradient: the weights of one device looping over the shares."""
    replicas = replicated.make_replicas(lambda: keras_model(dropout=False), devs[:2])
    shares = [tf.split(t, 2) for t in batches[0]]
    expected_moving = []
    for xs in shares[0]:  # what one device's BN does with one share in training mode, from the start
        fresh = keras_model(dropout=False)
        fresh(xs, training=True)
        expected_moving.append(fresh.layers[2].moving_mean.numpy())
    step = replicated.make_train_step(replicas, devs[:2], learning_rate=LR)
    step(*batches[0])
    for replica, moving in zip(replicas, expected_moving, strict=True):
        np.testing.assert_allclose(replica.layers[2].moving_mean.numpy(), moving, rtol=1e-5, atol=1e-7)
    for x, y in batches[1:]:
        step(x, y)
    expected = keras_model(dropout=False)
    one_device_loop(expected, batches, shards=2)
    for replica in replicas:
        for a, b in zip(replica.trainable_variables, expected.trainable_variables, strict=True):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=a.path)


def test_replicated_step_runs_dropout_in_training_mode(devs, batches):
    """Each replica's loss is its model's training-mode loss on its share: same seeds, same masks."""
    replicas = replicated.make_replicas(lambda: keras_model(batch_norm=False), devs[:2])
    twins = replicated.make_replicas(lambda: keras_model(batch_norm=False), devs[:2])  # same weights and seeds
    x, y = batches[0]
    expected = []
    for twin, xs, ys in zip(twins, tf.split(x, 2), tf.split(y, 2), strict=True):
        logits = twin(xs, training=True)
        ce = keras.losses.sparse_categorical_crossentropy(ys, logits, from_logits=True)
        expected.append(float(tf.reduce_mean(ce) + tf.add_n(twin.losses)))
    inference = float(
        tf.reduce_mean(
            keras.losses.sparse_categorical_crossentropy(
                tf.split(y, 2)[0], twins[0](tf.split(x, 2)[0], training=False), from_logits=True
            )
        )
    )
    losses = replicated.make_train_step(replicas, devs[:2], learning_rate=LR)(x, y)
    np.testing.assert_allclose([float(v) for v in losses], expected, rtol=1e-6)
    assert abs(expected[0] - inference) > 1e-3  # dropout changed the loss: the test can tell the modes apart


def distributed(mirrored, x, y):
    """An iterator of the one batch (x, y), cut into the replicas' shares as tf.distribute does (a short batch
    unevenly): the step's argument, with k = 1."""
    return iter(mirrored.experimental_distribute_dataset(tf.data.Dataset.from_tensors((x, y))))


def test_mirrored_step_trains_a_keras_model_with_synchronized_bn_like_one_device(devs, batches):
    """Synchronized BN normalizes with the whole batch's statistics: one device's BN on the batch."""
    mirrored = strategy.mirrored_strategy(devs[:2])
    with mirrored.scope():
        model = keras_model(dropout=False, synchronized=True)
        sgd = keras.optimizers.SGD(LR)
    step = strategy.mirrored_train_step(mirrored, model, sgd)
    losses = []
    for x, y in batches:
        losses.append(float(step(distributed(mirrored, x, y), 1)))
    expected = keras_model(dropout=False)
    np.testing.assert_allclose(losses, one_device_loop(expected, batches), rtol=1e-5)
    assert_same_state(model, expected)


def test_mirrored_step_divides_a_short_batch_by_the_examples_it_holds(devs, batches):
    """10 examples over 4 replicas (3, 3, 3, 1): the loss and the step of one device on those 10."""
    mirrored = strategy.mirrored_strategy(devs)
    with mirrored.scope():
        model = keras_model(batch_norm=False, dropout=False)
        sgd = keras.optimizers.SGD(LR)
    step = strategy.mirrored_train_step(mirrored, model, sgd)
    x, y = (t[:10] for t in batches[0])
    loss = float(step(distributed(mirrored, x, y), 1))
    expected = keras_model(batch_norm=False, dropout=False)
    np.testing.assert_allclose([loss], one_device_loop(expected, [(x, y)]), rtol=1e-5)
    assert_same_state(model, expected)
