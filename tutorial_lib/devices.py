"""Get N devices on any machine, and name them the one way TensorFlow always accepts.

TensorFlow can split one physical device into several *logical* devices, but only
before its runtime starts. `simulate(n)` makes that choice once per process:

- no GPU: n logical CPUs. Intra-op threads are set to 1 and inter-op threads to at
  least n, so each logical CPU behaves like one single-core worker; on a machine with
  C cores up to C of them truly run at once.
- one GPU (or fewer than n): n logical GPUs carved out of GPU 0. They run kernels, but
  NCCL refuses several ranks on one physical GPU ("Duplicate GPU detected").
- n or more GPUs: the first n real GPUs.

Set ``TUTORIAL_DEVICE=cpu`` to force CPU simulation, whatever `kind` says (the tests do,
so that their outputs are the same on every machine).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

ENV_VAR = "TUTORIAL_DEVICE"
KINDS = ("auto", "cpu", "gpu")
GPU_MEMORY_MB = 2048  # per logical GPU when one GPU is split

_current: Layout | None = None


@dataclass(frozen=True)
class Layout:
    """What `simulate` chose: the device kind, how it got there, and whether NCCL can run."""

    kind: str  # "CPU" or "GPU"
    n: int
    mode: str  # "simulated" (logical devices) or "real"
    nccl_ok: bool
    reason: str
    names: tuple[str, ...] = ()

    def __str__(self) -> str:
        nccl = "NCCL usable" if self.nccl_ok else "no NCCL"
        return f"{self.n} {self.mode} {self.kind} device(s), {nccl}: {self.reason}"


def plan(n: int, kind: str = "auto", physical_gpus: int = 0) -> Layout:
    """Decide, without touching TensorFlow, how to provide n devices.

    Split out of `simulate` so that the GPU branches can be tested on a CPU-only machine.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"simulate needs a whole number of devices n >= 1, got {n!r}.")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
    if kind == "gpu" and physical_gpus == 0:
        raise RuntimeError(
            "kind='gpu' was asked for but TensorFlow sees no GPU. Use kind='auto' or "
            "kind='cpu' to simulate devices on the CPU."
        )
    if kind == "cpu" or physical_gpus == 0:
        why = "CPU simulation asked for" if kind == "cpu" else "no GPU found"
        return Layout("CPU", n, "simulated", False, f"{why}; NCCL needs real GPUs")
    if physical_gpus >= n:
        return Layout("GPU", n, "real", True, f"{physical_gpus} GPUs found")
    return Layout(
        "GPU", n, "simulated", False,
        f"{physical_gpus} GPU(s) for {n} devices: NCCL refuses several ranks on one "
        "physical GPU ('Duplicate GPU detected')",
    )


def simulate(n: int, kind: str = "auto") -> list[str]:
    """Provide n devices of one kind and return their full names, e.g. '/device:CPU:0'.

    Call it first, before any other TensorFlow work. Calling it again with the same n
    returns the same devices; asking for another layout once TensorFlow has started
    raises a RuntimeError that says to restart the kernel.
    """
    global _current
    import tensorflow as tf

    if os.environ.get(ENV_VAR, "").lower() == "cpu":
        kind = "cpu"
    layout = plan(n, kind, len(tf.config.list_physical_devices("GPU")))
    if _current is not None:
        if (_current.kind, _current.n) == (layout.kind, layout.n):
            _announce(_current)
            return list(_current.names)
        _refuse(layout, f"{_current.n} logical {_current.kind} devices")
    try:
        _configure(tf, layout)
    except RuntimeError as err:  # the runtime started before us
        have = [d.name for d in tf.config.list_logical_devices(layout.kind)]
        if len(have) != n:
            _refuse(layout, f"{len(have)} {layout.kind} device(s)", err)
    names = tuple(d.name for d in tf.config.list_logical_devices(layout.kind))
    _current = Layout(**{**layout.__dict__, "names": names})
    _announce(_current)
    return list(names)


def current() -> Layout | None:
    """The layout chosen by `simulate` in this process, or None before it was called."""
    return _current


def _configure(tf, layout: Layout) -> None:
    gpus = tf.config.list_physical_devices("GPU")
    if layout.kind == "CPU":
        if gpus:  # forced CPU simulation: hide GPUs so nothing lands there by default
            tf.config.set_visible_devices([], "GPU")
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(layout.n)]
        )
        # One thread per op and at least one inter-op thread per device: each logical
        # CPU then acts as one single-core worker.
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(max(layout.n, os.cpu_count() or 1))
    elif layout.mode == "real":
        tf.config.set_visible_devices(gpus[: layout.n], "GPU")
    else:
        tf.config.set_visible_devices(gpus[:1], "GPU")
        tf.config.set_logical_device_configuration(
            gpus[0],
            [tf.config.LogicalDeviceConfiguration(memory_limit=GPU_MEMORY_MB)] * layout.n,
        )


def _refuse(layout: Layout, have: str, cause: Exception | None = None) -> None:
    raise RuntimeError(
        f"TensorFlow has already started with {have}; it cannot switch to {layout.n} "
        f"{layout.kind} devices in this process. Restart the kernel (Kernel > Restart) "
        f"and call simulate({layout.n}) first, before any other TensorFlow work."
    ) from cause


def _announce(layout: Layout) -> None:
    names = layout.names
    shown = ", ".join(names) if len(names) <= 4 else f"{names[0]} ... {names[-1]}"
    what = "logical" if layout.mode == "simulated" else "real"
    extra = "; intra-op threads 1 each" if layout.kind == "CPU" else ""
    print(f"{layout.n} {what} {layout.kind} device(s) ({layout.reason}{extra}): {shown}")


# --- names ----------------------------------------------------------------------------

_NAME = re.compile(
    r"""^(?:/job:[\w-]+)?(?:/replica:\d+)?(?:/task:\d+)?   # optional cluster prefix
        /?(?:device:)?                                     # '/device:' or '/' or nothing
        (?P<kind>[a-z_]+):(?P<index>\d+)$""",
    re.IGNORECASE | re.VERBOSE,
)
_KNOWN = {"cpu", "gpu", "tpu", "xla_cpu", "xla_gpu"}


def normalize(name: str) -> str:
    """Return the canonical local form '/device:GPU:1' of a device name.

    Accepts 'gpu:1', '/gpu:1', 'GPU:1', '/device:GPU:1' and full names such as
    '/job:localhost/replica:0/task:0/device:GPU:1'. Raises ValueError on anything else,
    with a hint when a full name was pasted into another one (the seed's
    ``'/gpu:{}'.format(name)`` bug).
    """
    if not isinstance(name, str):
        raise TypeError(f"a device name is a string such as '/device:GPU:0', got {name!r}.")
    match = _NAME.match(name.strip())
    if match and match["kind"].lower() in _KNOWN:
        return f"/device:{match['kind'].upper()}:{int(match['index'])}"
    hint = ""
    if name.lower().count("cpu") + name.lower().count("gpu") > 1:
        hint = (
            " It looks like a full device name was formatted into another one, as in "
            "'/gpu:{}'.format('/device:GPU:0'). Use the name as it is, or pass it to "
            "normalize()."
        )
    raise ValueError(
        f"{name!r} is not a device name. Write it as '/device:GPU:0' (or 'gpu:0', "
        f"'/cpu:0'): a kind from {sorted(_KNOWN)} and an index.{hint}"
    )


def bytes_per_device(variables) -> dict[str, int]:
    """Bytes of variable storage on each device, keyed by canonical device name."""
    totals: dict[str, int] = {}
    for v in variables:
        device = normalize(v.device)
        totals[device] = totals.get(device, 0) + v.shape.num_elements() * v.dtype.size
    return totals
