"""Zero bubble (ZB-H1), interleaving and recomputation run in TensorFlow (`pipeline_split`): each
equal to one device, each op on its chunk's device, W deferred where the schedule says, what
cannot run refused, and the activation memory read from the traced step."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import models, placement, reference, schedules
from tutorial_lib import pipeline_split as ps

GPUS = [f"/GPU:{i}" for i in range(4)]
RUNS = [("gpipe", 1, False), ("1f1b", 1, False), ("zb_h1", 1, False), ("interleaved", 2, False),
        ("gpipe", 1, True), ("zb_h1", 1, True), ("interleaved", 2, True)]  # fmt: skip


def layer(i, n_layers=8, width=16):
    """Layer i of a ReLU MLP of `n_layers` layers, 12 features in, 10 classes out."""
    last = i == n_layers - 1
    return models.Dense(12 if i == 0 else width, 10 if last else width, relu=not last, seed=i)


def whole_model(n_layers=8):
    return models.Sequential([layer(i, n_layers) for i in range(n_layers)])


def batch(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return tf.constant(rng.normal(size=(n, 12)).astype(np.float32)), tf.constant(rng.integers(0, 10, n), tf.int32)


@pytest.mark.parametrize("kind, v, recompute", RUNS)
@pytest.mark.parametrize("rule", ["sgd", pytest.param("adam", marks=pytest.mark.slow)])
def test_every_schedule_and_recomputation_equals_one_device_over_three_steps(devs, kind, v, recompute, rule):
    chunks, single = ps.make_chunks(layer, 8, devs[:2], v), whole_model()
    batches = [batch(seed=s) for s in range(3)]
    if rule == "sgd":
        pipe = ps.SplitPipeline(chunks, devs[:2], 4, 0.1, kind, recompute=recompute)
        expected = [float(reference.sgd_step(single, x, y, 0.1)) for x, y in batches]
    else:
        pipe = ps.SplitPipeline(chunks, devs[:2], 4, schedule=kind, optimizer=keras.optimizers.Adam(1e-3),
                                recompute=recompute)  # fmt: skip
        expected = reference.optimizer_losses(single, batches, keras.optimizers.Adam(1e-3))
    losses = [float(pipe.train_step(x, y)) for x, y in batches]
    np.testing.assert_allclose(losses, expected, atol=1e-6)
    for a, b in zip(pipe.variables, single.trainable_variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)
    assert int(pipe.step) == 3


def test_a_keras_chunk_with_regularizers_equals_one_device(devs):
    def dense(i, **kw):
        return keras.layers.Dense(10 if i == 3 else 16, kernel_regularizer=keras.regularizers.L2(0.01), **kw)

    keras.utils.set_random_seed(0)
    chunks = []
    for k, d in enumerate(devs[:2]):
        with tf.device(d):
            chunks.append(keras.Sequential([keras.Input((12 if k == 0 else 16,)), dense(2 * k), dense(2 * k + 1)]))
    single = keras.Sequential([keras.Input((12,)), *[layer for c in chunks for layer in c.layers]])
    x, y = batch()
    pipe = ps.SplitPipeline(chunks, devs[:2], 4, 0.1, "zb_h1")
    ref_loss, ref_grads = reference.loss_and_gradients(single, x, y)
    np.testing.assert_allclose(float(pipe.train_step(x, y)), float(ref_loss), atol=1e-6)
    for v, g in zip(single.trainable_variables, ref_grads, strict=True):
        v.assign_sub(0.1 * g)
    for a, b in zip(pipe.variables, single.trainable_variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kind, v, recompute", [r for r in RUNS if r[0] in ("zb_h1", "interleaved")])
def test_each_op_and_variable_stays_on_its_chunks_device(devs, kind, v, recompute):
    chunks = ps.make_chunks(layer, 8, devs[:2], v)
    pipe = ps.SplitPipeline(chunks, devs[:2], 4, schedule=kind, optimizer=keras.optimizers.Adam(1e-3),
                            recompute=recompute)  # fmt: skip
    x, y = batch()
    pipe.train_step(x, y)  # builds the optimizer copies
    owners = {}
    for k, (chunk, optimizer) in enumerate(zip(chunks, pipe.optimizers, strict=True)):
        owners.setdefault(devs[k % 2], []).extend([*chunk.trainable_variables, *optimizer.variables])
    report = placement.audit(pipe.traced_step, x, y, owners=owners, run=True)
    assert report.ok and report.ops_checked > 100 and report.variables_checked > 40, report
    gpu_chunks = ps.make_chunks(layer, 8, GPUS[:2], v)  # traced on /GPU:i names: no GPU needed
    gpu_pipe = ps.SplitPipeline(gpu_chunks, GPUS[:2], 4, 0.1, kind, recompute=recompute)
    gpu_owners = {}
    for k, chunk in enumerate(gpu_chunks):
        gpu_owners.setdefault(GPUS[k % 2], []).extend(chunk.trainable_variables)
    gpu_report = placement.audit(gpu_pipe.traced_step, *gpu_pipe.check_batch(x, y), owners=gpu_owners)
    assert gpu_report.ok and gpu_report.ops_checked > 100, gpu_report


def test_w_is_deferred_where_the_schedule_says(devs):
    pipe = ps.SplitPipeline(ps.make_chunks(layer, 8, devs[:2]), devs[:2], 4, 0.1, "zb_h1")
    x, y = batch()
    scopes = [scope for scope, device in pipe.scopes() if device == pipe.physical[1]]
    assert scopes == [f"stage1/{kind}{m}" for kind, m in schedules.zb_h1(2, 4)[1]]
    assert scopes.index("stage1/W0") > scopes.index("stage1/B1")  # stage 1 keeps one W waiting
    where = ps.op_steps(pipe, x, y)
    graph = pipe.traced_step.get_concrete_function(*pipe.check_batch(x, y)).graph
    steps = [scope for scope, _ in pipe.scopes()]
    waits_for = {steps[where[c.name]] for c in graph.get_operation_by_name("stage1/W0/start").control_inputs}
    assert waits_for == {"stage1/B1"}  # the graph runs W0 after B1 on its device, not after B0
    w_ops = [n for n, i in where.items() if steps[i] == "stage1/W0" and "gradient_tape/" in n]
    b_ops = [n for n, i in where.items() if steps[i] == "stage1/B0" and "gradient_tape/" in n]
    assert any("MatMul" in n for n in w_ops) and any("MatMul" in n for n in b_ops)  # both B and W do work


def test_kept_bytes_follow_the_schedule_and_recomputation(devs):
    x, y = batch(64)
    kept = {}
    for kind, v, recompute in RUNS:
        pipe = ps.SplitPipeline(ps.make_chunks(layer, 8, devs[:2], v), devs[:2], 4, 0.0, kind, recompute=recompute)
        kept[kind, recompute] = ps.kept_bytes(pipe, x, y)
    first = devs[0]
    assert kept["gpipe", False][first] > kept["1f1b", False][first]  # GPipe keeps all 4, 1F1B 2 micro-batches
    assert kept["gpipe", True][first] < kept["gpipe", False][first]  # only each micro-batch's input
    # ZB-H1's first stage keeps 1F1B's micro-batches, and from each B to its W the output gradients W reads
    assert kept["1f1b", False][first] < kept["zb_h1", False][first] < kept["gpipe", False][first]
    at_8 = {k: ps.SplitPipeline(ps.make_chunks(layer, 8, devs[:2]), devs[:2], 8, 0.0, k) for k in ("gpipe", "1f1b")}
    at_8 = {k: ps.kept_bytes(pipe, x, y)[first] for k, pipe in at_8.items()}
    assert at_8["1f1b"] < kept["1f1b", False][first]  # smaller micro-batches, still two of them in flight
    assert at_8["gpipe"] > 2 * at_8["1f1b"]  # GPipe keeps the whole batch at any M


def test_what_cannot_run_is_refused(devs):
    chunks = ps.make_chunks(layer, 8, devs[:2], 2)
    with pytest.raises(ValueError, match="v chunks per device"):
        ps.SplitPipeline(chunks[:3], devs[:2], 4, 0.1, "interleaved")
    with pytest.raises(ValueError, match="zb_h1 runs one chunk per device"):
        ps.SplitPipeline(chunks, devs[:2], 4, 0.1, "zb_h1")
    with pytest.raises(ValueError, match="interleaving needs v >= 2"):
        ps.SplitPipeline(chunks[:2], devs[:2], 4, 0.1, "interleaved")
    with pytest.raises(ValueError, match="M a multiple of S.*use M=2 or M=4"):
        ps.SplitPipeline(chunks, devs[:2], 3, 0.1, "interleaved")
    with pytest.raises(ValueError, match="schedule must be one of"):
        ps.SplitPipeline(chunks[:2], devs[:2], 4, 0.1, "zb_v")
    with pytest.raises(ValueError, match="7 layers do not cut into 2 devices x 2 chunks.*e.g. 8"):
        ps.make_chunks(layer, 7, devs[:2], 2)
    with tf.device(devs[0]):
        dropout = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16), keras.layers.Dropout(0.5, seed=1)])
    with tf.device(devs[1]):
        head = keras.Sequential([keras.Input((16,)), keras.layers.Dense(10)])
    with pytest.raises(ValueError, match="recompute=True would run its forward twice"):
        ps.SplitPipeline([dropout, head], devs[:2], 4, 0.1, "1f1b", recompute=True)
    from tutorial_lib import pipeline

    with pytest.raises(TypeError, match="read a SplitPipeline's step"):
        ps.kept_bytes(pipeline.Pipeline(chunks[:2], devs[:2], 4, 0.1), *batch())


def test_a_wave_of_two_zb_h1_steps_in_one_call_equals_two_steps_on_one_device(devs):
    pipe, single = ps.SplitPipeline(ps.make_chunks(layer, 8, devs[:2]), devs[:2], 4, 0.1, "zb_h1"), whole_model()
    batches = [batch(seed=s) for s in range(2)]
    losses = pipe.train_steps([x for x, _ in batches], [y for _, y in batches])
    np.testing.assert_allclose(losses, [float(reference.sgd_step(single, x, y, 0.1)) for x, y in batches], atol=1e-6)
    for a, b in zip(pipe.variables, single.trainable_variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)
