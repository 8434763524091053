"""A pipeline at scale (examples/pipeline_global.py): 2 stages x 2 data-parallel replicas on 4 devices, global
gradient clipping and float16's loss scaling across stages with the zero-bubble paper's post-validation, each equal
to one device over 3 steps with SGD and Adam; the update that post-validation takes at once waits for none of the
other stages' gradients, read from the graph; every op and variable on its device."""

import keras
import numpy as np
import pipeline_global as pg
import pipeline_parallel as pp
import pipeline_schedules as ps
import pytest
import tensorflow as tf

from tutorial_lib import models, pipeline_graph, placement, reference

GPUS = [f"/GPU:{i}" for i in range(4)]
OPTIMIZERS = {
    "SGD": lambda **kw: keras.optimizers.SGD(0.1, **kw),
    "Adam": lambda **kw: keras.optimizers.Adam(1e-3, **kw),
}


class Poisoned(tf.Module):
    """x * w (w = 1), whose weight's gradient is multiplied by `poison`: inf plants an overflow in this layer's
    weight gradient alone (its input's gradient stays finite, so the other stages' gradients do too)."""

    def __init__(self):
        super().__init__()
        self.w, self.poison = tf.Variable(1.0, name="w"), tf.Variable(1.0, trainable=False, name="poison")

    @property
    def trainable_variables(self):
        return (self.w,)

    def __call__(self, h):
        @tf.custom_gradient
        def scaled(h, w):
            return h * w, lambda g: (g * w, tf.reduce_sum(g * h) * self.poison)

        return scaled(h, self.w)


def layers(poisoned=False):
    """An MLP of 8 layers (12 features in, 10 logits out); with `poisoned`, a Poisoned layer in its first chunk."""
    made = [models.Dense(12 if i == 0 else 16, 10 if i == 7 else 16, relu=i < 7, seed=i) for i in range(8)]
    return made[:1] + [Poisoned()] + made[1:] if poisoned else made


def chunks_on(on, poisoned=False):
    """The MLP's layers cut into len(on) chunks, chunk k made under on[k]."""
    count = len(layers(poisoned))
    cuts = [round(k * count / len(on)) for k in range(len(on) + 1)]
    chunks = []
    for k, device in enumerate(on):
        with tf.device(device):
            chunks.append(models.Sequential(layers(poisoned)[cuts[k] : cuts[k + 1]]))
    return chunks


def batches(n=3, rows=16):
    """Batches whose every pre-activation stays 1e-5 or more from ReLU's kink over these steps (seed 0's reach 5e-8
    at a step: a rounding difference of 3e-8 in the weights then flips a unit, and the runs part)."""
    rng = np.random.default_rng(1)
    return [(tf.constant(rng.normal(size=(rows, 12)).astype(np.float32) * 3), tf.constant(rng.integers(0, 10, rows),
             tf.int32)) for _ in range(n)]  # fmt: skip


def pipeline(devices, kind, optimizer, clip_norm=None, post_validate=True, loss_scale=None, poisoned=False):
    """(replicas, their step) of `kind` on `devices` (S = 2: R = len(devices) / 2 replicas), M = 4."""
    v = 2 if kind in ("interleaved", "zb_v") else 1
    where = ps.placement_of(kind, 2, v)
    replicas = pg.replicate(lambda on: chunks_on(on, poisoned), devices, where, optimizer)
    sums = pg.stage_all_sums(replicas, nccl=False) if len(replicas) > 1 else None
    scales = [pg.make_loss_scale(rep.physical[-1], **loss_scale) for rep in replicas] if loss_scale else None
    steps = pg.make_replicated_train_steps(replicas, ps.orders_of(kind, 2, 4, v), pp.mean_cross_entropy, sums,
                                           clip_norm, scales, post_validate, placement=where)  # fmt: skip
    steps.all_sums = sums  # for the placement audit: their tokens are variables of the step
    return replicas, steps, scales


def assert_like_one_device(replicas, single):
    for rep in replicas:
        got = [v for chunk in rep.chunks for v in chunk.trainable_variables]
        for a, b in zip(got, single.trainable_variables, strict=True):
            np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)


@pytest.mark.parametrize("kind", ["1f1b", "zb_h1", "zb_v"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.slow
def test_two_stages_times_two_replicas_on_four_devices_equal_one_device(devs, kind, name):
    replicas, steps, _ = pipeline(devs[:4], kind, OPTIMIZERS[name])
    single = models.Sequential(layers())
    expected = reference.optimizer_losses(single, batches(), OPTIMIZERS[name]())
    got = [float(steps([x], [y])[0][0]) for x, y in batches()]
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert_like_one_device(replicas, single)
    assert {rep.devices[0] for rep in replicas} == {devs[0], devs[2]}  # stage 0 on devices 0 and 2


@pytest.mark.parametrize("replicas_n", [1, 2])
@pytest.mark.parametrize("post_validate", [True, False])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.slow
def test_global_clipping_across_stages_equals_keras_global_clipnorm_on_one_device(devs, replicas_n, post_validate,
                                                                                   name):  # fmt: skip
    clip = 0.7  # the global norms are 0.58, 0.81 and 0.54 (stage 1 alone 0.38, 0.57 and 0.30): step 2 is clipped
    replicas, steps, _ = pipeline(devs[: 2 * replicas_n], "zb_h1", OPTIMIZERS[name], clip, post_validate)
    single = models.Sequential(layers())
    expected = reference.optimizer_losses(single, batches(), OPTIMIZERS[name](global_clipnorm=clip))
    got, rolled = [], []
    for x, y in batches():
        loss, back = steps([x], [y])
        got.append(float(loss[0]))
        rolled.append(int(back[0]))
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert_like_one_device(replicas, single)
    # post-validation: the device that finishes first stepped at once where its own norm passed, and the global
    # norm did not: that step was rolled back and redone; waiting for the global state rolls nothing back
    assert (sum(rolled) > 0) == post_validate, rolled


@pytest.mark.parametrize("replicas_n", [1, 2])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.slow
def test_an_overflow_in_one_stage_skips_every_stages_update_as_a_loss_scale_optimizer_on_one_device(devs, replicas_n,
                                                                                                     name):  # fmt: skip
    settings = {"initial": 2.0**4, "growth_steps": 2}
    replicas, steps, scales = pipeline(devs[: 2 * replicas_n], "1f1b", OPTIMIZERS[name], loss_scale=settings,
                                       poisoned=True)  # fmt: skip
    single = models.Sequential(layers(poisoned=True))
    optimizer = keras.optimizers.LossScaleOptimizer(OPTIMIZERS[name](), initial_scale=2.0**4, dynamic_growth_steps=2)
    data = batches(4)
    for step, (x, y) in enumerate(data):
        poison = np.inf if step == 2 else 1.0  # step 3: stage 0's layer overflows, nothing else
        for layer in [single.layers[1]] + [rep.chunks[0].layers[1] for rep in replicas]:
            layer.poison.assign(poison)
        with tf.GradientTape() as tape:
            loss = models.cross_entropy(single(x), y)
            scaled = optimizer.scale_loss(loss)
        optimizer.apply(tape.gradient(scaled, single.trainable_variables), single.trainable_variables)
        got, rolled = steps([x], [y])
        np.testing.assert_allclose(float(got[0]), float(loss), atol=1e-6)
        assert_like_one_device(replicas, single)
        for ls in scales:  # doubled after two good steps, halved at the overflow
            assert float(ls.scale) == float(optimizer.dynamic_scale) == [16.0, 32.0, 16.0, 16.0][step]
        # 1F1B's stage 1 finishes first: it stepped at once, and rolled back at the overflow
        assert int(rolled[0]) == (replicas_n if step == 2 else 0)


@pytest.mark.parametrize("post_validate", [True, False])
def test_the_update_taken_at_once_waits_not_for_the_stage_that_finishes_last(devs, post_validate):
    replicas, steps, _ = pipeline(devs[:2], "zb_h1", OPTIMIZERS["SGD"], 0.6, post_validate)
    x, y = batches(1)[0]
    graph = steps.get_concrete_function([x], [y]).graph
    stage_1 = replicas[0].physical[1]  # ZB-H1's stage 1 finishes first: its update comes first in the chain
    conds = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf") and op.device == stage_1
             and "update" in op.name]  # fmt: skip
    first = pipeline_graph._ancestors(conds[0])  # the step taken at once, or (without post-validation) the only one
    kind, m = ps.zb_h1(2, 4)[0][-1]  # stage 0's last op, B3: whatever waits for any of its ops waits for its start
    assert (f"stage0/{kind}{m}/start" in first) != post_validate


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zb_h1", "zb_v"])
def test_every_op_and_variable_of_the_step_on_its_device_and_traced_on_gpu_names(devs, kind):
    x, y = batches(1)[0]
    for devices, run in ((devs[:4], True), (GPUS, False)):
        replicas, steps, scales = pipeline(devices, kind, OPTIMIZERS["Adam"], 0.6, loss_scale={"initial": 8.0})
        owners = {}
        for rep, ls in zip(replicas, scales, strict=True):
            for chunk, optimizer, device in zip(rep.chunks, rep.optimizers, rep.devices, strict=True):
                owners.setdefault(device, []).extend([*chunk.variables, *optimizer.variables])
            owners[rep.physical[-1]] += [ls.scale, ls.good]
        for k, all_sum in steps.all_sums.items():  # each device's ordering token
            for rep, token in zip(replicas, all_sum.tokens, strict=True):
                if all(token is not t for t in owners[rep.devices[k]]):
                    owners[rep.devices[k]].append(token)
        report = placement.audit(steps, [x], [y], owners=owners, run=run)
        assert report.ok and report.ops_checked > 200, report


def test_what_the_method_cannot_take_is_refused(devs):
    with pytest.raises(ValueError, match="3 devices do not hold 2 stages a replica"):
        pg.replicate(lambda on: chunks_on(on), devs[:3], [0, 1], OPTIMIZERS["SGD"])
    replicas = pg.replicate(lambda on: chunks_on(on), devs[:4], [0, 1], OPTIMIZERS["SGD"])
    orders = ps.orders_of("1f1b", 2, 4)
    with pytest.raises(ValueError, match="2 replicas need all_sums"):
        pg.make_replicated_train_steps(replicas, orders, pp.mean_cross_entropy)
    with pytest.raises(ValueError, match="clip_norm must be a positive number"):
        pg.make_replicated_train_steps(replicas[:1], orders, pp.mean_cross_entropy, clip_norm=0.0)
