"""The timing tools the notebooks use: warm up, repeat, take the median.

A laptop is noisy: other programs, turbo clocks and the garbage collector all move single
runs. So compare figures only as ratios measured in the same run (2 devices vs 1, now),
never against a fixed number of milliseconds.

- `median_time(fn, *args)`: median wall-clock seconds of a call.
- `measure(fn, *args)`: the median and the interquartile spread of the repeats.
- `cores_used(fn, *args)`: how many cores are busy on average while `fn` runs.
"""

from __future__ import annotations

import statistics
import time

from . import checks

# The clocks, read at each call through these names so that tests can put fake ones in.
_clock = time.perf_counter  # wall-clock seconds
_cpu_clock = time.process_time  # CPU seconds of this process, all threads together


def _block(result):
    """Wait until TensorFlow has really finished: fetch every tensor in the result."""
    import tensorflow as tf

    tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, result)


def _times(fn, args, kwargs, repeats, warmup) -> list[float]:
    """Seconds of each of `repeats` calls, after `warmup` calls that are not timed."""
    repeats = checks.whole_number(repeats, "repeats")
    warmup = checks.whole_number(warmup, "warmup", minimum=0)
    for _ in range(warmup):
        _block(fn(*args, **kwargs))
    times = []
    for _ in range(repeats):
        start = _clock()
        _block(fn(*args, **kwargs))
        times.append(_clock() - start)
    return times


def median_time(fn, *args, repeats: int = 5, warmup: int = 1, **kwargs) -> float:
    """Median wall-clock seconds of `fn(*args, **kwargs)` over `repeats` runs after `warmup`."""
    return statistics.median(_times(fn, args, kwargs, repeats, warmup))


def measure(fn, *args, repeats: int = 5, warmup: int = 1, **kwargs) -> tuple[float, float]:
    """(median, spread) in seconds; the spread is the interquartile range of the repeats."""
    times = _times(fn, args, kwargs, repeats, warmup)
    if len(times) == 1:
        return times[0], 0.0
    q1, _, q3 = statistics.quantiles(times, n=4)
    return statistics.median(times), q3 - q1


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
