"""Core devices: one TensorFlow server process per core, started by `devices.simulate(n, kind="cores")`.

The unit tests share one process that already simulated 4 logical CPUs, so every test that
connects to core devices runs a small driver script in a process of its own (cwd = the
repository root, so that it imports this checkout's `tutorial_lib`). The environment keeps
TUTORIAL_DEVICE=cpu from the root conftest.py: core devices are CPUs and must still be used.
One driver serves the checks of computing across two core devices and of `timeline.trace` on
them: each driver costs three TensorFlow starts. Workers that fail to start are tested here,
in this process: nothing connects to them.
"""

import json
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tutorial_lib import cluster, core_devices, devices, processes, timeline

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 10.0  # how long stopped workers may take to disappear
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find live workers")


def driver(code: str, *args) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code), *map(str, args)]


def tagged(stdout: str, tag: str) -> list:
    """The JSON values of every line 'TAG value' the driver printed."""
    return [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines() if line.startswith(tag + " ")]


def alive(pid: int) -> bool:
    """Whether a worker with this pid still runs (a zombie has finished; a reused pid runs another program)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z" and command.startswith(sys.executable.encode())


def still_alive(pids, within: float = DEADLINE_S) -> list[int]:
    end = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


# --- which core each device gets (no processes) ------------------------------------------


def test_one_core_each_while_there_are_enough(recwarn):
    assert core_devices.cores_for(2, [1, 0]) == [0, 1]
    assert not recwarn.list


def test_more_devices_than_cores_warns_what_the_timings_then_mean():
    with pytest.warns(UserWarning, match="no longer mean one core per device"):
        assert core_devices.cores_for(3, [0, 1]) == [0, 1, 0]


def test_plan_for_core_devices_says_its_model():
    layout = devices.plan(2, kind="cores", physical_gpus=8)  # core devices even where GPUs exist
    assert (layout.device_type, layout.model, layout.nccl_ok) == ("CPU", "cores", False)
    assert "one process per core" in str(layout)


# --- two core devices in a process of their own ------------------------------------------

CONNECTED = """
    import json, os, sys, tempfile, time, warnings
    from pathlib import Path
    from tutorial_lib import cluster, core_devices, devices, processes, timeline, worker_traces

    assert os.environ["TUTORIAL_DEVICE"] == "cpu"
    names = devices.simulate(2, kind="cores")
    print("PIDS", json.dumps([w.process.pid for w in core_devices.workers]), flush=True)
    print("LOGS", json.dumps([str(core_devices.workers[0].log.parent), str(cluster.log_root())]), flush=True)
    import tensorflow as tf

    @tf.function
    def step(a):
        with tf.device(names[0]):
            product = tf.matmul(a, a)  # on task 0 ...
        with tf.device(names[1]):
            total = tf.reduce_sum(product)  # ... feeds an op on task 1
        return product, total

    product, total = step(tf.ones([4, 4]))
    print("RESULT", json.dumps({"names": names, "product": product.device, "total": total.device,
                                "value": float(total), "model": devices.current().model}))
    print("AGAIN", json.dumps(devices.simulate(2, kind="cores")))
    for n, kind in ((3, "cores"), (2, "auto")):
        try:
            devices.simulate(n, kind=kind)
        except RuntimeError as err:
            print("REFUSED", json.dumps(str(err)))

    # Timelines across the two core devices (timeline.trace), on the same workers.
    tempfile.tempdir = sys.argv[1]  # the test's own folder: trace folders must not stay in it
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
def connected(tmp_path_factory):
    folder = tmp_path_factory.mktemp("traces")
    result = subprocess.run(driver(CONNECTED, folder), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    result.folder = folder
    return result


@pytest.mark.slow
def test_core_devices_compute_across_worker_tasks(connected):
    (result,) = tagged(connected.stdout, "RESULT")
    task = [f"/job:worker/replica:0/task:{k}/device:CPU:0" for k in range(2)]
    assert result["names"] == task
    assert (result["product"], result["total"]) == (task[0], task[1])
    assert result["value"] == 64.0  # ones(4, 4) @ ones(4, 4) is all fours
    assert result["model"] == "cores"  # honoured although TUTORIAL_DEVICE=cpu


@pytest.mark.slow
def test_simulate_cores_twice_returns_the_same_devices(connected):
    (result,) = tagged(connected.stdout, "RESULT")
    assert tagged(connected.stdout, "AGAIN") == [result["names"]]
    assert connected.stdout.count("2 core CPU device(s)") == 2  # announced both times


@pytest.mark.slow
def test_another_count_or_model_says_restart(connected):
    other_count, other_model = tagged(connected.stdout, "REFUSED")
    assert "2 core devices; it cannot switch to 3 core devices" in other_count
    assert "Restart the kernel" in other_count and "simulate(3, kind='cores')" in other_count
    assert "cannot switch to 2 CPU devices" in other_model and "Restart the kernel" in other_model


@pytest.mark.slow
@linux_only
def test_workers_end_when_the_kernel_exits(connected):
    (pids,) = tagged(connected.stdout, "PIDS")
    assert len(pids) == 2
    assert still_alive(pids) == []


@pytest.mark.slow
def test_worker_logs_are_removed_when_the_kernel_exits(connected):
    ((folder, log_root),) = tagged(connected.stdout, "LOGS")  # the log root of the kernel's temporary folder
    assert Path(folder).parent == Path(log_root) and Path(log_root).name == cluster.log_root().name
    assert not Path(folder).exists()


# --- timelines across the two core devices (timeline.trace), from the same driver -----------

TASK = [f"/job:worker/replica:0/task:{k}/device:CPU:0" for k in range(2)]


def _report(connected, tag: str):
    (report,) = tagged(connected.stdout, tag)
    return report


def _compute(report, device):
    """(start, end) of the matmuls and tanhs a device ran (its variable reads may run early)."""
    return [(s, e) for d, t, s, e in report["events"] if d == device and ("MatMul" in t or t == "Tanh")]


@pytest.mark.slow
def test_a_dependency_chain_runs_on_one_device_after_the_other(connected):
    report = _report(connected, "SEQUENTIAL")
    assert {d for d, *_ in report["events"]} == set(TASK)  # both workers' ops, named after their devices
    first, second = _compute(report, TASK[0]), _compute(report, TASK[1])
    assert len(first) == len(second) == 12  # 6 matmuls and 6 tanhs each
    # One clock: task 1 cannot start before task 0's result reached it.
    assert max(e for _, e in first) <= min(s for s, _ in second)
    # Strictly sequential, so about one device busy at a time whatever the load.
    assert 0 < sum(report["busy"].values()) <= 1.15


def _both_computing_ms(report) -> float:
    """Milliseconds during which both devices were running a matmul or tanh at the same time."""
    first, second = (timeline.merged(_compute(report, d)) for d in TASK)
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in first for s2, e2 in second)


@pytest.mark.slow
def test_independent_chains_keep_both_devices_busy(connected):
    report = _report(connected, "PARALLEL")
    assert {d for d, *_ in report["events"]} == set(TASK)
    assert all(len(_compute(report, d)) == 2 * 48 for d in TASK)  # 2 steps of 24 matmuls and 24 tanhs
    # Neither chain waits for the other: the two devices compute at the same time. How much of
    # the span both are busy depends on the machine's load (a busy CI machine measured 1.26
    # devices on average, a quiet one over 1.5), so the test asserts the overlap, not its size;
    # the dependent chain above has none.
    assert _both_computing_ms(report) > 0
    assert _both_computing_ms(_report(connected, "SEQUENTIAL")) == 0


@pytest.mark.slow
def test_the_profiler_clients_own_messages_stay_out_of_the_output(connected):
    assert _report(connected, "SEQUENTIAL")  # traces ran...
    assert "Starting to trace" not in connected.stdout  # ...and TensorFlow's C++ client printed nothing


@pytest.mark.slow
def test_an_idle_worker_is_no_error(connected):
    report = _report(connected, "ONE_DEVICE")
    assert {d for d, t, *_ in report["events"] if "MatMul" in t} == {TASK[0]}


@pytest.mark.slow
def test_ops_of_this_process_are_traced_with_a_warning(connected):
    report = _report(connected, "HERE")
    assert {d for d, t, *_ in report["events"] if "MatMul" in t} == {TASK[0], "/device:CPU:0"}
    (warning,) = _report(connected, "WARNED")
    assert "in this process, on no core device" in warning and "'/device:CPU:0'" in warning


@pytest.mark.slow
def test_a_step_longer_than_the_capture_window_is_refused(connected):
    report = _report(connected, "OVERRUN")
    assert report["error"].startswith("RuntimeError") and "would miss ops" in report["error"]
    assert report["left"] == []


@pytest.mark.slow
def test_fn_raising_under_the_trace_leaves_no_files(connected):
    assert _report(connected, "RAISES") == {"error": "ValueError: boom", "left": []}


@pytest.mark.slow
def test_tracing_on_a_worker_that_died_is_a_clear_error(connected):
    # caught before the warm-up: it would fail with gRPC's words, which name no core device
    dead = _report(connected, "DEAD")
    assert re.search(r"core device 1 \(pid \d+, core \d+\) exited with status", dead)
    assert "restart the kernel" in dead


# --- a worker that cannot start (in this process: it fails before anything connects) -------

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]  # a worker still starting, or hung


@pytest.fixture
def spawned(monkeypatch):
    """The processes `core_devices.start` spawns, recorded as it spawns them."""
    started = []

    def spawn(command, **kwargs):
        started.append(real_spawn(command, **kwargs))
        return started[-1]

    real_spawn = processes.spawn
    monkeypatch.setattr(processes, "spawn", spawn)
    return started


@linux_only
@pytest.mark.slow
def test_a_worker_whose_port_is_taken_is_a_clear_error_and_the_others_are_stopped(monkeypatch, spawned):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(core_devices, "free_ports", lambda n: [port] + cluster.free_ports(n - 1))
        real_command = core_devices._worker_command
        monkeypatch.setattr(
            core_devices,
            "_worker_command",  # task 0 real, task 1 still starting
            lambda task, core, addresses: SLEEPER if task else real_command(task, core, addresses),
        )
        expected = (
            r"(?s)core device 0 did not start: .*localhost:\d+ on core \d+\) exited with status 1"
            r".*is the port taken\?.*Could not start gRPC server"
        )
        with pytest.raises(RuntimeError, match=expected):
            core_devices.start(2)
    assert [p.poll() is not None for p in spawned] == [True, True]  # the healthy one was stopped too
    assert core_devices.workers == []


@linux_only
def test_workers_that_never_get_ready_are_a_clear_error_and_are_stopped(monkeypatch, spawned):
    monkeypatch.setattr(core_devices, "_worker_command", lambda *_: SLEEPER)
    monkeypatch.setattr(core_devices, "START_TIMEOUT_S", 1.0)
    with pytest.raises(RuntimeError, match=r"(?s)core device\(s\) \[0, 1\] not ready after 1 s.*START_TIMEOUT_S"):
        core_devices.start(2)
    assert [p.poll() is not None for p in spawned] == [True, True]
    assert core_devices.workers == []
