"""How `worker_traces` merges the core devices' trace files onto one clock, on synthetic traces.

`timeline.trace` on real core devices is tested in tests/test_core_devices.py, from the driver
process that starts them.
"""

import pytest
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from tutorial_lib import timeline, worker_traces

TASK = [f"/job:worker/replica:0/task:{k}/device:CPU:0" for k in range(2)]

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
