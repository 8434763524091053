"""All-reduce: notebook 03's lessons (central, ring, NCCL, `allreduce_grads`), the checked entry
`all_reduce`, gradient packing into buckets (the take-away's), and `nccl_version`.
"""

from __future__ import annotations

import ctypes
import glob
import itertools
import os
from dataclasses import dataclass

import data_parallel
import tensorflow as tf

from . import checks
from . import devices as _devices


# lesson: 03_nccl_allreduce
def central_all_reduce(tensors, devices):
    """Sum of one tensor per device, on every device, through the first: it receives N-1 tensors and sends N-1."""
    with tf.name_scope("central_all_reduce"):  # a timeline shows the ops of this scope as communication
        with tf.device(devices[0]):
            total = tf.add_n(tensors)
        results = []
        for d in devices:
            with tf.device(d):
                results.append(tf.identity(total))
        return results


# lesson: 03_nccl_allreduce
def ring_schedule(n):
    """Every chunk move of a ring all-reduce on n devices, in order: (phase, step, source, destination, chunk)."""
    moves = []
    for s in range(n - 1):  # reduce-scatter: device i passes its running sum of chunk (i - s - 1) on
        moves += [("reduce-scatter", s, i, (i + 1) % n, (i - s - 1) % n) for i in range(n)]
    for s in range(n - 1):  # all-gather: device i passes the finished chunk (i - s) on
        moves += [("all-gather", s, i, (i + 1) % n, (i - s) % n) for i in range(n)]
    return moves


# lesson: 03_nccl_allreduce
def reduce_scatter(tensors, devices, stats=None):
    """One 1-D tensor per device in; device i ends with the sum of chunk i (returned on devices[i])."""
    n, size = len(tensors), tensors[0].shape[0]
    sizes = [size // n + (1 if c < size % n else 0) for c in range(n)]  # n chunks, as equal as possible
    chunks = []  # chunks[i][c]: device i's running sum of chunk c
    for t, d in zip(tensors, devices, strict=True):
        with tf.device(d):
            chunks.append(tf.split(t, sizes))
    moves = [move for move in ring_schedule(n) if move[0] == "reduce-scatter"]
    sent = [0] * n
    for _, _, src, dst, c in moves:  # in one step a device receives another chunk than the one it sends
        with tf.device(devices[dst]):  # the receiver adds
            chunks[dst][c] = chunks[dst][c] + chunks[src][c]
        sent[src] += sizes[c] * tensors[0].dtype.size
    if stats is not None:
        stats.update(bytes_sent=sent, sends=moves)
    return [chunks[i][i] for i in range(n)]


# lesson: 03_nccl_allreduce
def all_gather(chunks, devices, stats=None):
    """Chunk i on devices[i] in; every device ends with all the chunks, concatenated (1-D)."""
    n = len(chunks)
    held = [[None] * n for _ in range(n)]  # held[i][c]: device i's copy of chunk c
    for i in range(n):
        held[i][i] = chunks[i]
    moves = [move for move in ring_schedule(n) if move[0] == "all-gather"]
    sent = [0] * n
    for _, _, src, dst, c in moves:
        with tf.device(devices[dst]):
            held[dst][c] = tf.identity(held[src][c])  # a copy, received from the left-hand neighbour
        sent[src] += chunks[c].shape.num_elements() * chunks[c].dtype.size
    if stats is not None:
        stats.update(bytes_sent=sent, sends=moves)
    results = []
    for row, d in zip(held, devices, strict=True):
        with tf.device(d):
            results.append(tf.concat(row, 0))
    return results


# lesson: 03_nccl_allreduce
def ring_all_reduce(tensors, devices, stats=None):
    """Sum of one tensor per device, on every device: reduce-scatter, then all-gather, of the flattened tensors."""
    with tf.name_scope("ring_all_reduce"):  # a timeline shows the ops of this scope as communication
        flat = []
        for t, d in zip(tensors, devices, strict=True):
            with tf.device(d):
                flat.append(tf.reshape(t, [-1]))
        halves = ({}, {})
        summed = all_gather(reduce_scatter(flat, devices, halves[0]), devices, halves[1])
        if stats is not None:
            sent = [a + b for a, b in zip(halves[0]["bytes_sent"], halves[1]["bytes_sent"], strict=True)]
            stats.update(bytes_sent=sent, sends=halves[0]["sends"] + halves[1]["sends"])
        results = []
        for s, d in zip(summed, devices, strict=True):
            with tf.device(d):
                results.append(tf.reshape(s, tensors[0].shape))
        return results


# lesson: 03_nccl_allreduce
nccl_names = itertools.count()


# lesson: 03_nccl_allreduce
def nccl_all_sum(tensors, devices):
    """NCCL all-reduce: one tf.raw_ops.NcclAllReduce per GPU, all in one graph."""
    name = f"nccl_{next(nccl_names)}"  # the ops of one all-reduce find each other by this name

    def build():
        summed = []
        for t, d in zip(tensors, devices, strict=True):
            with tf.device(d), tf.name_scope("nccl_all_reduce"):
                summed.append(
                    tf.raw_ops.NcclAllReduce(input=t, reduction="sum", num_devices=len(tensors), shared_name=name)
                )
        return summed

    # Run eagerly, each op would wait for peers that eager mode never starts: build them in one graph.
    return tf.function(build)() if tf.executing_eagerly() else build()


# lesson: 03_nccl_allreduce
ALL_SUMS = {"central": central_all_reduce, "ring": ring_all_reduce, "nccl": nccl_all_sum}


# lesson: 03_nccl_allreduce
def allreduce_grads(all_grads, average=True, method="ring", devices=None):
    """K towers x N gradients in, K x N out: each gradient replaced by its sum (or mean) over the
    towers, on its tower's device (`devices`, or the device of each tower's first gradient)."""
    k = len(all_grads)
    devices = devices or [grads[0].device for grads in all_grads]
    new_all_grads = []  # N x K
    for grads in zip(*all_grads, strict=True):  # one variable's gradient from every tower
        if grads[0] is None:  # a variable that the loss does not use
            new_all_grads.append([None] * k)
            continue
        summed = ALL_SUMS[method](list(grads), devices)
        reduced = []
        for g, d in zip(summed, devices, strict=True):
            with tf.device(d):  # average on the device that will use it
                reduced.append(g / k if average else g)
        new_all_grads.append(reduced)
    return [list(tower) for tower in zip(*new_all_grads, strict=True)]  # transpose back to K x N


def ring_bytes_per_device(num_bytes: int, n: int) -> float:
    """What each device sends in a ring all-reduce of `num_bytes`: 2(N-1)/N of it, whatever N is."""
    return 2 * (n - 1) / n * num_bytes


# --- the checked entry -------------------------------------------------------------------


def _checked_devices(tensors, devices) -> list[str]:
    """One device per tensor, from `devices` or the tensors; one known shape and one dtype for all."""
    if not tensors:
        raise ValueError("all-reduce needs at least one tensor (one per device), got none.")
    if devices is None:
        devices = [t.device for t in tensors]
        if not all(devices):
            raise ValueError(
                "cannot tell which device holds each tensor (inside tf.function, a tensor's device "
                "is known only under tf.device); pass devices=[...]."
            )
    devices = checks.device_list(devices)
    checks.same_length("tensors", tensors, "devices", devices)
    kinds = {(tuple(t.shape), t.dtype.name) for t in tensors}
    if len(kinds) > 1 or not tensors[0].shape.is_fully_defined():
        raise ValueError(f"all-reduce needs tensors of one known shape and one dtype, got {sorted(map(str, kinds))}.")
    return [_devices.normalize(d) for d in devices]


def _nccl_problem(devices) -> str | None:
    """Why NCCL cannot run on `devices`, and what to use instead; None if it can. On logical GPUs
    of one card, NCCL stops with "Duplicate GPU detected" or hangs: refused before any op is built."""
    cpus = [d for d in devices if "GPU" not in _devices.normalize(d)]
    if cpus:
        return f"NCCL runs on GPUs only, but tensors are on {cpus}. Use method='ring' or 'central'."
    layout = _devices.current()
    if layout is not None and not layout.nccl_ok:
        return f"NCCL cannot run on these devices: {layout.reason}. Use method='ring' on logical GPUs."
    return None


def auto_method(devices) -> str:
    """What method="auto" means: "nccl" where NCCL can run on every device, else "ring"."""
    return "ring" if _nccl_problem(devices) else "nccl"


METHODS = (*ALL_SUMS, "auto")


def all_reduce(tensors, method: str = "ring", average: bool = False, devices=None):
    """One tensor per device in, the sum (or mean) of all of them on every device out, by `method`
    (one of METHODS; "auto" picks one with `auto_method`)."""
    tensors = list(tensors)
    devices = _checked_devices(tensors, devices)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    if average and not tensors[0].dtype.is_floating:
        raise ValueError(f"average=True needs a floating dtype, got {tensors[0].dtype.name}; sum with average=False.")
    if method == "auto":
        method = auto_method(devices)
    if method == "nccl" and _nccl_problem(devices):  # no := here: AutoGraph cannot convert it
        raise RuntimeError(_nccl_problem(devices))
    summed = ALL_SUMS[method](tensors, devices)
    if not average:
        return summed
    results = []
    for s, d in zip(summed, devices, strict=True):
        with tf.device(d):
            results.append(s / len(tensors))
    return results


# --- packing many small gradients into few large ones ------------------------------------


def packed_allreduce_grads(all_grads, max_bytes: int, average: bool = True, method: str = "ring", devices=None):
    """`allreduce_grads` with each tower's gradients packed into buckets of at most `max_bytes`: one all-reduce per
    bucket, by `method`. The packing is the take-away's (`data_parallel.all_reduce_gradients`: from the last
    gradient, 16-bit ones summed in float32, each back in its own dtype, None ones left None). Inside a
    `tf.function`, pass `devices` (one per tower): a tensor's device is not known there."""
    max_bytes = checks.whole_number(max_bytes, "max_bytes")
    devices = devices or [next(g for g in grads if g is not None).device for grads in all_grads]
    summed = data_parallel.all_reduce_gradients(
        all_grads, devices, lambda tensors: all_reduce(tensors, method=method, devices=devices), max_bytes
    )
    if not average:
        return summed
    out = []
    for grads, d in zip(summed, devices, strict=True):
        with tf.device(d):
            out.append([None if g is None else g / len(all_grads) for g in grads])
    return out


# --- which NCCL is installed ---------------------------------------------------------------


@dataclass(frozen=True)
class NcclInfo:
    version: str | None
    path: str | None
    reason: str


def nccl_version() -> NcclInfo:
    """The version of the `nvidia-nccl-cu12` library, read with `ncclGetVersion` (it loads without a GPU)."""
    try:
        import nvidia.nccl
    except ImportError:
        return NcclInfo(None, None, "the nvidia-nccl-cu12 package is not installed (Linux x86_64 only)")
    roots = list(getattr(nvidia.nccl, "__path__", []))
    found = [p for r in roots for p in glob.glob(os.path.join(r, "lib", "libnccl.so*"))]
    if not found:
        return NcclInfo(None, None, f"no libnccl.so under {roots}")
    try:
        lib = ctypes.CDLL(found[0])
        code = ctypes.c_int()
        if lib.ncclGetVersion(ctypes.byref(code)) != 0:
            return NcclInfo(None, found[0], "ncclGetVersion returned an error")
    except OSError as err:
        return NcclInfo(None, found[0], f"the library did not load: {err}")
    major, rest = divmod(code.value, 10000)  # NCCL >= 2.9 encodes X.Y.Z as X*10000 + Y*100 + Z
    return NcclInfo(f"{major}.{rest // 100}.{rest % 100}", found[0], "loaded")
