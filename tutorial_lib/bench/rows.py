"""A benchmark row (a dict: case, variant, devices, ms, spread_ms, samples, device_model and
ratio fields, each with its range and verdict): made, compared, shown as a table, saved as JSON."""

from __future__ import annotations

import json
import os
import tempfile

from .. import timing

# The fields every row has; the table shows any others as notes.
FIELDS = ("case", "variant", "devices", "ms", "spread_ms", "samples", "device_model")


def device_model() -> str:
    """How the devices in use are made: "cores", "logical" or "real" (`devices.current().model`)."""
    from .. import devices

    layout = devices.current()
    return layout.model if layout else "none"


def row(case: str, variant: str, t: timing.Timing | None, per: int = 1, **extra) -> dict:
    """The row of a `Timing` (seconds), in milliseconds per `per` (the steps one timed call ran);
    `t` None: a row without a time of its own (a fit, or a case skipped with its reason)."""
    times = {"ms": None, "spread_ms": None, "samples": 0}
    if t is not None:
        times = {"ms": 1e3 * t.median / per, "spread_ms": 1e3 * t.spread / per, "samples": t.samples}
    return {"case": case, "variant": variant, **times, **extra, "device_model": device_model()}


def timing_of(r: dict, per: float = 1) -> timing.Timing:
    """A row's time as a `Timing` in seconds (divided by `per`, e.g. examples): the one way back."""
    return timing.Timing(r["ms"] / 1e3 / per, r["spread_ms"] / 1e3 / per, r["samples"])


def compared(variant: timing.Timing, baseline: timing.Timing, name: str) -> dict:
    """`name`: baseline's time over variant's, with the range its spreads allow and the verdict on variant."""
    value, low, high = timing.ratio(baseline, variant)
    return {name: value, f"{name}_range": [low, high], f"{name}_verdict": timing.verdict(variant, baseline)}


def _ratio_name(r: dict) -> str | None:
    return next((k[: -len("_verdict")] for k in r if k.endswith("_verdict")), None)


def _short(value) -> str:
    if isinstance(value, list | tuple):
        return "[" + ", ".join(map(_short, value)) + "]"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def format_table(rows) -> str:
    """The rows as text at a notebook's width: time, samples, the row's ratio with its range and
    verdict; any other fields on an indented line below."""
    lines = [f"{'case':15s} {'variant':30s} {'dev':>3s} {'ms':>8s} {'spread':>7s} {'n':>3s}  {'ratio':26s} verdict"]
    for r in rows:
        name = _ratio_name(r)
        ratio, verdict = "", ""
        if name:
            low, high = r[f"{name}_range"]
            ratio, verdict = f"{name} {r[name]:.2f} [{low:.2f}-{high:.2f}]", r[f"{name}_verdict"]
        ms, spread = ("-", "-") if r["ms"] is None else (f"{r['ms']:.3f}", f"{r['spread_ms']:.3f}")
        cells = f"{r['case']:15s} {r['variant']:30s} {r.get('devices', '-')!s:>3s} {ms:>8s} {spread:>7s}"
        lines.append(f"{cells} {r['samples']:3d}  {ratio:26s} {verdict}".rstrip())
        skip = {*FIELDS, *(f"{name}{s}" for s in ("", "_range", "_verdict") if name)}
        notes = ", ".join(f"{k} {_short(v)}" for k, v in r.items() if k not in skip)
        if notes:
            lines.append(f"    {notes}")
    return "\n".join(lines)


def json_path_problem(path: str) -> str | None:
    """Why `path` cannot take a JSON file (a message that names the fix), or None if it can."""
    if not path.strip():
        return "--json needs a file name, such as bench.json; it got an empty one"
    if os.path.isdir(path):
        return f"--json {path} is a folder; give a file name in it, such as {os.path.join(path, 'rows.json')}"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        return f"cannot write --json {path}: {folder} is not a writable folder"
    return None


def write_json(path: str, data) -> None:
    """Write `data` to `path` whole or not at all: into a temporary file beside it, then moved."""
    folder = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
    try:
        with os.fdopen(handle, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def checksums(devs, per_device):
    """One scalar per device, the sum of its results: what a timed function returns. Fetching
    them waits for every result (on a GPU, for its kernels, not only their launch) without
    copying the results here, a transfer that core devices would add to the time."""
    import tensorflow as tf

    sums = []
    for d, results in zip(devs, per_device, strict=True):
        with tf.device(d):
            sums.append(tf.add_n([tf.reduce_sum(r) for r in tf.nest.flatten(results)]))
    return sums


def synthetic_batch(examples: int, seed: int = 0):
    """Random 8x8 images and labels: for timing, where the values do not matter."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    x = tf.constant(rng.random((examples, 8, 8, 1), dtype=np.float32))
    return x, tf.constant(rng.integers(0, 10, examples, dtype=np.int32))
