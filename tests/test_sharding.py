"""ZeRO stages 0-3 from the ring's halves: equal to Keras Adam on one device, memory and bytes by formula."""

import re

import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import devices, sharding

WIDTHS = (64, 16, 10)  # layers of 1040 and 170 numbers: 3 does not divide them


@pytest.fixture(scope="module")
def devs():
    return devices.simulate(4, kind="cpu")


def _problem():
    rng = np.random.default_rng(0)
    flats = [
        tf.constant(0.1 * rng.normal(size=[WIDTHS[k] * WIDTHS[k + 1] + WIDTHS[k + 1]]).astype(np.float32))
        for k in range(2)
    ]
    x = tf.constant(rng.normal(size=[12, 64]).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, 12).astype(np.int32))
    return flats, x, y


def _keras_adam(flats, x, y, steps):
    weights, adam = [tf.Variable(f) for f in flats], tf.keras.optimizers.Adam(1e-2)
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = sharding.local_loss(weights, x, y, WIDTHS)
        adam.apply_gradients(zip(tape.gradient(loss, weights), weights, strict=True))
    return weights


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_stage_equals_keras_adam_and_moves_the_formula_bytes(devs, n, stage):
    flats, x, y = _problem()
    state, traffic = sharding.make_state(flats, devs[:n], stage), [0] * n
    for step in range(1, 4):
        sharding.zero_step(state, devs[:n], x, y, WIDTHS, stage, step, traffic)
    whole = [tf.concat([h["params"][k] for h in state], 0) if stage == 3 else state[-1]["params"][k] for k in range(2)]
    for mine, reference in zip(whole, _keras_adam(flats, x, y, 3), strict=True):
        np.testing.assert_allclose(mine.numpy(), reference.numpy(), atol=1e-5)
    psi = sum(f.shape[0] for f in flats)
    halves = 3 if stage == 3 else 2  # reduce-scatter + all-gather; stage 3 gathers twice
    assert sum(traffic) == 3 * halves * (n - 1) * psi * 4  # 3 steps, each chunk sent n - 1 times
    memory = sharding.memory_per_device(state, devs[:n])
    first = [sharding.shard_sizes(f.shape[0], n)[0] for f in flats]
    held = {k: 4 * (sum(first) if k in sharding.SHARDED[stage] else psi) for k in ("params", "grads", "m")}
    assert memory[devs[0]] == {"params": held["params"], "grads": held["grads"], "optimizer": 2 * held["m"]}


DEEP = (64, 16, 12, 12, 10)  # four layers of 1040, 204, 156 and 130 numbers


def _deep_problem():
    rng = np.random.default_rng(2)
    flats = [
        tf.constant(0.1 * rng.normal(size=[DEEP[k] * DEEP[k + 1] + DEEP[k + 1]]).astype(np.float32))
        for k in range(len(DEEP) - 1)
    ]
    return flats, tf.constant(rng.normal(size=[12, 64]).astype(np.float32)), tf.constant(rng.integers(0, 10, 12))


@pytest.mark.parametrize("n", [2, 3])
def test_zero3_by_layer_equals_adam_on_one_device_holding_at_most_two_layers(devs, n):
    flats, x, y = _deep_problem()
    weights, adam = [tf.Variable(f) for f in flats], tf.keras.optimizers.Adam(1e-2)
    one = sharding.make_state(flats, devs[:1], 0)  # the same Adam (adam_update), one device, the whole batch
    for step in range(1, 4):
        with tf.GradientTape() as tape:
            loss = sharding.local_loss(weights, x, y, DEEP)
        adam.apply_gradients(zip(tape.gradient(loss, weights), weights, strict=True))
        sharding.zero_step(one, devs[:1], x, y, DEEP, 0, step, [0])
    state, traffic, peak = sharding.make_state(flats, devs[:n], 3), [0] * n, [0] * n
    for step in range(1, 4):
        sharding.zero3_by_layer(state, devs[:n], x, y, DEEP, step, traffic, peak)
    for k, reference in enumerate(weights):
        mine = tf.concat([h["params"][k] for h in state], 0).numpy()
        np.testing.assert_allclose(mine, one[0]["params"][k].numpy(), rtol=0, atol=1e-6)
        # Keras rounds its learning rate and betas to float32 in the step size: 6.7e-6 of each update
        np.testing.assert_allclose(mine, reference.numpy(), rtol=0, atol=1e-5)
    sizes = [4 * f.shape[0] for f in flats]
    assert peak == [max(a + b for a, b in zip(sizes, sizes[1:], strict=False))] * n  # the first two layers
    assert peak[0] < sum(sizes)  # gather_weights holds them all
    psi = sum(f.shape[0] for f in flats)
    assert sum(traffic) == 3 * 3 * (n - 1) * psi * 4  # 3 steps of stage 3's bytes: two gathers and a reduce-scatter


def test_zero3_by_layer_refuses_a_state_of_whole_weights_and_a_short_peak(devs):
    flats, x, y = _deep_problem()
    whole = sharding.make_state(flats, devs[:2], 1)
    with pytest.raises(
        ValueError, match=r"layer 0 has 1040 numbers but the devices hold 2080 .* make_state\(flats, devices, 3\)"
    ):
        sharding.zero3_by_layer(whole, devs[:2], x, y, DEEP, 1, [0, 0], [0, 0])
    with pytest.raises(ValueError, match="2 devices but 1 peak counters"):
        sharding.zero3_by_layer(sharding.make_state(flats, devs[:2], 3), devs[:2], x, y, DEEP, 1, [0, 0], [0])


def test_shard_sizes_are_the_rings_chunks():
    assert sharding.shard_sizes(10, 3) == [4, 3, 3]
    assert sum(sharding.shard_sizes(1040, 3)) == 1040


def test_megatron_mlp_equals_one_device_forward_and_backward_with_one_all_reduce_each(devs):
    n, rng = 3, np.random.default_rng(1)
    x, a, b, dz = (tf.constant(rng.normal(size=s).astype(np.float32)) for s in ([4, 6], [6, 12], [12, 6], [4, 6]))
    with tf.GradientTape() as tape:
        tape.watch([x, a, b])
        z = tf.nn.relu(x @ a) @ b
    dx, da, db = tape.gradient(z, [x, a, b], output_gradients=dz)
    copies, traffic = sharding.placed([x] * n, devs[:n]), [0] * n
    a_parts, b_parts = tf.split(a, n, axis=1), tf.split(b, n, axis=0)
    with tf.GradientTape() as tape:
        tape.watch(copies + a_parts + b_parts)
        outs = sharding.megatron_mlp(copies, a_parts, b_parts, devs[:n], traffic)
    assert traffic == [2 * (n - 1) * 4 * 6 * 4 // n] * n  # one ring all-reduce of Z per device
    assert [devices.normalize(o.device) for o in outs] == devs[:n]
    gx, ga, gb = tape.gradient(outs, [copies, a_parts, b_parts], output_gradients=[dz] * n)
    assert traffic == [2 * 2 * (n - 1) * 4 * 6 * 4 // n] * n  # and one of X's gradient
    for out, grad in zip(outs, gx, strict=True):
        np.testing.assert_allclose(out.numpy(), z.numpy(), atol=1e-5)
        np.testing.assert_allclose(grad.numpy(), dx.numpy(), atol=1e-5)
    np.testing.assert_allclose(tf.concat(ga, 1).numpy(), da.numpy(), atol=1e-5)
    np.testing.assert_allclose(tf.concat(gb, 0).numpy(), db.numpy(), atol=1e-5)


def test_dtensor_runs_on_logical_cpus_and_shards_a_matmul_by_columns(devs):
    from tensorflow.experimental import dtensor

    mesh = dtensor.create_mesh([("model", 2)], devices=devs[:2])
    left, right = tf.ones([3, 4]), tf.reshape(tf.range(32, dtype=tf.float32), [4, 8])
    replicated = dtensor.Layout.replicated(mesh, rank=2)
    by_columns = dtensor.relayout(
        dtensor.copy_to_mesh(right, replicated), dtensor.Layout([dtensor.UNSHARDED, "model"], mesh)
    )
    product = tf.function(tf.matmul)(dtensor.copy_to_mesh(left, replicated), by_columns)
    assert [tuple(p.shape) for p in dtensor.unpack(product)] == [(3, 4), (3, 4)]
    np.testing.assert_array_equal(dtensor.relayout(product, replicated).numpy(), (left @ right).numpy())


def _values(state):
    return [v.numpy() for held in state for variables in held.values() for v in variables]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"step": 0}, "step must be a whole number >= 1, got 0"),
        ({"stage": 4}, "stage must be one of [0, 1, 2, 3]"),
        ({"x": tf.zeros([11, 64])}, "11 examples and 12 labels on 2 devices"),
        ({"traffic": [0]}, "2 devices but 1 traffic counters"),
    ],
)
def test_zero_step_refuses_bad_arguments_before_it_writes_anything(devs, change, message):
    flats, x, y = _problem()
    state, traffic = sharding.make_state(flats, devs[:2], 1), [0, 0]
    before = _values(state)
    args = {"state": state, "devices": devs[:2], "x": x, "y": y, "widths": WIDTHS, "stage": 1, "step": 1}
    with pytest.raises(ValueError, match=re.escape(message)):
        sharding.zero_step(**{**args, "traffic": traffic, **change})
    assert traffic == [0, 0] and all(np.array_equal(a, b) for a, b in zip(before, _values(state), strict=True))


def test_memory_per_device_takes_short_device_names_and_keeps_them():
    flats, _, _ = _problem()
    short, full = ["/CPU:0", "/CPU:1"], ["/device:CPU:0", "/device:CPU:1"]
    state = sharding.make_state(flats, short, 2)
    memory = sharding.memory_per_device(state, short)
    assert list(memory) == short
    assert list(memory.values()) == list(sharding.memory_per_device(state, full).values())
    with pytest.raises(ValueError, match=r"lives on .*CPU:1, not one of \['/CPU:0'\]"):
        sharding.memory_per_device(state, ["/CPU:0"])
