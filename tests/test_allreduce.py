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


def _chunk_bounds(size, n):
    sizes = [size // n + (1 if c < size % n else 0) for c in range(n)]
    return np.cumsum([0, *sizes])


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [1, 3, 7, 16])
def test_reduce_scatter_leaves_the_sum_of_chunk_i_on_device_i(devs, n, size):
    rng = np.random.default_rng(10 * n + size)
    values = [rng.normal(size=size).astype(np.float32) for _ in range(n)]
    chunks = allreduce.reduce_scatter(_on(devs[:n], values), devs[:n])
    bounds, total = _chunk_bounds(size, n), np.sum(values, axis=0)
    for i, chunk in enumerate(chunks):
        np.testing.assert_allclose(chunk, total[bounds[i] : bounds[i + 1]], rtol=1e-5, atol=1e-6)
        assert chunk.device.endswith(devs[i][-5:])


@pytest.mark.parametrize("sizes", [[3, 3, 2], [1, 0, 4], [5]])
def test_all_gather_gives_every_device_every_chunk(devs, sizes):
    n = len(sizes)
    chunks = _on(devs[:n], [np.arange(s, dtype=np.float32) + 10 * i for i, s in enumerate(sizes)])
    stats = {}
    gathered = allreduce.all_gather(chunks, devs[:n], stats=stats)
    expected = np.concatenate([c.numpy() for c in chunks])
    for d, g in zip(devs[:n], gathered, strict=True):
        np.testing.assert_array_equal(g, expected)
        assert g.device.endswith(d[-5:])
    # each device forwards every chunk but the one it receives last: (N-1) chunks
    assert sum(stats["bytes_sent"]) == 4 * sum(sizes) * (n - 1)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 3, 4)])
def test_ring_matches_the_sum_for_any_shape_and_size(devs, n, shape):
    rng = np.random.default_rng(sum(shape) + n)
    values = [rng.normal(size=shape).astype(np.float32) for _ in range(n)]
    results = allreduce.ring_all_reduce(_on(devs[:n], values), devs[:n])
    for d, r in zip(devs[:n], results, strict=True):
        np.testing.assert_allclose(r, np.sum(values, axis=0), rtol=1e-5, atol=1e-6)
        assert r.device.endswith(d[-5:]) and r.shape == shape


def test_ring_sums_integers_exactly(devs):
    ints = allreduce.ring_all_reduce(_on(devs, [[1, 2, 3]] * 4, tf.int32), devs)
    np.testing.assert_array_equal(ints[2], [4, 8, 12])


@pytest.mark.parametrize("size", [8, 12, 1000])
def test_ring_sends_two_n_minus_one_over_n_of_the_tensor_as_its_schedule_says(devs, size):
    stats = {}
    allreduce.ring_all_reduce(_on(devs, [np.ones(size)] * 4), devs, stats=stats)
    expected = allreduce.ring_bytes_per_device(size * 4, 4)
    if size % 4 == 0:
        assert stats["bytes_sent"] == [expected] * 4
    assert sum(stats["bytes_sent"]) == pytest.approx(4 * expected)
    assert stats["sends"] == allreduce.ring_schedule(4)
    assert all(dst == (src + 1) % 4 for _, _, src, dst, _ in stats["sends"])


def _replay(moves, n):
    """Whose values each device's copy of each chunk holds after `moves`: held[device][chunk], a set."""
    held = [[{i} for _ in range(n)] for i in range(n)]
    for phase, _, src, dst, c in moves:
        held[dst][c] = held[dst][c] | held[src][c] if phase == "reduce-scatter" else held[src][c]
    return held


@pytest.mark.parametrize("n", range(1, 7))
def test_the_schedule_ends_reduce_scatter_with_chunk_i_on_device_i_and_all_gather_with_everything(n):
    everyone, schedule = set(range(n)), allreduce.ring_schedule(n)
    halfway = _replay([m for m in schedule if m[0] == "reduce-scatter"], n)
    assert all(halfway[i][i] == everyone for i in range(n))
    assert all(chunk == everyone for row in _replay(schedule, n) for chunk in row)
    assert len(schedule) == 2 * n * (n - 1)


def test_ring_inside_tf_function_with_explicit_devices(devs):
    @tf.function
    def f(a, b):
        return allreduce.ring_all_reduce([a, b], devs[:2])

    out = f(tf.constant([1.0, 2.0, 3.0]), tf.constant([10.0, 20.0, 30.0]))
    np.testing.assert_allclose(out[1], [11.0, 22.0, 33.0])


def test_autograph_converts_all_reduce():
    # AutoGraph converts the package's functions traced in a tf.function; syntax it cannot
    # convert (:= for one) printed a warning with a memory address into notebook 04's output.
    assert "def tf__all_reduce" in tf.autograph.to_code(allreduce.all_reduce)


@pytest.mark.parametrize("method", ["ring", "central"])
def test_all_reduce_is_the_checked_entry_to_every_method(devs, method):
    values = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    for average, expected in ((False, [9.0, 12.0]), (True, [3.0, 4.0])):
        results = allreduce.all_reduce(_on(devs[:3], values), method=method, average=average)
        assert len(results) == 3
        for d, r in zip(devs[:3], results, strict=True):
            np.testing.assert_allclose(r, expected)
            assert r.device.endswith(d[-5:])


@pytest.mark.parametrize(
    "tensors, devices, message",
    [
        ([], None, "at least one tensor"),
        ([tf.zeros(2), tf.zeros(3)], None, "one known shape and one dtype"),
        ([tf.zeros(2), tf.zeros(2, tf.float64)], None, "one known shape and one dtype"),
        ([tf.zeros(2)], ["/cpu:0", "/cpu:1"], "1 tensors but 2 devices"),
        ([tf.zeros(2), tf.zeros(2)], ["/cpu:0"], "2 tensors but 1 devices"),
        ([tf.zeros(2)], ["/gpu:/device:GPU:0"], "is not a device name"),
    ],
)
def test_all_reduce_bad_input(tensors, devices, message):
    with pytest.raises(ValueError, match=message):
        allreduce.all_reduce(tensors, devices=devices)


def test_all_reduce_refuses_what_it_cannot_do(devs):
    with pytest.raises(TypeError, match=r"write \['/cpu:0'\]"):
        allreduce.all_reduce([tf.zeros(2)] * 6, devices="/cpu:0")  # six letters: once taken for six devices
    with pytest.raises(ValueError, match="method must be one of"):
        allreduce.all_reduce(_on(devs[:2], [[1.0], [2.0]]), method="tree")
    with pytest.raises(ValueError, match="floating dtype"):
        allreduce.all_reduce(_on(devs, [[1]] * 4, tf.int32), average=True)

    @tf.function
    def unplaced(a, b):
        return allreduce.all_reduce([a + 1, b + 1])

    with pytest.raises(ValueError, match="pass devices="):
        unplaced(tf.zeros(2), tf.zeros(2))


def test_nccl_on_cpu_says_why_and_what_to_use(devs):
    with pytest.raises(RuntimeError, match="NCCL runs on GPUs only.*method='ring'"):
        allreduce.all_reduce(_on(devs[:2], [[1.0], [2.0]]), method="nccl")


def test_nccl_on_logical_gpus_of_one_card_is_refused_before_any_nccl_op_is_built(monkeypatch):
    from tutorial_lib import devices

    logical = devices.plan(4, "auto", physical_gpus=1)  # four logical GPUs carved from one card
    assert not logical.nccl_ok
    monkeypatch.setattr(devices, "current", lambda: logical)
    monkeypatch.setitem(allreduce.ALL_SUMS, "nccl", lambda *_: pytest.fail("an NCCL op was built on logical GPUs"))
    gpus = [f"/device:GPU:{i}" for i in range(2)]
    with pytest.raises(RuntimeError, match="NCCL cannot run on these devices: 1 GPU.*Duplicate GPU"):
        allreduce.all_reduce([tf.ones(2), tf.ones(2)], method="nccl", devices=gpus)


def _recording(monkeypatch, method: str) -> list:
    """Replace ALL_SUMS[method] with one that records its devices and returns the tensors as they are."""
    calls = []

    def record(tensors, devices):
        calls.append(list(devices))
        return list(tensors)

    monkeypatch.setitem(allreduce.ALL_SUMS, method, record)
    return calls


def test_auto_method_is_the_ring_on_cpus(devs, monkeypatch):
    assert allreduce.auto_method(devs) == "ring"
    nccl = _recording(monkeypatch, "nccl")
    results = allreduce.all_reduce(_on(devs[:3], [[1.0], [2.0], [3.0]]), method="auto")
    np.testing.assert_allclose(np.concatenate(results), [6.0, 6.0, 6.0])
    assert nccl == []


def test_auto_method_is_nccl_on_gpus_that_nccl_can_run_on_and_the_ring_on_logical_gpus(monkeypatch):
    from tutorial_lib import devices

    gpus = [f"/device:GPU:{i}" for i in range(2)]
    real = devices.plan(2, "auto", physical_gpus=2)
    assert real.nccl_ok
    monkeypatch.setattr(devices, "current", lambda: real)
    assert allreduce.auto_method(gpus) == "nccl"
    assert allreduce.auto_method([*gpus, "/device:CPU:0"]) == "ring"
    nccl = _recording(monkeypatch, "nccl")
    allreduce.all_reduce([tf.ones(2), tf.ones(2)], method="auto", devices=gpus)
    assert nccl == [gpus]
    monkeypatch.setattr(devices, "current", lambda: devices.plan(2, "auto", physical_gpus=1))  # one card
    assert allreduce.auto_method(gpus) == "ring"


def _nccl_ops(fn, *args) -> list:
    """The NcclAllReduce ops that tracing `fn` builds: (shared name, device, num_devices). Never run."""
    from tutorial_lib import devices

    graph = tf.function(fn).get_concrete_function(*args).graph
    return [
        (op.get_attr("shared_name").decode(), devices.normalize(op.device), op.get_attr("num_devices"))
        for op in graph.get_operations()
        if op.type == "NcclAllReduce"
    ]


def test_nccl_all_sum_builds_one_raw_op_per_device_with_a_fresh_shared_name_each_time(devs):
    from tutorial_lib import devices

    tensors = _on(devs, [np.ones(3, np.float32)] * len(devs))
    first, second = (_nccl_ops(lambda t: allreduce.nccl_all_sum(t, devs), tensors) for _ in range(2))
    assert sorted(d for _, d, _ in first) == sorted(devices.normalize(d) for d in devs)
    assert {n for *_, n in first} == {len(devs)} and len({name for name, *_ in first}) == 1
    assert {name for name, *_ in first}.isdisjoint(name for name, *_ in second)


def test_allreduce_grads_over_nccl_is_one_all_reduce_per_variable(devs):
    grads = [_on([d] * 3, [np.ones(s, np.float32) for s in [(2, 2), (2,), (3,)]]) for d in devs]

    def reduce(g):
        placed = [[tf.identity(t) for t in tower] for tower in g]
        return allreduce.allreduce_grads(placed, method="nccl", devices=devs)

    found = _nccl_ops(reduce, grads)
    assert len({name for name, *_ in found}) == 3 and len(found) == 3 * len(devs)


def test_allreduce_grads_keeps_the_k_by_n_shape_and_none_gradients(devs):
    rng = np.random.default_rng(0)
    k, shapes = 3, [(4, 2), (2,), ()]
    grads = [[None] + [rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(k)]
    tower_grads = []
    for d, gs in zip(devs[:k], grads, strict=True):
        with tf.device(d):
            tower_grads.append([None if g is None else tf.constant(g) for g in gs])
    for method, average in (("ring", True), ("central", True), ("ring", False)):
        out = allreduce.allreduce_grads(tower_grads, average=average, method=method, devices=devs[:k])
        assert len(out) == k and all(len(t) == 4 for t in out)
        for tower in range(k):
            assert out[tower][0] is None
            for j in range(1, 4):
                expected = np.mean([g[j] for g in grads], 0) * (1 if average else k)
                np.testing.assert_allclose(out[tower][j], expected, rtol=1e-5)
                assert out[tower][j].device.endswith(devs[tower][-5:])


def test_packed_allreduce_equals_unpacked_in_each_gradients_own_dtype(devs):
    rng = np.random.default_rng(1)
    dtypes = [tf.float32, tf.float16, tf.float16, tf.float64]
    tower_grads = []
    for d in devs[:2]:
        with tf.device(d):
            tower_grads.append(
                [tf.cast(rng.normal(size=s), t) for s, t in zip([(3, 3), (3,), (5,), (2,)], dtypes, strict=True)]
            )
    packed = allreduce.packed_allreduce_grads(tower_grads, max_bytes=48, devices=devs[:2])
    plain = allreduce.allreduce_grads(tower_grads, devices=devs[:2])
    for tp, tq in zip(packed, plain, strict=True):
        assert [g.dtype for g in tp] == dtypes
        for a, b in zip(tp, tq, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-3)
    with pytest.raises(ValueError, match="max_bytes must be a whole number"):
        allreduce.packed_allreduce_grads(tower_grads, max_bytes=0)


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
