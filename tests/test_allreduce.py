import re

import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import allreduce


def _on(devs, values, dtype=tf.float32):
    out = []
    for d, v in zip(devs, values, strict=True):
        with tf.device(d):
            out.append(tf.constant(v, dtype))
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 3, 4)])
def test_ring_matches_the_sum_for_any_shape_and_size(devs, n, shape):
    rng = np.random.default_rng(sum(shape) + n)
    values = [rng.normal(size=shape).astype(np.float32) for _ in range(n)]
    results = allreduce.ring_all_reduce(_on(devs[:n], values))
    for d, r in zip(devs[:n], results, strict=True):
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
    for c, r in zip(central, ring, strict=True):
        np.testing.assert_allclose(c, r, rtol=1e-6)


@pytest.mark.parametrize(
    "tensors, devices, message",
    [
        ([], None, "at least one tensor"),
        ([tf.zeros(2), tf.zeros(3)], None, "one shape and dtype"),
        ([tf.zeros(2), tf.zeros(2, tf.float64)], None, "one shape and dtype"),
        ([tf.zeros(2)], ["/cpu:0", "/cpu:1"], "1 tensors but 2 devices"),
        ([tf.zeros(2), tf.zeros(2)], ["/cpu:0"], "2 tensors but 1 devices"),
        ([tf.zeros(2)], ["/gpu:/device:GPU:0"], "is not a device name"),
    ],
)
@pytest.mark.parametrize("reduce", [allreduce.ring_all_reduce, allreduce.central_all_reduce])
def test_all_reduce_bad_input(tensors, devices, message, reduce):
    with pytest.raises(ValueError, match=message):
        reduce(tensors, devices=devices)


@pytest.mark.parametrize("reduce", [allreduce.ring_all_reduce, allreduce.central_all_reduce])
def test_a_device_string_is_refused_not_read_letter_by_letter(reduce):
    with pytest.raises(TypeError, match=r"write \['/cpu:0'\]"):
        reduce([tf.zeros(2)] * 6, devices="/cpu:0")  # six letters: once taken for six devices


@pytest.mark.parametrize("method", ["ring", "central"])
def test_all_reduce_is_the_one_entry_to_the_reducers(devs, method):
    values = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    for average, expected in ((False, [9.0, 12.0]), (True, [3.0, 4.0])):
        results = allreduce.all_reduce(_on(devs[:3], values), method=method, average=average)
        assert len(results) == 3
        for d, r in zip(devs[:3], results, strict=True):
            np.testing.assert_allclose(r, expected)
            assert r.device.endswith(d[-5:])
    with pytest.raises(ValueError, match="method must be one of"):
        allreduce.all_reduce(_on(devs[:2], values[:2]), method="tree")


def test_gradient_all_reduces_go_through_all_reduce(devs, monkeypatch):
    calls, real = [], allreduce.all_reduce

    def spy(tensors, method="ring", average=False, devices=None):
        calls.append((len(tensors), method, average))
        return real(tensors, method=method, average=average, devices=devices)

    monkeypatch.setattr(allreduce, "all_reduce", spy)
    towers = []
    for d in devs[:2]:
        with tf.device(d):
            towers.append([tf.ones([3]), None, tf.ones([2, 2])])
    allreduce.allreduce_grads(towers, method="central")
    assert calls == [(2, "central", True)] * 2  # one per variable that has a gradient
    calls.clear()
    allreduce.packed_allreduce_grads([[g for g in t if g is not None] for t in towers], max_bytes=1000)
    assert calls == [(2, "ring", True)]  # one per bucket


def test_nccl_on_cpu_says_why_and_what_to_use(devs):
    with pytest.raises(RuntimeError, match="NCCL runs on GPUs only.*ring_all_reduce"):
        allreduce.nccl_all_reduce(_on(devs[:2], [[1.0], [2.0]]))
    with pytest.raises(RuntimeError, match="GPUs only"):
        allreduce.allreduce_grads([[tf.ones(2)], [tf.ones(2)]], method="nccl")


def test_nccl_on_logical_gpus_of_one_card_is_refused_before_any_nccl_op_is_built(monkeypatch):
    from tutorial_lib import devices

    logical = devices.plan(4, "auto", physical_gpus=1)  # four logical GPUs carved from one card
    assert not logical.nccl_ok
    monkeypatch.setattr(devices, "current", lambda: logical)
    monkeypatch.setattr(allreduce, "nccl_sum", lambda *_: pytest.fail("an NCCL op was built on logical GPUs"))
    gpus = [f"/device:GPU:{i}" for i in range(2)]
    with pytest.raises(RuntimeError, match="NCCL cannot run on these devices: 1 GPU.*Duplicate GPU"):
        allreduce.nccl_all_reduce([tf.ones(2), tf.ones(2)], devices=gpus)


def test_allreduce_grads_keeps_the_k_by_n_shape(devs):
    rng = np.random.default_rng(0)
    k, shapes = 3, [(4, 2), (2,), ()]
    grads = [[None] + [rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(k)]
    tower_grads = []
    for d, gs in zip(devs[:k], grads, strict=True):
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
    with pytest.raises(TypeError, match="list of device names"):
        allreduce.allreduce_grads([[tf.ones(1)]] * 6, devices="/cpu:0")
    with pytest.raises(ValueError, match="3 towers but 2 devices"):
        allreduce.allreduce_grads([[tf.ones(1)]] * 3, devices=devs[:2])


def _tower_pairs(devs, k):
    """k towers, each with its own variables (replicas) and gradients, as (gradient, variable) pairs."""
    towers = []
    for i, d in enumerate(devs[:k]):
        with tf.device(d):
            variables = [tf.Variable(tf.zeros([2, 3])), tf.Variable(0.0), tf.Variable([0.0])]
            grads = [tf.fill([2, 3], float(i)), None, tf.constant([10.0 * i])]
        towers.append(list(zip(grads, variables, strict=True)))
    return towers


@pytest.mark.parametrize("packed", [False, True])
def test_gradient_variable_pairs_keep_each_towers_own_variables(devs, packed):
    towers = _tower_pairs(devs, 3)
    if packed:
        towers = [[pair for pair in tower if pair[0] is not None] for tower in towers]
        out = allreduce.packed_allreduce_grads(towers, max_bytes=1000)
    else:
        out = allreduce.allreduce_grads(towers)
    plain = allreduce.allreduce_grads([[g for g, _ in tower] for tower in towers])
    assert len(out) == 3
    for tower, reduced, expected in zip(towers, out, plain, strict=True):
        assert [v for _, v in reduced] == [v for _, v in tower]  # each replica's own variables
        for (g, _), e in zip(reduced, expected, strict=True):
            assert (g is None) == (e is None)
            if e is not None:
                np.testing.assert_allclose(g, e)
    np.testing.assert_allclose(out[2][-1][0], [10.0])  # the mean of 0, 10 and 20


def test_mixing_pairs_and_plain_gradients_is_refused():
    v = tf.Variable(1.0)
    for reduce in (allreduce.allreduce_grads, lambda t: allreduce.packed_allreduce_grads(t, 100)):
        with pytest.raises(ValueError, match="mix .gradient, variable. pairs and plain gradients"):
            reduce([[(tf.constant(1.0), v)], [tf.constant(2.0)]])


def test_pack_unpack_round_trip():
    tensors = [tf.ones([2, 3]), tf.range(4.0), tf.constant(7.0)]
    vector, shapes = allreduce.pack(tensors)
    assert vector.shape == (11,)
    for a, b in zip(tensors, allreduce.unpack(vector, shapes), strict=True):
        np.testing.assert_array_equal(a, b)


def test_buckets_respect_the_size_limit():
    tensors = [tf.zeros([10])] * 5 + [tf.zeros([100])] + [tf.zeros([10])]
    assert allreduce.buckets(tensors, max_bytes=80) == [[0, 1], [2, 3], [4], [5], [6]]
    assert allreduce.buckets(tensors, max_bytes=10_000) == [list(range(7))]
    with pytest.raises(ValueError):
        allreduce.buckets(tensors, 0)


def test_buckets_never_mix_dtypes():
    tensors = [
        tf.zeros([2]),
        tf.zeros([2], tf.float16),
        tf.zeros([2], tf.float16),
        tf.zeros([2]),
        tf.zeros([2], tf.float64),
    ]
    assert allreduce.buckets(tensors, max_bytes=10_000) == [[0], [1, 2], [3], [4]]
    assert allreduce.buckets(tensors[1:3], max_bytes=4) == [[0], [1]]  # the size limit still holds


def test_packed_allreduce_equals_unpacked(devs):
    rng = np.random.default_rng(1)
    tower_grads = []
    for d in devs[:2]:
        with tf.device(d):
            tower_grads.append([tf.constant(rng.normal(size=s).astype(np.float32)) for s in [(3, 3), (3,), (5,)]])
    packed = allreduce.packed_allreduce_grads(tower_grads, max_bytes=48)
    plain = allreduce.allreduce_grads(tower_grads)
    for tp, tq in zip(packed, plain, strict=True):
        for a, b in zip(tp, tq, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6)


def test_packed_allreduce_returns_each_gradient_in_its_own_dtype(devs):
    dtypes = [tf.float32, tf.float16, tf.float16, tf.float64]
    tower_grads = []
    for i, d in enumerate(devs[:2]):
        with tf.device(d):
            tower_grads.append([tf.fill([3], tf.cast(i + j, dtype)) for j, dtype in enumerate(dtypes)])
    packed = allreduce.packed_allreduce_grads(tower_grads, max_bytes=10_000)
    for tower in packed:
        assert [g.dtype for g in tower] == dtypes
        for j, g in enumerate(tower):
            np.testing.assert_allclose(g, [j + 0.5] * 3)  # mean of j and j + 1


def test_packed_allreduce_needs_one_device_per_tower(devs):
    tower_grads = [[tf.ones([2])] for _ in range(3)]
    with pytest.raises(ValueError, match="3 towers but 2 devices"):
        allreduce.packed_allreduce_grads(tower_grads, max_bytes=100, devices=devs[:2])  # once dropped tower 3
    with pytest.raises(TypeError, match="list of device names"):
        allreduce.packed_allreduce_grads(tower_grads, max_bytes=100, devices=devs[0])


KNOWN_REASONS = (
    r"the nvidia-nccl-cu12 package is not installed",
    r"no libnccl\.so under",
    r"ncclGetVersion returned an error",
    r"the library did not load: ",
)


def test_nccl_version_reads_the_library_or_says_why():
    info = allreduce.nccl_version()
    if info.version is None:
        assert any(re.match(reason, info.reason) for reason in KNOWN_REASONS), info.reason
    else:
        assert re.fullmatch(r"2\.\d+\.\d+", info.version) and info.reason == "loaded"
        assert re.search(r"libnccl\.so[.\d]*$", info.path)


def test_nccl_version_says_why_when_the_package_is_absent(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "nvidia.nccl", None)  # import nvidia.nccl now raises ImportError
    info = allreduce.nccl_version()
    assert info.version is None and info.reason.startswith("the nvidia-nccl-cu12 package is not installed")
