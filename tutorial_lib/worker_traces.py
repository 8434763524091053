"""Timelines on core devices: every worker's profiler captures at once while `fn` runs, and each
trace's ops go on its worker's device and on one clock (each trace records when it started).
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
import threading
import time
import warnings

import tensorflow as tf

from . import core_devices, timeline, timing

# The workers' profilers start capturing within CAPTURE_LEAD_S of being asked (checked afterwards
# from the session times each records), and capture for the lead, plus CAPTURE_MARGIN times the
# steps as long as an untraced step took, plus CAPTURE_SLACK_S.
CAPTURE_LEAD_S = 0.5
CAPTURE_MARGIN = 3.0
CAPTURE_SLACK_S = 1.0
JOIN_GRACE_S = 60.0  # how long after the window the profiler may take to send its traces


def trace_cores(f, args, kwargs, steps: int, logdir: str, where: dict[str, str]) -> list[timeline.Event]:
    """`trace` on core devices: every worker's ops, and this process's own, on one clock."""
    hosts = {w.profiler.replace(":", "_"): core_devices.device_name(w.task) for w in core_devices.workers}
    ran = _profile_workers(f, args, kwargs, steps, logdir, [w.profiler for w in core_devices.workers])
    events = core_events(
        timeline.read_spaces(f"{logdir}/workers"), hosts, where, ran, timeline.read_spaces(f"{logdir}/local")
    )
    here = [e for e in events if e.device not in hosts.values()]
    if here:
        warnings.warn(
            f"{len(here)} op runs of fn were in this process, on no core device (e.g. {here[0].op!r}): ops "
            f"without a tf.device scope, such as a gradient computed outside the stages' scopes, run "
            f"here. They are in the events as device {here[0].device!r}; put them under tf.device to "
            "run them on a core device.",
            stacklevel=3,
        )
    return events


def _profile_workers(f, args, kwargs, steps: int, logdir: str, addresses: list[str]) -> tuple[int, int]:
    """Run `f` `steps` times while the profilers at `addresses` capture into `logdir`/workers, and
    this process's into `logdir`/local; return when `f` started and ended (ns since the epoch)."""
    began = time.perf_counter()
    timing.wait(f(*args, **kwargs))  # an untraced step, timed: it sizes the capture window
    window_s = CAPTURE_LEAD_S + CAPTURE_SLACK_S + CAPTURE_MARGIN * steps * (time.perf_counter() - began)
    failures: list[BaseException] = []

    def capture() -> None:  # blocks for the whole window, so it runs beside f in a thread
        try:
            tf.profiler.experimental.client.trace(
                ",".join(f"grpc://{a}" for a in addresses),
                f"{logdir}/workers",
                int(window_s * 1000),
                num_tracing_attempts=1,
            )
        except Exception as err:  # reported after the join, in the calling thread
            failures.append(err)

    capturing = threading.Thread(target=capture, name="tutorial_trace", daemon=True)
    with _c_stdout_silenced():  # the profiler client prints "Starting to trace ..." from C++
        capturing.start()
        try:
            time.sleep(CAPTURE_LEAD_S)  # the request reaches the workers and they start capturing
            start_ns = time.time_ns()
            timeline.profile(f, args, kwargs, steps, f"{logdir}/local")  # the ops this process runs itself
            end_ns = time.time_ns()
        finally:  # even when f raises: nothing may write into logdir once it is removed
            capturing.join(window_s + JOIN_GRACE_S)
    if capturing.is_alive():
        raise RuntimeError(
            f"the core devices' profilers did not answer within {JOIN_GRACE_S:.0f} s after the "
            f"{window_s:.1f} s capture window ({', '.join(addresses)}); are the workers still running? "
            "Restart the kernel to start them again."
        )
    if failures and not glob.glob(f"{logdir}/workers/**/*.xplane.pb", recursive=True):
        raise RuntimeError(f"the core devices' profilers returned no trace: {failures[0]}") from failures[0]
    return start_ns, end_ns


@contextlib.contextmanager
def _c_stdout_silenced():
    """Send what C++ code writes to file descriptor 1 to /dev/null for the block (in a terminal,
    Python's own prints too; in Jupyter `sys.stdout` is not descriptor 1)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def core_events(spaces: dict, hosts: dict[str, str], where: dict[str, str], ran: tuple[int, int], local=None):
    """The ops of `fn` in the core devices' traces (`spaces`: host -> trace; `hosts`: host -> its
    device) and in this process's (`local`), on one clock. Refuses traces that miss a worker or
    part of fn's run (`ran`: its start and end, ns since the epoch)."""
    missing = sorted(set(hosts) - set(spaces))
    if missing:
        raise RuntimeError(
            f"the profiler returned no trace for {[hosts[h] for h in missing]}; it returned {sorted(spaces)}. "
            "Has that worker stopped? Its log is in tutorial_lib.core_devices.workers[task].log; restart "
            "the kernel to start the core devices again."
        )
    for host, device in hosts.items():
        _check_window(spaces[host], device, ran)
    raw = [r for host, device in hosts.items() for r in timeline.space_events(spaces[host], where, device)]
    raw += [r for space in (local or {}).values() for r in timeline.space_events(space, where)]
    return timeline.as_events(raw)


def _check_window(space, device: str, ran: tuple[int, int]) -> None:
    """Refuse a trace whose capture window does not cover the whole run of fn."""
    session = timeline.session_ns(space)
    if session is None:
        raise RuntimeError(
            f"the trace of {device} does not record when it started, so it cannot be put on the same "
            "clock as the other devices' traces (a TensorFlow version whose profiler does not write "
            "the 'Task Environment' plane?)."
        )
    if session[0] > ran[0] or session[1] < ran[1]:
        ms = [(t - ran[0]) / 1e6 for t in (*session, ran[1])]
        raise RuntimeError(
            f"the profiler of {device} captured from {ms[0]:+.0f} ms to {ms[1]:+.0f} ms but fn ran from 0 to "
            f"{ms[2]:.0f} ms, so the timeline would miss ops. The capture window is sized from an untraced "
            "step; on a busy machine a traced step can take much longer: call trace again, or with fewer steps."
        )
