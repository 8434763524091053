"""How the benchmark reports a figure, and what its timed functions are given and return.

- `row(case, variant, seconds, spread, **extra)`: one row of the table (milliseconds), with
  the device model in use (`device_model()`: "cores", "logical" or "real").
- `compared(variant, baseline, name)`: a ratio of medians, the range its spreads allow and
  the verdict ("faster", "slower", "no significant difference"), as row fields.
- `checksums(devs, per_device)`: what a timed function returns instead of its results.
- `synthetic_batch(examples)`: random inputs, for timing.
"""

from __future__ import annotations

from . import timing


def device_model() -> str:
    """How the devices in use are made: "cores", "logical" or "real" (see `devices.MODELS`)."""
    from . import devices

    layout = devices.current()
    return layout.model if layout else "none"


def row(case, variant, seconds, spread, **extra):
    return {
        "case": case,
        "variant": variant,
        "ms": 1e3 * seconds,
        "spread_ms": 1e3 * spread,
        **extra,
        "device_model": device_model(),
    }


def compared(variant: timing.Timing, baseline: timing.Timing, name: str) -> dict:
    """`name` (baseline's time over variant's), its range from the spreads, and the verdict on variant."""
    value, low, high = timing.ratio(baseline, variant)
    return {name: value, f"{name}_range": [low, high], f"{name}_verdict": timing.verdict(variant, baseline)}


def checksums(devs, per_device):
    """One scalar per device: the sum of every result on it.

    A timed function returns these instead of its results. Fetching them waits for every
    result (on a GPU, for the kernels behind them, not only their launch), without copying
    the results themselves into this process, which on core devices would add a transfer
    to the time. A data dependency, because TensorFlow prunes ops that only a control
    dependency keeps.
    """
    import tensorflow as tf

    sums = []
    for d, results in zip(devs, per_device, strict=True):
        with tf.device(d):
            sums.append(tf.add_n([tf.reduce_sum(r) for r in tf.nest.flatten(results)]))
    return sums


def synthetic_batch(examples, seed=0):
    """Random 8x8 images and labels: for timing, where the values do not matter."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    x = tf.constant(rng.random((examples, 8, 8, 1), dtype=np.float32))
    return x, tf.constant(rng.integers(0, 10, examples, dtype=np.int32))
