import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import allreduce, sync_bn


def _spread(devs, arrays):
    out = []
    for d, a in zip(devs, arrays):
        with tf.device(d):
            out.append(tf.constant(a))
    return out


@pytest.mark.parametrize("shapes", [[(3, 5)] * 4, [(2, 5), (7, 5), (1, 5), (4, 5)], [(2, 4, 4, 3)] * 3])
def test_global_moments_equal_those_of_the_concatenated_batch(devs, shapes):
    rng = np.random.default_rng(len(shapes))
    arrays = [rng.normal(2.0, 3.0, size=s).astype(np.float32) for s in shapes]
    whole = np.concatenate(arrays).reshape(-1, shapes[0][-1]).astype(np.float64)
    for mean, variance in sync_bn.global_moments(_spread(devs, arrays)):
        np.testing.assert_allclose(mean, whole.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(variance, whole.var(0), rtol=1e-5)


def test_global_moments_stay_exact_for_a_large_mean(devs):
    rng = np.random.default_rng(0)
    arrays = [(1e4 + rng.normal(size=(16, 3))).astype(np.float32) for _ in devs]
    whole = np.concatenate(arrays).astype(np.float64)
    _, variance = sync_bn.global_moments(_spread(devs, arrays))[0]
    np.testing.assert_allclose(variance, whole.var(0), rtol=1e-3)
    # the textbook formula in float32 loses everything at this scale
    x = tf.constant(np.concatenate(arrays))
    naive = tf.reduce_mean(tf.square(x), 0) - tf.square(tf.reduce_mean(x, 0))
    assert np.max(np.abs(naive.numpy() - whole.var(0))) > 0.1


def _plain_bn(x, gamma, beta, eps):
    mean, variance = tf.nn.moments(x, [0])
    return tf.nn.batch_normalization(x, mean, variance, beta, gamma, eps)


def test_sync_bn_towers_equal_plain_bn_on_the_global_batch(devs):
    rng = np.random.default_rng(1)
    arrays = [rng.normal(1.0, 2.0, size=(4, 6)).astype(np.float32) for _ in devs]
    target = tf.constant(rng.normal(size=(16, 6)).astype(np.float32))
    bn = sync_bn.SyncBatchNorm(6)
    xs = _spread(devs, arrays)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(xs)
        outs = bn.towers(xs, devs, training=True)
        loss = tf.reduce_sum(tf.concat(outs, 0) * target)
    whole = tf.concat(xs, 0)
    with tf.GradientTape(persistent=True) as ref_tape:
        ref_tape.watch(whole)
        ref = _plain_bn(whole, bn.gamma, bn.beta, bn.epsilon)
        ref_loss = tf.reduce_sum(ref * target)
    np.testing.assert_allclose(tf.concat(outs, 0), ref, rtol=1e-4, atol=1e-5)
    for g, r in zip(tape.gradient(loss, [bn.gamma, bn.beta]), ref_tape.gradient(ref_loss, [bn.gamma, bn.beta])):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(tf.concat(tape.gradient(loss, xs), 0), ref_tape.gradient(ref_loss, whole),
                               rtol=1e-4, atol=1e-5)
    # moving statistics: one update with the global statistics
    mean, variance = tf.nn.moments(whole, [0])
    np.testing.assert_allclose(bn.moving_mean, 0.1 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.moving_variance, 0.9 + 0.1 * variance, rtol=1e-5)


def test_per_device_bn_differs_and_inference_uses_moving_statistics(devs):
    rng = np.random.default_rng(2)
    xs = _spread(devs, [rng.normal(size=(2, 3)).astype(np.float32) + i for i in range(len(devs))])
    local = sync_bn.SyncBatchNorm(3, synchronized=False)
    outs = local.towers(xs, devs, training=True)
    for x, out in zip(xs, outs):  # each device normalized with its own statistics
        np.testing.assert_allclose(out, _plain_bn(x, local.gamma, local.beta, local.epsilon), rtol=1e-4, atol=1e-5)
    frozen = local.towers(xs, devs, training=False)
    expected = (xs[0] - local.moving_mean) / tf.sqrt(local.moving_variance + local.epsilon)
    np.testing.assert_allclose(frozen[0], expected, rtol=1e-4, atol=1e-5)


def test_sync_bn_under_mirrored_strategy_matches_keras_synchronized_bn(devs):
    strategy = allreduce.mirrored_strategy(devs)
    rng = np.random.default_rng(3)
    x = rng.normal(3.0, 2.0, size=(16, 5)).astype(np.float32)
    with strategy.scope():
        ours = sync_bn.SyncBatchNorm(5, momentum=0.99, epsilon=1e-3)
        keras_bn = tf.keras.layers.BatchNormalization(synchronized=True, momentum=0.99, epsilon=1e-3)
        keras_bn.build((None, 5))
    dist_x = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(x[4 * ctx.replica_id_in_sync_group: 4 * ctx.replica_id_in_sync_group + 4]))

    @tf.function
    def both(xd):
        def replica(xr):
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(xr)
                a = ours(xr, training=True)
                b = keras_bn(xr, training=True)
                la, lb = tf.reduce_sum(a * a * xr), tf.reduce_sum(b * b * xr)
            return a, b, tape.gradient(la, xr), tape.gradient(lb, xr)
        return strategy.run(replica, args=(xd,))

    a, b, ga, gb = (tf.concat(strategy.experimental_local_results(t), 0) for t in both(dist_x))
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(a, _plain_bn(tf.constant(x), tf.ones(5), tf.zeros(5), 1e-3), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ga, gb, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(ours.moving_mean.numpy(), keras_bn.moving_mean.numpy(), rtol=1e-5, atol=1e-6)


def test_bad_input(devs):
    with pytest.raises(ValueError, match="same number of features"):
        sync_bn.global_moments(_spread(devs[:2], [np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float32)]))
    with pytest.raises(ValueError, match="device 1 has an empty batch"):
        sync_bn.global_moments(_spread(devs[:2], [np.zeros((2, 3), np.float32), np.zeros((0, 3), np.float32)]))
    with pytest.raises(ValueError, match="axis 5 does not exist"):
        sync_bn.global_moments(_spread(devs[:1], [np.zeros((2, 3), np.float32)]), axis=5)
    with pytest.raises(ValueError, match="one tensor per device"):
        sync_bn.global_moments([])
    with pytest.raises(ValueError, match="2 tensors but 1 devices"):
        sync_bn.SyncBatchNorm(3).towers(_spread(devs[:2], [np.zeros((2, 3), np.float32)] * 2), devs[:1], True)
