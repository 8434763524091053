"""The course's timing tools: warm up, repeat, take the median and the interquartile range
(`Timing`), and compare variants only as ratios measured in the same run."""

from __future__ import annotations

import math
import numbers
import os
import statistics
import time
from typing import NamedTuple

from . import checks

MIN_SAMPLES = 3  # fewer give no spread worth the name: no verdict from them
MIN_WINDOW = 0.1  # seconds: cores_taken's shortest window, 10 ticks of /proc/stat
QUIET_BELOW = 0.25  # cores kept busy by other programs: below this a machine counts as quiet
_clock = time.perf_counter  # module names, so that tests can put fake clocks in
_cpu_clock = time.process_time  # CPU seconds of this process, all threads together


class Timing(NamedTuple):
    """Seconds of a timed call: the median of `samples` runs and their interquartile range."""

    median: float
    spread: float
    samples: int


def summarize(seconds) -> Timing:
    """The `Timing` of a list of measured seconds."""
    seconds = list(seconds)
    if not seconds:
        raise ValueError("no times to summarize: time at least one call.")
    if len(seconds) == 1:
        return Timing(seconds[0], 0.0, 1)
    q1, _, q3 = statistics.quantiles(seconds, n=4)
    return Timing(statistics.median(seconds), q3 - q1, len(seconds))


def wait(result):
    """Wait until TensorFlow has computed every tensor of `result` (a strategy's per-replica
    values and other composites are opened up), and return it."""
    import tensorflow as tf

    tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, result, expand_composites=True)
    return result


def _timed_call(fn) -> float:
    start = _clock()
    wait(fn())
    return _clock() - start


def measure(fn, *args, repeats: int = 5, warmup: int = 1, **kwargs) -> Timing:
    """The `Timing` of `fn(*args, **kwargs)` over `repeats` runs, after `warmup` untimed ones."""
    repeats = checks.whole_number(repeats, "repeats")
    return interleaved({"fn": lambda: fn(*args, **kwargs)}, rounds=repeats, warmup=warmup)["fn"]


def median_time(fn, *args, repeats: int = 5, warmup: int = 1, **kwargs) -> float:
    """Median wall-clock seconds of `fn(*args, **kwargs)`."""
    return measure(fn, *args, repeats=repeats, warmup=warmup, **kwargs).median


def interleaved(variants: dict, rounds: int = 15, warmup: int = 1) -> dict[str, Timing]:
    """Time several variants in turns: each round calls every variant once, in the given order.

    `variants` maps a name to a function of no arguments. Timed one after another, a quiet
    minute of the machine would favour one variant; in turns, a change of load lands on all.
    """
    if not variants:
        raise ValueError("interleaved needs at least one variant to time, got none.")
    rounds = checks.whole_number(rounds, "rounds")
    warmup = checks.whole_number(warmup, "warmup", minimum=0)
    for _ in range(warmup):  # tracing and first allocations, untimed
        for fn in variants.values():
            wait(fn())
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(_timed_call(fn))
    return {name: summarize(t) for name, t in times.items()}


def ratio(slow: Timing, fast: Timing) -> tuple[float, float, float]:
    """(ratio, low, high): `slow.median / fast.median` and the range the spreads allow, each
    time taken as anywhere within half its spread of its median (never below zero). A speedup
    of B over A is `ratio(A, B)`."""
    low_den = fast.median + fast.spread / 2
    high_den = fast.median - fast.spread / 2
    low = max(slow.median - slow.spread / 2, 0.0) / low_den
    high = (slow.median + slow.spread / 2) / high_den if high_den > 0 else math.inf
    return slow.median / fast.median, low, high


def verdict(variant: Timing, baseline: Timing, busy: bool = False) -> str:
    """The word for `variant` against `baseline`: "faster" or "slower" when the whole range of
    `ratio(baseline, variant)` lies on one side of 1, "no significant difference" otherwise,
    "too few samples" below `MIN_SAMPLES`, and "busy machine" when other programs took cores
    while it was measured (`busy`, from `cores_taken`): then no verdict holds."""
    if busy:
        return "busy machine"
    if min(variant.samples, baseline.samples) < MIN_SAMPLES:
        return "too few samples"
    _, low, high = ratio(baseline, variant)
    if low > 1:
        return "faster"
    if high < 1:
        return "slower"
    return "no significant difference"


def cores_used(fn, *args, repeats: int = 50, **kwargs) -> float:
    """Average number of busy cores while `fn` runs: this process's CPU time over wall time
    (one call first, not counted)."""
    repeats = checks.whole_number(repeats, "repeats")
    wait(fn(*args, **kwargs))
    cpu, wall = _cpu_clock(), _clock()
    for _ in range(repeats):
        wait(fn(*args, **kwargs))
    return (_cpu_clock() - cpu) / (_clock() - wall)


def busy_warning(load: float, cores: int) -> str | None:
    """A warning when other programs keep more than every core busy (load average above the cores)."""
    if load <= cores:
        return None
    return (
        f"warning: this machine is busy (load average {load:.1f} on {cores} cores): other processes take "
        "cores from the devices while they are measured, so ratios become noisy and speedups shrink. "
        "Close other programs, or read the figures as lower bounds with wide spreads."
    )


def cores_taken(seconds: float = 1.0) -> float | None:
    """How many of this process's cores other programs kept busy over the next `seconds`: the busy
    time of those cores in /proc/stat, less this process's own CPU time. None without /proc/stat."""
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not MIN_WINDOW <= seconds < math.inf:
        raise ValueError(
            f"seconds must be a finite number >= {MIN_WINDOW} (/proc/stat counts 10 ms ticks, so a shorter window "
            f"measures nothing and would say quiet), got {seconds!r}: e.g. cores_taken(1.0)."
        )
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    try:
        before = _busy_and_total(cores)
    except (OSError, ValueError):
        return None
    own, wall = _cpu_clock(), _clock()
    time.sleep(seconds)
    own, wall = _cpu_clock() - own, _clock() - wall
    after = _busy_and_total(cores)
    busy, total = after[0] - before[0], after[1] - before[1]
    return max(busy / max(total, 1e-9) * len(cores) - own / wall, 0.0)


def _busy_and_total(cores) -> tuple[float, float]:
    """Busy and total clock ticks since boot, summed over the `cores` lines of /proc/stat."""
    busy = total = 0.0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
                ticks = [float(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
                busy, total = busy + sum(ticks) - ticks[3] - ticks[4], total + sum(ticks)
    if not total:
        raise ValueError("no line of /proc/stat for this process's cores")
    return busy, total


def machine_state(taken: float | None, cores: int) -> tuple[bool, str]:
    """(busy?, a sentence to print before any timing verdict) from `cores_taken`."""
    cores = checks.whole_number(cores, "cores")
    if taken is not None and (isinstance(taken, bool) or not isinstance(taken, numbers.Real) or not taken >= 0):
        raise ValueError(f"taken is what cores_taken() returns, a number of cores >= 0 or None, got {taken!r}.")
    if taken is None:
        return False, "the machine's load cannot be read here (no /proc/stat): judge the verdicts yourself"
    if round(taken, 2) < QUIET_BELOW:
        return False, f"quiet machine: other programs kept {taken:.2f} of {cores} cores busy"
    return True, (
        f"busy machine: other programs kept {taken:.1f} of {cores} cores busy, so the timings below are slower "
        "and noisier than on a quiet machine, and no verdict is drawn from them. Close other programs and re-run."
    )
