"""The benchmark's other cases: gradient packing, the all-reduce methods with their alpha-beta
fit, the input pipeline and mixed precision; with their summary lines."""

from __future__ import annotations

import functools

from .. import timing
from .rows import checksums, compared, device_model, row, synthetic_batch


def packing(devs, tensors=100, elements=1000, repeats=15) -> list[dict]:
    """All-reduce of many small tensors, one call each, against the same bytes in one bucket."""
    import tensorflow as tf

    from .. import allreduce

    nbytes = tensors * elements * 4

    def gradients(base):
        # Made inside the measured function from one scalar argument: 200 tensor arguments
        # would cost more than the all-reduce, and constants would be folded away.
        grads = []
        for i, d in enumerate(devs):
            with tf.device(d):
                grads.append([tf.fill([elements], base + float(i + j)) for j in range(tensors)])
        return grads

    one_by_one = tf.function(lambda b: checksums(devs, allreduce.allreduce_grads(gradients(b), devices=devs)))
    bucketed = tf.function(
        lambda b: checksums(devs, allreduce.packed_allreduce_grads(gradients(b), nbytes, devices=devs))
    )
    base = tf.constant(1.0)
    names = (f"{tensors} tensors, one all-reduce each", "packed into one bucket")
    variants = {names[0]: functools.partial(one_by_one, base), names[1]: functools.partial(bucketed, base)}
    times = timing.interleaved(variants, rounds=repeats)
    alone, packed = (row("packing", name, times[name], devices=len(devs), bytes=nbytes) for name in names)
    return [alone, packed | compared(times[names[1]], times[names[0]], "speedup")]


# Tensor sizes (float32 elements) of the all-reduce case: from one element, where the time is
# the latency of the messages alone, to 4 MB, where it is bandwidth; the tiny ones pin down
# the fitted latency (alpha), which the large ones alone leave to the noise.
ALLREDUCE_SIZES = (1, 10, 100, 1_000, 10_000, 100_000, 1_000_000)
# Each method timed, with the algorithm of the cost model that describes it.
METHODS = {"central": "central", "ring": "ring", "collective (MirroredStrategy)": "ring"}
# A call that reaches the first device and moves nothing: what every timed call costs before
# any message, timed in the same rounds and taken off before the alpha-beta fit.
CALL = "the call alone"


def allreduce_methods(devs, sizes=ALLREDUCE_SIZES, repeats=15) -> list[dict]:
    """Central, ring and (on devices of this process) TensorFlow's collective all-reduce across
    sizes, with bus bandwidth, beside a call that moves nothing; then each method's latency per
    message (alpha) and bandwidth (1/beta), fitted on what it takes beyond that call."""
    import tensorflow as tf

    n, rows = len(devs), []
    methods = {m: _timed_all_reduce(devs, m) for m in ("central", "ring")}
    methods[CALL] = tf.function(lambda ts: checksums(devs[:1], ts[:1]))
    collective = _collective_all_reduce(devs)
    for size in sizes:
        tensors = []
        for i, d in enumerate(devs):
            with tf.device(d):
                tensors.append(tf.fill([size], float(i)))
        variants = {name: functools.partial(fn, tensors) for name, fn in methods.items()}
        if collective:
            variants["collective (MirroredStrategy)"] = functools.partial(collective, size)
        for name, t in timing.interleaved(variants, rounds=repeats).items():
            bus = {} if name == CALL else {"bus_gb_per_s": 2 * (n - 1) / n * size * 4 / t.median / 1e9}
            rows.append(row("all-reduce", name, t, devices=n, bytes=size * 4, **bus))
    return rows + alpha_beta_rows(rows, n)


def _timed_all_reduce(devs, method: str):
    import tensorflow as tf

    from .. import allreduce

    return tf.function(lambda ts: checksums(devs, allreduce.all_reduce(ts, method=method, devices=devs)))


def _collective_all_reduce(devs):
    """TensorFlow's collective all-reduce under MirroredStrategy, as a function of the size; None on
    core devices, where MirroredStrategy refuses devices of other processes."""
    import tensorflow as tf

    from ..strategy import mirrored_strategy

    if device_model() == "cores":
        return None
    strategy = mirrored_strategy(devs)

    @tf.function
    def collective(size):
        summed = strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("SUM", tf.ones([size])))
        return checksums(devs, strategy.experimental_local_results(summed))

    return collective


def alpha_beta_rows(rows, n: int) -> list[dict]:
    """Each method's latency per message (alpha) and link bandwidth (1/beta), fitted on its medians
    less those of the call alone at the same size."""
    from .. import costmodel

    call = {r["bytes"]: r["ms"] / 1e3 for r in rows if r["variant"] == CALL}
    fits = []
    for method, algorithm in METHODS.items():
        mine = sorted((r["bytes"], r["ms"] / 1e3 - call.get(r["bytes"], 0.0)) for r in rows if r["variant"] == method)
        if len({b for b, _ in mine}) < 2:
            continue
        link = costmodel.fit_alpha_beta([b for b, _ in mine], [t for _, t in mine], n, algorithm)
        gb_per_s = 1 / link.beta / 1e9 if link.beta > 0 else None  # beta 0: the fit clipped a negative slope
        fits.append(
            row(
                "all-reduce fit",
                f"{method} ({algorithm} model)",
                None,
                devices=n,
                alpha_us=1e6 * link.alpha,
                link_gb_per_s=gb_per_s,
            )
        )
    return fits


def input_pipeline(devs, batch=256, steps=20, read_ms=2.0, repeats=5) -> list[dict]:
    """A training step fed by tf.data whose reads wait `read_ms` per batch (an emulated disk or
    network): no prefetch, tf.data prefetch, and prefetch to the device where the device is in
    this process (a dataset cannot be sent to a core device's process)."""
    import tensorflow as tf

    # A private tf.data test op: it waits without using a core, as a disk read does. The public
    # route is a map through `tf.py_function(time.sleep)`, which runs Python in the pipeline.
    from tensorflow.python.data.experimental.ops.testing import sleep

    from .. import models, towers

    x, y = synthetic_batch(batch * steps)
    base = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
    base = base.apply(sleep(int(read_ms * 1000)))
    plain = tf.data.Options()
    plain.experimental_optimization.inject_prefetch = False  # or tf.data adds a prefetch by itself
    variants = {"no prefetch": base.with_options(plain), "tf.data prefetch": base.prefetch(2)}
    if device_model() != "cores":
        variants["prefetch to the device"] = base.apply(tf.data.experimental.prefetch_to_device(devs[0], 2))
    with tf.device(devs[0]):
        net = models.MLP(hidden=(512, 512))
    step = towers.make_train_step(net, devs[:1], 0.01)

    def epoch(ds):
        for xb, yb in ds:
            loss = step(xb, yb)
        return loss

    times = timing.interleaved({name: functools.partial(epoch, ds) for name, ds in variants.items()}, rounds=repeats)
    rows = [row("input pipeline", name, t, per=steps, devices=1, read_ms=read_ms) for name, t in times.items()]
    return rows[:1] + [r | compared(times[r["variant"]], times["no prefetch"], "speedup") for r in rows[1:]]


def mixed_precision(devs, repeats=10) -> list[dict]:
    """float32 against float16 matrix products on the first device, where it is a GPU with
    tensor cores (compute capability >= 7); a row that says why not elsewhere."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    capability = tf.config.experimental.get_device_details(gpus[0]).get("compute_capability") if gpus else None
    if "GPU" not in devs[0] or not capability or capability < (7, 0):
        reason = "no GPU with tensor cores (compute capability 7.0+); CPUs gain nothing from float16"
        return [row("mixed precision", "skipped", None, reason=reason)]

    @tf.function
    def matmul(a):
        with tf.device(devs[0]):
            return tf.matmul(a, a)

    with tf.device(devs[0]):
        x = tf.random.normal([4096, 4096])
        variants = {f"matmul 4096 {d.name}": functools.partial(matmul, tf.cast(x, d)) for d in (tf.float32, tf.float16)}
    times = timing.interleaved(variants, rounds=repeats)
    rows = [
        row("mixed precision", name, t, devices=1, tflops=2 * 4096**3 / t.median / 1e12) for name, t in times.items()
    ]
    return [rows[0], rows[1] | compared(times["matmul 4096 float16"], times["matmul 4096 float32"], "speedup")]


def summary(rows) -> list[str]:
    """The packing speedup and each all-reduce fit, one line each."""
    lines = []
    for r in rows:
        if r["case"] == "packing" and "speedup" in r:
            lines.append(f"packing into one bucket: {r['speedup']:.2f}x ({r['speedup_verdict']})")
        elif r["case"] == "all-reduce fit":
            gb = r["link_gb_per_s"]
            link = "unbounded (beta fitted as 0)" if gb is None else f"{gb:.3g} GB/s"
            lines.append(f"{r['variant']}: alpha {r['alpha_us']:.0f} us per message, link {link}")
    return lines
