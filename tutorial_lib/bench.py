"""Timing that survives a noisy laptop: warm up, repeat, take the median.

Compare figures only as ratios measured in the same run (2 devices vs 1, now), never
against a fixed number of milliseconds.
"""

from __future__ import annotations

import statistics
import time


def _block(result):
    """Wait until TensorFlow has really finished: fetch every tensor in the result."""
    import tensorflow as tf

    tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, result)


def median_time(fn, *args, repeats: int = 5, warmup: int = 1, **kwargs) -> float:
    """Median wall-clock seconds of `fn(*args, **kwargs)` over `repeats` runs after `warmup`."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}.")
    for _ in range(warmup):
        _block(fn(*args, **kwargs))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _block(fn(*args, **kwargs))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cores_used(fn, *args, repeats: int = 50, **kwargs) -> float:
    """Average number of busy cores while `fn` runs: process CPU time over wall time."""
    _block(fn(*args, **kwargs))
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(repeats):
        _block(fn(*args, **kwargs))
    return (time.process_time() - cpu) / (time.perf_counter() - wall)
