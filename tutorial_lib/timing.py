"""The timing tools the notebooks use: warm up, repeat, take the median.

A laptop is noisy: other programs, turbo clocks and the garbage collector all move single
runs. So compare figures only as ratios measured in the same run (2 devices vs 1, now),
never against a fixed number of milliseconds.

- `median_time(fn, *args)`: median wall-clock seconds of a call.
- `measure(fn, *args)`: the median and the interquartile spread of the repeats.
- `cores_used(fn, *args)`: how many cores are busy on average while `fn` runs.
- `interleaved(variants, rounds)`: several variants timed in turns, so that a change in the
  machine's load (another program starting, the clock slowing down) weighs on them all alike.
- `ratio(slow, fast)` and `verdict(variant, baseline)`: a speed ratio with the range its
  spreads allow, and the word for it ("faster", "slower", "no significant difference").
"""

from __future__ import annotations

import math
import statistics
import time
from typing import NamedTuple

from . import checks

# The clocks, read at each call through these names so that tests can put fake ones in.
_clock = time.perf_counter  # wall-clock seconds
_cpu_clock = time.process_time  # CPU seconds of this process, all threads together


def _block(result):
    """Wait until TensorFlow has really finished: fetch every tensor in the result.

    Composite values (a strategy's per-replica results, ragged tensors) are opened up into
    their tensors: a PerReplica has no `numpy`, and would otherwise not be waited for.
    """
    import tensorflow as tf

    tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, result, expand_composites=True)


class Timing(NamedTuple):
    """Seconds of a timed call: the median of the repeats and their interquartile spread."""

    median: float
    spread: float


def _summary(times) -> Timing:
    if len(times) == 1:
        return Timing(times[0], 0.0)
    q1, _, q3 = statistics.quantiles(times, n=4)
    return Timing(statistics.median(times), q3 - q1)


def _timed_call(fn, *args, **kwargs) -> float:
    start = _clock()
    _block(fn(*args, **kwargs))
    return _clock() - start


def _times(fn, args, kwargs, repeats, warmup) -> list[float]:
    """Seconds of each of `repeats` calls, after `warmup` calls that are not timed."""
    repeats = checks.whole_number(repeats, "repeats")
    warmup = checks.whole_number(warmup, "warmup", minimum=0)
    for _ in range(warmup):
        _block(fn(*args, **kwargs))
    return [_timed_call(fn, *args, **kwargs) for _ in range(repeats)]


def median_time(fn, *args, repeats: int = 5, warmup: int = 1, **kwargs) -> float:
    """Median wall-clock seconds of `fn(*args, **kwargs)` over `repeats` runs after `warmup`."""
    return statistics.median(_times(fn, args, kwargs, repeats, warmup))


def measure(fn, *args, repeats: int = 5, warmup: int = 1, **kwargs) -> Timing:
    """(median, spread) in seconds; the spread is the interquartile range of the repeats."""
    return _summary(_times(fn, args, kwargs, repeats, warmup))


def interleaved(variants: dict, rounds: int = 15, warmup: int = 1) -> dict[str, Timing]:
    """Time several variants in turns: each round calls every variant once, in the given order.

    `variants` maps a name to a function of no arguments (use a lambda or
    `functools.partial` to bind them). First `warmup` untimed calls of each, for tracing
    and first allocations. Timing all of one variant, then all of the next, would credit
    one of them with a quiet minute of the machine; in turns, a change of load lands on
    every variant alike. Returns {name: Timing(median, spread)}.
    """
    if not variants:
        raise ValueError("interleaved needs at least one variant to time, got none.")
    rounds = checks.whole_number(rounds, "rounds")
    warmup = checks.whole_number(warmup, "warmup", minimum=0)
    for _ in range(warmup):
        for fn in variants.values():
            _block(fn())
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(_timed_call(fn))
    return {name: _summary(t) for name, t in times.items()}


def ratio(slow: Timing, fast: Timing) -> tuple[float, float, float]:
    """(ratio, low, high): `slow.median / fast.median`, and the range the spreads allow.

    Each time is taken as anywhere within half its interquartile spread of its median
    (the middle half of its repeats), and never below zero; the range runs from the least
    favourable pairing of those bounds to the most favourable (up to infinity when the
    faster time's lower bound reaches zero). A speedup of B over A is `ratio(A, B)`; the
    weak-scaling efficiency of N devices is `ratio(one_device, n_devices)`.
    """
    low_den = fast.median + fast.spread / 2
    high_den = fast.median - fast.spread / 2
    low = max(slow.median - slow.spread / 2, 0.0) / low_den
    high = (slow.median + slow.spread / 2) / high_den if high_den > 0 else math.inf
    return slow.median / fast.median, low, high


def verdict(variant: Timing, baseline: Timing) -> str:
    """Whether `variant` is "faster" or "slower" than `baseline`, or shows "no significant difference".

    Faster only when the whole range of `ratio(baseline, variant)` lies above 1, slower
    only when it lies below: a difference smaller than the noise of the repeats is no
    difference.
    """
    _, low, high = ratio(baseline, variant)
    if low > 1:
        return "faster"
    if high < 1:
        return "slower"
    return "no significant difference"


def cores_used(fn, *args, repeats: int = 50, **kwargs) -> float:
    """Average number of busy cores while `fn` runs: process CPU time over wall time.

    One call first, not counted, so that tracing and first allocations do not weigh in.
    """
    repeats = checks.whole_number(repeats, "repeats")
    _block(fn(*args, **kwargs))
    cpu, wall = _cpu_clock(), _clock()
    for _ in range(repeats):
        _block(fn(*args, **kwargs))
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
