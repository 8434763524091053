"""examples/data_parallel.py, the method the take-away trains: its all-reduce, buckets, synchronized batch
norm and step, each against one device, and where each op and variable of every variant of the step lives."""

import subprocess
import sys
from pathlib import Path

import data_parallel as dp
import keras
import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import placement

GPUS = [f"/GPU:{i}" for i in range(8)]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _on(devices, arrays):
    placed = []
    for device, a in zip(devices, arrays, strict=True):
        with tf.device(device):
            placed.append(tf.constant(a))
    return placed


def test_all_sum_gives_the_sum_on_every_device_and_the_sum_of_the_gradients(devs):
    all_sum = dp.make_all_sum(devs, nccl=False)
    parts = _on(devs, [np.arange(6, dtype=np.float32).reshape(2, 3) * (k + 1) for k in range(len(devs))])
    for summed in all_sum(parts):  # eagerly: built and run as one tf.function
        np.testing.assert_array_equal(summed, np.arange(6).reshape(2, 3) * sum(range(1, len(devs) + 1)))

    @tf.function
    def gradients(xs):
        loss = tf.add_n([float(k + 1) * tf.reduce_sum(s) for k, s in enumerate(all_sum(xs))])
        return tf.gradients(loss, xs)

    for g in gradients(parts):
        np.testing.assert_array_equal(g, np.full((2, 3), sum(range(1, len(devs) + 1))))


def test_all_sum_is_nccl_on_whole_gpus_and_a_ring_elsewhere_with_its_timeout():
    for nccl, hint in ((True, b"nccl"), (False, b"ring")):
        all_sum = dp.make_all_sum(GPUS[:2], nccl=nccl, timeout=12.5)
        summed = tf.function(lambda a, b, all_sum=all_sum: all_sum([a, b]))
        graph = summed.get_concrete_function(tf.ones([3]), tf.ones([3])).graph
        ops = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
        assert sorted(op.device for op in ops) == ["/device:GPU:0", "/device:GPU:1"]
        assert {op.get_attr("communication_hint") for op in ops} == {hint}
        assert {op.get_attr("timeout_seconds") for op in ops} == {12.5}


# A failed collective aborts TensorFlow's collective executor for the rest of the process ("Restart your program
# to reset"): the failures run in a child Python of their own, on 2 logical CPUs.
FAILURE = """
import sys, time
import numpy as np, keras, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
devs = [d.name for d in tf.config.list_logical_devices("CPU")]
sys.path.insert(0, sys.argv[1])
import data_parallel as dp


class OnNaN(keras.layers.Layer):  # what the replica whose input is NaN does: fails, or hangs for 6 s
    def call(self, x):
        if sys.argv[2] == "fails":
            return tf.debugging.check_numerics(x, "this device's activations")
        wait = lambda t: (time.sleep(6.0) if np.isnan(t.numpy()).any() else None, t)[1]
        return tf.reshape(tf.py_function(wait, [x], x.dtype), tf.shape(x))


replicas = dp.make_replicas(lambda: keras.Sequential([keras.Input((4,)), OnNaN(), keras.layers.Dense(10)]), devs)
optimizers = dp.replica_optimizers(replicas, devs, lambda: keras.optimizers.SGD(0.1))
step = dp.make_train_step(replicas, devs, optimizers, dp.make_all_sum(devs, False, timeout=float(sys.argv[3])), False)
feeds = []
for i, device in enumerate(devs):
    x = np.full((2, 4), np.nan if i == 1 else 1.0, np.float32)
    with tf.device(device):
        feeds.append(iter(tf.data.Dataset.from_tensors((x, np.zeros(2, np.int32))).repeat()))
try:
    step(feeds, 1)
except tf.errors.OpError as err:
    print(type(err).__name__, " ".join(str(err).split())[-600:])
"""


def _one_device(kind, timeout):
    done = subprocess.run([sys.executable, "-c", FAILURE, str(EXAMPLES), kind, str(timeout)], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
def test_a_device_that_fails_before_its_all_reduce_stops_the_step_with_its_error():
    out = _one_device("fails", timeout=300.0)  # the others' all-reduce is cancelled, not left waiting 300 s
    assert out.startswith("InvalidArgumentError") and "this device's activations" in out, out


@pytest.mark.slow
def test_a_device_that_hangs_past_the_timeout_stops_the_step_with_deadline_exceeded():
    assert _one_device("hangs", timeout=1.0).startswith("DeadlineExceededError")


def test_buckets_start_from_the_last_gradient_leave_out_none_and_hold_at_most_their_bytes():
    grads = [tf.zeros([10]), None, tf.zeros([5]), tf.zeros([20]), tf.zeros([5], tf.bfloat16)]  # 40, -, 20, 80, 20 B
    assert dp.bucket_plan(grads, 0) == [[4], [3], [2], [0]]
    assert dp.bucket_plan(grads, 100) == [[4, 3], [2, 0]]  # float32 bytes: bfloat16 is summed in float32
    assert dp.bucket_plan(grads, 1000) == [[4, 3, 2, 0]]


def test_gradients_are_summed_in_float32_and_none_stays_none(devs):
    all_sum = dp.make_all_sum(devs[:2], nccl=False)
    values = [[np.full([3], 0.1 * (k + 1)), np.arange(4.0)] for k in range(2)]
    grads = [[None, *_on([d, d], [a.astype(np.float32) for a in v])] for d, v in zip(devs[:2], values, strict=True)]
    grads[0][1], grads[1][1] = (tf.cast(g[1], tf.bfloat16) for g in grads)
    out = dp.all_reduce_gradients(grads, devs[:2], all_sum, bucket_bytes=1 << 20)
    graph = tf.function(lambda: dp.all_reduce_gradients(grads, devs[:2], all_sum, 1 << 20)).get_concrete_function()
    assert {op.get_attr("T") for op in graph.graph.get_operations() if op.type == "CollectiveReduceV2"} == {tf.float32}
    for replica in out:
        assert replica[0] is None and replica[1].dtype == tf.bfloat16 and replica[2].dtype == tf.float32
        np.testing.assert_allclose(tf.cast(replica[1], tf.float32), [0.3] * 3, rtol=1e-2)
        np.testing.assert_array_equal(replica[2], [0, 2, 4, 6])


def cnn(l2=1e-3, frozen=False):
    """Batch norm at the top and in a nested Sequential block; `frozen`: the block's does not train (fine-tuning:
    Keras then normalizes with its moving statistics)."""
    inner = keras.layers.BatchNormalization(momentum=0.9)
    inner.trainable = not frozen
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3, padding="same", use_bias=False, kernel_regularizer=keras.regularizers.L2(l2)),
        keras.layers.BatchNormalization(momentum=0.9),
        keras.layers.ReLU(),
        keras.Sequential([keras.layers.Conv2D(6, 3, padding="same"), inner]),
        keras.layers.Flatten(),
        keras.layers.Dense(10),
    ])  # fmt: skip


def _feeds(devs, x, y, global_batch):
    n, feeds = len(devs), []
    for i, device in enumerate(devs):
        shares = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch, drop_remainder=True)
        shares = shares.map(lambda a, b, i=i: (tf.split(a, n)[i], tf.split(b, n)[i]))
        feeds.append(iter(shares.apply(tf.data.experimental.prefetch_to_device(device, 1))))
    return feeds


@pytest.mark.parametrize(
    "n, bucket_bytes, frozen",
    [(2, 0, False), (3, 1 << 20, True), pytest.param(4, 300, False, marks=pytest.mark.slow)],
)
def test_the_synchronized_step_equals_keras_on_one_device_over_the_whole_batch_in_float64(
    devs, n, bucket_bytes, frozen
):
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        keras.utils.set_random_seed(0)
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(4 * 3 * n, 8, 8, 1)), rng.integers(0, 10, 4 * 3 * n).astype(np.int32)
        replicas = dp.make_replicas(lambda: cnn(frozen=frozen), devs[:n])
        optimizers = dp.replica_optimizers(replicas, devs[:n], lambda: keras.optimizers.Adam(1e-2))
        step = dp.make_train_step(replicas, devs[:n], optimizers, dp.make_all_sum(devs[:n], False), True, bucket_bytes)
        with tf.device(devs[0]):
            single, adam = cnn(frozen=frozen), keras.optimizers.Adam(1e-2)
        for v, first in zip(single.variables, replicas[0].variables, strict=True):
            v.assign(first)
        loss = step(_feeds(devs[:n], x, y, 4 * n), tf.constant(3))  # 3 steps in one call: their mean loss
        expected = []
        for k in range(3):
            with tf.GradientTape() as tape:
                xb, yb = x[4 * n * k : 4 * n * (k + 1)], y[4 * n * k : 4 * n * (k + 1)]
                ref = tf.reduce_mean(dp.cross_entropy(yb, single(xb, training=True))) + sum(single.losses)
            adam.apply_gradients(
                zip(tape.gradient(ref, single.trainable_variables), single.trainable_variables, strict=True)
            )
            expected.append(float(ref))
        np.testing.assert_allclose(float(loss), np.mean(expected), rtol=1e-8)  # Adam, 3 steps: rounding grows
        for replica in replicas:
            for v, r in zip(replica.variables, single.variables, strict=True):
                np.testing.assert_allclose(v.numpy(), r.numpy(), rtol=1e-6, atol=1e-9, err_msg=v.path)
    finally:
        keras.config.set_floatx("float32")
        keras.config.set_dtype_policy("float32")


def test_a_float16_step_that_overflows_leaves_the_moving_statistics_as_the_weights(devs):
    keras.config.set_dtype_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)  # whether 6e4 overflows depends on the weights: fixed ones, whatever ran before
        replicas = dp.make_replicas(lambda: cnn(l2=0.0), devs[:2])
        adam = lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3))  # noqa: E731
        optimizers = dp.replica_optimizers(replicas, devs[:2], adam)
        step = dp.make_train_step(replicas, devs[:2], optimizers, dp.make_all_sum(devs[:2], False))
        before = [v.numpy() for v in replicas[0].variables]
        huge = np.full((4, 8, 8, 1), 6e4, np.float32)  # float16's largest is 65,504: the forward overflows
        step(_feeds(devs[:2], huge, np.zeros(4, np.int32), 4), 1)
    finally:
        keras.config.set_dtype_policy("float32")
    assert float(optimizers[0].dynamic_scale) < 2.0**15  # the step was skipped: its scale was lowered
    for replica in replicas:
        for v, b in zip(replica.variables, before, strict=True):
            np.testing.assert_array_equal(v.numpy(), b, err_msg=v.path)  # moving statistics too: no inf, no NaN


def _step_on(devices, sync_bn=True, bucket_bytes=0, jit=False, policy="float32", nccl=False):
    keras.config.set_dtype_policy(policy if policy == "float32" else f"mixed_{policy}")
    try:
        keras.utils.set_random_seed(0)
        replicas = dp.make_replicas(cnn, devices)
        make = lambda: keras.optimizers.Adam(1e-3)  # noqa: E731
        if policy == "float16":
            make = lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3))  # noqa: E731
        optimizers = dp.replica_optimizers(replicas, devices, make)
        all_sum = dp.make_all_sum(devices, nccl)
        step = dp.make_train_step(replicas, devices, optimizers, all_sum, sync_bn, bucket_bytes, jit)
    finally:
        keras.config.set_dtype_policy("float32")
    feeds = [iter(tf.data.Dataset.from_tensors((np.ones((2, 8, 8, 1), np.float32), np.arange(2))).repeat())
             for _ in devices]  # fmt: skip
    owners = {
        d: [*r.variables, *o.variables, t]
        for d, r, o, t in zip(devices, replicas, optimizers, all_sum.tokens, strict=True)
    }
    return step, feeds, owners


VARIANTS = {
    "sync BN": {},
    "local BN, one all-reduce per gradient": {"sync_bn": False},
    "sync BN in buckets of 300 bytes": {"bucket_bytes": 300},
    "local BN, XLA": {"sync_bn": False, "jit": True},
    "bfloat16": {"policy": "bfloat16"},
    "float16": {"policy": "float16", "sync_bn": False},
}


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.slow
def test_every_variant_of_the_step_traces_on_gpu_names_with_every_op_on_its_replica(n, variant):
    step, feeds, owners = _step_on(GPUS[:n], nccl=True, **VARIANTS[variant])
    report = placement.audit(step, feeds, 1, owners=owners)
    assert report.ok and report.ops_checked > 50 * n, report
    graph = step.get_concrete_function(feeds, 1).graph
    collectives = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
    assert collectives and {op.get_attr("communication_hint") for op in collectives} == {b"nccl"}
    assert sorted({op.device for op in collectives}) == [f"/device:GPU:{i}" for i in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_of_the_step_runs_with_every_op_and_variable_on_its_replica(devs, variant):
    step, feeds, owners = _step_on(devs, **VARIANTS[variant])
    report = placement.audit(step, feeds, 1, owners=owners, run=True)
    assert report.ok and report.variables_checked > 40, report


def test_strategies_over_4_3_and_2_devices_share_a_process_and_leave_no_state(devs):
    base = tf.distribute.MirroredStrategy._collective_key_base
    for n in (4, 3, 2):
        strategy = dp.mirrored_strategy(devs[:n])
        total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
        assert float(total) == n
    assert tf.distribute.MirroredStrategy._collective_key_base == base


def test_the_mirrored_step_runs_k_steps_a_call_equal_to_one_device(devs):
    strategy = dp.mirrored_strategy(devs[:2])
    with strategy.scope():
        model, sgd = cnn(), keras.optimizers.SGD(0.1)
    with tf.device(devs[0]):
        single, one_sgd = cnn(), keras.optimizers.SGD(0.1)
    for v, w in zip(single.variables, model.variables, strict=True):
        v.assign(w.value)
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(24, 8, 8, 1)).astype(np.float32), rng.integers(0, 10, 24).astype(np.int32)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    loss = dp.mirrored_train_step(strategy, model, sgd)(iter(strategy.experimental_distribute_dataset(data)), 3)
    losses = []
    for xb, yb in data:  # Keras' local batch norm on each replica's share: the reference keeps them apart
        with tf.GradientTape() as tape:
            halves = zip(tf.split(xb, 2), tf.split(yb, 2), strict=True)
            ref = tf.add_n([tf.reduce_sum(dp.cross_entropy(b, single(a, training=True))) for a, b in halves]) / 8
            ref += sum(single.losses)
        one_sgd.apply_gradients(
            zip(tape.gradient(ref, single.trainable_variables), single.trainable_variables, strict=True)
        )
        losses.append(float(ref))
    np.testing.assert_allclose(float(loss), np.mean(losses), rtol=1e-5)
    for v, r in zip(model.trainable_variables, single.trainable_variables, strict=True):
        np.testing.assert_allclose(v.numpy(), r.numpy(), rtol=1e-4, atol=1e-5)
