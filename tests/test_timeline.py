import tempfile

import matplotlib.pyplot as plt
import pytest
import tensorflow as tf

from tutorial_lib import timeline
from tutorial_lib.devices import normalize


def _weights(devs, n=2, size=256):
    out = []
    for d in devs[:n]:
        with tf.device(d):
            out.append(tf.Variable(tf.random.stateless_normal([size, size], seed=[0, 1]) / 16))
    return out


def test_placement_reports_the_devices_asked_for_when_they_exist(devs):
    w = _weights(devs)

    def f(x):
        with tf.device(devs[1]):
            return tf.matmul(x, w[1], name="on_one")

    rows = timeline.placement(f, tf.ones([4, 256]))
    assert {name: device for name, _, device in rows}["on_one"] == "/device:CPU:1"
    # x arrives on CPU:0 and is copied to CPU:1: the executed graph shows the copy's two ends
    copies = {(op_type, device) for _, op_type, device in rows if op_type in timeline.COPY_TYPES}
    assert copies == {("_Send", "/device:CPU:0"), ("_Recv", "/device:CPU:1")}


def _fallback_step(x):
    with tf.device("/device:CPU:7"):  # there are 4 CPUs: soft placement moves this op
        asked_seven = tf.math.square(x, name="asked_seven")
    with tf.device("/device:CPU:2"):
        asked_two = tf.math.negative(x, name="asked_two")
    return asked_seven, asked_two


@pytest.mark.usefixtures("devs")  # 4 CPUs
def test_placement_reports_where_an_op_ran_not_the_request():
    x = tf.ones([3])
    asked = {name: device for name, _, device in timeline.requested_placement(_fallback_step, x)}
    ran = {name: device for name, _, device in timeline.placement(_fallback_step, x)}
    assert asked["asked_seven"] == "/device:CPU:7" and asked["asked_two"] == "/device:CPU:2"
    # The executed graph says CPU:0, as the eager runtime does for the same request (a tensor's
    # .device is where the op that made it ran); the profiler records no device for CPU ops.
    with tf.device("/device:CPU:7"):
        eager = tf.math.square(x)
    assert ran["asked_seven"] == normalize(eager.device) == "/device:CPU:0"
    assert ran["asked_two"] == "/device:CPU:2"  # a request that can be met is kept
    # and the request really is impossible: without soft placement it is an error
    tf.config.set_soft_device_placement(False)
    try:
        with pytest.raises(tf.errors.InvalidArgumentError, match="CPU:7"):
            tf.function(_fallback_step)(x)
    finally:
        tf.config.set_soft_device_placement(True)


def test_placement_restores_the_variables_fn_changes(devs):
    with tf.device(devs[1]):
        v = tf.Variable([1.0, 2.0])

    def step(x):
        v.assign_add(x)
        return v.read_value()

    rows = timeline.placement(step, tf.ones([2]))
    assert v.numpy().tolist() == [1.0, 2.0]  # ran once, then restored
    assert ("AssignAddVariableOp", "/device:CPU:1") in {(op_type, device) for _, op_type, device in rows}


@pytest.mark.usefixtures("devs")
def test_trace_reports_the_device_an_op_ran_on():
    events = timeline.trace(_fallback_step, tf.ones([64, 64]))
    ran = {e.op: e.device for e in events}
    assert ran["asked_seven"] == "/device:CPU:0" and ran["asked_two"] == "/device:CPU:2"


def test_sequential_chain_keeps_one_device_busy_at_a_time(devs):
    w = _weights(devs)

    def chain(x):
        for _ in range(4):
            for d, v in zip(devs[:2], w, strict=True):
                with tf.device(d):
                    x = tf.tanh(tf.matmul(x, v))
        return x

    events = timeline.trace(chain, tf.ones([256, 256]), steps=2)
    assert {e.device for e in events} == {"/device:CPU:0", "/device:CPU:1"}
    assert any(e.type == "MatMul" or "MatMul" in e.type for e in events)
    assert all(0 <= e.start <= e.end for e in events)
    busy = timeline.busy_fraction(events)
    assert all(0 < f <= 1 for f in busy.values())
    assert timeline.mean_busy_devices(events) < 1.2


def test_independent_work_overlaps(devs):
    w = _weights(devs, size=512)

    def parallel(x):
        outs = []
        for d, v in zip(devs[:2], w, strict=True):
            with tf.device(d):
                y = x
                for _ in range(12):
                    y = tf.tanh(tf.matmul(y, v))
                outs.append(y)
        return outs

    # Independent chains on two devices are in progress at the same time (whether the OS
    # runs both threads at once does not matter to the trace). How much of the span both are
    # busy moves with the machine's load, so the test asserts that they overlap at all.
    events = timeline.trace(parallel, tf.ones([512, 512]), steps=3)
    lanes = [timeline.merged((e.start, e.end) for e in events if e.device == d) for d in devs[:2]]
    both_ms = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in lanes[0] for s2, e2 in lanes[1])
    assert both_ms > 0


def test_merged_intervals_do_not_double_count():
    assert timeline.merged([(0, 2), (1, 3), (5, 6)]) == [[0, 3], [5, 6]]
    events = [
        timeline.Event("/device:CPU:0", "a", "X", 0, 2),
        timeline.Event("/device:CPU:0", "b", "X", 1, 4),
        timeline.Event("/device:CPU:1", "c", "X", 2, 4),
    ]
    assert timeline.busy_fraction(events) == {"/device:CPU:0": 1.0, "/device:CPU:1": 0.5}
    assert timeline.mean_busy_devices(events) == 1.5


def test_phase_time_splits_busy_time_by_phase():
    events = [
        timeline.Event("/device:CPU:0", "MatMul", "MatMul", 0, 2),
        timeline.Event("/device:CPU:0", "gradient_tape/MatMul", "MatMul", 2, 5),
        timeline.Event("/device:CPU:1", "AssignSubVariableOp", "AssignSubVariableOp", 5, 6),
    ]
    table = timeline.phase_time(events)
    assert table["/device:CPU:0"] == {"forward": 2, "backward": 3, "reduce": 0, "update": 0, "other": 0}
    assert table["/device:CPU:1"]["update"] == 1


def test_phases():
    assert timeline.Event("d", "gradient_tape/MatMul", "MatMul", 0, 1).phase == "backward"
    assert timeline.Event("d", "AssignSubVariableOp", "AssignSubVariableOp", 0, 1).phase == "update"
    assert timeline.Event("d", "MatMul", "MatMul", 0, 1).phase == "forward"
    assert timeline.Event("d", "average_gradients/AddN", "AddN", 0, 1).phase == "reduce"
    assert timeline.Event("d", "ring_all_reduce/add_3", "AddV2", 0, 1).phase == "reduce"


@pytest.mark.parametrize(
    "op, op_type, phase",
    [
        # scope names that merely contain a reduce word are not reduce scopes
        ("tower_0/ToString", "AsString", "forward"),
        ("moving_average/AssignSub", "AssignSubVariableOp", "update"),
        ("scattering/MatMul", "MatMul", "forward"),
        # reduce scopes opened again (TensorFlow's _1, _2), nested, or inside an inlined function
        ("tower_1/ring_all_reduce_2/add_3", "AddV2", "reduce"),
        ("StatefulPartitionedCall/average_gradients_1/truediv", "RealDiv", "reduce"),
        ("nccl_all_reduce/NcclAllReduce", "NcclAllReduce", "reduce"),
        ("replica_1/CollectiveReduceV2", "CollectiveReduceV2", "reduce"),
    ],
)
def test_reduce_scopes_are_whole_name_components(op, op_type, phase):
    assert timeline.Event("d", op, op_type, 0, 1).phase == phase


def test_the_packages_reduce_scopes_are_reduce_and_nothing_else_is(devs):
    from tutorial_lib import allreduce, towers

    def step(a, b):
        with tf.device(devs[0]):
            x = tf.tanh(a)
        with tf.device(devs[1]):
            y = tf.tanh(b)
        twice = allreduce.ring_all_reduce(allreduce.ring_all_reduce([x, y], devices=devs[:2]), devices=devs[:2])
        central = allreduce.allreduce_grads([[x], [y]], method="central", devices=devs[:2])
        averaged = [towers.average_gradients([[x], [y]], devs[0]) for _ in range(2)]
        return twice, central, averaged

    ops = timeline.requested_placement(step, tf.ones([8]), tf.ones([8]))  # the graph's op names
    scopes = (
        "ring_all_reduce/",
        "ring_all_reduce_1/",
        "central_all_reduce/",
        "average_gradients/",
        "average_gradients_1/",
    )
    assert {s for s in scopes if any(name.startswith(s) for name, _, _ in ops)} == set(scopes)
    for name, op_type, device in ops:
        assert (timeline.Event(device, name, op_type, 0, 1).phase == "reduce") == name.startswith(scopes), name


def _trace_folders(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("tutorial_trace_"))


def test_trace_removes_its_files(devs, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this test's own temporary folder
    with tf.device(devs[0]):
        w = tf.Variable(tf.ones([64, 64]))
    events = timeline.trace(lambda x: tf.matmul(x, w), tf.ones([64, 64]))
    assert any(e.op == "MatMul" for e in events)  # the trace was written and read
    assert _trace_folders(tmp_path) == []


def test_trace_removes_its_files_when_fn_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    calls = []

    def fails_when_traced():
        calls.append(1)
        if len(calls) > 1:  # the untraced warm-up succeeds
            raise RuntimeError("boom")
        return tf.constant(1.0)

    with pytest.raises(RuntimeError, match="boom"):
        timeline.trace(fails_when_traced, placement_of=[])
    assert len(calls) == 2 and _trace_folders(tmp_path) == []


def test_plot_has_a_lane_per_device_and_labelled_axes():
    events = [timeline.Event("/device:CPU:0", "a", "X", 0, 2), timeline.Event("/device:CPU:1", "c", "X", 2, 4)]
    ax = timeline.plot(events, title="demo")
    assert ax.get_title() == "demo" and ax.get_xlabel() == "time (ms)"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["CPU:0", "CPU:1"]
    assert timeline.lane_label("/job:worker/replica:0/task:1/device:CPU:0") == "worker 1"
    assert timeline.lane_label("/job:localhost/replica:0/task:0/device:CPU:0") == "CPU:0"
    plt.close(ax.figure)


def test_plot_draws_phases_of_ones_own_and_refuses_one_without_a_colour():
    events = [timeline.Event("/device:CPU:0", "W0/a", "X", 0, 2), timeline.Event("/device:CPU:0", "b", "X", 2, 4)]
    weights = lambda e: "W" if e.op.startswith("W0/") else e.phase  # noqa: E731
    ax = timeline.plot(events, phase_of=weights, colors={"W": "tab:red"})
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["forward", "W"]
    plt.close(ax.figure)
    with pytest.raises(ValueError, match=r"phases \['W'\] have no colour"):
        timeline.plot(events, phase_of=weights)


def test_bad_input():
    with pytest.raises(ValueError, match="steps"):
        timeline.trace(lambda: tf.constant(1.0), steps=0)
    with pytest.raises(ValueError, match="no events"):
        timeline.busy_fraction([])
    with pytest.raises(ValueError, match="no events"):
        timeline.plot([])


def test_placement_after_a_run_that_raised_reads_only_its_own_graphs(devs):
    with tf.device(devs[1]):
        w = tf.Variable(tf.ones([4, 4]))

    @tf.function(jit_compile=True)
    def compiled():  # XLA will not read a variable of another device: the run raises
        return tf.matmul(w, w)

    def fails():
        with tf.device(devs[0]):
            return compiled()

    with pytest.raises(tf.errors.InvalidArgumentError):
        timeline.placement(fails)
    rows = timeline.placement(lambda: tf.add(tf.constant(1.0), 1.0, name="only_this"))
    assert "only_this" in {name for name, _, _ in rows}
    assert not [row for row in rows if "Call" in row[1]], rows  # the failed run's call is not read here
