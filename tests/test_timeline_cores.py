"""`timeline.trace` on core devices: every worker's ops, on one clock.

The unit tests share a process with 4 logical CPUs, so the traces on core devices run in a
driver process of their own (the pattern of tests/test_core_devices.py). How several
workers' trace files are merged is tested here on synthetic traces.
"""

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from tutorial_lib import timeline, worker_traces

ROOT = Path(__file__).resolve().parents[1]
TASK = [f"/job:worker/replica:0/task:{k}/device:CPU:0" for k in range(2)]

DRIVER = """
    import json, sys, tempfile, time, warnings
    from pathlib import Path
    from tutorial_lib import devices, timeline, worker_traces

    tempfile.tempdir = sys.argv[1]  # the test's own folder: trace folders must not stay in it
    names = devices.simulate(2, kind="cores")
    import tensorflow as tf

    weights = []
    for name in names:
        with tf.device(name):
            weights.append(tf.Variable(tf.random.stateless_normal([512, 512], seed=[0, 1]) / 32))

    def one_after_the_other(x):  # task 1's chain needs task 0's result
        for name, w in zip(names, weights, strict=True):
            with tf.device(name):
                for _ in range(6):
                    x = tf.tanh(tf.matmul(x, w))
        return x

    def side_by_side(x):  # two independent chains, one per device
        outs = []
        for name, w in zip(names, weights, strict=True):
            with tf.device(name):
                y = x
                for _ in range(24):
                    y = tf.tanh(tf.matmul(y, w))
                outs.append(y)
        return outs

    def only_task_0(x):
        with tf.device(names[0]):
            return tf.matmul(x, weights[0])

    def partly_here(x):  # the second matmul has no tf.device scope: it runs in this process
        return tf.matmul(only_task_0(x), weights[1], name="unplaced")

    def report(tag, events):
        rows = [[e.device, e.type, e.start, e.end] for e in events]
        busy = timeline.busy_fraction(events) if events else {}
        print(tag, json.dumps({"events": rows, "busy": busy}), flush=True)

    x = tf.ones([512, 512])
    report("SEQUENTIAL", timeline.trace(one_after_the_other, x))
    report("PARALLEL", timeline.trace(side_by_side, x, steps=2))
    report("ONE_DEVICE", timeline.trace(only_task_0, x))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report("HERE", timeline.trace(partly_here, x))
    print("WARNED", json.dumps([str(w.message) for w in caught]), flush=True)

    calls = []

    def slow_when_traced():  # the third call (warm-up, timed step, traced step) outlasts the window
        calls.append(1)
        if len(calls) == 3:
            time.sleep(worker_traces.CAPTURE_LEAD_S + worker_traces.CAPTURE_SLACK_S + 2.0)
        return only_task_0(x)

    def fails_when_traced():
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("boom")
        return only_task_0(x)

    for tag, fn in (("OVERRUN", slow_when_traced), ("RAISES", fails_when_traced)):
        calls.clear()
        try:
            timeline.trace(fn, placement_of=[])
        except (RuntimeError, ValueError) as err:
            left = sorted(p.name for p in Path(sys.argv[1]).iterdir() if p.name.startswith("tutorial_trace_"))
            print(tag, json.dumps({"error": f"{type(err).__name__}: {err}", "left": left}), flush=True)

    from tutorial_lib import core_devices

    core_devices.workers[1].process.kill()  # a worker that died: its profiler cannot answer
    core_devices.workers[1].process.wait()
    try:
        timeline.trace(only_task_0, x)
    except RuntimeError as err:
        print("DEAD", json.dumps(str(err)), flush=True)
"""


@pytest.fixture(scope="module")
def driven(tmp_path_factory):
    folder = tmp_path_factory.mktemp("traces")
    command = [sys.executable, "-c", textwrap.dedent(DRIVER), str(folder)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    tagged = [line.split(" ", 1) for line in result.stdout.splitlines() if line.split(" ", 1)[0].isupper()]
    return {tag: json.loads(value) for tag, value in tagged} | {"stdout": result.stdout}


def _compute(report, device):
    """(start, end) of the matmuls and tanhs a device ran (its variable reads may run early)."""
    return [(s, e) for d, t, s, e in report["events"] if d == device and ("MatMul" in t or t == "Tanh")]


@pytest.mark.slow
def test_a_dependency_chain_runs_on_one_device_after_the_other(driven):
    report = driven["SEQUENTIAL"]
    assert {d for d, *_ in report["events"]} == set(TASK)  # both workers' ops, named after their devices
    first, second = _compute(report, TASK[0]), _compute(report, TASK[1])
    assert len(first) == len(second) == 12  # 6 matmuls and 6 tanhs each
    # One clock: task 1 cannot start before task 0's result reached it.
    assert max(e for _, e in first) <= min(s for s, _ in second)
    # Strictly sequential, so about one device busy at a time whatever the load.
    assert 0 < sum(report["busy"].values()) <= 1.15


@pytest.mark.slow
def test_independent_chains_keep_both_devices_busy(driven):
    report = driven["PARALLEL"]
    assert {d for d, *_ in report["events"]} == set(TASK)
    assert all(len(_compute(report, d)) == 2 * 48 for d in TASK)  # 2 steps of 24 matmuls and 24 tanhs
    assert sum(report["busy"].values()) > 1.3


@pytest.mark.slow
def test_the_profiler_clients_own_messages_stay_out_of_the_output(driven):
    assert driven["SEQUENTIAL"]  # traces ran...
    assert "Starting to trace" not in driven["stdout"]  # ...and TensorFlow's C++ client printed nothing


@pytest.mark.slow
def test_an_idle_worker_is_no_error(driven):
    report = driven["ONE_DEVICE"]
    assert {d for d, t, *_ in report["events"] if "MatMul" in t} == {TASK[0]}


@pytest.mark.slow
def test_ops_of_this_process_are_traced_with_a_warning(driven):
    report = driven["HERE"]
    assert {d for d, t, *_ in report["events"] if "MatMul" in t} == {TASK[0], "/device:CPU:0"}
    (warning,) = driven["WARNED"]
    assert "in this process, on no core device" in warning and "'/device:CPU:0'" in warning


@pytest.mark.slow
def test_a_step_longer_than_the_capture_window_is_refused(driven):
    report = driven["OVERRUN"]
    assert report["error"].startswith("RuntimeError") and "would miss ops" in report["error"]
    assert report["left"] == []


@pytest.mark.slow
def test_a_worker_that_died_is_a_clear_error(driven):
    # caught before the warm-up: it would fail with gRPC's words, which name no core device
    assert re.search(r"core device 1 \(pid \d+, core \d+\) exited with status", driven["DEAD"])
    assert "restart the kernel" in driven["DEAD"]


@pytest.mark.slow
def test_fn_raising_under_the_trace_leaves_no_files(driven):
    assert driven["RAISES"] == {"error": "ValueError: boom", "left": []}


# --- merging the workers' trace files (synthetic traces, no processes) -------------------

S = 1_000_000_000_000_000_000  # a session start, in ns since the epoch (2001)
MS = 1_000_000  # ns


def _space(start_ns, events, stop_ns=None):
    """A trace file as a worker writes it: session times, and `events` (label, offset in ms,
    duration in ms) on one thread whose times count from the session start."""
    space = xplane_pb2.XSpace()
    env = space.planes.add(name="Task Environment")
    for k, (name, value) in enumerate((("profile_start_time", start_ns), ("profile_stop_time", stop_ns))):
        if value is not None:
            env.stat_metadata[k + 1].name = name
            env.stats.add(metadata_id=k + 1, uint64_value=value)
    host = space.planes.add(name="/host:CPU")
    line = host.lines.add(name="tf_Compute", timestamp_ns=0)
    for k, (label, offset_ms, duration_ms) in enumerate(events):
        host.event_metadata[k + 1].name = label
        line.events.add(metadata_id=k + 1, offset_ps=int(offset_ms * 1e9), duration_ps=int(duration_ms * 1e9))
    return space


# The graph's placement: ops without a tf.device scope get this process's CPU.
WHERE = {"MatMul": "/device:CPU:0", "MatMul_1": "/device:CPU:0", "loss": "/device:CPU:0"}


def test_worker_files_are_merged_on_one_clock_with_the_workers_devices():
    spaces = {
        "localhost_1": _space(S, [("MatMul:_MklMatMul", 1, 2), ("ExecutorState::Process", 0, 5)], S + 10 * MS),
        # started 5 ms later: its event at 0 ms is 4 ms after the other's at 1 ms
        "localhost_2": _space(S + 5 * MS, [("MatMul_1:MatMul", 0, 3), ("x/_1:_Send", 3, 1)], S + 12 * MS),
    }
    hosts = {"localhost_1": TASK[0], "localhost_2": TASK[1]}
    local = {"vm": _space(S + 6 * MS, [("loss:Mean", 2, 1)], S + 9 * MS)}  # this process's own trace
    events = worker_traces.core_events(spaces, hosts, WHERE, ran=(S + 5 * MS, S + 10 * MS), local=local)
    assert [(e.device, e.op, e.type, e.start, e.end) for e in events] == [
        (TASK[0], "MatMul", "_MklMatMul", 0.0, 2.0),  # the device is the worker's, not the graph's default
        (TASK[1], "MatMul_1", "MatMul", 4.0, 7.0),  # runtime bookkeeping and _Send are left out
        ("/device:CPU:0", "loss", "Mean", 7.0, 8.0),  # this process's ops: the graph says where
    ]
    assert timeline.busy_fraction(events) == {TASK[0]: 2 / 8, TASK[1]: 3 / 8, "/device:CPU:0": 1 / 8}


def test_a_missing_worker_file_is_refused():
    spaces = {"localhost_1": _space(S, [("MatMul:MatMul", 1, 2)], S + 10 * MS)}
    hosts = {"localhost_1": TASK[0], "localhost_2": TASK[1]}
    with pytest.raises(RuntimeError, match=r"no trace for \['/job:worker/replica:0/task:1/device:CPU:0'\]"):
        worker_traces.core_events(spaces, hosts, WHERE, ran=(S + MS, S + 2 * MS))


@pytest.mark.parametrize("ran", [(S - MS, S + 2 * MS), (S + MS, S + 11 * MS)], ids=["began early", "ended late"])
def test_a_run_outside_the_capture_window_is_refused(ran):
    spaces = {"localhost_1": _space(S, [("MatMul:MatMul", 1, 2)], S + 10 * MS)}
    with pytest.raises(RuntimeError, match="would miss ops"):
        worker_traces.core_events(spaces, {"localhost_1": TASK[0]}, WHERE, ran)


def test_a_trace_without_session_times_is_refused():
    spaces = {"localhost_1": _space(S, [("MatMul:MatMul", 1, 2)], stop_ns=None)}
    with pytest.raises(RuntimeError, match="cannot be put on the same clock"):
        worker_traces.core_events(spaces, {"localhost_1": TASK[0]}, WHERE, ran=(S + MS, S + 2 * MS))
