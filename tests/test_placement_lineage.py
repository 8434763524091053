"""The placement audit as a proof: each op has ONE owner by lineage, function bodies (a `tf.function`
helper, XLA, `tf.cond`, `tf.while_loop`) are entered, and a run fails on any op it cannot place. Each
planted slip is found traced on /GPU:i names (no GPU needed) and run on logical CPU devices; each
correct step gives 0 misplaced. Small self-contained steps: nothing here imports examples/."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import placement, timeline

GPUS = ["/device:GPU:0", "/device:GPU:1"]


def _devices(devs, run):
    """Run on two logical CPUs, or trace on two GPU names."""
    return devs[:2] if run else GPUS


def _batch(n=8):
    return tf.random.stateless_normal([n, 8, 8, 1], [0, 1]), tf.constant(np.arange(n) % 10, tf.int32)


def _replicas(devices):
    """One small CNN (two convolutions) and its SGD per device, each made there, and device 0's seed state
    for the augmentation noise."""
    keras.utils.set_random_seed(0)
    replicas, optimizers = [], []
    for d in devices:
        with tf.device(d):
            convolutions = [keras.layers.Conv2D(4, 3, activation="relu") for _ in range(2)]
            replicas.append(keras.Sequential([keras.Input((8, 8, 1)), *convolutions, keras.layers.Flatten(),
                                              keras.layers.Dense(10)]))  # fmt: skip
            optimizers.append(keras.optimizers.SGD(0.1))
            optimizers[-1].build(replicas[-1].trainable_variables)
    with tf.device(devices[0]):
        seeds = keras.random.SeedGenerator(1)
    owners = {d: [*r.variables, *o.variables] for d, r, o in zip(devices, replicas, optimizers, strict=True)}
    owners[devices[0]].append(seeds.state)
    return replicas, optimizers, seeds, owners


def _loss(replica, x, y, n):
    logits = replica(x, training=True)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)) / n


def _all_sum(tensors, devices):
    """A central all-reduce, in an all-reduce name scope: the audit reads its ops as communication."""
    with tf.name_scope("all_reduce"):
        with tf.device(devices[0]):
            total = tf.add_n(tensors)
        results = []
        for d in devices:
            with tf.device(d):
                results.append(tf.identity(total))
        return results


def _data_parallel_step(replicas, optimizers, seeds, devices, slip=None):
    """Each replica's share plus noise drawn on device 0, one tf.gradients pass, each replica's gradients
    packed into one bucket, summed, unpacked and applied on its device. `slip`: "outside" calls replica 1
    outside its tf.device; "unpack" unpacks replica 1's summed bucket on device 0."""
    n = len(devices)

    @tf.function
    def step(x, y):
        xs, ys = tf.split(x, n), tf.split(y, n)
        with tf.device(devices[0]):  # augmentation noise, drawn from device 0's seed state
            noise = 0.1 * keras.random.normal(tf.shape(xs[0]), seed=seeds)
        parts = []
        for i, (device, replica) in enumerate(zip(devices, replicas, strict=True)):
            where = contextlib.nullcontext() if slip == "outside" and i == 1 else tf.device(device)
            with where:
                parts.append(_loss(replica, xs[i] + noise, ys[i], n))
        k = len(replicas[0].trainable_variables)
        # Asks for no device and mixes every replica's loss: either may add. The runtime prunes it (only its
        # gradient is used), and the audit places it where the step's other such ops ran: "default device".
        flat = tf.gradients(tf.add_n(parts), [v.value for r in replicas for v in r.trainable_variables])
        packed = []
        for i, device in enumerate(devices):
            with tf.device(device):
                packed.append(tf.concat([tf.reshape(g, [-1]) for g in flat[i * k : (i + 1) * k]], 0))
        for i, (device, replica, summed) in enumerate(zip(devices, replicas, _all_sum(packed, devices), strict=True)):
            weights = replica.trainable_variables
            with tf.device(devices[0] if slip == "unpack" and i == 1 else device):
                pieces = tf.split(summed, [int(np.prod(v.shape)) for v in weights])
                grads = [tf.reshape(p, v.shape) for p, v in zip(pieces, weights, strict=True)]
            with tf.device(device):
                optimizers[i].apply_gradients(zip(grads, weights, strict=True))
        return tf.add_n(parts)  # the batch's loss, for reporting

    return step


def _audit_slip(devs, run, slip):
    devices = _devices(devs, run)
    replicas, optimizers, seeds, owners = _replicas(devices)
    step = _data_parallel_step(replicas, optimizers, seeds, devices, slip)
    return devices, placement.audit(step, *_batch(), owners=owners, run=run)


@pytest.mark.parametrize("run", [False, True])
def test_the_correct_data_parallel_step_has_every_op_with_its_owner(devs, run):
    _, report = _audit_slip(devs, run, None)
    assert report.ok and report.ops_checked > 150 and not report.unresolved, report
    if run:  # the runtime removed and fused some: each placed by other evidence, and said how
        assert report.how["ran"] > 100 and report.how["requested"] > 20, report.how
        assert report.how["default device"] == 1, report.how  # the sum that tf.gradients differentiates


@pytest.mark.parametrize("run", [False, True])
def test_a_replica_called_outside_its_device_with_noise_from_device_0_is_found(devs, run):
    # Issue 49: an audit that lets an op run where any of its inputs' owners is read noise from device 0's
    # seed state as making replica 1's convolutions "device 0's or device 1's": 0 misplaced, traced and run.
    devices, report = _audit_slip(devs, run, "outside")
    counts = report.counts()
    for op_type in ("Conv2D", "Conv2DBackpropFilter", "BiasAddGrad"):  # replica 1's two convolutions
        assert counts[(op_type, devices[0], devices[1])] >= 2, report  # and the dense layer's BiasAddGrad
    assert counts[("MatMul", devices[0], devices[1])] == 3, report  # the dense layer forward and backward
    assert all(m.owner == devices[1] and m.device == devices[0] for m in report.misplaced), report
    if run:  # replica 1's convolutions asked for no device: the run shows them in the fused kernels on device 0
        assert report.how["fused"], report.how


@pytest.mark.parametrize("run", [False, True])
def test_replica_1s_summed_gradients_unpacked_on_device_0_are_found(devs, run):
    # Issue 51: the runtime removes the unpacking ops; an audit that skipped ops missing from the run said 0.
    devices, report = _audit_slip(devs, run, "unpack")
    weights = 6  # two kernels and two biases per convolution and the dense layer: 3 x 2
    assert report.counts() == {("SplitV", devices[0], devices[1]): 1, ("Reshape", devices[0], devices[1]): weights}
    if run:
        assert report.how["requested"], report  # removed by the runtime: checked by the device they asked for


def _penalty_step(replica, optimizer, devices, body, pinned):
    """Replica 1's loss plus an L2 penalty on its first kernel whose product is pinned to device 0 (`pinned`),
    computed in `body`: "inline", a `tf.function` "helper", a "jit" helper, a "cond" or a "while" loop."""
    kernel = replica.layers[0].kernel

    def product():
        with tf.device(devices[0]) if pinned else contextlib.nullcontext():
            return kernel.value * kernel.value

    helpers = {"helper": tf.function(product), "jit": tf.function(product, jit_compile=True)}

    def penalty(x):
        if body in helpers:
            return tf.reduce_sum(helpers[body]())
        if body == "cond":
            return tf.cond(tf.reduce_sum(x) > -1e9, lambda: tf.reduce_sum(product()), lambda: tf.constant(0.0))
        if body == "while":
            return tf.while_loop(lambda i, _: i < 2, lambda i, s: (i + 1, s + tf.reduce_sum(product())), [0, 0.0])[1]
        return tf.reduce_sum(product())

    @tf.function
    def step(x, y):
        with tf.device(devices[1]):
            loss = _loss(replica, x, y, 1) + 1e-3 * penalty(x)
            weights = [v.value for v in replica.trainable_variables]
            optimizer.apply_gradients(zip(tf.gradients(loss, weights), replica.trainable_variables, strict=True))
        return loss

    return step


@pytest.mark.parametrize("run", [False, True])
@pytest.mark.parametrize("body", ["inline", "helper", "jit", "cond", "while"])
def test_a_product_of_device_1s_weight_pinned_to_device_0_is_found_in_every_kind_of_body(devs, run, body):
    # Issue 51: an audit that did not enter function bodies saw nothing in a @tf.function helper; inline, it did.
    devices = _devices(devs, run)
    replicas, optimizers, _, owners = _replicas(devices)
    owners = {devices[1]: owners[devices[1]]}
    for pinned in (False, True):
        step = _penalty_step(replicas[1], optimizers[1], devices, body, pinned)
        report = placement.audit(step, *_batch(), owners=owners, run=run)
        if not pinned:
            assert report.ok, report
            continue
        wrong = {(m.type, m.device, m.owner) for m in report.misplaced}
        if body == "jit":  # one program on one device: the pin means nothing, the call is on device 1
            assert report.ok, report
        else:
            assert ("Mul", devices[0], devices[1]) in wrong, report  # the product
            assert all(m.owner == devices[1] and m.device == devices[0] for m in report.misplaced), report


def _small_cnn_weights(device):
    with tf.device(device):
        rng = np.random.default_rng(0)
        return [tf.Variable(rng.normal(size=shape).astype(np.float32) * 0.1) for shape in ([3, 3, 1, 4], [144, 10])]


@tf.function(jit_compile=True)
def _compiled_share(x, y, kernel, dense):
    """One replica's forward and backward, compiled by XLA into one program; its weights come in as values
    (XLA refuses to read a variable of another device, see the next test)."""
    with tf.GradientTape() as tape:
        tape.watch([kernel, dense])
        h = tf.nn.relu(tf.nn.conv2d(x, kernel, 1, "VALID"))
        logits = tf.matmul(tf.reshape(h, [-1, 144]), dense)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    return loss, tape.gradient(loss, [kernel, dense])


@pytest.mark.parametrize("run", [False, True])
def test_an_xla_call_of_replica_1_on_device_0_is_found_with_every_op_of_its_body(devs, run):
    devices = _devices(devs, run)
    weights = _small_cnn_weights(devices[1])
    for device in devices:

        @tf.function
        def step(x, y, device=device):
            with tf.device(devices[1]):
                values = [w.read_value() for w in weights]
            with tf.device(device):
                loss, grads = _compiled_share(x, y, *values)
            with tf.device(devices[1]):
                for w, g in zip(weights, grads, strict=True):
                    w.assign_sub(0.1 * g)
            return loss

        report = placement.audit(step, *_batch(), owners={devices[1]: weights}, run=run)
        if device == devices[1]:
            assert report.ok and report.ops_checked > 20, report
            continue
        counts = report.counts()
        assert counts[("PartitionedCall", devices[0], devices[1])] == 1, report  # the call (stateless: no variable)
        for op_type, n in (("Conv2D", 1), ("Conv2DBackpropFilter", 1), ("MatMul", 3)):  # and its body, on device 0
            assert counts[(op_type, devices[0], devices[1])] == n, report
        assert all(m.device == devices[0] and m.owner == devices[1] for m in report.misplaced), report
        if run:
            assert report.how["in its XLA cluster"] > 10, report


def test_an_xla_call_that_reads_another_devices_variable_is_found_traced_and_refused_by_tensorflow_run(devs):
    for devices, run in ((GPUS, False), (devs[:2], True)):
        replicas, optimizers, _, owners = _replicas(devices)
        replica = replicas[1]

        @tf.function(jit_compile=True)
        def share(x, y, replica=replica):  # captures replica 1's variables
            with tf.GradientTape() as tape:
                loss = _loss(replica, x, y, 1)
            return loss, tape.gradient(loss, replica.trainable_variables)

        @tf.function
        def step(x, y, share=share, devices=devices, replica=replica, optimizer=optimizers[1]):
            with tf.device(devices[0]):  # the slip: replica 1's compiled call on device 0
                loss, grads = share(x, y)
            with tf.device(devices[1]):
                optimizer.apply_gradients(zip(grads, replica.trainable_variables, strict=True))
            return loss

        if run:  # XLA will not read a variable of another device: the run itself fails
            with pytest.raises(tf.errors.InvalidArgumentError, match="Trying to access resource"):
                placement.audit(step, *_batch(), owners={devices[1]: owners[devices[1]]}, run=True)
            continue
        report = placement.audit(step, *_batch(), owners={devices[1]: owners[devices[1]]})
        counts = report.counts()
        assert counts[("StatefulPartitionedCall", devices[0], devices[1])] == 1, report
        assert counts[("Conv2D", devices[0], devices[1])] == 2, report  # the body's ops: on the call's device


@pytest.mark.parametrize("run", [False, True])
def test_a_sum_of_two_replicas_may_run_on_either_and_nowhere_else(devs, run):
    devices = [*_devices(devs, run), "/device:GPU:2" if not run else devs[2]]
    with tf.device(devices[0]):
        a = tf.Variable(1.0)
    with tf.device(devices[1]):
        b = tf.Variable(2.0)
    for where, ok in ((devices[0], True), (devices[1], True), (devices[2], False)):

        @tf.function
        def step(where=where):
            with tf.device(devices[0]):
                left = a * 2.0
            with tf.device(devices[1]):
                right = b * 2.0
            with tf.device(where):
                return left + right + 1.0

        report = placement.audit(step, owners={devices[0]: [a], devices[1]: [b]}, run=run)
        assert report.ok == ok, report
        if not ok:  # the sum, then the +1 of it: both may go to either owner
            assert report.counts() == {("AddV2", devices[2], " or ".join(sorted(devices[:2]))): 2}, report


@pytest.mark.parametrize("run", [False, True])
def test_data_a_device_was_given_belongs_to_it_weakly(devs, run):
    devices = _devices(devs, run)
    with tf.device(devices[1]):
        w = tf.Variable(tf.ones([64, 4]))
    for augment_on_1 in (True, False):

        @tf.function
        def step(x, augment_on_1=augment_on_1):
            with tf.device(devices[1]):
                share = tf.identity(x)  # the batch, copied to device 1: device 1's data, weakly
            with tf.device(devices[1]) if augment_on_1 else contextlib.nullcontext():
                augmented = tf.reverse(share, [1])  # asks for no device (False): runs on device 0
            with tf.device(devices[1]):
                return tf.reduce_sum(tf.matmul(augmented, w))  # device 1's weight: device 1's, strongly

        report = placement.audit(step, tf.ones([2, 64]), owners={devices[1]: [w]}, run=run)
        expected = {} if augment_on_1 else {("ReverseV2", devices[0], devices[1]): 1}
        assert report.counts() == expected, report


def test_an_op_the_run_does_not_show_and_nothing_places_fails_the_report(devs, monkeypatch):
    with tf.device(devs[1]):
        w = tf.Variable(tf.ones([4, 4]))

    @tf.function
    def step(x):
        h = tf.matmul(x, w, name="product")  # asks for no device
        with tf.device(devs[1]):
            return tf.reduce_sum(h)

    real = timeline.placement
    monkeypatch.setattr(timeline, "placement", lambda *a: [row for row in real(*a) if row[0] != "product"])
    report = placement.audit(step, tf.ones([2, 4]), owners={devs[1]: [w]}, run=True)
    assert not report.ok and report.unresolved == ["product (MatMul)"], report
    assert "1 unresolved" in str(report) and "unresolved: product (MatMul)" in str(report)
    monkeypatch.setattr(timeline, "placement", lambda *_: [("elsewhere", "NoOp", devs[0])])  # no name matches
    with pytest.raises(RuntimeError, match="found in the run by its name"):
        placement.audit(step, tf.ones([2, 4]), owners={devs[1]: [w]}, run=True)
