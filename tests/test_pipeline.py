import contextlib
import itertools
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import data, devices, models, pipeline, reference, timeline


@pytest.fixture(scope="module")
def batch():
    (x, y), _ = data.load_digits()
    return tf.constant(x[:64]), tf.constant(y[:64])


def mlp_stages(devices=None, seed=1):
    """A 3-stage MLP on the digits: cheap enough to run every schedule at every M."""
    sizes = [(64, 32, True), (32, 32, True), (32, 10, False)]
    stages = []
    for s, (n_in, n_out, relu) in enumerate(sizes):
        with tf.device(devices[s]) if devices else contextlib.nullcontext():
            layers = [models.Flatten()] if s == 0 else []
            stages.append(models.Sequential([*layers, models.Dense(n_in, n_out, relu=relu, seed=seed + s)]))
    return stages


def assert_same_step(pipe, single, x, y, lr):
    """The pipelined step and the single-device step: same loss, same weights after, within 1e-5."""
    loss = pipe.train_step(x, y)
    ref = reference.sgd_step(single, x, y, lr)
    np.testing.assert_allclose(float(loss), float(ref), atol=1e-5)
    for v, w in zip(pipe.variables, single.trainable_variables, strict=True):
        np.testing.assert_allclose(v.numpy(), w.numpy(), atol=1e-5)


# --- the schedules -------------------------------------------------------------------------


def test_bubble_fraction():
    assert pipeline.bubble_fraction(1, 8) == 0
    assert pipeline.bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert pipeline.bubble_fraction(np.int64(4), np.int64(4)) == pytest.approx(3 / 7)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="stages must be a whole number"):
            pipeline.bubble_fraction(bad, 4)
        with pytest.raises(ValueError, match="micro_batches must be a whole number"):
            pipeline.schedule(2, bad)


def test_simulate_gives_the_formula_for_equal_stages_and_more_for_gpipe_with_unequal_phases():
    for S, M in ((2, 1), (2, 8), (3, 4), (4, 6)):
        for kind in ("gpipe", "1f1b"):
            idle = pipeline.simulated_idle(pipeline.schedule(S, M, kind), 1.0, 2.0)
            assert idle == pytest.approx([pipeline.bubble_fraction(S, M)] * S)
    # notebook 05's MLP: stage 0 does 3.5 forward and 5.5 backward products, stage 1 does 3 and 6
    for M, gpipe in ((2, 0.345), (4, 0.226), (8, 0.148)):
        assert np.mean(
            pipeline.simulated_idle(pipeline.schedule(2, M, "gpipe"), [3.5, 3.0], [5.5, 6.0])
        ) == pytest.approx(gpipe, abs=1e-3)
        one_f_one_b = pipeline.simulated_idle(pipeline.schedule(2, M, "1f1b"), [3.5, 3.0], [5.5, 6.0])
        assert np.mean(one_f_one_b) == pytest.approx(pipeline.bubble_fraction(2, M))
    with pytest.raises(ValueError, match="one forward and one backward time per stage"):
        pipeline.simulated_idle(pipeline.schedule(2, 2), [1.0], 2.0)


def test_two_stage_orders():
    F, B = "F", "B"
    assert pipeline.schedule(2, 3, "gpipe") == [[(F, 0), (F, 1), (F, 2), (B, 0), (B, 1), (B, 2)]] * 2
    assert pipeline.schedule(2, 3, "1f1b") == [
        [(F, 0), (F, 1), (B, 0), (F, 2), (B, 1), (B, 2)],  # one warm-up forward on stage 0
        [(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2)],
    ]
    assert pipeline.schedule(2, 2, "sequential")[0] == [(F, 0), (B, 0), (F, 1), (B, 1)]


@pytest.mark.parametrize("kind", pipeline.SCHEDULES)
@pytest.mark.parametrize("stages, micro_batches", [(1, 3), (2, 1), (2, 8), (3, 2), (4, 8), (8, 3)])
def test_each_stage_runs_each_forward_then_its_backward_once(kind, stages, micro_batches):
    orders = pipeline.schedule(stages, micro_batches, kind)
    assert len(orders) == stages
    for order in orders:
        assert sorted(order) == sorted([(op, m) for m in range(micro_batches) for op in "FB"])
        assert all(order.index(("F", m)) < order.index(("B", m)) for m in range(micro_batches))
    assert len(pipeline.unroll(orders)) == 2 * stages * micro_batches  # and nothing waits forever


@pytest.mark.parametrize("stages, micro_batches", [(2, 1), (2, 8), (3, 2), (4, 4), (4, 16), (8, 3)])
def test_stash_bound_of_each_schedule(stages, micro_batches):
    def bound(kind):
        return pipeline.stash_bound(pipeline.schedule(stages, micro_batches, kind))

    assert bound("sequential") == [1] * stages
    assert bound("gpipe") == [micro_batches] * stages
    assert bound("1f1b") == [min(stages - s, micro_batches) for s in range(stages)]  # PipeDream-Flush


def test_schedule_rejects_unknown_kind():
    with pytest.raises(ValueError, match="schedule must be one of"):
        pipeline.schedule(2, 2, "zigzag")


def test_orders_that_wait_on_each_other_are_refused():
    backward_first = [[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]]
    with pytest.raises(ValueError, match="wait on each other forever"):
        pipeline.unroll(backward_first)


# --- the one-graph step equals the single-device step ---------------------------------------


@pytest.mark.parametrize("kind", pipeline.SCHEDULES)
@pytest.mark.parametrize("micro_batches", [1, 2, 4, 8])
def test_every_schedule_and_m_equals_the_single_device_step(devs, batch, kind, micro_batches):
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], micro_batches, learning_rate=0.5, schedule=kind)
    single = models.Sequential(mlp_stages())
    for _ in range(2):  # two steps: the second starts from the first one's update
        assert_same_step(pipe, single, x, y, 0.5)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_the_seed_cnn_with_and_without_recomputation(devs, batch, kind):
    x, y = batch
    for recompute in (False, True):
        stages = models.cnn_stages(devices=devs[:3], seed=5)
        pipe = pipeline.Pipeline(stages, devs[:3], 4, learning_rate=0.1, schedule=kind, recompute=recompute)
        assert_same_step(pipe, models.Sequential(models.cnn_stages(seed=5)), x, y, 0.1)


def test_gradients_equal_the_reference_without_an_update(devs, batch):
    x, y = batch
    stages = mlp_stages(devs[:3])
    pipe = pipeline.Pipeline(stages, devs[:3], 4, learning_rate=0.5, schedule="1f1b")
    before = [v.numpy() for v in pipe.variables]
    loss, grads = pipe.gradients(x, y)
    ref_loss, ref_grads = reference.loss_and_gradients(models.Sequential(stages), x, y)
    np.testing.assert_allclose(loss, ref_loss, atol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-6)
    for v, b in zip(pipe.variables, before, strict=True):
        np.testing.assert_array_equal(v.numpy(), b)


def test_each_op_runs_on_its_stage_device(devs, batch):
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 2, learning_rate=0.0, schedule="1f1b")
    graph = pipe._train.get_concrete_function(x, y).graph
    for op in graph.get_operations():
        if op.name.startswith("stage") and op.type in ("MatMul", "AddN"):
            s = int(op.name[len("stage")])
            assert op.device.endswith(devs[s].split("/")[-1]), (op.name, op.device)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_each_forward_output_is_copied_to_the_next_stage_before_the_stage_goes_on(devs, batch, kind):
    """The copy on the next device is part of the forward, and the stage's next op waits for it:
    otherwise TensorFlow's executor may send the output only when the stage runs out of work."""
    x, y = batch
    S, M = 3, 4
    pipe = pipeline.Pipeline(mlp_stages(devs[:S]), devs[:S], M, learning_rate=0.0, schedule=kind)
    graph = pipe._train.get_concrete_function(x, y).graph
    ops = {op.name: op for op in graph.get_operations()}
    for s in range(S - 1):
        order = pipe.orders[s]
        for (op, m), (next_op, next_m) in itertools.pairwise(order):
            if op != "F":
                continue
            copy = next(
                o
                for o in graph.get_operations()
                if o.name.startswith(f"stage{s}/F{m}/") and o.type == "Identity" and o.device == devs[s + 1]
            )
            prefix = "" if next_op == "F" else "gradient_tape/"  # a backward's ops carry the tape's names
            scope = f"{prefix}stage{s}/F{next_m}/"
            waiting = [o for name, o in ops.items() if name.startswith(scope) and copy in o.control_inputs]
            assert waiting, f"stage {s}: ({next_op}, {next_m}) does not wait for forward {m}'s copy"
            assert any(copy is t.op for t in ops[f"stage{s + 1}/F{m}/Identity"].inputs)  # and stage s+1 reads it


def live_matmuls(graph, device, any_device=False):
    """The graph's matrix products on `device` that an output or an update needs: TensorFlow
    prunes the others when it runs the function (the tape builds both gradients of a product)."""
    needed = [t.op for t in graph.outputs] + [op for op in graph.get_operations() if op.op_def.is_stateful]
    live = set()
    while needed:
        op = needed.pop()
        if op not in live:
            live.add(op)
            needed += [t.op for t in op.inputs] + list(op.control_inputs)
    return [op for op in live if op.type == "MatMul" and (any_device or pipeline.normalize(op.device) == device)]


def multiply_adds(op) -> int:
    a, b = (t.shape for t in op.inputs)
    rows, inner = (a[1], a[0]) if op.get_attr("transpose_a") else (a[0], a[1])
    return rows * inner * (b[0] if op.get_attr("transpose_b") else b[1])


def test_the_first_stage_computes_no_gradient_of_the_batch(devs, batch):
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 4, learning_rate=0.0, schedule="1f1b")
    graph = pipe._train.get_concrete_function(x, y).graph
    # per micro-batch: stage 0 runs its forward and its weight gradient, but no input gradient
    assert len(live_matmuls(graph, devs[0])) == 2 * 4
    assert len(live_matmuls(graph, devs[1])) == 3 * 4


def test_bench_stages_do_equal_work(devs):
    from tutorial_lib import bench_pipeline

    width, batch = 16, 32
    stages = bench_pipeline.balanced_stages(devs[:2], width)
    x, y = bench_pipeline.dense_batch(batch, bench_pipeline.input_width(width))
    pipe = pipeline.Pipeline(stages, devs[:2], 4, learning_rate=0.0, schedule="gpipe")
    graph = pipe._train.get_concrete_function(x, y).graph
    first, second = (sum(map(multiply_adds, live_matmuls(graph, d))) for d in devs[:2])
    logits = 3 * batch * width * 10  # the second stage's small extra layer: forward, weight and input gradients
    assert first == second - logits == 9 * batch * width * width


@pytest.mark.parametrize("kind", pipeline.SCHEDULES)
def test_stash_read_from_a_traced_run_keeps_the_bound(devs, batch, kind):
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 4, learning_rate=0.0, schedule=kind)
    events = timeline.trace(pipe.train_step, x, y, placement_of=lambda: [pipe._train.get_concrete_function(x, y)])
    assert {e.device for e in events} >= set(devs[:3])
    measured = pipeline.stash_from_trace(events, 3)
    assert measured == pipeline.stash_bound(pipe.orders)  # the control dependencies held


# --- faults ---------------------------------------------------------------------------------


class Guard(tf.Module):
    """A stage that fails at run time on inputs above a limit: a step that breaks half-way."""

    trainable_variables = ()

    def __call__(self, h):
        with tf.control_dependencies([tf.debugging.assert_less(tf.reduce_max(h), 10.0, message="too large")]):
            return tf.identity(h)


def guarded_stages(devices):
    """mlp_stages with a Guard in front of stage 1: a step fails there on a scaled-up batch."""
    stages = mlp_stages(devices)
    return [stages[0], models.Sequential([Guard(), stages[1]]), stages[2]]


def test_a_failed_step_leaves_no_partial_update_and_the_next_step_is_right(devs, batch):
    x, y = batch
    guarded = guarded_stages(devs[:3])
    pipe = pipeline.Pipeline(guarded, devs[:3], 4, learning_rate=0.5, schedule="1f1b")
    single = models.Sequential(mlp_stages())
    before = [v.numpy() for v in pipe.variables]
    bad = tf.concat([x[:-16], 1e4 * x[-16:]], 0)  # only the last micro-batch fails, on stage 1
    with pytest.raises(tf.errors.InvalidArgumentError, match="too large"):
        pipe.train_step(bad, y)
    for v, b in zip(pipe.variables, before, strict=True):
        np.testing.assert_array_equal(v.numpy(), b)  # stage 0 did not update alone
    assert_same_step(pipe, single, x, y, 0.5)


# --- a wave: several steps in one call ------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_a_wave_equals_the_single_device_steps(devs, batch, kind):
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 4, learning_rate=0.5, schedule=kind)
    single = models.Sequential(mlp_stages())
    batches = batches_of(x, y, 16)
    losses = pipe.train_steps(*zip(*batches, strict=True))
    refs = [reference.sgd_step(single, xb, yb, 0.5) for xb, yb in batches]
    np.testing.assert_allclose(losses, refs, atol=1e-5)
    for v, w in zip(pipe.variables, single.trainable_variables, strict=True):
        np.testing.assert_allclose(v.numpy(), w.numpy(), atol=1e-5)
    assert int(pipe.step) == len(batches)


def test_a_wave_draws_the_dropout_masks_of_its_steps(devs, batch):
    x, y = batch
    waved = pipeline.Pipeline(dropout_stages(devs[:3]), devs[:3], 4, learning_rate=0.5, schedule="1f1b")
    stepped = pipeline.Pipeline(dropout_stages(devs[:3]), devs[:3], 4, learning_rate=0.5, schedule="1f1b")
    stepped.train_step(x, y)
    waved.train_step(x, y)  # the wave starts at step 1: its masks are those of steps 1 and 2
    losses = waved.train_steps([x, x], [y, y])
    np.testing.assert_allclose(losses, [stepped.train_step(x, y), stepped.train_step(x, y)], atol=1e-6)
    assert abs(float(losses[0]) - float(losses[1])) > 1e-4  # two different steps, not one step twice
    for a, b in zip(waved.variables, stepped.variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)


def test_each_step_of_a_wave_starts_after_the_step_before_is_applied(devs, batch):
    """No Python between the steps, but no stage starts a step on half-updated weights."""
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 2, learning_rate=0.5, schedule="1f1b")
    graph = pipe._wave.get_concrete_function((x, x), (y, y)).graph
    counters = [op for op in graph.get_operations() if op.type == "AssignAddVariableOp"]
    assert len(counters) == 2
    updates = [op for op in graph.get_operations() if op.type == "AssignSubVariableOp"]
    assert len(updates) == 2 * len(pipe.variables)
    # the second step's first op on each stage (its scopes are uniquified: stage{s}/F0_1)
    for s in range(3):
        first = graph.get_operation_by_name(f"stage{s}/F0_1/Identity")
        assert counters[0] in first.control_inputs, f"stage {s} starts step 2 before step 1 is applied"


def test_a_failed_wave_keeps_the_steps_before_it_whole(devs, batch):
    x, y = batch
    guarded = guarded_stages(devs[:3])
    pipe = pipeline.Pipeline(guarded, devs[:3], 4, learning_rate=0.5, schedule="1f1b")
    single = models.Sequential(mlp_stages())
    (x0, y0), (x1, y1), (x2, y2) = batches_of(x, y, 16)[:3]
    with pytest.raises(tf.errors.InvalidArgumentError, match="too large"):
        pipe.train_steps([x0, 1e4 * x1, x2], [y0, y1, y2])  # step 1 fails on stage 1
    reference.sgd_step(single, x0, y0, 0.5)
    assert int(pipe.step) == 1  # the counter says how many steps were applied
    for v, w in zip(pipe.variables, single.trainable_variables, strict=True):
        np.testing.assert_allclose(v.numpy(), w.numpy(), atol=1e-6)  # step 0 in every stage, nothing of step 1


def test_a_wave_refuses_mismatched_or_empty_batches(devs, batch):
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 4, learning_rate=0.5)
    with pytest.raises(ValueError, match="2 input batches and 1 label batches"):
        pipe.train_steps([x, x], [y])
    with pytest.raises(ValueError, match="at least one"):
        pipe.train_steps([], [])
    with pytest.raises(TypeError, match="a list of input batches and a list of label batches, not one tensor"):
        pipe.train_steps(x, y)  # one batch, not a list of them: its rows would be taken as batches
    with pytest.raises(ValueError, match="does not split into 4 equal micro-batches"):
        pipe.train_steps([x, x[:10]], [y, y[:10]])


def test_a_sum_reduced_or_unreduced_loss_is_refused(devs, batch):
    x, y = batch

    def summed(logits, labels):
        return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))

    def unreduced(logits, labels):
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)

    for loss_fn, message in ((summed, "sums over the examples"), (unreduced, "must return a scalar")):
        pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 4, learning_rate=0.1, loss_fn=loss_fn)
        with pytest.raises(ValueError, match=message):
            pipe.train_step(x, y)


def test_a_custom_mean_loss_with_one_hot_labels_works(devs, batch):
    x, y = batch

    def one_hot_loss(logits, labels):
        return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=labels, logits=logits))

    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 4, learning_rate=0.5, loss_fn=one_hot_loss)
    single = models.Sequential(mlp_stages())
    loss = pipe.train_step(x, tf.one_hot(y, 10))
    np.testing.assert_allclose(loss, reference.sgd_step(single, x, y, 0.5), atol=1e-5)


def test_labels_and_dtypes_that_do_not_fit_get_clear_errors(devs, batch):
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 4, learning_rate=0.1)
    with pytest.raises(ValueError, match=r"extra axis: pass tf.squeeze\(y, axis=-1\)"):
        pipe.train_step(x, y[:, None])
    with pytest.raises(ValueError, match="look one-hot"):
        pipe.train_step(x, tf.one_hot(y, 10))
    for dtype in (tf.float16, tf.float64):
        with pytest.raises(ValueError, match=rf"stage 0 cannot take the micro-batch .*{dtype.name}.*tf.cast"):
            pipe.train_step(tf.cast(x, dtype), y)


def test_float16_and_float64_activations_between_stages(devs, batch):
    x, y = batch

    class Cast(tf.Module):
        trainable_variables = ()

        def __init__(self, dtype):
            super().__init__()
            self.dtype = dtype

        def __call__(self, h):
            return tf.cast(h, self.dtype)

    stages = mlp_stages(devs[:3])
    mixed = [
        models.Sequential([stages[0], Cast(tf.float64)]),  # stage 0 sends float64
        models.Sequential([Cast(tf.float32), stages[1], Cast(tf.float16)]),  # stage 1 sends float16
        models.Sequential([Cast(tf.float32), stages[2]]),
    ]
    pipe = pipeline.Pipeline(mixed, devs[:3], 4, learning_rate=0.5, schedule="1f1b")
    loss, _ = pipe.gradients(x, y)
    ref_loss, _ = reference.loss_and_gradients(models.Sequential(mixed), x, y)
    np.testing.assert_allclose(loss, ref_loss, atol=1e-5)


def test_train_step_inside_a_users_tf_function(devs, batch):
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 4, learning_rate=0.5, schedule="1f1b")
    single = models.Sequential(mlp_stages())

    @tf.function
    def two_steps(x, y):
        return pipe.train_step(x, y), pipe.train_step(x, y)

    losses = two_steps(x, y)
    refs = [reference.sgd_step(single, x, y, 0.5) for _ in range(2)]
    np.testing.assert_allclose(losses, refs, atol=1e-5)


def test_bad_input(devs, batch):
    x, y = batch
    stages = mlp_stages(devs[:3])
    with pytest.raises(ValueError, match="one device per stage, got 3 stages and 2 devices"):
        pipeline.Pipeline(stages, devs[:2], micro_batches=2, learning_rate=0.1)
    with pytest.raises(ValueError, match="micro_batches must be a whole number"):
        pipeline.Pipeline(stages, devs[:3], micro_batches=0, learning_rate=0.1)
    with pytest.raises(ValueError, match="schedule must be one of"):
        pipeline.Pipeline(stages, devs[:3], micro_batches=2, learning_rate=0.1, schedule="pipedream")
    with pytest.raises(ValueError, match="does not split into 5 equal micro-batches"):
        pipeline.Pipeline(stages, devs[:3], micro_batches=5, learning_rate=0.1).train_step(x, y)
    mismatched = [stages[0], models.Sequential([models.Dense(10, 10)]), stages[2]]
    with pytest.raises(ValueError, match="stage 1 cannot take the output of stage 0"):
        pipeline.Pipeline(mismatched, devs[:3], micro_batches=2, learning_rate=0.1).train_step(x, y)


# --- StagingArea: the next step's batch staged while this one runs --------------------------


def batches_of(x, y, size):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


def test_staged_input_trains_like_the_single_device_steps(devs, batch):
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 4, learning_rate=0.5, schedule="1f1b")
    staged = pipeline.StagedInput(pipe)
    single = models.Sequential(mlp_stages())
    batches = batches_of(x, y, 16)
    losses = staged.run(batches)
    refs = [reference.sgd_step(single, xb, yb, 0.5) for xb, yb in batches]
    np.testing.assert_allclose(losses, refs, atol=1e-5)
    assert staged.size() == 0  # drained
    assert staged.run([]) == []


def test_a_failed_staged_step_leaves_the_area_empty_and_the_next_run_works(devs, batch):
    x, y = batch
    guarded = guarded_stages(devs[:3])
    pipe = pipeline.Pipeline(guarded, devs[:3], 4, learning_rate=0.5)
    staged = pipeline.StagedInput(pipe)
    single = models.Sequential(mlp_stages())
    batches = batches_of(x, y, 16)
    with pytest.raises(tf.errors.InvalidArgumentError, match="too large"):
        staged.run([batches[0], (1e4 * batches[1][0], batches[1][1]), batches[2]])  # fails at step 1
    assert staged.size() == 0  # the batch staged for step 2 is gone: no stale get next time
    refs = [reference.sgd_step(single, xb, yb, 0.5) for xb, yb in batches[:1]]  # step 0 ran
    losses = staged.run(batches)
    refs += [reference.sgd_step(single, xb, yb, 0.5) for xb, yb in batches]
    np.testing.assert_allclose(losses, refs[1:], atol=1e-5)


def test_staged_input_refuses_a_tf_function_and_other_shapes(devs, batch):
    x, y = batch
    staged = pipeline.StagedInput(pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 4, learning_rate=0.0))
    with pytest.raises(RuntimeError, match="cannot be traced into a tf.function"):
        tf.function(lambda: staged.run([(x, y)]))()
    with pytest.raises(ValueError, match="every batch must have the shapes"):
        staged.run([(x[:16], y[:16]), (x[:32], y[:32])])
    assert staged.size() == 0


def test_bench_rows_compare_with_the_naive_split(devs):
    from tutorial_lib import bench, bench_pipeline

    rows = bench.pipeline_vs_naive(devs[:2], width=16, batch=32, micro_batches=4, repeats=1, rounds=1, steps=2)
    lines = bench.summary(rows)
    schedules = ["gpipe, M=4", "1f1b, M=4"]
    assert [line.split(":")[0] for line in lines] == [
        f"pipeline {v}"
        for v in [
            *[schedules[0]] * 2,
            *[schedules[1]] * 2,
            "data parallel, ring",
            *schedules,
            "stages together, M=4",
        ]
    ]
    assert "bubble" in lines[1] and "schedule" in lines[1] and "inside ops" in lines[1] and "rest" in lines[1]
    assert any(word in lines[-1] for word in ("(faster;", "(slower;", "(no significant difference;"))  # a verdict
    memory = {r["variant"]: r for r in rows if r["case"] == "pipeline memory"}
    rows = [r for r in rows if r["case"] != "pipeline memory"]
    by_name = {r["variant"]: r for r in rows}
    assert list(by_name)[:3] == ["naive split", "gpipe, M=4", "1f1b, M=4"]
    assert {"gpipe, M=1", "gpipe, M=2", "gpipe, M=4, recompute", "gpipe, M=4, 2 steps, StagedInput"} <= set(by_name)
    assert {"data parallel, ring", "stage 0 alone, M=1", "stage 1 alone, M=4", "stages together, M=4"} <= set(by_name)
    assert all(r["case"] == "pipeline" and r["ms"] > 0 for r in rows)
    assert by_name["naive split"]["speedup_vs_naive"] == 1
    assert all(by_name[v]["controller_cores"] >= 0 for v in ("naive split", "1f1b, M=4", "data parallel, ring"))
    assert by_name["gpipe, M=2"]["bubble_theory"] == pytest.approx(1 / 3)
    for r in rows[1:]:
        if "micro_batches" in r:
            assert r["bubble_from_times"] == pytest.approx(1 - r["speedup_vs_naive"] / 2)  # busy share = speedup / S
    for name in ("gpipe, M=1", "gpipe, M=2", "1f1b, M=2", "gpipe, M=4", "1f1b, M=4"):
        idle = by_name[name]["idle_per_stage"]  # read from traced steps
        assert len(idle) == 2 and all(0 < share < 1 for share in idle)
        assert by_name[name]["bubble_measured"] == min(idle) and by_name[name]["start_skew_ms"] >= 0
        parts = by_name[name]["bubble_parts"]  # measured parts of the pacing stage's idle share
        assert sum(parts.values()) == pytest.approx(min(idle))
        assert all(t > 0 for op in "FB" for t in by_name[name]["op_ms"][op])
        assert all(0 <= share < 1 for share in by_name[name]["idle_in_schedule"] + by_name[name]["idle_inside_ops"])
        assert by_name[name]["busy_ms"] == pytest.approx(by_name[name]["traced_ms"] * (1 - min(idle)))
        assert by_name[name]["between_steps_ms"] >= 0
    assert "bubble_measured" not in by_name["gpipe, M=4, recompute"]
    pipe = pipeline.Pipeline(bench_pipeline.balanced_stages(devs[:2], 16), devs[:2], 2, learning_rate=0.0)
    with pytest.raises(ValueError, match="steps must be a whole number >= 1, got 0"):
        bench_pipeline.idle_shares(pipe, tf.zeros([4, 24]), tf.zeros([4], tf.int32), steps=0)
    gap = bench.gap_parts(rows, "1f1b, M=4")
    assert gap["gap_ms"] == pytest.approx(gap["measured_ms"] - by_name["naive split"]["ms"] * 5 / 8)
    parts = [v for k, v in gap.items() if k not in ("measured_ms", "ideal_ms", "gap_ms")]
    assert len(parts) == 7 and sum(parts) == pytest.approx(gap["gap_ms"])
    assert list(memory) == ["sequential, M=4", "gpipe, M=4", "1f1b, M=4", "gpipe, M=4, recompute"]
    for r in memory.values():
        assert r["stash_measured"] == r["stash_bound"]  # read from the traced run
        assert r["peak_kept_bytes"] == [
            n * b for n, b in zip(r["stash_measured"], r["kept_bytes_per_micro_batch"], strict=True)
        ]
    assert memory["1f1b, M=4"]["stash_measured"] == [2, 1] and memory["gpipe, M=4"]["stash_measured"] == [4, 4]
    # one micro-batch of 8 rows: stage 0 keeps its input (24 wide) and three outputs (16 wide), in float32
    assert memory["gpipe, M=4"]["kept_bytes_per_micro_batch"][0] == 8 * (24 + 3 * 16) * 4
    assert memory["gpipe, M=4, recompute"]["kept_bytes_per_micro_batch"][0] == 8 * 24 * 4  # the input only


def test_gap_parts_from_known_times():
    from tutorial_lib import bench, bench_pipeline

    def r(variant, ms, **info):
        return {"variant": variant, "ms": ms, "devices": 2, **info}

    parts = {"schedule": 0.25, "inside ops": 0.05, "rest": 0.1}  # the pacing stage idles 40 % of the step
    rows = [
        r("naive split", 200.0),
        r("1f1b, M=4", 150.0, micro_batches=4, bubble_measured=0.4, bubble_parts=parts),
        r("1f1b, M=4, recompute", 170.0, micro_batches=4),
        r("stage 0 alone, M=1", 90.0, part="stage alone", stage=0, m=1),
        r("stage 1 alone, M=1", 90.0, part="stage alone", stage=1, m=1),
        r("stage 0 alone, M=4", 94.0, part="stage alone", stage=0, m=4),
        r("stage 1 alone, M=4", 98.0, part="stage alone", stage=1, m=4),
        r("stages together, M=4", 106.0, part="stages together", m=4),
    ]
    assert bench_pipeline.sharing_slowdown(rows, 4) == pytest.approx(106 / 98 - 1)
    assert [r["variant"] for r in bench_pipeline.sharing_rows(rows, 4)] == [
        "stages together, M=4",
        "stage 1 alone, M=4",
    ]
    with pytest.raises(ValueError, match="not timed alone and together at M = 2"):
        bench_pipeline.sharing_slowdown(rows, 2)
    with pytest.raises(ValueError, match="timed alone at M = \\[1, 4\\], not at 2"):
        bench.gap_parts([*rows, r("gpipe, M=2", 160.0, micro_batches=2)], "gpipe, M=2")
    with pytest.raises(ValueError, match="has no traced steps"):
        bench.gap_parts(rows, "1f1b, M=4, recompute")
    idle = r("gpipe, M=4", 150.0, micro_batches=4, bubble_measured=1.0, bubble_parts=parts)
    with pytest.raises(ValueError, match="no busy time to split"):
        bench.gap_parts([*rows, idle], "gpipe, M=4")
    gap = bench.gap_parts(rows, "1f1b, M=4")
    fill = 5 / 4  # 1 / (1 - the formula's 0.2)
    busy = 150 * 0.6  # the pacing stage's busy share of the timed step
    assert gap["ideal_ms"] == pytest.approx(200 * fill / 2)
    assert list(gap.values())[3:] == pytest.approx(
        [
            (180 - 200) * fill / 2,  # the naive split's 20 ms of transfers and call
            (192 - 180) * fill / 2,  # micro-batching
            98 * fill - 192 * fill / 2,  # the slower stage sets the pace
            (busy - 98) * fill,  # both at once: here the pacing stage ran faster than alone
            busy / 0.75 - busy * fill,  # the schedule's 25 % idle, not the formula's 20 %
            busy / 0.7 - busy / 0.75,  # gaps inside ops
            150 - busy / 0.7,  # the rest of the idle share: the model is now the timed step
        ]
    )
    assert sum(list(gap.values())[3:]) == pytest.approx(gap["gap_ms"])


def test_each_stage_alone_does_the_products_it_does_in_the_pipeline(devs):
    from tutorial_lib import bench_pipeline

    width, batch, M = 16, 32, 4
    stages = bench_pipeline.balanced_stages(devs[:2], width)
    x, y = bench_pipeline.dense_batch(batch, bench_pipeline.input_width(width))
    pipe = pipeline.Pipeline(stages, devs[:2], M, learning_rate=0.0, schedule="1f1b")
    in_pipeline = pipe._train.get_concrete_function(x, y).graph
    inputs = bench_pipeline._stage_inputs(stages, devs[:2], x, y)
    for s in range(2):
        work = bench_pipeline._stage_work(stages, s, M)

        def alone(work=work, s=s):
            with tf.device(devs[s]):
                return work(*inputs[s])[0]

        graph = tf.function(alone).get_concrete_function().graph
        assert sum(map(multiply_adds, live_matmuls(graph, devs[s]))) == sum(
            map(multiply_adds, live_matmuls(in_pipeline, devs[s]))
        )


def test_data_parallel_step_equals_the_single_device_step(devs):
    from tutorial_lib import bench_pipeline

    x, y = bench_pipeline.dense_batch(32, bench_pipeline.input_width(16))
    replicas = []
    for d in devs[:2]:
        with tf.device(d):
            replicas.append(models.Sequential(bench_pipeline.balanced_stages([d, d], 16)))
    single = models.Sequential(bench_pipeline.balanced_stages([devs[0], devs[0]], 16))
    step = bench_pipeline.data_parallel_step(replicas, devs[:2], 0.5)
    graph = step.get_concrete_function(tf.split(x, 2), tf.split(y, 2)).graph
    placed = [pipeline.normalize(op.device) if op.device else None for op in live_matmuls(graph, None, any_device=True)]
    assert sorted(placed) == sorted(devs[:2] * (len(placed) // 2))  # forward and backward, half on each device
    for _ in range(2):
        loss = step(tf.split(x, 2), tf.split(y, 2))
        np.testing.assert_allclose(loss, reference.sgd_step(single, x, y, 0.5), atol=1e-5)
        for net in replicas:
            for v, w in zip(net.trainable_variables, single.trainable_variables, strict=True):
                np.testing.assert_allclose(v.numpy(), w.numpy(), atol=1e-5)


# --- dropout: the same mask in the forward and in any recomputation --------------------------


def dropout_stages(devices=None):
    stages = mlp_stages(devices)
    with tf.device(devices[1]) if devices else contextlib.nullcontext():
        stages[1] = models.Sequential([pipeline.Dropout(0.5, seed=3), stages[1], pipeline.Dropout(0.25, seed=4)])
    return stages


def micro_batch_reference(model, x, y, micro_batches, step, lr):
    """SGD on one device over the same micro-batches, each drawing the pipeline's dropout masks."""
    losses, total = [], None
    for m, (xm, ym) in enumerate(zip(tf.split(x, micro_batches), tf.split(y, micro_batches), strict=True)):
        with pipeline.micro_batch(tf.constant(step, tf.int64), m), tf.GradientTape() as tape:
            loss = models.cross_entropy(model(xm), ym) / micro_batches
        grads = tape.gradient(loss, model.trainable_variables)
        total = grads if total is None else [t + g for t, g in zip(total, grads, strict=True)]
        losses.append(loss)
    reference.apply_sgd(model.trainable_variables, total, lr)
    return float(tf.add_n(losses))


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_dropout_draws_the_same_mask_when_recomputed_and_on_one_device(devs, batch, kind):
    x, y = batch
    kept = pipeline.Pipeline(dropout_stages(devs[:3]), devs[:3], 4, learning_rate=0.5, schedule=kind)
    redone = pipeline.Pipeline(dropout_stages(devs[:3]), devs[:3], 4, 0.5, schedule=kind, recompute=True)
    single = models.Sequential(dropout_stages())
    plain = models.Sequential(mlp_stages())  # no dropout: the masks must change the result
    for step in range(2):
        losses = [float(kept.train_step(x, y)), float(redone.train_step(x, y))]
        ref = micro_batch_reference(single, x, y, 4, step, 0.5)
        np.testing.assert_allclose(losses, [ref, ref], atol=1e-5)
        assert abs(ref - float(reference.sgd_step(plain, x, y, 0.5))) > 1e-3
    for a, b, c in zip(kept.variables, redone.variables, single.trainable_variables, strict=True):
        np.testing.assert_allclose(a.numpy(), c.numpy(), atol=1e-5)
        np.testing.assert_allclose(b.numpy(), c.numpy(), atol=1e-5)
    assert int(kept.step) == 2


def keras_stages(devices=None, dropout=0.0):
    """The seed's kind of stages: Keras models, weights seeded, the first on devices[0]."""
    import keras

    stages = []
    for s, (n_in, n_out) in enumerate(((64, 32), (32, 10))):
        with tf.device(devices[s]) if devices else contextlib.nullcontext():
            layers = [
                keras.Input((n_in,)),
                keras.layers.Dense(n_out, kernel_initializer=keras.initializers.GlorotUniform(s)),
            ]
            if s == 0 and dropout:
                layers.append(keras.layers.Dropout(dropout, seed=3))
            stages.append(keras.Sequential(layers))
    return stages


def test_keras_stages_train_like_the_single_device_step(devs, batch):
    x, y = batch
    x = tf.reshape(x, [x.shape[0], -1])
    pipe = pipeline.Pipeline(keras_stages(devs[:2]), devs[:2], 4, learning_rate=0.5, schedule="1f1b")
    single = keras_stages()
    variables = [v for stage in single for v in stage.trainable_variables]
    for _ in range(2):
        with tf.GradientTape() as tape:
            ref = models.cross_entropy(single[1](single[0](x)), y)
        for v, g in zip(variables, tape.gradient(ref, variables), strict=True):
            v.assign_sub(0.5 * g)
        np.testing.assert_allclose(pipe.train_step(x, y), ref, atol=1e-5)
    for v, w in zip(pipe.variables, variables, strict=True):
        np.testing.assert_allclose(v.numpy(), w.numpy(), atol=1e-5)


def test_a_keras_dropout_drops_in_the_pipeline_and_is_refused_under_recompute(devs, batch):
    x, y = batch
    x = tf.reshape(x, [x.shape[0], -1])
    stages = keras_stages(devs[:2], dropout=0.5)
    loss, _ = pipeline.Pipeline(stages, devs[:2], 4, learning_rate=0.5).gradients(x, y)
    without = models.cross_entropy(stages[1](stages[0](x, training=False)), y)  # the same weights, no dropout
    assert abs(float(loss) - float(without)) > 1e-4  # the stage was told it trains: its Dropout dropped
    with pytest.raises(ValueError, match="Keras layer 'dropout.*' \\(Dropout\\), which draws new random numbers"):
        pipeline.Pipeline(stages, devs[:2], 4, learning_rate=0.5, recompute=True)


def test_dropout_is_off_outside_a_micro_batch_and_checks_its_rate():
    x = tf.ones([4, 8])
    np.testing.assert_array_equal(pipeline.Dropout(0.5)(x), x)
    with pipeline.micro_batch(tf.constant(0, tf.int64), 1):
        dropped = pipeline.Dropout(0.5)(x).numpy()
    assert set(np.unique(dropped)) <= {0.0, 2.0} and 0 < (dropped == 0).sum() < x.shape.num_elements()
    with pytest.raises(ValueError, match="dropout rate must lie in"):
        pipeline.Dropout(1.0)


# --- parameter updates with any Keras optimizer, one per stage ----------------------------


def optimizer_reference(single, batches, optimizer):
    """A Keras `optimizer` on the whole model on one device: the losses of one step per batch."""
    losses = []
    for x, y in batches:
        loss, grads = reference.loss_and_gradients(single, x, y)
        optimizer.apply_gradients(zip(grads, single.trainable_variables, strict=True))
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_adam_per_stage_equals_adam_on_one_device(devs, batch, kind):
    import keras

    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 4, schedule=kind, optimizer=keras.optimizers.Adam(1e-3))
    single = models.Sequential(mlp_stages())
    batches = batches_of(x, y, 16)[:4]
    losses = [float(pipe.train_step(*batches[0]))] + [
        float(v) for v in pipe.train_steps(*zip(*batches[1:], strict=True))
    ]
    np.testing.assert_allclose(losses, optimizer_reference(single, batches, keras.optimizers.Adam(1e-3)), atol=1e-5)
    for v, w in zip(pipe.variables, single.trainable_variables, strict=True):
        np.testing.assert_allclose(v.numpy(), w.numpy(), atol=1e-5)
    assert [int(o.iterations) for o in pipe.optimizers] == [4, 4, 4]  # one iteration per step, not one per stage


def test_each_stage_optimizer_lives_on_its_stage_device(devs, batch):
    import keras

    template = keras.optimizers.Adam(1e-3)
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 2, optimizer=template)
    pipe.gradients(*batch)  # the copies are built with the first batch
    for s, optimizer in enumerate(pipe.optimizers):
        assert optimizer is not template
        slots = [v for v in optimizer.variables if v.name not in ("iteration", "learning_rate")]
        assert len(slots) == 2 * len(pipe.stages[s].trainable_variables)  # Adam: two moments per weight
        for v in optimizer.variables:
            assert devices.normalize(v.value.device) == devs[s], (s, v.name, v.value.device)


@pytest.mark.parametrize("optimizer", [None, "adam"])
def test_every_update_waits_for_every_stage_s_last_backward(devs, batch, optimizer):
    """All or nothing, read from the graph: no stage can update before another's gradients exist."""
    import keras

    x, y = batch
    rule = {"optimizer": keras.optimizers.Adam(1e-3)} if optimizer else {"learning_rate": 0.1}
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 4, schedule="1f1b", **rule)
    pipe.gradients(x, y)
    graph = pipe._train.get_concrete_function(x, y).graph
    writes = [op for op in graph.get_operations() if op.name.startswith("update") and "Assign" in op.type]
    assert len(writes) >= len(pipe.variables)
    for write in writes:
        seen, todo = set(), [write]
        while todo:  # every op this write waits for, by data or by control
            op = todo.pop()
            for before in [t.op for t in op.inputs] + list(op.control_inputs):
                if before.name not in seen:
                    seen.add(before.name)
                    todo.append(before)
        for s in range(3):
            assert any(name.startswith(f"stage{s}/B3/") for name in seen), (write.name, s)


def test_adam_with_keras_stages_one_built_only_by_the_first_batch(devs, batch):
    import keras

    x, y = batch
    x = tf.reshape(x, [x.shape[0], -1])

    def stages(devices=None):
        first = keras_stages(devices)[0]
        with tf.device(devices[1]) if devices else contextlib.nullcontext():
            head = keras.Sequential([keras.layers.Dense(10, kernel_initializer=keras.initializers.GlorotUniform(7))])
        return [first, head]  # the head has no Input: Keras creates its weights at its first call

    pipe = pipeline.Pipeline(stages(devs[:2]), devs[:2], 4, schedule="1f1b", optimizer=keras.optimizers.Adam(1e-3))
    single = stages()
    single[1](single[0](x))  # build it
    variables = [v for stage in single for v in stage.trainable_variables]
    optimizer = keras.optimizers.Adam(1e-3)
    for _ in range(2):
        with tf.GradientTape() as tape:
            ref = models.cross_entropy(single[1](single[0](x)), y)
        optimizer.apply_gradients(zip(tape.gradient(ref, variables), variables, strict=True))
        np.testing.assert_allclose(pipe.train_step(x, y), ref, atol=1e-5)
    for v, w in zip(pipe.variables, variables, strict=True):
        np.testing.assert_allclose(v.numpy(), w.numpy(), atol=1e-5)


def test_adamw_keeps_its_weight_decay_exclusions_and_a_stage_may_have_no_weights(devs, batch):
    import keras

    x, y = batch
    template = keras.optimizers.AdamW(1e-3, weight_decay=0.5)
    template.exclude_from_weight_decay(var_names=["b"])  # the biases of models.Dense
    first, second, third = mlp_stages(devs[:3])
    pipe = pipeline.Pipeline([first, second, Guard(), third], [*devs[:3], devs[3]], 4, optimizer=template)
    single = models.Sequential(mlp_stages())
    reference_optimizer = keras.optimizers.AdamW(1e-3, weight_decay=0.5)
    reference_optimizer.exclude_from_weight_decay(var_names=["b"])
    losses = [float(pipe.train_step(x, y)) for _ in range(2)]
    np.testing.assert_allclose(losses, optimizer_reference(single, [(x, y)] * 2, reference_optimizer), atol=1e-5)
    for v, w in zip(pipe.variables, single.trainable_variables, strict=True):
        np.testing.assert_allclose(v.numpy(), w.numpy(), atol=1e-5)
    assert [int(o.iterations) for o in pipe.optimizers] == [2, 2, 0, 2]  # the Guard has nothing to update


def test_a_failed_step_leaves_the_optimizers_untouched(devs, batch):
    import keras

    x, y = batch
    pipe = pipeline.Pipeline(guarded_stages(devs[:3]), devs[:3], 4, optimizer=keras.optimizers.Adam(1e-3))
    with pytest.raises(tf.errors.InvalidArgumentError, match="too large"):
        pipe.train_step(tf.concat([x[:-16], 1e4 * x[-16:]], 0), y)
    for optimizer in pipe.optimizers:
        assert int(optimizer.iterations) == 0
        assert all(not np.any(v.numpy()) for v in optimizer.variables if v.name != "learning_rate")


@pytest.mark.filterwarnings("ignore:The object being serialized includes a `lambda`")
def test_the_update_rule_is_given_once_and_the_optimizer_is_one_the_stages_can_share_out(devs):
    import keras

    stages = mlp_stages(devs[:3])
    with pytest.raises(ValueError, match="either learning_rate .* or optimizer"):
        pipeline.Pipeline(stages, devs[:3], 2)
    with pytest.raises(ValueError, match="not both"):
        pipeline.Pipeline(stages, devs[:3], 2, learning_rate=0.1, optimizer=keras.optimizers.Adam(1e-3))
    with pytest.raises(TypeError, match="must be a Keras optimizer .* got float"):
        pipeline.Pipeline(stages, devs[:3], 2, optimizer=0.1)
    used = keras.optimizers.Adam(1e-3)
    used.build(stages[0].trainable_variables)
    with pytest.raises(ValueError, match="already built"):
        pipeline.Pipeline(stages, devs[:3], 2, optimizer=used)
    with pytest.raises(ValueError, match="each stage's copy sees only its own stage"):
        pipeline.stage_optimizers(keras.optimizers.Adam(1e-3, global_clipnorm=1.0), stages, devs[:3])
    with pytest.raises(ValueError, match="loss scaling is not supported"):
        pipeline.Pipeline(stages, devs[:3], 2, optimizer=keras.optimizers.Adam(1e-3, loss_scale_factor=128.0))
    with pytest.raises(ValueError, match="loss scaling is not supported"):
        pipeline.Pipeline(stages, devs[:3], 2, optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    accumulating = keras.optimizers.Adam(1e-3, global_clipnorm=1.0, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="global_clipnorm with gradient_accumulation_steps"):
        pipeline.Pipeline(stages, devs[:3], 2, optimizer=accumulating)
    with pytest.raises(TypeError, match="not a lambda"):
        pipeline.stage_optimizers(keras.optimizers.Adam(lambda: 1e-3), stages, devs[:3])


def test_global_clipnorm_clips_by_the_norm_over_every_stage(devs, batch):
    import keras

    x, y = batch
    clip = 0.05  # SGD, whose step scales with the gradient (Adam's hardly does)
    pipe = pipeline.Pipeline(
        mlp_stages(devs[:3]), devs[:3], 4, schedule="1f1b", optimizer=keras.optimizers.SGD(0.5, global_clipnorm=clip)
    )
    single = models.Sequential(mlp_stages())
    assert float(tf.linalg.global_norm(reference.loss_and_gradients(single, x, y)[1])) > 2 * clip  # the clip binds
    losses = [float(pipe.train_step(x, y)) for _ in range(2)]
    reference_losses = optimizer_reference(single, [(x, y)] * 2, keras.optimizers.SGD(0.5, global_clipnorm=clip))
    np.testing.assert_allclose(losses, reference_losses, atol=1e-5)
    for v, w in zip(pipe.variables, single.trainable_variables, strict=True):
        np.testing.assert_allclose(v.numpy(), w.numpy(), atol=1e-5)
    assert all(o.global_clipnorm is None for o in pipe.optimizers)  # the pipeline clipped, not each stage


def test_clip_by_global_norm_scales_every_stage_by_one_norm(devs):
    grads = [[tf.constant([3.0])], [tf.constant([4.0]), tf.constant([0.0])], []]
    clipped = pipeline.clip_by_global_norm(grads, 1.0, devs[:3])  # norm 5
    np.testing.assert_allclose([float(g[0]) for g in clipped[0] + clipped[1]], [0.6, 0.8, 0.0], atol=1e-6)
    unclipped = pipeline.clip_by_global_norm(grads, 10.0, devs[:3])
    np.testing.assert_allclose([float(g[0]) for g in unclipped[0] + unclipped[1]], [3.0, 4.0, 0.0], atol=1e-6)
    infinite = pipeline.clip_by_global_norm([[tf.constant([np.inf])], [tf.constant([1.0])]], 1.0, devs[:2])
    assert np.isnan(float(infinite[1][0][0]))  # as Keras: a step on a norm that is not finite is NaN, not silent
    assert pipeline.clip_by_global_norm([[], []], 1.0, devs[:2]) == [[], []]  # no stage has weights


def test_a_checkpoint_resumes_training_as_if_never_stopped(devs, batch, tmp_path):
    import keras

    x, y = batch
    batches = batches_of(x, y, 16)

    def new_pipeline():  # with dropout: its masks follow the step counter, which must be restored too
        return pipeline.Pipeline(
            dropout_stages(devs[:3]), devs[:3], 4, schedule="1f1b", optimizer=keras.optimizers.Adam(1e-2)
        )

    first = new_pipeline()
    first.train_steps(*zip(*batches[:2], strict=True))
    path = first.checkpoint().save(str(tmp_path / "ckpt"))
    later = [float(first.train_step(*b)) for b in batches[2:4]]

    resumed = new_pipeline()
    resumed.build(*batches[2])  # the optimizers exist from here
    for v in resumed.variables:
        v.assign(tf.zeros_like(v))  # nothing of the first run's weights is left but what is restored
    resumed.checkpoint().restore(path).assert_consumed()
    assert int(resumed.step) == 2 and [int(o.iterations) for o in resumed.optimizers] == [2, 2, 2]
    np.testing.assert_allclose([float(resumed.train_step(*b)) for b in batches[2:4]], later, atol=1e-6)
    for a, b in zip(resumed.variables, first.variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)


def lazy_keras_stages(devices=None):
    """keras_stages with a head that has no Input: Keras creates its weights at its first call."""
    import keras

    first = keras_stages(devices)[0]
    with tf.device(devices[1]) if devices else contextlib.nullcontext():
        head = keras.Sequential([keras.layers.Dense(10, kernel_initializer=keras.initializers.GlorotUniform(7))])
    return [first, head]


def test_a_checkpoint_before_the_optimizers_exist_is_refused_and_build_makes_them(devs, batch, tmp_path):
    import keras

    x, y = batch
    x = tf.reshape(x, [x.shape[0], -1])

    def new_pipeline():
        return pipeline.Pipeline(lazy_keras_stages(devs[:2]), devs[:2], 4, optimizer=keras.optimizers.Adam(1e-3))

    first = new_pipeline()
    with pytest.raises(RuntimeError, match="call pipeline.build"):
        first.checkpoint()
    first.train_step(x, y)
    path = first.checkpoint().save(str(tmp_path / "ckpt"))
    resumed = new_pipeline()
    resumed.build(x, y)
    assert int(resumed.step) == 0 and [int(o.iterations) for o in resumed.optimizers] == [0, 0]  # build changes nothing
    resumed.checkpoint().restore(path).assert_consumed()
    np.testing.assert_allclose(resumed.train_step(x, y), first.train_step(x, y), atol=1e-6)
    assert resumed.checkpoint() is resumed.checkpoint()  # one object: its saves count on (ckpt-1, ckpt-2, ...)


def test_two_threads_first_calls_build_one_set_of_optimizers(devs, batch, monkeypatch):
    import keras

    x, y = batch
    x = tf.reshape(x, [x.shape[0], -1])
    pipe = pipeline.Pipeline(lazy_keras_stages(devs[:2]), devs[:2], 4, optimizer=keras.optimizers.Adam(1e-3))
    built, build = [], pipeline.stage_optimizers

    def slow_build(*args):  # long enough for the second thread to arrive while the first builds
        time.sleep(0.3)
        built.append(build(*args))
        return built[-1]

    monkeypatch.setattr(pipeline, "stage_optimizers", slow_build)
    errors = []

    def first_call():
        try:
            pipe.build(x, y)
        except Exception as err:  # an error in a thread would otherwise pass unseen
            errors.append(err)

    threads = [threading.Thread(target=first_call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors
    assert len(built) == 1 and pipe.optimizers is built[0]


def test_batches_of_alternating_shapes_are_checked_once_each(devs, batch, monkeypatch):
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 4, learning_rate=0.1)
    dry_runs, dry_run = [], pipe._dry_run
    monkeypatch.setattr(pipe, "_dry_run", lambda x, y: dry_runs.append(tuple(x.shape)) or dry_run(x, y))
    flat = tf.reshape(x, [x.shape[0], -1])
    for _ in range(3):
        pipe.gradients(flat[:32], y[:32])
        pipe.gradients(flat[:16], y[:16])
    assert dry_runs == [(32, 64), (16, 64)]


def test_a_checkpoint_keeps_the_keras_dropout_seed(devs, batch, tmp_path):
    import keras

    x, y = batch
    x = tf.reshape(x, [x.shape[0], -1])

    def new_pipeline():
        return pipeline.Pipeline(
            keras_stages(devs[:2], dropout=0.5), devs[:2], 4, optimizer=keras.optimizers.Adam(1e-2)
        )

    first = new_pipeline()
    first.train_step(x, y)
    path = first.checkpoint().save(str(tmp_path / "ckpt"))
    later = [float(first.train_step(x, y)) for _ in range(2)]
    resumed = new_pipeline()
    resumed.build(x, y)
    resumed.checkpoint().restore(path).assert_consumed()
    np.testing.assert_allclose([float(resumed.train_step(x, y)) for _ in range(2)], later, atol=1e-6)


def test_a_variable_shared_by_two_stages_is_refused_with_an_optimizer(devs):
    import keras

    shared = models.Dense(32, 32, seed=1)
    stages = [models.Sequential([models.Flatten(), models.Dense(64, 32, seed=0), shared]), shared]
    with pytest.raises(ValueError, match="belongs to stages 0 and 1"):
        pipeline.Pipeline(stages, devs[:2], 2, optimizer=keras.optimizers.Adam(1e-3))
    pipeline.Pipeline(stages, devs[:2], 2, learning_rate=0.1)  # plain SGD adds the two updates, as one device does


def test_the_stages_together_variant_runs_every_stage_at_once(devs):
    from tutorial_lib import bench_pipeline

    pair = devs[:2]
    stages = bench_pipeline.balanced_stages(pair, 16)
    x, y = bench_pipeline.dense_batch(32, bench_pipeline.input_width(16))
    variants = bench_pipeline._gap_variants(stages, pair, bench_pipeline._stage_inputs(stages, pair, x, y), 4)

    def matmul_devices(name):
        fn, _ = variants[name]
        return {device for _, op_type, device in timeline.placement(fn) if "MatMul" in op_type}

    assert variants["stages together, M=4"][1] == {"part": "stages together", "m": 4}
    assert matmul_devices("stages together, M=4") == set(pair)
    assert matmul_devices("stage 1 alone, M=4") == {pair[1]}
