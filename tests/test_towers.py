import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import data, models, reference, towers


def test_split_batch_splits_tuples_alike():
    x = tf.reshape(tf.range(24.0), [12, 2])
    y = tf.range(12)
    shards = towers.split_batch((x, y), 3)
    assert len(shards) == 3
    np.testing.assert_array_equal(shards[1][0], x[4:8])
    np.testing.assert_array_equal(shards[2][1], y[8:])


def test_split_batch_names_the_fix_for_uneven_batches():
    with pytest.raises(ValueError, match=r"batch of 10 examples does not split evenly into 4 towers.*such as 8"):
        towers.split_batch(tf.zeros([10, 3]), 4)


@pytest.mark.parametrize("n", [0, -2, 1.5, 2.0, True])
def test_split_batch_rejects_bad_tower_counts(n):
    with pytest.raises(ValueError, match=r"number of towers\) must be a whole number"):
        towers.split_batch(tf.zeros([4]), n)


def test_split_batch_takes_numpy_integers():
    shards = towers.split_batch(tf.range(6), np.int64(2))  # e.g. a count read from an array
    np.testing.assert_array_equal(shards[1], [3, 4, 5])


def test_split_batch_rejects_mismatched_parts():
    with pytest.raises(ValueError, match="same number of examples"):
        towers.split_batch((tf.zeros([4, 2]), tf.zeros([6])), 2)


def test_average_gradients_means_each_variable_and_keeps_none(devs):
    tower_grads = [[tf.constant([1.0, 2.0]), None, tf.constant(3.0)], [tf.constant([3.0, 6.0]), None, tf.constant(5.0)]]
    avg = towers.average_gradients(tower_grads, device=devs[0])
    np.testing.assert_allclose(avg[0], [2.0, 4.0])
    assert avg[1] is None
    np.testing.assert_allclose(avg[2], 4.0)
    assert avg[0].device.endswith("CPU:0")


def test_tower_gradients_average_to_the_whole_batch_gradient(devs):
    (x, y), _ = data.load_digits()
    x, y = tf.constant(x[:64]), tf.constant(y[:64])
    model = models.MLP(seed=0)
    with tf.GradientTape() as tape:
        loss = models.cross_entropy(model(x), y)
    reference = tape.gradient(loss, model.trainable_variables)
    losses, grads = towers.tower_gradients(model, x, y, devs)
    np.testing.assert_allclose(tf.add_n(losses) / len(losses), loss, rtol=1e-6)
    for ref, avg in zip(reference, towers.average_gradients(grads), strict=True):
        np.testing.assert_allclose(avg, ref, rtol=1e-5, atol=1e-7)
    assert [g.device[-5:] for g in [gs[0] for gs in grads]] == [d[-5:] for d in devs]


def test_train_step_equals_single_device_sgd(devs):
    (x, y), _ = data.load_digits()
    x, y = tf.constant(x[:64]), tf.constant(y[:64])
    parallel, single = models.MLP(seed=3), models.MLP(seed=3)
    step = towers.make_train_step(parallel, devs, learning_rate=0.5)
    for _ in range(3):
        np.testing.assert_allclose(step(x, y), reference.sgd_step(single, x, y, 0.5), rtol=1e-5)
    for a, b in zip(parallel.trainable_variables, single.trainable_variables, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
