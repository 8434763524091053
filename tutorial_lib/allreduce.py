"""All-reduce: every device ends with the sum (or mean) of every device's tensor.

- `central_all_reduce`: gather on one device, sum, send back (the tower-averaging way).
- `ring_all_reduce`: the bandwidth-optimal ring, written out: reduce-scatter, then
  all-gather, N-1 steps each; every device sends 2(N-1)/N of the tensor, whatever N is.
- `nccl_all_reduce`: NVIDIA's NCCL `all_sum` kernel, on distinct physical GPUs only.
- `allreduce_grads`: tensorpack's K towers x N gradients interface over any of them.
- `pack` / `unpack` / `buckets`: fuse many small tensors into few large ones.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from dataclasses import dataclass

import tensorflow as tf

from . import devices as _devices

METHODS = ("ring", "nccl", "central")


def _placed(tensors, devices=None) -> list[str]:
    """The device of each tensor, from `devices` or from the tensors themselves."""
    if not tensors:
        raise ValueError("all-reduce needs at least one tensor (one per device), got none.")
    if devices is None:
        devices = [t.device for t in tensors]
        if not all(devices):
            raise ValueError("cannot tell which device holds each tensor (inside tf.function, a "
                             "tensor's device is known only under tf.device); pass devices=[...].")
    if len(devices) != len(tensors):
        raise ValueError(f"{len(tensors)} tensors but {len(devices)} devices.")
    shapes = {tuple(t.shape) for t in tensors}
    dtypes = {t.dtype for t in tensors}
    if len(shapes) > 1 or len(dtypes) > 1:
        raise ValueError(f"all-reduce needs tensors of one shape and dtype, got shapes {sorted(shapes)} "
                         f"and dtypes {sorted(d.name for d in dtypes)}.")
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
            raise ValueError(f"average=True needs a floating dtype, got {total.dtype.name}; "
                             "cast first or sum with average=False.")
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


@_scoped("ring_all_reduce")
def ring_all_reduce(tensors, average: bool = False, devices=None, stats: dict | None = None):
    """Ring all-reduce of one tensor per device; returns one result per device, on it.

    Each tensor is cut into N chunks. Reduce-scatter: in step s, device i sends chunk
    (i - s) mod N to device i+1, which adds it to its own copy; after N-1 steps device i
    holds the full sum of chunk (i + 1) mod N. All-gather: N-1 more steps pass the
    finished chunks around the ring. If `stats` is a dict, it receives `bytes_sent` (per
    device) and `sends`, one (phase, step, source, destination, chunk) per message.
    """
    where = _placed(tensors, devices)
    n = len(tensors)
    shape, dtype = tensors[0].shape, tensors[0].dtype
    sizes = _chunk_sizes(shape.num_elements(), n)
    chunks = []  # chunks[i][c]: device i's current copy of chunk c
    for t, d in zip(tensors, where):
        with tf.device(d):
            chunks.append(tf.split(tf.reshape(t, [-1]), sizes))
    sent, log = [0] * n, []

    def step(phase, s, combine, chunk_of):
        new = [list(row) for row in chunks]  # every send in a step reads the old values
        for i in range(n):
            c, dst = chunk_of(i), (i + 1) % n
            with tf.device(where[dst]):
                new[dst][c] = combine(chunks[dst][c], chunks[i][c])
            sent[i] += sizes[c] * dtype.size
            log.append((phase, s, i, dst, c))
        chunks[:] = new

    for s in range(n - 1):
        step("reduce-scatter", s, lambda mine, received: mine + received, lambda i, s=s: (i - s) % n)
    for s in range(n - 1):
        step("all-gather", s, lambda mine, received: tf.identity(received), lambda i, s=s: (i + 1 - s) % n)

    if stats is not None:
        stats.update(bytes_sent=sent, sends=log)
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
    return {"controller in": (n - 1) * num_bytes, "controller out": (n - 1) * num_bytes,
            "other device sends": float(num_bytes)}


@_scoped("nccl_all_reduce")
def nccl_all_reduce(tensors, average: bool = False, devices=None):
    """NCCL `all_sum` over tensors on distinct physical GPUs; a clear error anywhere else."""
    where = _placed(tensors, devices)
    cpus = [d for d in where if "GPU" not in d]
    if cpus:
        raise RuntimeError(f"NCCL runs on GPUs only, but tensors are on {cpus}. Use "
                           "ring_all_reduce or central_all_reduce (method='ring' or 'central').")
    layout = _devices.current()
    if layout is not None and not layout.nccl_ok:
        raise RuntimeError(f"NCCL cannot run on these devices: {layout.reason}. Use "
                           "ring_all_reduce (method='ring') on logical GPUs.")
    from tensorflow.python.ops import nccl_ops

    summed = nccl_ops.all_sum(list(tensors))  # each tensor already on its own GPU
    return [_finish(t, d, len(tensors), average) for t, d in zip(summed, where)]


_REDUCERS = {"ring": ring_all_reduce, "nccl": nccl_all_reduce, "central": central_all_reduce}


def all_reduce(tensors, method: str = "ring", average: bool = False, devices=None):
    """One tensor per device in, the sum (or mean) of all of them on every device out."""
    if method not in _REDUCERS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    return _REDUCERS[method](list(tensors), average=average, devices=devices)


def allreduce_grads(all_grads, average: bool = True, method: str = "ring", devices=None):
    """All-reduce K towers' gradients (K lists of N) and return K lists of N, as tensorpack does.

    Gradient j of tower k is replaced by the sum (or mean) over towers of gradient j,
    placed on tower k's device. None gradients (unused variables) stay None.
    """
    if method not in _REDUCERS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    from .towers import _check_tower_grads

    _check_tower_grads(all_grads)
    k = len(all_grads)
    if k == 1 and not average:
        return [list(all_grads[0])]
    reduce = _REDUCERS[method]
    per_variable = []  # N x K
    for grads in zip(*all_grads):
        if grads[0] is None:
            per_variable.append([None] * k)
        else:
            per_variable.append(reduce(list(grads), average=average, devices=devices))
    return [list(tower) for tower in zip(*per_variable)]  # back to K x N


# --- packing many small tensors into few large ones -----------------------------------


def pack(tensors):
    """Flatten and concatenate tensors into one vector; returns (vector, shapes)."""
    shapes = [t.shape for t in tensors]
    flat = [t if t.shape.rank == 1 else tf.reshape(t, [-1]) for t in tensors]  # no op for vectors
    return tf.concat(flat, 0), shapes


def unpack(vector, shapes):
    """Inverse of `pack`: cut the vector and restore the shapes."""
    pieces = tf.split(vector, [s.num_elements() for s in shapes])
    return [p if s.rank == 1 else tf.reshape(p, s) for p, s in zip(pieces, shapes)]


def buckets(tensors, max_bytes: int) -> list[list[int]]:
    """Group consecutive tensor indices into buckets of at most `max_bytes` each.

    A tensor larger than `max_bytes` gets a bucket of its own.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}.")
    groups, size = [], 0
    for i, t in enumerate(tensors):
        nbytes = t.shape.num_elements() * t.dtype.size
        if groups and size + nbytes <= max_bytes:
            groups[-1].append(i)
            size += nbytes
        else:
            groups.append([i])
            size = nbytes
    return groups


def packed_allreduce_grads(all_grads, max_bytes: int, average: bool = True, method: str = "ring", devices=None):
    """`allreduce_grads` with each tower's gradients packed into buckets first.

    Inside a `tf.function`, pass `devices` (one per tower): a tensor's device is not known there.
    """
    from .towers import _check_tower_grads

    _check_tower_grads(all_grads)
    if any(g is None for g in all_grads[0]):
        raise ValueError("packing needs every gradient; drop variables whose gradient is None first.")
    places = [_normalize_or_none(d) for d in devices] if devices else [grads[0].device or None for grads in all_grads]
    out = [[None] * len(all_grads[0]) for _ in all_grads]
    for group in buckets(all_grads[0], max_bytes):
        packed, shapes = [], None
        for grads, device in zip(all_grads, places):
            with tf.device(device):
                vector, shapes = pack([grads[j] for j in group])
            packed.append(vector)
        reduced = allreduce_grads([[p] for p in packed], average=average, method=method, devices=devices)
        for k, ((vector,), device) in enumerate(zip(reduced, places)):
            with tf.device(device):
                for j, g in zip(group, unpack(vector, shapes)):
                    out[k][j] = g
    return out


def _normalize_or_none(device):
    return _devices.normalize(device) if device else None


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


def mirrored_strategy(devices, cross_device_ops=None) -> tf.distribute.MirroredStrategy:
    """A `MirroredStrategy` whose collective keys cannot collide with an earlier one's.

    Every `MirroredStrategy` numbers its collective groups from the same base. A second
    strategy over a different number of devices in the same process then reuses a group key
    with another size and fails with "... is joining a group with size 2, but that group has
    size 4". TensorFlow's own tests move the base between strategies; so does this.
    """
    tf.distribute.MirroredStrategy._collective_key_base += 100_000
    return tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops)


def mirrored_train_step(strategy, model, optimizer, global_batch: int):
    """Notebook 03's custom step under a `tf.distribute` strategy; returns the batch's loss.

    Each replica divides its summed loss by the global batch, so that the gradients, summed
    across replicas inside `apply_gradients`, are those of the global mean.
    """

    @tf.function
    def step(dist_x, dist_y):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=model(x))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        losses = strategy.run(replica_step, args=(dist_x, dist_y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    return step
