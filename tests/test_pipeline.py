import contextlib
import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import data, devices, models, pipeline, pipeline_checks, reference
from tutorial_lib.bench import pipeline as bench_pipeline


@pytest.fixture(scope="module")
def batch():
    (x, y), _ = data.load_digits()
    return tf.constant(x[:64]), tf.constant(y[:64])


def mlp_stages(devices=None, seed=1):
    """A 3-stage MLP on the digits: cheap enough to run every schedule."""
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


def batches_of(x, y, size):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


def graph_of(pipe, x, y):
    pipe.check_batch(x, y)
    return pipe.traced_step.get_concrete_function(x, y).graph


# --- the one-graph step equals the single-device step ---------------------------------------


@pytest.mark.parametrize(
    "kind, micro_batches, recompute",
    [("gpipe", 1, False), ("sequential", 4, False), ("gpipe", 4, False), ("1f1b", 4, False), ("zb_h1", 4, False),
     ("1f1b", 4, True), ("zb_h1", 2, True)],
)  # fmt: skip
def test_every_schedule_equals_the_single_device_step(devs, batch, kind, micro_batches, recompute):
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], micro_batches, 0.5, kind, recompute=recompute)
    single = models.Sequential(mlp_stages())
    for _ in range(2):  # two steps: the second starts from the first one's update
        assert_same_step(pipe, single, x, y, 0.5)


@pytest.mark.slow
def test_the_askers_cnn_split_in_three(devs, batch):
    x, y = batch
    pipe = pipeline.Pipeline(models.cnn_stages(devices=devs[:3], seed=5), devs[:3], 2, 0.1, schedule="1f1b")
    assert_same_step(pipe, models.Sequential(models.cnn_stages(seed=5)), x, y, 0.1)


def test_the_naive_split_of_notebook_01_equals_one_tape(devs, batch):
    x, y = batch
    stages = mlp_stages(devs[:3])
    loss, grads = pipeline.staged_gradients(stages, devs[:3], x, y)
    ref_loss, ref_grads = reference.loss_and_gradients(models.Sequential(stages), x, y)
    np.testing.assert_allclose(loss, ref_loss, atol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-6)


def test_each_op_runs_on_its_stage_device(devs, batch):
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 2, learning_rate=0.0, schedule="1f1b")
    for op in graph_of(pipe, x, y).get_operations():
        if op.name.startswith("stage") and op.type in ("MatMul", "AddN"):
            assert devices.normalize(op.device) == devs[int(op.name[len("stage")])], (op.name, op.device)


def copies_to_next_stage(graph, s, m, next_device):
    return [
        o
        for o in graph.get_operations()
        if o.name.startswith(f"stage{s}/F{m}/") and o.type == "Identity" and devices.normalize(o.device) == next_device
    ]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_each_forward_output_is_copied_to_the_next_stage_before_the_stage_goes_on(devs, batch, kind):
    """The copy on the next device is part of the forward, and the stage's next op waits for it:
    otherwise TensorFlow's executor may send the output only when the stage runs out of work."""
    x, y = batch
    S, M = 3, 4
    pipe = pipeline.Pipeline(mlp_stages(devs[:S]), devs[:S], M, learning_rate=0.0, schedule=kind)
    assert pipe.wait_for_arrival  # the default on CPU devices
    graph = graph_of(pipe, x, y)
    ops = {op.name: op for op in graph.get_operations()}
    for s in range(S - 1):
        for (op, m), (next_op, next_m) in itertools.pairwise(pipe.orders[s]):
            if op != "F":
                continue
            (copy,) = copies_to_next_stage(graph, s, m, devs[s + 1])
            start = ops[f"stage{s}/{next_op}{next_m}/start"]  # every op of the stage's next F or B waits for it
            assert copy in start.control_inputs, f"stage {s}: ({next_op}, {next_m}) does not wait for F{m}'s copy"
            assert any(copy is t.op for t in ops[f"stage{s + 1}/F{m}/Identity"].inputs)  # and stage s+1 reads it


def test_the_hand_off_wait_is_a_parameter_whose_default_depends_on_the_device_type(devs, batch):
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 4, learning_rate=0.0, wait_for_arrival=False)
    graph = graph_of(pipe, x, y)
    assert not any(copies_to_next_stage(graph, s, m, devs[s + 1]) for s in range(2) for m in range(4))
    assert pipeline_checks.all_cpus(["/job:worker/replica:0/task:1/device:CPU:0", "/device:CPU:3"])
    assert not pipeline_checks.all_cpus(["/device:GPU:0", "/device:GPU:1", "/device:CPU:0"])  # GPUs: off


def live_matmuls(graph, device):
    """The graph's matrix products on `device` that an output or an update needs: TensorFlow
    prunes the others when it runs the function (the tape builds both gradients of a product)."""
    needed = [t.op for t in graph.outputs] + [op for op in graph.get_operations() if op.op_def.is_stateful]
    live = set()
    while needed:
        op = needed.pop()
        if op not in live:
            live.add(op)
            needed += [t.op for t in op.inputs] + list(op.control_inputs)
    return [op for op in live if op.type == "MatMul" and devices.normalize(op.device) == device]


def multiply_adds(op) -> int:
    a, b = (t.shape for t in op.inputs)
    rows, inner = (a[1], a[0]) if op.get_attr("transpose_a") else (a[0], a[1])
    return rows * inner * (b[0] if op.get_attr("transpose_b") else b[1])


def test_the_first_stage_computes_no_gradient_of_the_batch(devs, batch):
    x, y = batch
    graph = graph_of(pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 4, learning_rate=0.0), x, y)
    # per micro-batch: stage 0 runs its forward and its weight gradient, but no input gradient
    assert len(live_matmuls(graph, devs[0])) == 2 * 4
    assert len(live_matmuls(graph, devs[1])) == 3 * 4


def test_the_bench_stages_do_equal_work(devs):
    width, rows = 16, 32
    stages = bench_pipeline.balanced_stages(devs[:2], width)
    x, y = bench_pipeline.dense_batch(rows, bench_pipeline.input_width(width), devs[:2])
    graph = graph_of(pipeline.Pipeline(stages, devs[:2], 4, learning_rate=0.0), x, y)
    first, second = (sum(map(multiply_adds, live_matmuls(graph, d))) for d in devs[:2])
    logits = 3 * rows * width * 10  # the second stage's small extra layer: forward, weight and input gradients
    assert first == second - logits == 9 * rows * width * width


# --- Keras stages: training=True, their own losses, what they may hold ----------------------


def keras_stages(devices=None, dropout=0.0, l2=0.0):
    """Two Keras models, weights seeded; with `l2`, a weight regularizer and an activity regularizer."""
    stages = []
    for s, (n_in, n_out) in enumerate(((64, 32), (32, 10))):
        with tf.device(devices[s]) if devices else contextlib.nullcontext():
            regularizer = keras.regularizers.L2(l2) if l2 else None
            dense = keras.layers.Dense(
                n_out, kernel_initializer=keras.initializers.GlorotUniform(s), kernel_regularizer=regularizer
            )
            layers = [keras.Input((n_in,)), dense]
            if s == 0 and l2:
                layers.append(keras.layers.ActivityRegularization(l2=l2))  # add_loss, the mean over the batch
            if s == 0 and dropout:
                layers.append(keras.layers.Dropout(dropout, seed=3))
            stages.append(keras.Sequential(layers))
    return stages


def keras_reference_step(single, x, y, lr):
    """A one-device Keras loop: training=True, model.losses added to the loss, plain SGD."""
    variables = [v for stage in single for v in stage.trainable_variables]
    with tf.GradientTape() as tape:
        logits = single[1](single[0](x, training=True), training=True)
        loss = models.cross_entropy(logits, y) + tf.add_n(single[0].losses + single[1].losses)
    for v, g in zip(variables, tape.gradient(loss, variables), strict=True):
        v.assign_sub(lr * g)
    return float(loss)


def test_keras_stages_with_regularizers_train_like_the_one_device_keras_loop(devs, batch):
    x, y = batch
    x = tf.reshape(x, [x.shape[0], -1])
    pipe = pipeline.Pipeline(keras_stages(devs[:2], l2=0.05), devs[:2], 4, learning_rate=0.5, schedule="1f1b")
    single = keras_stages(l2=0.05)
    without = float(models.cross_entropy(single[1](single[0](x)), y))
    for _ in range(2):
        ref = keras_reference_step(single, x, y, 0.5)
        np.testing.assert_allclose(float(pipe.train_step(x, y)), ref, atol=1e-5)
    assert ref - without > 0.1  # the regularizers count: the test would pass without them otherwise
    variables = [v for stage in single for v in stage.trainable_variables]
    for v, w in zip(pipe.variables, variables, strict=True):
        np.testing.assert_allclose(v.numpy(), w.numpy(), atol=1e-5)


@pytest.mark.slow
def test_a_keras_dropout_drops_in_the_pipeline_as_over_the_same_micro_batches_on_one_device(devs, batch):
    x, y = batch
    x = tf.reshape(x, [x.shape[0], -1])
    keras.utils.set_random_seed(0)
    stages = keras_stages(devs[:2], dropout=0.5)
    keras.utils.set_random_seed(0)
    single = keras_stages(dropout=0.5)
    pipe = pipeline.Pipeline(stages, devs[:2], 4, learning_rate=1.0)
    pipe.check_batch(x, y)  # builds the stages
    before = [v.numpy() for v in pipe.variables]
    without = models.cross_entropy(stages[1](stages[0](x, training=False)), y)
    loss = pipe.train_step(x, y)
    grads = [b - v.numpy() for b, v in zip(before, pipe.variables, strict=True)]  # SGD at learning rate 1
    assert abs(float(loss) - float(without)) > 1e-4  # the stage was told it trains: its Dropout dropped
    variables = [v for stage in single for v in stage.trainable_variables]
    total, ref = None, 0.0
    for xm, ym in zip(tf.split(x, 4), tf.split(y, 4), strict=True):  # the same masks, one micro-batch at a time
        with tf.GradientTape() as tape:
            loss_m = models.cross_entropy(single[1](single[0](xm, training=True), training=True), ym) / 4
        g = tape.gradient(loss_m, variables)
        total, ref = (g if total is None else [a + b for a, b in zip(total, g, strict=True)]), ref + float(loss_m)
    np.testing.assert_allclose(float(loss), ref, atol=1e-5)
    for a, b in zip(grads, total, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_tf_module_stage_that_hides_keras_layers_and_batch_norm_are_refused(devs):
    with tf.device(devs[0]):
        hidden = models.Sequential([keras.layers.Dense(8), keras.layers.Dropout(0.5)])
    with pytest.raises(
        ValueError, match="stage 0 is a Sequential that holds the Keras layer 'dense.*': .*keras.Sequential"
    ):
        pipeline.Pipeline([hidden, mlp_stages(devs[:3])[1]], devs[:2], 2, learning_rate=0.1)
    inner = keras.Sequential([keras.Input((8,)), keras.layers.BatchNormalization()])
    for stage in (keras.Sequential([keras.Input((8,)), keras.layers.BatchNormalization()]), keras.Sequential([inner])):
        with pytest.raises(ValueError, match="stage 1 has the BatchNormalization layer .*LayerNormalization"):
            pipeline.Pipeline([keras.Sequential([keras.Input((4,)), keras.layers.Dense(8)]), stage], devs[:2], 2, 0.1)


# --- faults: what a failed step leaves ------------------------------------------------------


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


@pytest.mark.slow
def test_a_step_that_fails_in_a_forward_changes_nothing_and_the_next_step_is_right(devs, batch):
    x, y = batch
    pipe = pipeline.Pipeline(guarded_stages(devs[:3]), devs[:3], 4, optimizer=keras.optimizers.Adam(1e-2))
    pipe.check_batch(x, y)  # the optimizers exist from here
    state = [v.numpy() for v in pipe.variables + [w for o in pipe.optimizers for w in o.variables]]
    bad = tf.concat([x[:-16], 1e4 * x[-16:]], 0)  # only the last micro-batch fails, on stage 1
    with pytest.raises(tf.errors.InvalidArgumentError, match="too large"):
        pipe.train_step(bad, y)
    after = [v.numpy() for v in pipe.variables + [w for o in pipe.optimizers for w in o.variables]]
    for a, b in zip(after, state, strict=True):
        np.testing.assert_array_equal(a, b)  # weights, Adam's moments and iterations: stage 0 did not update alone
    assert int(pipe.step) == 0


class FailingAdam(keras.optimizers.Adam):
    """Adam whose apply fails at run time while its `failing` flag (a variable) is set."""

    failing = None

    def update_step(self, gradient, variable, learning_rate):
        checks = (
            [tf.debugging.assert_equal(self.failing, False, message="update failed")]
            if self.failing is not None
            else []
        )
        with tf.control_dependencies(checks):
            super().update_step(gradient, variable, learning_rate)


@pytest.mark.slow
def test_a_step_that_fails_in_an_update_does_not_count_as_applied(devs, batch):
    """The claim of Pipeline's docstring: some stages may be updated, but `step` is not advanced."""
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 4, optimizer=FailingAdam(1e-2))
    pipe.check_batch(x, y)
    failing = tf.Variable(False)
    pipe.optimizers[1].failing = failing  # stage 1's update fails when the flag is set
    pipe.train_step(x, y)
    failing.assign(True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="update failed"):
        pipe.train_step(x, y)
    assert int(pipe.step) == 1


# --- a wave: several steps in one call ------------------------------------------------------


def test_a_wave_equals_the_single_device_steps(devs, batch):
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 2, learning_rate=0.5, schedule="1f1b")
    single = models.Sequential(mlp_stages())
    batches = batches_of(x, y, 32)
    losses = pipe.train_steps(*zip(*batches, strict=True))
    refs = [reference.sgd_step(single, xb, yb, 0.5) for xb, yb in batches]
    np.testing.assert_allclose(losses, refs, atol=1e-5)
    for v, w in zip(pipe.variables, single.trainable_variables, strict=True):
        np.testing.assert_allclose(v.numpy(), w.numpy(), atol=1e-5)
    assert int(pipe.step) == len(batches)


def test_each_step_of_a_wave_starts_after_the_step_before_is_applied(devs, batch):
    """No Python between the steps, but no stage starts a step on half-updated weights."""
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 2, learning_rate=0.5, schedule="1f1b")
    pipe.check_batch(x, y)
    graph = pipe._wave.get_concrete_function((x, x), (y, y)).graph
    counters = [op for op in graph.get_operations() if op.type == "AssignAddVariableOp"]
    assert len(counters) == 2
    assert len([op for op in graph.get_operations() if op.type == "AssignSubVariableOp"]) == 2 * len(pipe.variables)
    for s in range(3):  # the second step's first op on each stage waits (its scopes are uniquified: stage{s}/F0_1)
        assert counters[0] in graph.get_operation_by_name(f"stage{s}/F0_1/start").control_inputs


def test_a_failed_wave_keeps_the_steps_before_it_whole(devs, batch):
    x, y = batch
    pipe = pipeline.Pipeline(guarded_stages(devs[:3]), devs[:3], 2, learning_rate=0.5, schedule="1f1b")
    single = models.Sequential(mlp_stages())
    (x0, y0), (x1, y1) = batches_of(x, y, 32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="too large"):
        pipe.train_steps([x0, 1e4 * x1], [y0, y1])  # step 1 fails on stage 1
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


# --- bad input: clear errors instead of TensorFlow's ----------------------------------------


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
    loss = pipe.train_step(x, tf.one_hot(y, 10))
    np.testing.assert_allclose(loss, reference.sgd_step(models.Sequential(mlp_stages()), x, y, 0.5), atol=1e-5)


def test_labels_and_dtypes_that_do_not_fit_get_clear_errors(devs, batch):
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 4, learning_rate=0.1)
    with pytest.raises(ValueError, match=r"extra axis: pass tf.squeeze\(y, axis=-1\)"):
        pipe.train_step(x, y[:, None])
    with pytest.raises(ValueError, match="look one-hot"):
        pipe.train_step(x, tf.one_hot(y, 10))
    with pytest.raises(ValueError, match="integer class ids .* tf.cast"):
        pipe.train_step(x, tf.cast(y, tf.float32))
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
    ref_loss, _ = reference.loss_and_gradients(models.Sequential(mixed), x, y)  # before the step's update
    loss = pipeline.Pipeline(mixed, devs[:3], 4, learning_rate=0.5, schedule="1f1b").train_step(x, y)
    np.testing.assert_allclose(loss, ref_loss, atol=1e-5)


@pytest.mark.slow
def test_train_step_inside_a_users_tf_function(devs, batch):
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 2, learning_rate=0.5, schedule="1f1b")
    single = models.Sequential(mlp_stages())
    two_steps = tf.function(lambda x, y: (pipe.train_step(x, y), pipe.train_step(x, y)))
    np.testing.assert_allclose(two_steps(x, y), [reference.sgd_step(single, x, y, 0.5) for _ in range(2)], atol=1e-5)


def test_bad_input(devs, batch):
    x, y = batch
    stages = mlp_stages(devs[:3])
    with pytest.raises(ValueError, match="one device per stage, got 3 stages and 2 devices"):
        pipeline.Pipeline(stages, devs[:2], micro_batches=2, learning_rate=0.1)
    with pytest.raises(ValueError, match="micro_batches must be a whole number"):
        pipeline.Pipeline(stages, devs[:3], micro_batches=0, learning_rate=0.1)
    with pytest.raises(ValueError, match="schedule must be one of"):
        pipeline.Pipeline(stages, devs[:3], micro_batches=2, learning_rate=0.1, schedule="pipedream")
    with pytest.raises(TypeError, match="must be a list of device names"):
        pipeline.Pipeline(stages, devs[0], micro_batches=2, learning_rate=0.1)
    with pytest.raises(ValueError, match="does not split into 5 equal micro-batches"):
        pipeline.Pipeline(stages, devs[:3], micro_batches=5, learning_rate=0.1).train_step(x, y)
    mismatched = [stages[0], models.Sequential([models.Dense(10, 10)]), stages[2]]
    with pytest.raises(ValueError, match="stage 1 cannot take the output of stage 0"):
        pipeline.Pipeline(mismatched, devs[:3], micro_batches=2, learning_rate=0.1).train_step(x, y)


def test_batches_of_alternating_shapes_are_checked_once_each(devs, batch, monkeypatch):
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 4, learning_rate=0.1)
    dry_runs, dry_run = [], pipeline_checks.dry_run
    monkeypatch.setattr(
        pipeline_checks, "dry_run", lambda *args: dry_runs.append(tuple(args[2].shape)) or dry_run(*args)
    )
    flat = tf.reshape(x, [x.shape[0], -1])
    for _ in range(2):
        pipe.train_step(flat[:32], y[:32])
        pipe.train_step(flat[:16], y[:16])
    assert dry_runs == [(32, 64), (16, 64)]


# --- parameter updates with a Keras optimizer, one copy per stage ---------------------------


@pytest.mark.slow
def test_adam_per_stage_equals_adam_on_one_device(devs, batch):
    x, y = batch
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 2, schedule="1f1b", optimizer=keras.optimizers.Adam(1e-3))
    single = models.Sequential(mlp_stages())
    batches = batches_of(x, y, 16)[:3]
    losses = [float(pipe.train_step(*batches[0]))]
    losses += [float(v) for v in pipe.train_steps(*zip(*batches[1:], strict=True))]
    expected = reference.optimizer_losses(single, batches, keras.optimizers.Adam(1e-3))
    np.testing.assert_allclose(losses, expected, atol=1e-5)
    for v, w in zip(pipe.variables, single.trainable_variables, strict=True):
        np.testing.assert_allclose(v.numpy(), w.numpy(), atol=1e-5)
    assert [int(o.iterations) for o in pipe.optimizers] == [3, 3, 3]  # one iteration per step, not one per stage


def test_each_stage_optimizer_lives_on_its_stage_device(devs, batch):
    template = keras.optimizers.Adam(1e-3)
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 2, optimizer=template)
    pipe.check_batch(*batch)  # the copies are built with the first batch
    for s, optimizer in enumerate(pipe.optimizers):
        assert optimizer is not template
        slots = [v for v in optimizer.variables if v.name not in ("iteration", "learning_rate")]
        assert len(slots) == 2 * len(pipe.stages[s].trainable_variables)  # Adam: two moments per weight
        for v in optimizer.variables:
            assert devices.normalize(v.value.device) == devs[s], (s, v.name, v.value.device)


@pytest.mark.parametrize("optimizer", [None, "adam"])
def test_every_update_waits_for_every_stage_s_last_backward(devs, batch, optimizer):
    """No stage updates alone, read from the graph: no write can run before every stage's gradients exist."""
    x, y = batch
    rule = {"optimizer": keras.optimizers.Adam(1e-3)} if optimizer else {"learning_rate": 0.1}
    pipe = pipeline.Pipeline(mlp_stages(devs[:3]), devs[:3], 4, schedule="1f1b", **rule)
    graph = graph_of(pipe, x, y)
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


def test_adam_with_a_keras_stage_built_only_by_the_first_batch(devs, batch):
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
    x, y = batch
    template = keras.optimizers.AdamW(1e-3, weight_decay=0.5)
    template.exclude_from_weight_decay(var_names=["b"])  # the biases of models.Dense
    first, second, third = mlp_stages(devs[:3])
    pipe = pipeline.Pipeline([first, second, Guard(), third], [*devs[:3], devs[3]], 2, optimizer=template)
    reference_optimizer = keras.optimizers.AdamW(1e-3, weight_decay=0.5)
    reference_optimizer.exclude_from_weight_decay(var_names=["b"])
    single = models.Sequential(mlp_stages())
    losses = [float(pipe.train_step(x, y)) for _ in range(2)]
    np.testing.assert_allclose(losses, reference.optimizer_losses(single, [(x, y)] * 2, reference_optimizer), atol=1e-5)
    for v, w in zip(pipe.variables, single.trainable_variables, strict=True):
        np.testing.assert_allclose(v.numpy(), w.numpy(), atol=1e-5)
    assert [int(o.iterations) for o in pipe.optimizers] == [2, 2, 0, 2]  # the Guard has nothing to update


@pytest.mark.filterwarnings("ignore:The object being serialized includes a `lambda`")
def test_the_update_rule_is_given_once_and_the_optimizer_is_one_the_stages_can_share_out(devs, batch):
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
    with pytest.raises(ValueError, match="global_clipnorm is not supported.* clipnorm"):
        pipeline.Pipeline(stages, devs[:3], 2, optimizer=keras.optimizers.Adam(1e-3, global_clipnorm=1.0))
    with pytest.raises(ValueError, match="loss scaling is not supported"):
        pipeline.Pipeline(stages, devs[:3], 2, optimizer=keras.optimizers.Adam(1e-3, loss_scale_factor=128.0))
    with pytest.raises(ValueError, match="loss scaling is not supported"):
        pipeline.Pipeline(stages, devs[:3], 2, optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    with pytest.raises(TypeError, match="not a lambda"):
        pipeline.Pipeline(stages, devs[:3], 2, optimizer=keras.optimizers.Adam(lambda: 1e-3)).check_batch(*batch)


def test_a_variable_shared_by_two_stages_is_refused_with_an_optimizer(devs):
    shared = models.Dense(32, 32, seed=1)
    stages = [models.Sequential([models.Flatten(), models.Dense(64, 32, seed=0), shared]), shared]
    with pytest.raises(ValueError, match="belongs to stages 0 and 1"):
        pipeline.Pipeline(stages, devs[:2], 2, optimizer=keras.optimizers.Adam(1e-3))
    pipeline.Pipeline(stages, devs[:2], 2, learning_rate=0.1)  # plain SGD adds the two updates, as one device does
