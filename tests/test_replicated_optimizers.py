import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import data, models, replicated_optimizers, strategy


@pytest.fixture(scope="module")
def batches():
    (x, y), _ = data.load_digits()
    return [(tf.constant(x[i : i + 32]), tf.constant(y[i : i + 32])) for i in range(0, 96, 32)]


def _adam_reference(batches, device, lr=1e-2):
    with tf.device(device):
        model = models.MLP(hidden=(16,), seed=3)
    optimizer = tf.keras.optimizers.Adam(lr)
    for x, y in batches:
        with tf.GradientTape() as tape:
            loss = models.cross_entropy(model(x), y)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return [v.numpy() for v in model.trainable_variables]


@pytest.mark.parametrize("n", [2, 4])
def test_replicas_with_their_own_adam_equal_one_device_adam(devs, batches, n):
    replicas = []
    for device in devs[:n]:
        with tf.device(device):
            replicas.append(models.MLP(hidden=(16,), seed=3))
    start = [v.numpy() for v in replicas[0].trainable_variables]
    optimizers = [tf.keras.optimizers.Adam(1e-2) for _ in range(n)]
    step = replicated_optimizers.make_replicated_step(replicas, optimizers, devs[:n])
    for x, y in batches:
        step(x, y)
    reference = _adam_reference(batches, devs[0])
    for replica, optimizer, device in zip(replicas, optimizers, devs[:n], strict=True):
        weights = [v.numpy() for v in replica.trainable_variables]
        assert replicated_optimizers.update_gap(start, weights, reference) < 1e-5
        assert int(optimizer.iterations) == len(batches)  # one apply per batch, not n
        slots = [v for v in optimizer.variables if v.path.endswith(("momentum", "velocity"))]
        assert len(slots) == 2 * len(weights)  # m and v per variable, each beside its variable
        assert all(slot.value.device.endswith(device[-5:]) for slot in slots)


def _two_replicas(devs):
    """Two copies of the seed's one-layer model, one per device, with the same initial values."""
    replicas = []
    for device in devs[:2]:
        with tf.device(device):
            replicas.append(models.MLP(hidden=(), seed=0))
    return replicas


def test_one_adam_shared_by_replicas_is_refused_with_the_reason(devs):
    replicas = _two_replicas(devs)
    adam = tf.keras.optimizers.Adam()
    with pytest.raises(ValueError, match="its own optimizer"):
        replicated_optimizers.make_replicated_step(replicas, [adam, adam], devs[:2])
    with pytest.raises(ValueError, match="2 replicas but 1 optimizers"):
        replicated_optimizers.make_replicated_step(replicas, [adam], devs[:2])


def test_what_the_check_prevents_keras_refuses_on_the_second_replica(devs):
    replicas = _two_replicas(devs)
    adam = tf.keras.optimizers.Adam()
    grads = [tf.ones_like(v) for v in replicas[0].trainable_variables]
    adam.apply_gradients(zip(grads, replicas[0].trainable_variables, strict=True))
    with pytest.raises(ValueError, match="Unknown variable"):
        adam.apply_gradients(zip(grads, replicas[1].trainable_variables, strict=True))


def test_update_ratio_and_gap():
    start = [np.zeros(3), np.zeros(2)]
    reference = [np.array([1.0, 0, 0]), np.array([0.0, 0])]
    assert replicated_optimizers.update_ratio(start, [2 * r for r in reference], reference) == pytest.approx(2)
    assert replicated_optimizers.update_gap(start, [2 * r for r in reference], reference) == pytest.approx(1)
    assert replicated_optimizers.update_gap(start, reference, reference) == 0
    shifted = [np.array([1.0, 0, 0]), np.array([0.0, 0.25])]
    assert replicated_optimizers.update_gap(start, shifted, reference) == pytest.approx(0.25)


def test_update_comparisons_refuse_what_cannot_be_compared():
    with pytest.raises(ValueError, match="did not move"):
        replicated_optimizers.update_gap([np.zeros(2)], [np.ones(2)], [np.zeros(2)])
    with pytest.raises(ValueError, match="shapes differ"):
        replicated_optimizers.update_ratio([np.zeros(2)], [np.ones(3)], [np.ones(2)])
    with pytest.raises(ValueError, match="1 start values but 2 weights"):
        replicated_optimizers.update_ratio([np.zeros(2)], [np.ones(2)] * 2, [np.ones(2)])


@pytest.mark.parametrize(("size", "expected"), [(10, 10), (3, 3), (8, 8)])
def test_real_global_batch_counts_a_short_batch(devs, size, expected):
    mirrored = strategy.mirrored_strategy(devs)
    dataset = mirrored.experimental_distribute_dataset(tf.data.Dataset.range(size).batch(size))
    (batch,) = list(dataset)
    assert replicated_optimizers.real_global_batch(mirrored, batch) == expected
