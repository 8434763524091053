"""All-reduce: every device ends with the sum (or mean) of every device's tensor.

- `central_all_reduce`: gather on one device, sum, send back (the tower-averaging way).
- `ring_schedule` / `ring_all_reduce`: the bandwidth-optimal ring, its chunk moves, then
  executed: reduce-scatter, then all-gather, N-1 steps each; every device sends 2(N-1)/N of
  the tensor, whatever N is.
- `nccl_all_reduce`: NVIDIA's NCCL all-reduce (the public `tf.raw_ops.NcclAllReduce`), on
  distinct physical GPUs only.
- `all_reduce(tensors, method=...)`: the one entry to the three, which the rest goes through.
- `allreduce_grads`: tensorpack's K towers x N gradients interface over any of them.
- `pack` / `unpack` / `buckets`: fuse many small tensors into few large ones.

`MirroredStrategy`, TensorFlow's own route, has its helpers in `strategy`.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import itertools
import os
from dataclasses import dataclass

import tensorflow as tf

from . import checks
from . import devices as _devices
from .towers import unzip_tower_grads

METHODS = ("ring", "nccl", "central")


def _placed(tensors, devices=None) -> list[str]:
    """The device of each tensor, from `devices` or from the tensors themselves."""
    if not tensors:
        raise ValueError("all-reduce needs at least one tensor (one per device), got none.")
    if devices is None:
        devices = [t.device for t in tensors]
        if not all(devices):
            raise ValueError(
                "cannot tell which device holds each tensor (inside tf.function, a "
                "tensor's device is known only under tf.device); pass devices=[...]."
            )
    devices = checks.device_list(devices)
    checks.same_length("tensors", tensors, "devices", devices)
    shapes = {tuple(t.shape) for t in tensors}
    dtypes = {t.dtype for t in tensors}
    if len(shapes) > 1 or len(dtypes) > 1:
        raise ValueError(
            f"all-reduce needs tensors of one shape and dtype, got shapes {sorted(shapes)} "
            f"and dtypes {sorted(d.name for d in dtypes)}."
        )
    return [_devices.normalize(d) for d in devices]


def _scoped(name):
    """Run the function under a name scope, so that timelines can show its ops as 'reduce'."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with tf.name_scope(name):
                return fn(*args, **kwargs)

        return inner

    return wrap


def _finish(total, device: str, n: int, average: bool):
    with tf.device(device):
        if not average:
            return tf.identity(total)
        if not total.dtype.is_floating:
            raise ValueError(
                f"average=True needs a floating dtype, got {total.dtype.name}; cast first or sum with average=False."
            )
        return total / tf.cast(n, total.dtype)


@_scoped("central_all_reduce")
def central_all_reduce(tensors, average: bool = False, devices=None, controller: str | None = None):
    """Send every tensor to `controller` (default: the first device), sum there, send back."""
    where = _placed(tensors, devices)
    controller = _devices.normalize(controller) if controller else where[0]
    with tf.device(controller):
        total = tf.add_n([tf.identity(t) for t in tensors])
    return [_finish(total, d, len(tensors), average) for d in where]


def _chunk_sizes(size: int, n: int) -> list[int]:
    """n chunk lengths as equal as possible (the first size % n are one longer)."""
    return [size // n + (1 if i < size % n else 0) for i in range(n)]


def ring_schedule(n: int) -> list[tuple[str, int, int, int, int]]:
    """Every chunk move of a ring all-reduce on n devices, in order: (phase, step, source, destination, chunk).

    Reduce-scatter: in step s, device i sends chunk (i - s) mod n to device i+1, which adds
    it to its own copy; after n-1 steps device i holds the full sum of chunk (i + 1) mod n.
    All-gather: in step s, device i passes finished chunk (i + 1 - s) mod n on to device i+1.
    Each step is n moves, one per device, that all read the values from before the step.
    """
    n = checks.whole_number(n, "the number of devices n")
    moves = []
    for s in range(n - 1):
        moves += [("reduce-scatter", s, i, (i + 1) % n, (i - s) % n) for i in range(n)]
    for s in range(n - 1):
        moves += [("all-gather", s, i, (i + 1) % n, (i + 1 - s) % n) for i in range(n)]
    return moves


@_scoped("ring_all_reduce")
def ring_all_reduce(tensors, average: bool = False, devices=None, stats: dict | None = None):
    """Ring all-reduce of one tensor per device; returns one result per device, on it.

    Each tensor is cut into N chunks, and the chunk moves of `ring_schedule(N)` are
    executed one step (N moves) at a time. If `stats` is a dict, it receives `bytes_sent`
    (per device) and `sends`, the (phase, step, source, destination, chunk) of every message.
    """
    where = _placed(tensors, devices)
    n = len(tensors)
    shape, dtype = tensors[0].shape, tensors[0].dtype
    sizes = _chunk_sizes(shape.num_elements(), n)
    chunks = []  # chunks[i][c]: device i's current copy of chunk c
    for t, d in zip(tensors, where, strict=True):
        with tf.device(d):
            chunks.append(tf.split(tf.reshape(t, [-1]), sizes))
    sent, moves = [0] * n, ring_schedule(n)
    for first in range(0, len(moves), n):
        new = [list(row) for row in chunks]  # every move of a step reads the values from before it
        for phase, _, src, dst, c in moves[first : first + n]:
            with tf.device(where[dst]):
                received = chunks[src][c]
                new[dst][c] = chunks[dst][c] + received if phase == "reduce-scatter" else tf.identity(received)
            sent[src] += sizes[c] * dtype.size
        chunks = new

    if stats is not None:
        stats.update(bytes_sent=sent, sends=moves)
    results = []
    for i, d in enumerate(where):
        with tf.device(d):
            total = tf.reshape(tf.concat(chunks[i], 0), shape)
        results.append(_finish(total, d, n, average))
    return results


def ring_bytes_per_device(num_bytes: int, n: int) -> float:
    """What theory says each device sends in a ring all-reduce: 2(N-1)/N of the tensor."""
    return 2 * (n - 1) / n * num_bytes


def central_bytes(num_bytes: int, n: int) -> dict[str, float]:
    """Bytes through the controller in a central all-reduce: N-1 tensors in, N-1 out."""
    return {
        "controller in": (n - 1) * num_bytes,
        "controller out": (n - 1) * num_bytes,
        "other device sends": float(num_bytes),
    }


_nccl_names = itertools.count()


def nccl_sum(tensors, devices):
    """NCCL all-reduce through the public raw op: one `tf.raw_ops.NcclAllReduce` per device.

    The k ops of one all-reduce find each other by their `shared_name`, so each call gets a
    new one. Each op blocks until all k have started: eagerly they would run one by one and
    wait forever, so outside a `tf.function` the ops are built and run inside one (as
    TensorFlow's private `nccl_ops.all_sum` does). No checks: see `nccl_all_reduce`.
    """
    name = f"tutorial_nccl_{next(_nccl_names)}"

    def build():
        summed = []
        for t, d in zip(tensors, devices, strict=True):
            with tf.device(d):
                summed.append(
                    tf.raw_ops.NcclAllReduce(input=t, reduction="sum", num_devices=len(tensors), shared_name=name)
                )
        return summed

    return tf.function(build)() if tf.executing_eagerly() else build()


@_scoped("nccl_all_reduce")
def nccl_all_reduce(tensors, average: bool = False, devices=None):
    """NCCL all-reduce over tensors on distinct physical GPUs; a clear error anywhere else.

    Logical GPUs carved from one card are refused before any NCCL op is built: NCCL with
    several ranks on one GPU stops with "Duplicate GPU detected" or hangs.
    """
    where = _placed(tensors, devices)
    cpus = [d for d in where if "GPU" not in d]
    if cpus:
        raise RuntimeError(
            f"NCCL runs on GPUs only, but tensors are on {cpus}. Use "
            "ring_all_reduce or central_all_reduce (method='ring' or 'central')."
        )
    layout = _devices.current()
    if layout is not None and not layout.nccl_ok:
        raise RuntimeError(
            f"NCCL cannot run on these devices: {layout.reason}. Use ring_all_reduce (method='ring') on logical GPUs."
        )
    summed = nccl_sum(list(tensors), where)
    return [_finish(t, d, len(tensors), average) for t, d in zip(summed, where, strict=True)]


_REDUCERS = {"ring": ring_all_reduce, "nccl": nccl_all_reduce, "central": central_all_reduce}


def _reducer(method: str):
    if method not in _REDUCERS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    return _REDUCERS[method]


def all_reduce(tensors, method: str = "ring", average: bool = False, devices=None):
    """One tensor per device in, the sum (or mean) of all of them on every device out."""
    return _reducer(method)(list(tensors), average=average, devices=devices)


def _tower_devices(towers, devices):
    """`devices` checked to name one device per tower (None stays None: each tensor's own)."""
    if devices is None:
        return None
    devices = checks.device_list(devices)
    checks.same_length("towers", towers, "devices", devices)
    return devices


def _with_variables(tower_grads, variables):
    """Each tower's gradients paired again with its own variables, where they came as pairs."""
    if variables is None:
        return tower_grads
    return [list(zip(grads, vs, strict=True)) for grads, vs in zip(tower_grads, variables, strict=True)]


def allreduce_grads(all_grads, average: bool = True, method: str = "ring", devices=None):
    """All-reduce K towers' gradients (K lists of N) and return K lists of N, as tensorpack does.

    Gradient j of tower k is replaced by the sum (or mean) over towers of gradient j,
    placed on tower k's device. None gradients (unused variables) stay None. Towers of
    `(gradient, variable)` pairs give back pairs, each tower keeping its own variables.
    """
    _reducer(method)  # an unknown method is refused even where there is nothing to reduce
    grads, variables = unzip_tower_grads(all_grads)
    devices = _tower_devices(grads, devices)
    k = len(grads)
    if k == 1 and not average:
        return _with_variables(grads, variables)
    per_variable = [
        [None] * k if column[0] is None else all_reduce(column, method, average, devices)
        for column in zip(*grads, strict=True)
    ]  # N x K
    return _with_variables([[column[i] for column in per_variable] for i in range(k)], variables)


# --- packing many small tensors into few large ones -----------------------------------


def pack(tensors):
    """Flatten and concatenate tensors into one vector; returns (vector, shapes)."""
    shapes = [t.shape for t in tensors]
    flat = [t if t.shape.rank == 1 else tf.reshape(t, [-1]) for t in tensors]  # no op for vectors
    return tf.concat(flat, 0), shapes


def unpack(vector, shapes):
    """Inverse of `pack`: cut the vector and restore the shapes."""
    pieces = tf.split(vector, [s.num_elements() for s in shapes])
    return [p if s.rank == 1 else tf.reshape(p, s) for p, s in zip(pieces, shapes, strict=True)]


def buckets(tensors, max_bytes: int) -> list[list[int]]:
    """Group consecutive tensor indices into buckets of at most `max_bytes` each, one dtype per bucket.

    A tensor larger than `max_bytes` gets a bucket of its own, and a tensor whose dtype
    differs from the one before it starts a new bucket: a packed vector has a single dtype.
    """
    max_bytes = checks.whole_number(max_bytes, "max_bytes")
    groups, size = [], 0
    for i, t in enumerate(tensors):
        nbytes = t.shape.num_elements() * t.dtype.size
        if groups and size + nbytes <= max_bytes and t.dtype == tensors[groups[-1][0]].dtype:
            groups[-1].append(i)
            size += nbytes
        else:
            groups.append([i])
            size = nbytes
    return groups


def packed_allreduce_grads(all_grads, max_bytes: int, average: bool = True, method: str = "ring", devices=None):
    """`allreduce_grads` with each tower's gradients packed into buckets first.

    Inside a `tf.function`, pass `devices` (one per tower): a tensor's device is not known there.
    Each gradient comes back in its own dtype; towers of `(gradient, variable)` pairs give back pairs.
    """
    grads, variables = unzip_tower_grads(all_grads)
    if any(g is None for g in grads[0]):
        raise ValueError("packing needs every gradient; drop variables whose gradient is None first.")
    devices = _tower_devices(grads, devices)
    places = [_devices.normalize(d) for d in devices] if devices else [tower[0].device or None for tower in grads]
    out = [[None] * len(grads[0]) for _ in grads]
    for group in buckets(grads[0], max_bytes):
        packed, shapes = [], None
        for tower, device in zip(grads, places, strict=True):
            with tf.device(device):
                vector, shapes = pack([tower[j] for j in group])
            packed.append(vector)
        reduced = all_reduce(packed, method=method, average=average, devices=devices)
        for k, (vector, device) in enumerate(zip(reduced, places, strict=True)):
            with tf.device(device):
                for j, g in zip(group, unpack(vector, shapes), strict=True):
                    out[k][j] = g
    return _with_variables(out, variables)


# --- which NCCL is installed ---------------------------------------------------------


@dataclass(frozen=True)
class NcclInfo:
    version: str | None
    path: str | None
    reason: str


def nccl_version() -> NcclInfo:
    """The NCCL version of the `nvidia-nccl-cu12` library, read with `ncclGetVersion`.

    The library loads without a GPU; `version` is None (with the reason) where it is absent.
    """
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
