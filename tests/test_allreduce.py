import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import allreduce


def _on(devs, values, dtype=tf.float32):
    out = []
    for d, v in zip(devs, values):
        with tf.device(d):
            out.append(tf.constant(v, dtype))
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 3, 4)])
def test_ring_matches_the_sum_for_any_shape_and_size(devs, n, shape):
    rng = np.random.default_rng(sum(shape) + n)
    values = [rng.normal(size=shape).astype(np.float32) for _ in range(n)]
    results = allreduce.ring_all_reduce(_on(devs[:n], values))
    for d, r in zip(devs[:n], results):
        np.testing.assert_allclose(r, np.sum(values, axis=0), rtol=1e-5, atol=1e-6)
        assert r.device.endswith(d[-5:]) and r.shape == shape


def test_ring_average_and_integers(devs):
    ints = allreduce.ring_all_reduce(_on(devs, [[1, 2, 3]] * 4, tf.int32))
    np.testing.assert_array_equal(ints[2], [4, 8, 12])
    avg = allreduce.ring_all_reduce(_on(devs, [[1.0], [2.0], [3.0], [6.0]]), average=True)
    np.testing.assert_allclose(avg[3], [3.0])
    with pytest.raises(ValueError, match="floating dtype"):
        allreduce.ring_all_reduce(_on(devs, [[1]] * 4, tf.int32), average=True)


@pytest.mark.parametrize("size", [8, 12, 1000])
def test_ring_sends_two_n_minus_one_over_n_of_the_tensor(devs, size):
    stats = {}
    allreduce.ring_all_reduce(_on(devs, [np.ones(size)] * 4), stats=stats)
    expected = allreduce.ring_bytes_per_device(size * 4, 4)
    if size % 4 == 0:
        assert stats["bytes_sent"] == [expected] * 4
    assert sum(stats["bytes_sent"]) == pytest.approx(4 * expected)
    # 2(N-1) steps, every device sending once per step to its right-hand neighbour
    assert len(stats["sends"]) == 2 * 3 * 4
    assert all(dst == (src + 1) % 4 for _, _, src, dst, _ in stats["sends"])


def test_ring_inside_tf_function_with_explicit_devices(devs):
    @tf.function
    def f(a, b):
        return allreduce.ring_all_reduce([a, b], devices=devs[:2])

    out = f(tf.constant([1.0, 2.0, 3.0]), tf.constant([10.0, 20.0, 30.0]))
    np.testing.assert_allclose(out[1], [11.0, 22.0, 33.0])


def test_central_matches_ring(devs):
    values = [np.arange(6.0) * (i + 1) for i in range(4)]
    central = allreduce.central_all_reduce(_on(devs, values), average=True)
    ring = allreduce.ring_all_reduce(_on(devs, values), average=True)
    for c, r in zip(central, ring):
        np.testing.assert_allclose(c, r, rtol=1e-6)


@pytest.mark.parametrize(
    "tensors, devices, message",
    [
        ([], None, "at least one tensor"),
        ([tf.zeros(2), tf.zeros(3)], None, "one shape and dtype"),
        ([tf.zeros(2), tf.zeros(2, tf.float64)], None, "one shape and dtype"),
        ([tf.zeros(2)], ["/cpu:0", "/cpu:1"], "1 tensors but 2 devices"),
        ([tf.zeros(2)], ["/gpu:/device:GPU:0"], "is not a device name"),
    ],
)
def test_all_reduce_bad_input(tensors, devices, message):
    with pytest.raises(ValueError, match=message):
        allreduce.ring_all_reduce(tensors, devices=devices)


def test_nccl_on_cpu_says_why_and_what_to_use(devs):
    with pytest.raises(RuntimeError, match="NCCL runs on GPUs only.*ring_all_reduce"):
        allreduce.nccl_all_reduce(_on(devs[:2], [[1.0], [2.0]]))
    with pytest.raises(RuntimeError, match="GPUs only"):
        allreduce.allreduce_grads([[tf.ones(2)], [tf.ones(2)]], method="nccl")


def test_allreduce_grads_keeps_the_k_by_n_shape(devs):
    rng = np.random.default_rng(0)
    k, shapes = 3, [(4, 2), (2,), ()]
    grads = [[None] + [rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(k)]
    tower_grads = []
    for d, gs in zip(devs, grads):
        with tf.device(d):
            tower_grads.append([None if g is None else tf.constant(g) for g in gs])
    for method in ("ring", "central"):
        out = allreduce.allreduce_grads(tower_grads, average=True, method=method)
        assert len(out) == k and all(len(t) == 4 for t in out)
        for tower in range(k):
            assert out[tower][0] is None
            for j in range(1, 4):
                np.testing.assert_allclose(out[tower][j], np.mean([g[j] for g in grads], 0), rtol=1e-5)
                assert out[tower][j].device.endswith(devs[tower][-5:])


def test_allreduce_grads_bad_input(devs):
    with pytest.raises(ValueError, match="method must be one of"):
        allreduce.allreduce_grads([[tf.ones(1)]], method="tree")
    with pytest.raises(ValueError, match="lengths"):
        allreduce.allreduce_grads([[tf.ones(1)], []])
    with pytest.raises(ValueError, match="empty"):
        allreduce.allreduce_grads([])


def test_pack_unpack_round_trip():
    tensors = [tf.ones([2, 3]), tf.range(4.0), tf.constant(7.0)]
    vector, shapes = allreduce.pack(tensors)
    assert vector.shape == (11,)
    for a, b in zip(tensors, allreduce.unpack(vector, shapes)):
        np.testing.assert_array_equal(a, b)


def test_buckets_respect_the_size_limit():
    tensors = [tf.zeros([10])] * 5 + [tf.zeros([100])] + [tf.zeros([10])]
    assert allreduce.buckets(tensors, max_bytes=80) == [[0, 1], [2, 3], [4], [5], [6]]
    assert allreduce.buckets(tensors, max_bytes=10_000) == [list(range(7))]
    with pytest.raises(ValueError):
        allreduce.buckets(tensors, 0)


def test_packed_allreduce_equals_unpacked(devs):
    rng = np.random.default_rng(1)
    tower_grads = []
    for d in devs[:2]:
        with tf.device(d):
            tower_grads.append([tf.constant(rng.normal(size=s).astype(np.float32)) for s in [(3, 3), (3,), (5,)]])
    packed = allreduce.packed_allreduce_grads(tower_grads, max_bytes=48)
    plain = allreduce.allreduce_grads(tower_grads)
    for tp, tq in zip(packed, plain):
        for a, b in zip(tp, tq):
            np.testing.assert_allclose(a, b, rtol=1e-6)


def test_nccl_version_reads_the_library_or_says_why():
    info = allreduce.nccl_version()
    if info.version is None:
        assert info.reason
    else:
        major, minor, patch = (int(p) for p in info.version.split("."))
        assert major == 2 and minor >= 0 and info.path.endswith((".so", ".so.2"))


def test_mirrored_strategies_of_different_sizes_can_share_a_process(devs):
    for n in (4, 2, 3):
        strategy = allreduce.mirrored_strategy(devs[:n])

        @tf.function
        def total(strategy=strategy):
            ones = strategy.run(lambda: tf.ones([2]))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, ones, axis=None)

        np.testing.assert_allclose(total(), [n, n])


def test_mirrored_train_step_equals_single_device_sgd(devs):
    from tutorial_lib import data, models, towers

    (x, y), _ = data.load_digits()
    x, y = tf.constant(x[:32]), tf.constant(y[:32])
    strategy = allreduce.mirrored_strategy(devs)
    with strategy.scope():
        net, sgd = models.MLP(seed=2), tf.keras.optimizers.SGD(0.5)
    single = models.MLP(seed=2)
    step = allreduce.mirrored_train_step(strategy, net, sgd, global_batch=32)
    dist = strategy.experimental_distribute_values_from_function(
        lambda ctx: (tf.split(x, 4)[ctx.replica_id_in_sync_group], tf.split(y, 4)[ctx.replica_id_in_sync_group]))
    for _ in range(2):
        loss = step(*dist)
        with tf.GradientTape() as tape:
            ref = models.cross_entropy(single(x), y)
        towers.apply_sgd(single.trainable_variables, tape.gradient(ref, single.trainable_variables), 0.5)
        np.testing.assert_allclose(loss, ref, rtol=1e-5)
    for a, b in zip(net.trainable_variables, single.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
