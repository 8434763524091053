"""Core devices that fail after they started: a dead worker, a frozen one, Ctrl-C while an op
waits for a frozen one, and a kernel killed with its workers running.

One driver process starts four core devices and breaks them one by one (the pattern of
tests/test_core_devices.py, whose helpers it uses).
"""

import os
import re
import signal
import subprocess
import tempfile

import pytest
from test_core_devices import ROOT, alive, driver, linux_only, still_alive, tagged  # tests/ is on sys.path

from tutorial_lib import core_devices

# One driver, four core devices: 3 is killed, 2 frozen (as by SIGSTOP or Ctrl-Z), 1 frozen while
# a Ctrl-C (SIGINT to the driver) comes during its op; 0 must outlive the refusal, then die
# with the driver when the test SIGKILLs it.

FAULTS = """
    import json, os, signal, sys, threading, time
    from tutorial_lib import core_devices, devices

    names = devices.simulate(4, kind="cores")
    import tensorflow as tf
    pids = [w.process.pid for w in core_devices.workers]

    def run_on(task):
        start = time.monotonic()
        try:
            with tf.device(names[task]):
                float(tf.reduce_sum(tf.ones([2, 2]) * 2))
            ended = "ran"
        except tf.errors.OpError as err:
            ended = type(err).__name__
        return [ended, time.monotonic() - start]

    os.kill(pids[3], signal.SIGKILL)  # it dies before its first op
    core_devices.workers[3].process.wait()
    print("DEAD", json.dumps(run_on(3)), flush=True)
    os.kill(pids[2], signal.SIGSTOP)
    print("FROZEN", json.dumps(run_on(2)), flush=True)

    os.kill(pids[1], signal.SIGSTOP)
    start, seen = time.monotonic(), threading.Event()

    def interrupt_once(signum, frame):  # as Python's own handler, but later presses do nothing
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    def press_ctrl_c():  # every 0.5 s until the interrupt is seen (under load, once, none was)
        while not seen.wait(0.5):
            os.kill(os.getpid(), signal.SIGINT)

    signal.signal(signal.SIGINT, interrupt_once)
    threading.Thread(target=press_ctrl_c, daemon=True).start()
    returned = interrupted = None
    try:  # the KeyboardInterrupt comes once the op returns: from it, or just after it
        returned = run_on(1)
        time.sleep(10)
    except KeyboardInterrupt:
        interrupted = time.monotonic() - start
    seen.set()
    print("INTERRUPTED", json.dumps(interrupted), flush=True)  # outside the try: an interrupt
    print("RETURNED", json.dumps(returned), flush=True)  # inside a print would cut its line

    try:
        devices.simulate(4, kind="cores")
    except RuntimeError as err:
        print("REFUSED", json.dumps(str(err)), flush=True)
    print("ALIVE", json.dumps(pids[0]), flush=True)
    time.sleep(600)  # until the test kills this process
"""


@pytest.fixture(scope="module")
def faults():
    """The driver's output up to ALIVE, and whether worker 0 outlived the driver's SIGKILL."""
    with tempfile.TemporaryFile("w+") as errors:  # a file, not a pipe that nobody reads
        process = subprocess.Popen(driver(FAULTS), cwd=ROOT, stdout=subprocess.PIPE, stderr=errors, text=True)
        try:
            out = ""
            while not tagged(out, "ALIVE"):  # then the driver sleeps
                line = process.stdout.readline()
                if not line:
                    errors.seek(0)
                    pytest.fail(f"the driver ended early: {out}{errors.read()[-3000:]}")
                out += line
            (survivor,) = tagged(out, "ALIVE")
            assert alive(survivor), out
            os.kill(process.pid, signal.SIGKILL)  # no Python code runs: only PR_SET_PDEATHSIG can help
            process.wait()
            return out, still_alive([survivor])
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            process.stdout.close()


def _ends_in_an_error_within_the_limit(ended):
    # Before, the dead worker's op waited 120 s and the frozen one's 100 s and more.
    assert ended[0] == "UnavailableError" and ended[1] < core_devices.FROZEN_LIMIT_S + 30, ended


def _refused(out: str, task: int, what: str) -> None:
    (refused,) = tagged(out, "REFUSED")
    assert re.search(rf"core device {task} \(pid \d+, core \d+\) {re.escape(what)}", refused), refused
    assert "restart the kernel" in refused


@linux_only
@pytest.mark.slow
@pytest.mark.parametrize(
    "tag, task, refusal",
    [("DEAD", 3, "exited with status -9"), ("FROZEN", 2, "was frozen (stopped) for 3 s and was killed")],
)
def test_a_dead_or_frozen_worker_ends_its_op_in_an_error_and_simulate_refuses_it(faults, tag, task, refusal):
    out, _ = faults
    _ends_in_an_error_within_the_limit(*tagged(out, tag))
    _refused(out, task, refusal)


@linux_only
@pytest.mark.slow
def test_ctrl_c_stops_the_wait_for_a_frozen_worker(faults):
    out, _ = faults
    (interrupted,) = tagged(out, "INTERRUPTED")  # seconds to the KeyboardInterrupt; before the watcher, 90
    assert interrupted is not None and interrupted < core_devices.FROZEN_LIMIT_S + 30, out
    _refused(out, 1, "was frozen (stopped) for 3 s and was killed")


@linux_only
@pytest.mark.slow
def test_the_last_worker_dies_with_a_killed_kernel(faults):
    _, survivors = faults
    assert survivors == []
