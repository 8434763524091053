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


@pytest.mark.parametrize(
    "grads, message",
    [
        ([], "empty"),
        ([[tf.zeros(2)], [tf.zeros(2), tf.zeros(1)]], "lengths"),
        ([[tf.zeros(2)], [tf.zeros(3)]], "different shapes"),
        ([[tf.zeros(2)], [tf.zeros(2, tf.float16)]], "different shapes or dtypes"),
        ([[tf.zeros(2)], [None]], "some towers and None in others"),
    ],
)
def test_average_gradients_bad_input(grads, message):
    with pytest.raises(ValueError, match=message):
        towers.average_gradients(grads)


def _pairs(grads, variables):
    return list(zip(grads, variables, strict=True))


def test_average_gradients_takes_cifar10_gradient_variable_pairs(devs):
    shared = [tf.Variable([0.0, 0.0]), tf.Variable(0.0), tf.Variable(1.0)]
    plain = [[tf.constant([1.0, 2.0]), None, tf.constant(3.0)], [tf.constant([3.0, 6.0]), None, tf.constant(5.0)]]
    averaged = towers.average_gradients([_pairs(g, shared) for g in plain], device=devs[0])
    assert [v for _, v in averaged] == shared  # tower 0's variables, as cifar10_multi_gpu_train.py does
    expected = towers.average_gradients(plain)
    assert averaged[1][0] is None and expected[1] is None
    for (g, _), e in zip(averaged, expected, strict=True):
        if e is not None:
            np.testing.assert_allclose(g, e)


def test_average_gradients_refuses_a_mix_of_pairs_and_plain_gradients():
    v = tf.Variable(1.0)
    with pytest.raises(ValueError, match="mix .gradient, variable. pairs and plain gradients"):
        towers.average_gradients([[(tf.constant(1.0), v)], [tf.constant(2.0)]])


def test_apply_sgd_refuses_fewer_gradients_than_variables():
    variables = [tf.Variable(1.0), tf.Variable(2.0)]
    with pytest.raises(ValueError, match="2 variables but 1 gradients"):
        towers.apply_sgd(variables, [tf.constant(1.0)], 0.1)  # used to update the first and skip the second
    assert [float(v) for v in variables] == [1.0, 2.0]


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


def test_tower_gradients_need_a_list_of_devices():
    x, y = tf.zeros([4, 8, 8, 1]), tf.zeros([4], tf.int32)
    with pytest.raises(ValueError, match="devices is empty"):
        towers.tower_gradients(models.MLP(), x, y, [])
    with pytest.raises(TypeError, match=r"got the string '/device:CPU:0'; write \['/device:CPU:0'\]"):
        towers.tower_gradients(models.MLP(), x, y, "/device:CPU:0")  # used to ask for 13 towers, one per letter


def test_make_train_step_needs_a_list_of_devices():
    with pytest.raises(TypeError, match=r"write \['/cpu:0'\]"):
        towers.make_train_step(models.MLP(), "/cpu:0", 0.1)
    with pytest.raises(ValueError, match="devices is empty"):
        towers.make_train_step(models.MLP(), [], 0.1)  # used to be an IndexError on devices[0]
