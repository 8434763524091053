"""The placement audit: every training step the course teaches keeps each op and variable on its owner's
device, traced with /GPU:i names (no GPU needed) and run on logical CPUs; each planted defect is named."""

import data_parallel as dp
import keras
import numpy as np
import pytest
import tensorflow as tf
import train_multi_gpu as program
from test_train_pipelined import example as pipelined  # noqa: E402

from tutorial_lib import allreduce, models, pipeline, placement, replicated, towers
from tutorial_lib.strategy import mirrored_strategy, mirrored_train_step

GPUS = [f"/GPU:{i}" for i in range(8)]


def _sync_bn(devices, make_optimizer=lambda: keras.optimizers.Adam(1e-3)):
    keras.utils.set_random_seed(0)
    replicas = dp.make_replicas(lambda: program.make_model((8, 8, 1)), devices)
    optimizers = dp.replica_optimizers(replicas, devices, make_optimizer)
    owners = {d: [*r.variables, *o.variables] for d, r, o in zip(devices, replicas, optimizers, strict=True)}
    return replicas, optimizers, owners


def _batch(n=8):
    return tf.random.stateless_normal([n, 8, 8, 1], [0, 1]), tf.constant(np.arange(n) % 10, tf.int32)


# The take-away's own step, every variant on 2, 3, 4 and 8 GPU names and run: tests/test_data_parallel.py.


def _backward_on_one_device(replicas, devices, optimizers):
    """The step as it was: one tape, its gradient() called outside every replica's device scope."""
    n, all_sum = len(devices), dp.make_all_sum(devices, nccl=False)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = dp.replicated_forward(replicas, devices, tf.split(x, n), all_sum)
            loss = tf.add_n([models.cross_entropy(lg, ys) / n for lg, ys in zip(logits, tf.split(y, n), strict=True)])
        grads = tape.gradient(loss, [r.trainable_variables for r in replicas])
        grads = allreduce.allreduce_grads(grads, average=False, devices=devices)
        for device, replica, optimizer, g in zip(devices, replicas, optimizers, grads, strict=True):
            with tf.device(device):
                optimizer.apply_gradients(zip(g, replica.trainable_variables, strict=True))
        return loss

    return step


@pytest.mark.parametrize("run", [False, True])
def test_the_audit_names_a_backward_pass_built_outside_the_replicas_device(devs, run):
    replicas, optimizers, owners = _sync_bn(devs[:2])
    report = placement.audit(_backward_on_one_device(replicas, devs[:2], optimizers), *_batch(), owners=owners, run=run)
    counts = report.counts()
    for op_type in ("Conv2DBackpropFilter", "MaxPoolGrad", "ReluGrad"):  # replica 1's two of each, on device 0
        # A run's graph optimizer may drop or fuse some (oneDNN builds fuse differently): at least one ran.
        assert counts[(op_type, devs[0], devs[1])] == 2 or run and counts[(op_type, devs[0], devs[1])], report
    assert not any(m.owner == devs[0] for m in report.misplaced), report  # replica 0's are where they belong


def test_a_raw_nccl_all_reduce_under_a_tape_fails_as_tensorflow_registers_it_and_tf_gradients_traces():
    """tensorpack's route (notebook 03's nccl_all_sum, the raw op) inside the forward: TensorFlow's registered
    gradient reads op.device, which a tape's stand-in op lacks; tf.gradients hands it the real op."""
    replicas, _, _ = _sync_bn(GPUS[:2])
    x, y = _batch(4)
    raw = lambda tensors: allreduce.nccl_all_sum(tensors, GPUS[:2])  # noqa: E731

    def loss_of(x, y):
        logits = dp.replicated_forward(replicas, GPUS[:2], tf.split(x, 2), raw)
        return tf.add_n([models.cross_entropy(lg, ys) for lg, ys in zip(logits, tf.split(y, 2), strict=True)])

    @tf.function
    def taped(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(x, y)
        return tape.gradient(loss, replicas[0].trainable_variables)

    with pytest.raises(AttributeError, match="device"):  # nccl_ops._all_sum_grad reads op.device of a mock op
        taped.get_concrete_function(x, y)
    weights = [v.value for v in replicas[0].trainable_variables]
    tf.function(lambda x, y: tf.gradients(loss_of(x, y), weights)).get_concrete_function(x, y)


def _dropout_stage():
    return [keras.layers.Flatten(), keras.layers.Dense(10), keras.layers.Dropout(0.5)]


def test_the_audit_names_a_layer_made_outside_its_device_and_an_optimizer_built_on_the_default_one(devs):
    layers = _dropout_stage()  # made here, outside the device scope: Keras creates Dropout's seed state now
    with tf.device(devs[1]):
        model = keras.Sequential([keras.Input((8, 8, 1)), *layers])
    adam = keras.optimizers.Adam()  # built outside the device scope: its counter and slots on device 0
    adam.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.device(devs[1]):
            with tf.GradientTape() as tape:
                loss = models.cross_entropy(model(x, training=True), y)
            grads = tape.gradient(loss, model.trainable_variables)
            adam.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    report = placement.audit(step, *_batch(), owners={devs[1]: [*model.variables, *adam.variables]}, run=True)
    wrong = {m.name for m in report.misplaced if m.type == "variable"}
    assert any("seed_generator_state" in name for name in wrong), report
    assert {"iteration", "learning_rate"} <= {name.rpartition("/")[2] for name in wrong}, wrong


def test_replicas_keep_their_own_dropout_seeds_and_get_the_first_ones_weights(devs):
    replicas = dp.make_replicas(lambda: keras.Sequential([keras.Input((8, 8, 1)), *_dropout_stage()]), devs[:2])
    seeds = [[v.numpy() for v in r.variables if "seed" in v.path] for r in replicas]
    assert len(seeds[0]) == 1 and not np.array_equal(seeds[0][0], seeds[1][0])
    for a, b in zip(replicas[0].weights, replicas[1].weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    x = tf.ones([64, 8, 8, 1])
    masks = [(r(x, training=True).numpy() == 0) for r in replicas]
    assert (masks[0] != masks[1]).any()  # each replica its own dropout mask


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_replicated_step_keeps_each_replica_on_its_device(devs, optimizer):
    replicas = replicated.make_replicas(lambda: models.MLP(seed=0), devs[:2])
    optimizers = None
    owners = {d: list(r.variables) for d, r in zip(devs[:2], replicas, strict=True)}
    if optimizer == "adam":
        optimizers = replicated.replica_optimizers(replicas, devs[:2], lambda: keras.optimizers.Adam(1e-3))
        owners = {d: [*owners[d], *o.variables] for d, o in zip(devs[:2], optimizers, strict=True)}
    step = replicated.make_train_step(replicas, devs[:2], learning_rate=0.1, optimizers=optimizers)
    x, y = tf.reshape(_batch()[0], [8, 64]), _batch()[1]
    for run in (False, True):
        report = placement.audit(step, x, y, owners=owners, run=run)
        assert report.ok and report.ops_checked > 20, report
    gpu_replicas = replicated.make_replicas(lambda: models.MLP(seed=0), GPUS[:4])
    gpu_step = replicated.make_train_step(gpu_replicas, GPUS[:4], learning_rate=0.1, method="nccl")
    gpu_owners = {d: list(r.variables) for d, r in zip(GPUS[:4], gpu_replicas, strict=True)}
    assert placement.audit(gpu_step, tf.zeros([8, 64]), y, owners=gpu_owners).ok


def test_the_tower_step_runs_each_tower_on_its_device_and_averages_on_the_controller(devs):
    with tf.device(devs[0]):
        model = models.MLP(seed=0)
    step = towers.make_train_step(model, devs[:3], learning_rate=0.1)
    x, y = tf.reshape(_batch(6)[0], [6, 64]), _batch(6)[1]
    scopes = {f"tower_{i}": d for i, d in enumerate(devs[:3])}  # the towers read the controller's weights
    for run in (False, True):
        report = placement.audit(step, x, y, owners={devs[0]: model.variables}, scopes=scopes, run=run)
        assert report.ok and report.ops_checked > 30, report
    gpu_step = towers.make_train_step(model, GPUS[:3], learning_rate=0.1)  # traced on GPU names
    gpu_scopes = {f"tower_{i}": d for i, d in enumerate(GPUS[:3])}
    assert placement.audit(gpu_step, x, y, owners={GPUS[0]: model.variables}, scopes=gpu_scopes).ok


def test_the_mirrored_strategy_step_keeps_each_copy_on_its_device(devs):
    strategy = mirrored_strategy(devs[:2])
    with strategy.scope():
        model, adam = program.make_model((8, 8, 1), synchronized=True), keras.optimizers.Adam(1e-3)
        adam.build(model.trainable_variables)
    step = mirrored_train_step(strategy, model, adam)
    batches = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(_batch()).repeat()))
    copies = [strategy.experimental_local_results(v.value) for v in [*model.variables, *adam.variables]]
    owners = {d: [c[i] for c in copies] for i, d in enumerate(devs[:2])}
    report = placement.audit(step, batches, 1, owners=owners, run=True)
    assert report.ok and report.variables_checked == len(copies) * 2, report


@pytest.mark.parametrize(
    "schedule",
    [
        pytest.param("sequential", marks=pytest.mark.slow),
        pytest.param("gpipe", marks=pytest.mark.slow),
        "1f1b",
        "zb_h1",
    ],
)
def test_every_pipeline_schedule_keeps_each_stage_on_its_device(devs, schedule):
    stages = pipelined.make_chunks(devs[:3], (8, 8, 1), seed=0)
    pipe = pipeline.Pipeline(stages, devs[:3], 2, schedule=schedule, optimizer=keras.optimizers.Adam(1e-3))
    x, y = _batch()
    pipe.train_step(x, y)  # builds the optimizer copies
    owners = {d: [*s.variables, *o.variables] for d, s, o in zip(devs[:3], stages, pipe.optimizers, strict=True)}
    report = placement.audit(pipe.traced_step, x, y, owners=owners, run=True)
    assert report.ok and report.variables_checked > 20, report


@pytest.mark.slow
def test_the_take_away_pipeline_keeps_each_chunk_and_its_dropout_seeds_on_its_device_for_every_schedule(devs):
    from tutorial_lib import gpu_audit

    reports = gpu_audit.pipeline_reports(devs[:3])
    assert len(reports) == 12 and all(r.ok and r.variables_checked > 20 for r in reports.values()), reports
    piped = gpu_audit.load("train_pipelined")
    run = piped.build(piped.parse(["--micro-batches", "2"]), devs[:3], (8, 8, 1))
    assert any("seed" in v.path for v in run.chunks[2].variables)  # the dropout's seeds: with their stage


def _all_reduced_elsewhere(right):
    """data_parallel.all_reduce_gradients packing and unpacking each replica's gradients on the other's device."""
    return lambda grads, devices, all_sum, *rest: right(grads, devices[::-1], all_sum, *rest)


def _updated_elsewhere(right):
    """pipeline_global.device_update run on another device of the replica than its stage's."""

    def device_update(rep, ks, *rest):
        with tf.device(next(d for d in rep.physical if d != rep.devices[ks[0]])):
            return right(rep, ks, *rest)

    return device_update


@pytest.mark.parametrize(
    "module, name, misplace",
    [(None, None, None), (dp, "all_reduce_gradients", _all_reduced_elsewhere),
     (pipelined.pg, "device_update", _updated_elsewhere)],
)  # fmt: skip
@pytest.mark.slow
def test_the_take_away_pipelines_replicas_all_reduce_and_update_each_stage_on_its_device(
    devs, monkeypatch, module, name, misplace
):
    """train_pipelined.py --replicas 2 --clipnorm 1.0 on 4 devices, audited as gpu_check audits it: ok, and not ok
    where a stage's all-reduce or its update is moved to another device."""
    from tutorial_lib import gpu_audit

    if module is not None:
        monkeypatch.setattr(module, name, misplace(getattr(module, name)))
    report = gpu_audit.replicated_pipeline_report(devs[:4], run=module is None)  # misplaced: the requests suffice
    if module is None:
        assert report.ok and report.variables_checked > 40 and report.ops_checked > 500, report
    else:
        assert not report.ok and report.misplaced, report


def test_owners_must_be_a_dict_of_devices():
    with pytest.raises(TypeError, match="owners is a dict"):
        placement.audit(lambda: 0, owners=[])


def test_allreduce_names_are_communication_for_the_audit():
    assert allreduce  # the scopes the audit reads as communication are the allreduce module's
    from tutorial_lib.timeline import is_communication

    assert is_communication("tower_0/ring_all_reduce_1/add") and not is_communication("moving_average/AssignSub")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_zero_stage_updates_each_shard_on_its_device(devs, stage):
    from tutorial_lib import sharding

    widths, rng = (64, 16, 10), np.random.default_rng(0)
    sizes = [widths[k] * widths[k + 1] + widths[k + 1] for k in (0, 1)]
    flats = [tf.constant(rng.normal(size=[size]).astype(np.float32)) for size in sizes]
    state = sharding.make_state(flats, devs[:2], stage)
    owners = {d: [v for kind in held.values() for v in kind] for d, held in zip(devs[:2], state, strict=True)}

    @tf.function
    def update():
        grads = []
        for d in devs[:2]:
            with tf.device(d):
                grads.append(tf.ones([flats[0].shape[0]]))
        sharding.update_layer(state, devs[:2], 0, grads, stage, 1, [0, 0])

    report = placement.audit(update, owners=owners, run=True)  # stages 1-2 split each device's weights: there
    assert report.ok and report.variables_checked == 16, report


def test_owners_that_the_step_does_not_read_or_that_are_not_variables_are_refused(devs):
    with tf.device(devs[0]):
        used, unused = tf.Variable(1.0), tf.Variable(2.0)
    step = tf.function(lambda x: used * x)
    x = tf.constant(1.0)
    with pytest.raises(ValueError, match="reads none of the owners' variables"):  # it said ok, 0 ops checked
        placement.audit(step, x, owners={devs[0]: [unused]})
    cases = [
        ({devs[0]: keras.Sequential([keras.Input((1,))])}, TypeError, r"is a list of variables.*got a Sequential"),
        ({devs[0]: used}, TypeError, "is a list of variables, e.g. model.variables, got a ResourceVariable"),
        ({devs[0]: [tf.constant(1.0)]}, TypeError, "holds a EagerTensor, not a variable"),
        ({devs[0]: [used], devs[1]: [used]}, ValueError, "is given to two owners"),
    ]
    for owners, error, message in cases:
        with pytest.raises(error, match=message):
            placement.audit(step, x, owners=owners)
    with pytest.raises(TypeError, match=r"scopes is a dict \{name scope: device\}"):
        placement.audit(step, x, owners={devs[0]: [used]}, scopes=["tower_0"])
    with pytest.raises(TypeError, match="step is the training step to audit"):
        placement.audit(None, x, owners={devs[0]: [used]})
