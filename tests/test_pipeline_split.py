"""Every schedule run in TensorFlow (`pipeline_split`, the take-away's step): each equal to one device for S in 2, 3,
4 and M in 1, S-1, S, 2S, with and without recomputation; each device's executed order read from the graph, every op
kept in it; each op on its chunk's device; what cannot run refused; the activation memory read from the traced step
and explained by the per-layer table."""

import keras
import numpy as np
import pipeline_parallel as pp
import pytest
import tensorflow as tf

from tutorial_lib import models, pipeline_graph, placement, reference, schedules
from tutorial_lib import pipeline_split as ps

GPUS = [f"/GPU:{i}" for i in range(4)]
RUNS = [("gpipe", 1, False), ("1f1b", 1, False), ("zb_h1", 1, False), ("interleaved", 2, False), ("zb_v", 2, False),
        ("gpipe", 1, True), ("zb_h1", 1, True), ("interleaved", 2, True), ("zb_v", 2, True)]  # fmt: skip
GRID = [
    (S, M, kind, recompute)
    for S in (2, 3, 4)
    for M in sorted({1, S - 1, S, 2 * S})
    for kind in schedules.EVERY_SCHEDULE
    for recompute in (False, True)
    if kind != "interleaved" or M % S == 0
]
FAST = {(2, 2), (3, 3)}  # the rest of the grid is marked slow


def layer(i, n_layers=8, width=16, features=12):
    """Layer i of a ReLU MLP of `n_layers` layers, `features` in, 10 classes out."""
    last = i == n_layers - 1
    return models.Dense(features if i == 0 else width, 10 if last else width, relu=not last, seed=i)


def whole_model(n_layers=8, width=16):
    return models.Sequential([layer(i, n_layers, width) for i in range(n_layers)])


def batch(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return tf.constant(rng.normal(size=(n, 12)).astype(np.float32)), tf.constant(rng.integers(0, 10, n), tf.int32)


def grid_pipe(devs, S, M, kind, recompute, width=8, **rule):
    """Two layers a chunk (so that each backward shows which gradients it computes), on S devices."""
    v = 2 if kind in ("interleaved", "zb_v") else 1
    n = 2 * S * v
    chunks = ps.make_chunks(lambda i: layer(i, n, width), n, devs[:S], v, kind)
    return ps.SplitPipeline(chunks, devs[:S], M, schedule=kind, recompute=recompute, **rule), n


@pytest.mark.parametrize(
    "S, M, kind, recompute", [pytest.param(*g, marks=[] if g[:2] in FAST else pytest.mark.slow) for g in GRID]
)
def test_every_schedule_equals_one_device_and_runs_each_devices_order_read_from_the_graph(devs, S, M, kind, recompute):
    pipe, n = grid_pipe(devs, S, M, kind, recompute, learning_rate=0.1)
    single, batches = whole_model(n, 8), [batch(24, seed) for seed in range(3)]
    expected = [float(reference.sgd_step(single, x, y, 0.1)) for x, y in batches]
    np.testing.assert_allclose([float(pipe.train_step(x, y)) for x, y in batches], expected, atol=1e-6)
    for a, b in zip(pipe.variables, single.trainable_variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)
    x, y = batches[0]
    # What each device runs, in the order the graph imposes, labelled by what each op computes: the schedule's
    # orders for this name, not the step's own (a 1F1B step under the name ZB-H1 fails here: next test).
    v = 2 if kind in ("interleaved", "zb_v") else 1
    assert pipeline_graph.executed_orders(pipe, x, y) == pipeline_graph.expected_labels(
        schedules.orders_of(kind, S, M, v)
    )
    assert pipeline_graph.ops_outside_order(pipe, x, y) == 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", schedules.EVERY_SCHEDULE)
@pytest.mark.parametrize("recompute", [False, True])
def test_every_schedule_with_adam_per_chunk_equals_adam_on_one_device_over_three_steps(devs, kind, recompute):
    pipe, n = grid_pipe(devs, 3, 3, kind, recompute, optimizer=keras.optimizers.Adam(1e-3))
    single, batches = whole_model(n, 8), [batch(24, seed) for seed in range(3)]
    expected = reference.optimizer_losses(single, batches, keras.optimizers.Adam(1e-3))
    np.testing.assert_allclose([float(pipe.train_step(x, y)) for x, y in batches], expected, atol=1e-6)
    for a, b in zip(pipe.variables, single.trainable_variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)
    assert int(pipe.step) == 3


def test_a_1f1b_step_under_the_name_zb_h1_and_a_step_that_chains_only_the_input_gradient_are_caught(devs, monkeypatch):
    x, y = batch(24)
    labelled, _ = grid_pipe(devs, 2, 4, "1f1b", False, learning_rate=0.1)
    labelled.kind = "zb_h1"  # the bug the order test is for: numbers right, schedule not the one named
    assert pipeline_graph.executed_orders(labelled, x, y) != pipeline_graph.expected_labels(schedules.zb_h1(2, 4))
    whole = pp.backward_op

    def chains_only_the_input_gradient(run, k, m):  # the old SplitPipeline's GPipe, 1F1B and interleaved
        made = whole(run, k, m)
        return made[-1:] if k else made

    monkeypatch.setattr(pp, "backward_op", chains_only_the_input_gradient)
    leaky, _ = grid_pipe(devs, 2, 4, "1f1b", False, learning_rate=0.1)
    assert pipeline_graph.ops_outside_order(leaky, x, y) > 20  # stage 1's weight gradients float


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
@pytest.mark.parametrize("kind, v, recompute", [r for r in RUNS if r[0] in ("zb_h1", "interleaved", "zb_v")])
def test_each_op_and_variable_stays_on_its_chunks_device(devs, kind, v, recompute):
    chunks = ps.make_chunks(layer, 8, devs[:2], v, kind)
    lane = schedules.placement_of(kind, 2, v)
    pipe = ps.SplitPipeline(chunks, devs[:2], 4, schedule=kind, optimizer=keras.optimizers.Adam(1e-3),
                            recompute=recompute)  # fmt: skip
    x, y = batch()
    pipe.train_step(x, y)  # builds the optimizer copies
    owners = {}
    for k, (chunk, optimizer) in enumerate(zip(chunks, pipe.optimizers, strict=True)):
        owners.setdefault(devs[lane[k]], []).extend([*chunk.trainable_variables, *optimizer.variables])
    report = placement.audit(pipe.traced_step, x, y, owners=owners, run=True)
    assert report.ok and report.ops_checked > 100 and report.variables_checked > 40, report
    gpu_chunks = ps.make_chunks(layer, 8, GPUS[:2], v, kind)  # traced on /GPU:i names: no GPU needed
    gpu_pipe = ps.SplitPipeline(gpu_chunks, GPUS[:2], 4, 0.1, kind, recompute=recompute)
    gpu_owners = {}
    for k, chunk in enumerate(gpu_chunks):
        gpu_owners.setdefault(GPUS[lane[k]], []).extend(chunk.trainable_variables)
    gpu_report = placement.audit(gpu_pipe.traced_step, *gpu_pipe.check_batch(x, y), owners=gpu_owners)
    assert gpu_report.ok and gpu_report.ops_checked > 100, gpu_report


def test_w_is_deferred_where_the_schedule_says(devs):
    pipe = ps.SplitPipeline(ps.make_chunks(layer, 8, devs[:2]), devs[:2], 4, 0.1, "zb_h1")
    x, y = batch()
    scopes = [scope for scope, device in pipe.scopes() if device == pipe.physical[1]]
    assert scopes == [f"stage1/{kind}{m}" for kind, m in schedules.zb_h1(2, 4)[1]]
    assert scopes.index("stage1/W0") > scopes.index("stage1/B1")  # stage 1 keeps one W waiting
    where = pipeline_graph.op_steps(pipe, x, y)
    graph = pipeline_graph.graph_of(pipe, x, y)
    steps = [scope for scope, _ in pipe.scopes()]
    start = graph.get_operation_by_name("stage1/W0/start")
    waits_for = {steps[where[c.name]] for c in start.control_inputs}
    assert waits_for == {"stage1/B1"}  # the graph runs W0 after B1 on its device, not after B0
    assert [label for label in pipeline_graph.executed_orders(pipe, x, y)[0] if label != "F"] == ["B+W"] * 4


@pytest.mark.slow
def test_kept_bytes_follow_the_schedule_recomputation_and_zb_h1s_merged_first_stage(devs):
    x, y = batch(64)
    kept = {}
    for kind, v, recompute in RUNS + [("1f1b", 1, True)]:
        pipe = ps.SplitPipeline(
            ps.make_chunks(layer, 8, devs[:2], v, kind), devs[:2], 4, 0.0, kind, recompute=recompute
        )
        kept[kind, recompute] = pipeline_graph.kept_bytes(pipe, x, y)
        assert pipeline_graph.explained_peaks(pipe, x, y) == pytest.approx(kept[kind, recompute], rel=0.05)
    first, last = devs[:2]
    assert kept["gpipe", False][first] > kept["1f1b", False][first]  # GPipe keeps all 4, 1F1B 2 micro-batches
    assert kept["gpipe", True][first] < kept["gpipe", False][first]  # only each micro-batch's input
    for recompute in (False, True):  # stage 0's B and W merged: 1F1B's memory there
        assert kept["zb_h1", recompute][first] == kept["1f1b", recompute][first]
    assert kept["zb_h1", False][last] > kept["1f1b", False][last]  # a split W keeps its tapes and output gradients
    at_8 = {k: ps.SplitPipeline(ps.make_chunks(layer, 8, devs[:2]), devs[:2], 8, 0.0, k) for k in ("gpipe", "1f1b")}
    at_8 = {k: pipeline_graph.kept_bytes(pipe, x, y)[first] for k, pipe in at_8.items()}
    assert at_8["1f1b"] < kept["1f1b", False][first]  # smaller micro-batches, still two of them in flight
    assert at_8["gpipe"] > 2 * at_8["1f1b"]  # GPipe keeps the whole batch at any M


def _kept_until(pipe, x, y, chunk):
    """(bytes one micro-batch keeps from F to its B, from B to its W) on `chunk`, from the per-layer table."""
    rows = [r for r in pipeline_graph.kept_per_layer(pipe, x, y) if r["chunk"] == chunk]
    until_b = sum(r["bytes"] for r in rows if r["interval"] in ("F→B", "F→W"))
    return until_b, sum(r["bytes"] for r in rows if r["interval"] in ("F→W", "B→W"))


def test_a_split_w_of_an_mlp_keeps_more_than_its_b_and_of_an_attention_block_less(devs):
    x, y = batch(64)
    mlp = ps.SplitPipeline(ps.make_chunks(layer, 8, devs[:2]), devs[:2], 4, 0.0, "zb_h1")
    until_b, until_w = _kept_until(mlp, x, y, chunk=1)
    assert until_w > until_b  # W reads each layer's input, its ReLU's output and its output gradient

    def attention(qkv):  # no weights: its scores and softmax are read by B only
        q, k, v = tf.split(qkv, 3, axis=-1)
        return tf.matmul(tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / 4.0), v)

    chunks = []
    for k, d in enumerate(devs[:2]):
        with tf.device(d):
            body = [keras.layers.Dense(48), keras.layers.Lambda(attention), keras.layers.Dense(16),
                    keras.layers.Dense(64), keras.layers.Activation("gelu"), keras.layers.Dense(16)]  # fmt: skip
            head = [keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10)] if k else []
            chunks.append(keras.Sequential([keras.Input((32, 16)), *body, *head]))
    x = tf.random.stateless_normal([8, 32, 16], [0, 1])
    block = ps.SplitPipeline(chunks, devs[:2], 4, 0.0, "zb_h1")
    until_b, until_w = _kept_until(block, x, y[:8], chunk=1)
    assert until_w < until_b / 2  # W keeps the linear layers' inputs and output gradients only


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
    with pytest.raises(ValueError, match="ZB-V runs two chunks per device in a V, got 1"):
        ps.SplitPipeline(chunks[:2], devs[:2], 4, 0.1, "zb_v")
    with pytest.raises(ValueError, match="schedule must be one of"):
        ps.SplitPipeline(chunks[:2], devs[:2], 4, 0.1, "zb_w")
    with pytest.raises(ValueError, match="7 layers do not cut into 2 devices x 2 chunks.*e.g. 8"):
        ps.make_chunks(layer, 7, devs[:2], 2)
    with tf.device(devs[0]):
        dropout = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16), keras.layers.Dropout(0.5, seed=1)])
    with tf.device(devs[1]):
        head = keras.Sequential([keras.Input((16,)), keras.layers.Dense(10)])
    with pytest.raises(ValueError, match="recompute=True would run its forward twice"):
        ps.SplitPipeline([dropout, head], devs[:2], 4, 0.1, "1f1b", recompute=True)


def test_recomputation_refuses_a_forward_that_draws_from_tf_random_without_a_variable(devs):
    # Issue 51: no state to see, yet the rerun draws another mask and the gradient is not the forward's.
    with tf.device(devs[0]):
        noisy = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16),
                                  keras.layers.Lambda(lambda h: h * tf.cast(tf.random.uniform(tf.shape(h)) > 0.5,
                                                                            h.dtype))])  # fmt: skip
    with tf.device(devs[1]):
        head = keras.Sequential([keras.Input((16,)), keras.layers.Dense(10)])
    pipe = ps.SplitPipeline([noisy, head], devs[:2], 4, 0.1, "1f1b", recompute=True)
    with pytest.raises(ValueError, match=r"chunk 0 draws random numbers in its forward \(RandomUniform\)"):
        pipe.train_step(*batch())
    ps.SplitPipeline([noisy, head], devs[:2], 4, 0.1, "1f1b").train_step(*batch())  # without recomputation: fine


def test_a_wave_of_two_zb_h1_steps_in_one_call_equals_two_steps_on_one_device(devs):
    pipe, single = ps.SplitPipeline(ps.make_chunks(layer, 8, devs[:2]), devs[:2], 4, 0.1, "zb_h1"), whole_model()
    batches = [batch(seed=s) for s in range(2)]
    losses = pipe.train_steps([x for x, _ in batches], [y for _, y in batches])
    np.testing.assert_allclose(losses, [float(reference.sgd_step(single, x, y, 0.1)) for x, y in batches], atol=1e-6)
    for a, b in zip(pipe.variables, single.trainable_variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)
