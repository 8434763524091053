import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import allreduce, sync_bn
from tutorial_lib.devices import normalize
from tutorial_lib.strategy import mirrored_strategy


def _spread(devs, arrays):
    out = []
    for d, a in zip(devs[: len(arrays)], arrays, strict=True):  # the first len(arrays) devices
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
    for g, r in zip(
        tape.gradient(loss, [bn.gamma, bn.beta]), ref_tape.gradient(ref_loss, [bn.gamma, bn.beta]), strict=True
    ):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        tf.concat(tape.gradient(loss, xs), 0), ref_tape.gradient(ref_loss, whole), rtol=1e-4, atol=1e-5
    )
    # moving statistics: one update with the global statistics
    mean, variance = tf.nn.moments(whole, [0])
    np.testing.assert_allclose(bn.moving_mean, 0.1 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.moving_variance, 0.9 + 0.1 * variance, rtol=1e-5)


def test_per_device_bn_differs_and_inference_uses_moving_statistics(devs):
    rng = np.random.default_rng(2)
    xs = _spread(devs, [rng.normal(size=(2, 3)).astype(np.float32) + i for i in range(len(devs))])
    local = sync_bn.SyncBatchNorm(3, synchronized=False)
    outs = local.towers(xs, devs, training=True)
    for x, out in zip(xs, outs, strict=True):  # each device normalized with its own statistics
        np.testing.assert_allclose(out, _plain_bn(x, local.gamma, local.beta, local.epsilon), rtol=1e-4, atol=1e-5)
    frozen = local.towers(xs, devs, training=False)
    expected = (xs[0] - local.moving_mean) / tf.sqrt(local.moving_variance + local.epsilon)
    np.testing.assert_allclose(frozen[0], expected, rtol=1e-4, atol=1e-5)


def test_sync_bn_under_mirrored_strategy_matches_keras_synchronized_bn(devs):
    strategy = mirrored_strategy(devs)
    rng = np.random.default_rng(3)
    x = rng.normal(3.0, 2.0, size=(16, 5)).astype(np.float32)
    with strategy.scope():
        ours = sync_bn.SyncBatchNorm(5, momentum=0.99, epsilon=1e-3)
        keras_bn = tf.keras.layers.BatchNormalization(synchronized=True, momentum=0.99, epsilon=1e-3)
        keras_bn.build((None, 5))
    dist_x = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(x[4 * ctx.replica_id_in_sync_group : 4 * ctx.replica_id_in_sync_group + 4])
    )

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
    with pytest.raises(ValueError, match="every device's batch is empty"):
        sync_bn.global_moments(_spread(devs[:2], [np.zeros((0, 3), np.float32)] * 2))
    with pytest.raises(ValueError, match=r"shape \(batch, ..., features\)"):
        sync_bn.global_moments(_spread(devs[:1], [np.float32(2.0)]))
    with pytest.raises(ValueError, match="one tensor per device"):
        sync_bn.global_moments([])
    with pytest.raises(ValueError, match="2 tensors but 1 devices"):
        sync_bn.SyncBatchNorm(3).towers(_spread(devs[:2], [np.zeros((2, 3), np.float32)] * 2), devs[:1], True)


def test_global_moments_are_one_all_reduce(devs, monkeypatch):
    calls = []
    real = allreduce.all_reduce

    def counting(tensors, **kwargs):
        calls.append(len(tensors))
        return real(tensors, **kwargs)

    monkeypatch.setattr(allreduce, "all_reduce", counting)
    sync_bn.global_moments(_spread(devs, [np.ones((2, 3), np.float32)] * len(devs)), method="central")
    assert calls == [len(devs)]


def _exact_moments(arrays):
    """Reference mean and variance: two passes in extended precision over the whole batch."""
    whole = np.concatenate(arrays).reshape(-1, arrays[0].shape[-1]).astype(np.longdouble)
    mean = whole.mean(0)
    return mean, ((whole - mean) ** 2).mean(0)


@pytest.mark.parametrize("mean, std", [(1e4, 1e-2), (1e6, 1.0)])
def test_global_variance_stays_exact_when_the_mean_dwarfs_the_spread(devs, mean, std):
    rng = np.random.default_rng(4)
    arrays = [mean + std * rng.normal(size=(count, 3)) for count in (3, 8, 1, 5)]  # float64, unequal counts
    _, exact = _exact_moments(arrays)
    for _, variance in sync_bn.global_moments(_spread(devs, arrays)):
        assert variance.dtype == tf.float64
        relative = np.abs(variance.numpy() - exact) / exact
        assert np.max(relative) <= 1e-9, relative  # E[x^2] - E[x]^2 in float64 is off by ~1e-4 here


def _strategy_call(strategy, layer, shards, training=True):
    """Run `layer` on one shard per replica; returns the concatenated outputs."""
    dist_x = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(shards[ctx.replica_id_in_sync_group])
    )

    @tf.function
    def run(xd):
        return strategy.run(lambda xr: layer(xr, training=training), args=(xd,))

    return tf.concat(strategy.experimental_local_results(run(dist_x)), 0)


def test_sync_bn_under_mirrored_strategy_is_exact_for_a_large_mean_in_float64(devs):
    strategy = mirrored_strategy(devs)
    rng = np.random.default_rng(5)
    shards = [1e4 + 1e-2 * rng.normal(size=(count, 3)) for count in (3, 8, 1, 5)]
    with strategy.scope():
        bn = sync_bn.SyncBatchNorm(3, epsilon=1e-12)
    out = _strategy_call(strategy, bn, shards)
    mean, variance = _exact_moments(shards)
    expected = (np.concatenate(shards).astype(np.longdouble) - mean) / np.sqrt(variance + np.longdouble(1e-12))
    assert out.dtype == tf.float64
    np.testing.assert_allclose(out.numpy(), expected.astype(np.float64), rtol=0, atol=1e-8)


def test_an_empty_replica_shard_contributes_nothing_under_mirrored_strategy(devs):
    # the last partial batch of an epoch: 3 examples over 4 replicas leaves one replica with none
    strategy = mirrored_strategy(devs)
    rng = np.random.default_rng(6)
    x, target = rng.normal(2.0, 3.0, size=(2, 3, 5)).astype(np.float32)
    cuts = [(0, 1), (1, 2), (2, 3), (3, 3)]
    with strategy.scope():
        bn = sync_bn.SyncBatchNorm(5, momentum=0.9)

    def shards(a):
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(a[slice(*cuts[ctx.replica_id_in_sync_group])])
        )

    @tf.function
    def step(xd, td):
        def replica(xr, tr):
            with tf.GradientTape() as tape:
                tape.watch(xr)
                out = bn(xr, training=True)
                loss = tf.reduce_sum(out * out * tr)
            return out, tape.gradient(loss, xr)

        return strategy.run(replica, args=(xd, td))

    out, grad = (tf.concat(strategy.experimental_local_results(t), 0) for t in step(shards(x), shards(target)))
    whole = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(whole)
        ref = _plain_bn(whole, bn.gamma, bn.beta, bn.epsilon)
        ref_loss = tf.reduce_sum(ref * ref * target)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grad, tape.gradient(ref_loss, whole), rtol=1e-4, atol=1e-5)
    mean, variance = x.astype(np.float64).mean(0), x.astype(np.float64).var(0)
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.1 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(), 0.9 + 0.1 * variance, rtol=1e-5)


def test_an_empty_tower_contributes_nothing_and_an_empty_global_batch_is_refused(devs):
    rng = np.random.default_rng(7)
    arrays = [rng.normal(1.0, 2.0, size=(count, 4)).astype(np.float32) for count in (3, 0, 2, 4)]
    whole = tf.constant(np.concatenate(arrays))
    mean, variance = tf.nn.moments(whole, [0])
    synced = sync_bn.SyncBatchNorm(4)
    outs = synced.towers(_spread(devs, arrays), devs, training=True)
    assert [int(o.shape[0]) for o in outs] == [3, 0, 2, 4]
    np.testing.assert_allclose(
        tf.concat(outs, 0), _plain_bn(whole, synced.gamma, synced.beta, synced.epsilon), rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(synced.moving_mean, 0.1 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(synced.moving_variance, 0.9 + 0.1 * variance, rtol=1e-5)
    # per-device BN: each non-empty tower on its own; moving statistics weighted by the counts
    local = sync_bn.SyncBatchNorm(4, synchronized=False)
    outs = local.towers(_spread(devs, arrays), devs, training=True)
    for a, out in zip(arrays, outs, strict=True):
        assert out.shape == a.shape
        if len(a):
            np.testing.assert_allclose(
                out, _plain_bn(tf.constant(a), local.gamma, local.beta, local.epsilon), rtol=1e-4, atol=1e-5
            )
    within = sum(len(a) * a.var(0, dtype=np.float64) for a in arrays if len(a)) / len(whole)
    np.testing.assert_allclose(local.moving_mean, 0.1 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(local.moving_variance, 0.9 + 0.1 * within, rtol=1e-5)
    with pytest.raises(ValueError, match="every device's batch is empty"):
        synced.towers(_spread(devs[:2], [np.zeros((0, 4), np.float32)] * 2), devs[:2], training=True)


@pytest.mark.parametrize("dtype, rtol, atol", [(np.float16, 1e-2, 1e-2), (np.float64, 1e-12, 1e-12)])
def test_sync_bn_normalizes_float16_and_float64_and_returns_the_input_dtype(devs, dtype, rtol, atol):
    rng = np.random.default_rng(8)
    arrays = [rng.normal(3.0, 2.0, size=(3, 4)).astype(dtype) for _ in devs]
    mean, variance = _exact_moments(arrays)
    bn = sync_bn.SyncBatchNorm(4, epsilon=1e-3)
    bn.gamma.assign([1.0, 2.0, 0.5, -1.0])
    bn.beta.assign([0.0, 1.0, -1.0, 0.25])
    gamma, beta = bn.gamma.numpy().astype(np.float64), bn.beta.numpy().astype(np.float64)
    expected = (np.concatenate(arrays).astype(np.float64) - np.float64(mean)) / np.sqrt(np.float64(variance) + 1e-3)
    expected = expected * gamma + beta
    outs = bn.towers(_spread(devs, arrays), devs, training=True)
    assert {o.dtype for o in outs} == {tf.as_dtype(dtype)}
    np.testing.assert_allclose(tf.concat(outs, 0).numpy().astype(np.float64), expected, rtol=rtol, atol=atol)
    single = bn(tf.constant(np.concatenate(arrays)), training=True)  # one device: plain BN
    assert single.dtype == tf.as_dtype(dtype)
    np.testing.assert_allclose(single.numpy().astype(np.float64), expected, rtol=rtol, atol=atol)
    frozen = bn(tf.constant(arrays[0]), training=False)
    assert frozen.dtype == tf.as_dtype(dtype) and np.isfinite(frozen.numpy()).all()


def test_sync_bn_refuses_the_wrong_number_of_features_and_non_float_input(devs):
    bn = sync_bn.SyncBatchNorm(3)
    with pytest.raises(ValueError, match=r"built for 3 features.*last axis has 4.*SyncBatchNorm\(4\)"):
        bn(tf.zeros((2, 4)), training=True)
    with pytest.raises(ValueError, match=r"built for 3 features.*last axis has 5"):
        bn.towers(_spread(devs[:2], [np.zeros((2, 5), np.float32)] * 2), devs[:2], training=False)
    with pytest.raises(TypeError, match=r"floating-point.*int32.*tf.cast"):
        bn(tf.zeros((2, 3), tf.int32), training=True)
    with pytest.raises(ValueError, match="num_features must be a whole number"):
        sync_bn.SyncBatchNorm(0)


def test_global_moments_leave_each_pair_on_the_device_of_its_input(devs):
    xs = _spread(devs, [np.full((2, 3), i, np.float32) for i in range(len(devs))])
    for x, (mean, variance) in zip(xs, sync_bn.global_moments(xs), strict=True):
        assert normalize(mean.device) == normalize(variance.device) == normalize(x.device)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_global_moments_of_16_bit_input_are_float32_and_finite(devs, dtype):
    # a spread of 300 gives a variance near 90,000: past float16's largest value, 65,504
    whole = np.random.default_rng(9).normal(0.0, 300.0, (64, 3))
    xs = [tf.cast(x, dtype) for x in _spread(devs, np.split(whole, len(devs)))]
    exact = tf.concat([tf.cast(x, tf.float64) for x in xs], 0).numpy()  # what the rounded inputs hold
    for mean, variance in sync_bn.global_moments(xs):
        assert mean.dtype == variance.dtype == tf.float32
        np.testing.assert_allclose(mean, exact.mean(0), rtol=1e-5, atol=1e-3)
        np.testing.assert_allclose(variance, exact.var(0), rtol=1e-5)
    mean, variance = sync_bn.global_moments(_spread(devs, np.split(whole.astype(np.float32), len(devs))))[0]
    assert mean.dtype == variance.dtype == tf.float32  # float32 stays float32 (float64 stays float64, above)


def test_sync_bn_moving_statistics_of_float16_input_stay_finite_and_right(devs):
    whole = np.random.default_rng(10).normal(0.0, 300.0, (64, 3)).astype(np.float16)
    exact = whole.astype(np.float64)
    expected_mean, expected_variance = 0.1 * exact.mean(0), 0.9 + 0.1 * exact.var(0)
    towers = sync_bn.SyncBatchNorm(3)
    outs = towers.towers(_spread(devs, np.split(whole, len(devs))), devs, training=True)
    single = sync_bn.SyncBatchNorm(3)
    outs.append(single(tf.constant(whole), training=True))
    for bn in (towers, single):
        np.testing.assert_allclose(bn.moving_mean, expected_mean, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(bn.moving_variance, expected_variance, rtol=1e-5)
    for out in outs:
        assert out.dtype == tf.float16 and np.isfinite(out.numpy()).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(momentum=1.5), r"momentum must be in \[0, 1\] \(Keras uses 0.99\), got 1.5"),
        (dict(momentum=-0.1), r"momentum must be in \[0, 1\].*got -0.1"),
        (dict(momentum=float("nan")), r"momentum must be in \[0, 1\].*got nan"),
        (dict(epsilon=0.0), r"epsilon must be > 0 \(Keras uses 0.001\), got 0.0.*NaN"),
        (dict(epsilon=-1e-3), r"epsilon must be > 0.*got -0.001"),
        (dict(momentum="0.9"), r"momentum must be in \[0, 1\].*got '0.9'"),
    ],
)
def test_sync_bn_refuses_a_momentum_outside_0_1_and_an_epsilon_not_above_0(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sync_bn.SyncBatchNorm(3, **kwargs)


def test_sync_bn_accepts_the_ends_of_the_momentum_range_and_a_tiny_epsilon():
    for momentum in (0, 1.0, np.float32(0.99)):
        assert sync_bn.SyncBatchNorm(3, momentum=momentum, epsilon=1e-12).momentum == momentum


def _poisoned(devs, bad):
    """One batch per device, `bad` (NaN or Inf) in the second device's."""
    arrays = [np.full((2, 3), float(i), np.float32) for i in range(len(devs))]
    arrays[1][0, 1] = bad
    return _spread(devs, arrays)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("synchronized", [True, False])
def test_a_non_finite_batch_is_refused_and_leaves_the_moving_statistics_unchanged(devs, bad, synchronized):
    bn = sync_bn.SyncBatchNorm(3, synchronized=synchronized, name="bn7")
    bn.towers(_spread(devs, [np.full((2, 3), float(i), np.float32) for i in range(len(devs))]), devs, True)
    before = bn.moving_mean.numpy(), bn.moving_variance.numpy()
    xs = _poisoned(devs, bad)
    message = r"SyncBatchNorm bn7: the batch statistics are not finite.*left unchanged.*learning rate"
    calls = [
        lambda: bn.towers(xs, devs, training=True),
        lambda: bn(tf.concat(xs, 0), training=True),
        tf.function(lambda: bn.towers(xs, devs, training=True)),
    ]
    for call in calls:
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            call()
        np.testing.assert_array_equal(bn.moving_mean, before[0])
        np.testing.assert_array_equal(bn.moving_variance, before[1])


def _methods_used(monkeypatch) -> list:
    """Wrap every all-reduce method so that the names of those that run are recorded."""
    used = []
    for name, fn in list(allreduce.ALL_SUMS.items()):

        def record(tensors, devices, name=name, fn=fn):
            used.append(name)
            return fn(tensors, devices)

        monkeypatch.setitem(allreduce.ALL_SUMS, name, record)
    return used


def test_sync_bn_towers_and_global_moments_take_a_method_and_choose_one_by_default(devs, monkeypatch):
    used = _methods_used(monkeypatch)
    xs = _spread(devs, [np.full((2, 3), float(i), np.float32) for i in range(len(devs))])
    bn = sync_bn.SyncBatchNorm(3)
    bn.towers(xs, devs, training=True)
    sync_bn.global_moments(xs)
    assert used == ["ring", "ring"]  # "auto" on CPUs
    bn.towers(xs, devs, training=True, method="central")
    assert used[2:] == ["central"]
    # where auto_method says NCCL (every device a GPU that NCCL can run on), towers uses it
    monkeypatch.setattr(allreduce, "auto_method", lambda _: "central")  # central stands in: no GPU here
    bn.towers(xs, devs, training=True)
    sync_bn.global_moments(xs)
    assert used[3:] == ["central", "central"]
    with pytest.raises(ValueError, match=r"method must be one of \('central', 'ring', 'nccl', 'auto'\), got 'tree'"):
        sync_bn.SyncBatchNorm(3, synchronized=False).towers(xs, devs, training=True, method="tree")
