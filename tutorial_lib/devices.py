"""Get N devices on any machine (`simulate`, once per process; `TUTORIAL_DEVICE=cpu` forces CPU
simulation), and name them the one way TensorFlow always accepts (`normalize`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from dataclasses import dataclass

from . import checks, core_devices, stop_filtering_stderr

ENV_VAR = "TUTORIAL_DEVICE"
KINDS = ("auto", "cpu", "gpu", "cores")
# How the devices are made, as `Layout.model` names it.
MODELS = {"logical": "logical devices in this process", "cores": "one process per core", "real": "physical devices"}
GPU_MEMORY_MB = 2048  # per logical GPU when one GPU is split
LOCAL_JOB = core_devices.LOCAL_JOB  # the job of this process's own devices

_current: Layout | None = None


@dataclass(frozen=True)
class Layout:
    """What `simulate` chose: the device type, how the devices are made, and whether NCCL can run."""

    device_type: str  # "CPU" or "GPU"
    n: int
    nccl_ok: bool
    reason: str
    model: str  # "logical", "cores" or "real": a key of MODELS
    names: tuple[str, ...] = ()
    per_gpu: tuple[int, ...] = ()  # logical GPUs made on each physical GPU (logical GPUs only)

    def __str__(self) -> str:
        nccl = "NCCL usable" if self.nccl_ok else "no NCCL"
        made = "real" if self.model == "real" else "simulated"
        return f"{self.n} {made} {self.device_type} device(s) ({MODELS[self.model]}), {nccl}: {self.reason}"


def plan(n: int, kind: str = "auto", physical_gpus: int = 0) -> Layout:
    """Decide, without touching TensorFlow, how to provide n devices (so that the GPU branches can
    be tested on a CPU-only machine)."""
    n = checks.whole_number(n, "the number of devices n")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
    if kind == "cores":
        return Layout("CPU", n, False, "core devices asked for; NCCL needs real GPUs", "cores")
    if kind == "gpu" and physical_gpus == 0:
        raise RuntimeError(
            "kind='gpu' was asked for but TensorFlow sees no GPU. Use kind='auto' or "
            "kind='cpu' to simulate devices on the CPU."
        )
    if kind == "cpu" or physical_gpus == 0:
        why = "CPU simulation asked for" if kind == "cpu" else "no GPU found"
        return Layout("CPU", n, False, f"{why}; NCCL needs real GPUs", "logical")
    if physical_gpus >= n:
        return Layout("GPU", n, True, f"{physical_gpus} GPUs found", "real")
    # As equal as possible, the first GPUs one more: 5 over 2 -> (3, 2), GPU:0 to GPU:2 on the first.
    per_gpu = tuple(n // physical_gpus + (i < n % physical_gpus) for i in range(physical_gpus))
    return Layout("GPU", n, False, _spread_reason(n, per_gpu), "logical", per_gpu=per_gpu)


def _spread_reason(n: int, per_gpu: tuple[int, ...]) -> str:
    """What was chosen for n devices on too few GPUs, why NCCL is off, and what to ask for instead."""
    gpus = len(per_gpu)
    split = " + ".join(map(str, per_gpu))
    why_not = (
        "NCCL off: it refuses two ranks on one physical GPU ('Duplicate GPU detected') and may "
        "hang, so use method='ring' or 'central'"
    )
    if gpus == 1:
        return f"1 GPU for {n} devices: {n} logical GPUs carved out of it; {why_not}; NCCL needs 2 or more GPUs"
    return (
        f"{gpus} GPUs for {n} devices: {n} logical GPUs spread over the {gpus} GPUs ({split}); "
        f"{why_not}. For NCCL on the {gpus} real GPUs, call simulate({gpus}) instead"
    )


def simulate(n: int, kind: str = "auto") -> list[str]:
    """Provide n devices and return their full names, e.g. '/device:CPU:0'. Call it first, before any
    other TensorFlow work; again with the same n and kind, it returns the same devices."""
    global _current
    if os.environ.get(ENV_VAR, "").lower() == "cpu" and kind in ("auto", "gpu"):
        kind = "cpu"  # forced; core devices are CPUs already
    # Core devices need no GPU count: their workers start before TensorFlow is imported here.
    layout = plan(n, kind) if kind == "cores" else plan(n, kind, _physical_gpus())
    if _current is not None:
        if (_current.device_type, _current.n, _current.model) == (layout.device_type, layout.n, layout.model):
            if layout.model == "cores":
                core_devices.check_workers()  # the same devices only while every worker serves
            _announce(_current)
            return list(_current.names)
        _refuse(layout, _devices(_current, started=True))
    names = _start_core_devices(layout.n) if layout.model == "cores" else _start_in_process(layout)
    stop_filtering_stderr()  # TensorFlow has started: its start-up lines are behind us, a crash's are not
    _current = dataclasses.replace(layout, names=tuple(names))
    _announce(_current)
    return list(names)


def current() -> Layout | None:
    """The layout chosen by `simulate` in this process (its `model` says how), or None before it was called."""
    return _current


def _physical_gpus() -> int:
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))


def _start_core_devices(n: int) -> list[str]:
    """core_devices.start(n), without its warning that devices share cores: the line simulate prints says
    it (a warning would show as a red block under the notebook's first cell)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*several devices share a core", category=UserWarning)
        return core_devices.start(n)


def _start_in_process(layout: Layout) -> list[str]:
    import tensorflow as tf

    try:
        _configure(tf, layout)
    except RuntimeError as err:  # the runtime started before us
        have = [d.name for d in tf.config.list_logical_devices(layout.device_type)]
        if len(have) != layout.n:
            _refuse(layout, f"{len(have)} {layout.device_type} device(s)", err)
    return [d.name for d in tf.config.list_logical_devices(layout.device_type)]


def _configure(tf, layout: Layout) -> None:
    gpus = tf.config.list_physical_devices("GPU")
    if layout.device_type == "CPU":
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
    elif layout.model == "real":
        tf.config.set_visible_devices(gpus[: layout.n], "GPU")
    else:  # n logical GPUs spread over all the physical ones (fewer than n), layout.per_gpu on each
        tf.config.set_visible_devices(gpus, "GPU")
        for gpu, k in zip(gpus, layout.per_gpu, strict=True):
            tf.config.set_logical_device_configuration(
                gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=GPU_MEMORY_MB) for _ in range(k)]
            )


def _refuse(layout: Layout, have: str, cause: Exception | None = None) -> None:
    call = f"simulate({layout.n}, kind='cores')" if layout.model == "cores" else f"simulate({layout.n})"
    raise RuntimeError(
        f"TensorFlow has already started with {have}; it cannot switch to {_devices(layout)} "
        f"in this process. Restart the kernel (Kernel > Restart) and call {call} first, "
        "before any other TensorFlow work."
    ) from cause


def _devices(layout: Layout, started: bool = False) -> str:
    """'2 core devices', '4 CPU devices'; '4 logical CPU devices' for a layout already in force."""
    if layout.model == "cores":
        return f"{layout.n} core devices"
    logical = "logical " if started and layout.model == "logical" else ""
    return f"{layout.n} {logical}{layout.device_type} devices"


def _announce(layout: Layout) -> None:
    names = layout.names
    shown = ", ".join(names) if len(names) <= 4 else f"{names[0]} ... {names[-1]}"
    what = "core" if layout.model == "cores" else layout.model
    print(f"{layout.n} {what} {layout.device_type} device(s) ({layout.reason}{_threads_note(layout)}): {shown}")


def _threads_note(layout: Layout) -> str:
    """What is really in force, read back rather than assumed: configuring fails once TensorFlow runs."""
    if layout.model == "cores":
        cores = sorted({w.core for w in core_devices.workers})
        shared = (
            f"; {layout.n} devices share {len(cores)} core(s), so speed figures no longer mean one core per "
            "device (results stay correct)"
            if layout.n > len(cores)
            else ""
        )
        return f"; one server process per device, pinned to core(s) {cores}{shared}"
    if layout.device_type != "CPU":
        return ""
    import tensorflow as tf

    threads = tf.config.threading.get_intra_op_parallelism_threads()
    if threads == 1:
        return "; intra-op threads 1 each"
    in_force = threads or "TensorFlow's default, one per core"
    return f"; intra-op threads could not be set, TensorFlow had already started: {in_force} in force"


# --- names ----------------------------------------------------------------------------

_NAME = re.compile(
    r"""^(?:/job:(?P<job>[\w-]+))?(?:/replica:(?P<replica>\d+))?(?:/task:(?P<task>\d+))?  # cluster prefix
        /?(?:device:)?                                     # '/device:' or '/' or nothing
        (?P<kind>[a-z_]+):(?P<index>\d+)$""",
    re.IGNORECASE | re.VERBOSE,
)
_KNOWN = {"cpu", "gpu", "tpu", "xla_cpu", "xla_gpu"}


def normalize(name: str) -> str:
    """The canonical form of a device name: '/device:GPU:1' from 'gpu:1', '/gpu:1', 'GPU:1' or
    '/job:localhost/replica:0/task:0/device:GPU:1'. Another process's device keeps its job, replica
    and task ('/job:worker/replica:0/task:1/device:CPU:0'), so that two core devices stay two."""
    if not isinstance(name, str):
        raise TypeError(f"a device name is a string such as '/device:GPU:0', got {name!r}.")
    match = _NAME.match(name.strip())
    if match and match["kind"].lower() in _KNOWN:
        return _canonical(match)
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


def _canonical(match: re.Match) -> str:
    device = f"/device:{match['kind'].upper()}:{int(match['index'])}"
    place = (match["job"] or LOCAL_JOB, int(match["replica"] or 0), int(match["task"] or 0))
    if place == (LOCAL_JOB, 0, 0):
        return device  # this process's own device
    return "/job:{}/replica:{}/task:{}".format(*place) + device


def bytes_per_device(variables) -> dict[str, int]:
    """Bytes of variable storage on each device, keyed by canonical device name."""
    totals: dict[str, int] = {}
    for v in variables:
        device = normalize(v.device)
        totals[device] = totals.get(device, 0) + v.shape.num_elements() * v.dtype.size
    return totals
