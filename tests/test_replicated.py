import keras
import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import data, devices, models, reference, replicated


@pytest.fixture(scope="module")
def batches():
    (x, y), _ = data.load_digits()
    return [(tf.constant(x[i : i + 32]), tf.constant(y[i : i + 32])) for i in range(0, 96, 32)]


def _weights(model):
    return [v.numpy() for v in model.trainable_variables]


def _adam_reference(batches, lr=1e-2):
    model = models.MLP(hidden=(16,), seed=3)
    optimizer = keras.optimizers.Adam(lr)
    for x, y in batches:
        with tf.GradientTape() as tape:
            loss = models.cross_entropy(model(x), y)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return _weights(model)


@pytest.mark.parametrize("n", [2, 4])
def test_replicas_with_their_own_adam_equal_one_device_adam(devs, batches, n):
    replicas = replicated.make_replicas(lambda: models.MLP(hidden=(16,), seed=3), devs[:n])
    start = _weights(replicas[0])
    optimizers = replicated.replica_optimizers(replicas, devs[:n], lambda: keras.optimizers.Adam(1e-2))
    step = replicated.make_train_step(replicas, devs[:n], optimizers=optimizers)
    for x, y in batches:
        step(x, y)
    reference_weights = _adam_reference(batches)
    for replica, optimizer in zip(replicas, optimizers, strict=True):
        assert replicated.update_gap(start, _weights(replica), reference_weights) < 1e-5
        assert int(optimizer.iterations) == len(batches)  # one apply per batch, not n


def test_each_replicas_optimizer_keeps_every_variable_on_the_replicas_device(devs):
    """Its step counter and learning rate too: made elsewhere, every replica would read them from there."""
    replicas = replicated.make_replicas(lambda: models.MLP(hidden=(), seed=0), devs)
    optimizers = replicated.replica_optimizers(replicas, devs, lambda: keras.optimizers.Adam(1e-3))
    for optimizer, device in zip(optimizers, devs, strict=True):
        places = {v.path.split("/")[-1]: devices.normalize(v.value.device) for v in optimizer.variables}
        assert {"iteration", "learning_rate"} <= set(places)
        assert set(places.values()) == {devices.normalize(device)}, places


def test_sgd_replicas_equal_one_device_and_return_every_replicas_loss(devs, batches):
    replicas = replicated.make_replicas(lambda: models.MLP(hidden=(16,), seed=1), devs)
    single = models.MLP(hidden=(16,), seed=1)
    step = replicated.make_train_step(replicas, devs, learning_rate=0.5, method="central")
    for x, y in batches:
        losses = step(x, y)
        assert len(losses) == len(devs)
        np.testing.assert_allclose(np.mean(losses), reference.sgd_step(single, x, y, 0.5), rtol=1e-5)
    for replica in replicas:
        for a, b in zip(_weights(replica), _weights(single), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_make_replicas_broadcasts_the_first_replicas_values(devs):
    seeds = iter(range(4))
    replicas = replicated.make_replicas(lambda: models.MLP(hidden=(8,), seed=next(seeds)), devs)
    for replica, device in zip(replicas, devs, strict=True):
        for a, b in zip(_weights(replica), _weights(replicas[0]), strict=True):
            np.testing.assert_array_equal(a, b)
        assert {devices.normalize(v.device) for v in replica.trainable_variables} == {devices.normalize(device)}


def test_one_adam_for_several_replicas_is_refused_by_keras(devs):
    """What makes one optimizer per replica necessary: Keras 3 refuses a second set of variables."""
    replicas = replicated.make_replicas(lambda: models.MLP(hidden=(), seed=0), devs[:2])
    adam = keras.optimizers.Adam()
    grads = [tf.ones_like(v) for v in replicas[0].trainable_variables]
    adam.apply_gradients(zip(grads, replicas[0].trainable_variables, strict=True))
    with pytest.raises(ValueError, match="Unknown variable"):
        adam.apply_gradients(zip(grads, replicas[1].trainable_variables, strict=True))


def test_update_ratio_and_gap():
    start = [np.zeros(3), np.zeros(2)]
    ref = [np.array([1.0, 0, 0]), np.array([0.0, 0])]
    assert replicated.update_ratio(start, [2 * r for r in ref], ref) == pytest.approx(2)
    assert replicated.update_gap(start, [2 * r for r in ref], ref) == pytest.approx(1)
    assert replicated.update_gap(start, ref, ref) == 0
    shifted = [np.array([1.0, 0, 0]), np.array([0.0, 0.25])]
    assert replicated.update_gap(start, shifted, ref) == pytest.approx(0.25)


def test_update_comparisons_refuse_what_cannot_be_compared():
    with pytest.raises(ValueError, match="did not move"):
        replicated.update_gap([np.zeros(2)], [np.ones(2)], [np.zeros(2)])
    with pytest.raises(ValueError, match="shapes differ"):
        replicated.update_ratio([np.zeros(2)], [np.ones(3)], [np.ones(2)])
    with pytest.raises(ValueError, match="1 start values but 2 weights"):
        replicated.update_ratio([np.zeros(2)], [np.ones(2)] * 2, [np.ones(2)])
