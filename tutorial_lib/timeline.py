"""Measured timelines: which device ran which op, and when.

`trace` returns one `Event` per op run (device from `placement`, times from the profiler);
`busy_fraction`, `phase_time`, `mean_busy_devices` and `plot` read the events.
"""

from __future__ import annotations

import glob
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import tensorflow as tf
from tensorflow.python.eager import context  # private: see `placement`

from . import checks, core_devices, timing
from .devices import normalize

# The copies TensorFlow adds where a value crosses devices: in `placement`, not computation.
COPY_TYPES = ("_Send", "_Recv", "_HostSend", "_HostRecv")
# Bookkeeping ops that move or name data but do no work worth drawing.
_SKIP_TYPES = {*COPY_TYPES, "NoOp", "Const", "_Arg", "_Retval"}
PHASE_COLORS = dict(
    forward="tab:blue", backward="tab:orange", reduce="tab:purple", update="tab:green", other="tab:gray"
)
# Gradient communication, as a whole component of an op's name: `tower_0/ring_all_reduce_1/add`
# matches (TensorFlow adds _1, _2, ... to a scope opened twice), `moving_average/AssignSub` does not.
_REDUCE_SCOPE = re.compile("(average_gradients|(central_|ring_|nccl_)?all_reduce|allreduce)(_[0-9]+)?")


def is_communication(op_name: str) -> bool:
    """Is the op part of gradient averaging or an all-reduce, by one of its name scopes?"""
    return any(_REDUCE_SCOPE.fullmatch(part) for part in op_name.split("/"))


@dataclass(frozen=True)
class Event:
    device: str
    op: str
    type: str
    start: float  # milliseconds from the first recorded event
    end: float

    @property
    def phase(self) -> str:
        """forward, backward (built by GradientTape), reduce (averaging or all-reduce of
        gradients, by name scope), update (variable writes) or other (reads, copies)."""
        if "Collective" in self.type or is_communication(self.op):
            return "reduce"
        if "gradient_tape" in self.op or "backward" in self.op or "Grad" in self.type:
            return "backward"
        if self.type.startswith(("ResourceApply", "AssignSub", "AssignAdd", "Assign")):
            return "update"
        if self.type in ("ReadVariableOp", "Identity"):
            return "other"
        return "forward"


def placement(fn, *args, **kwargs) -> list[tuple[str, str, str]]:
    """(op name, op type, device) for every op TensorFlow ran for `fn`, where it ran (soft placement
    may move a `tf.device` request without a word), copies (`COPY_TYPES`) included.

    Runs `fn` once as a fresh `tf.function` and restores its variables. It reads the executed graphs
    from the eager context's graph collection (private), as `tf.summary.trace_on(graph=True)` does.
    """
    core_devices.check_workers()  # TensorFlow would ask a dead worker for its graphs and wait
    fresh = tf.function(getattr(fn, "python_function", fn))  # placed when first run: now
    variables = fresh.get_concrete_function(*args, **kwargs).variables
    saved = [v.numpy() for v in variables]
    ctx = context.context()
    ctx.enable_graph_collection()
    try:
        # The graphs of a function run that raised come out with the next run's (measured: a failed
        # XLA call's step showed up in the next audit): one empty run takes them first.
        _nothing()
        ctx.export_run_metadata()
        timing.wait(fresh(*args, **kwargs))
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_graph_collection()
        for v, value in zip(variables, saved, strict=True):
            v.assign(value)
    rows = [
        (node.name, node.op, normalize(node.device))
        for graph in metadata.function_graphs
        for partition in graph.partition_graphs
        for node in partition.node
    ]
    if not rows:
        raise RuntimeError(
            "TensorFlow returned no executed graph for fn; was it run eagerly (tf.config.run_functions_eagerly)?"
        )
    return rows


@tf.function
def _nothing():
    return tf.constant(0)


def requested_placement(fn, *args, **kwargs) -> list[tuple[str, str, str]]:
    """(op name, op type, requested device) for every op of `fn`'s graph: what `tf.device` asked
    for, '' where nothing was asked. Not where the op ran: see `placement`."""
    return _graph_placement(_as_function(fn).get_concrete_function(*args, **kwargs).graph)


def _graph_placement(graph) -> list[tuple[str, str, str]]:
    graph_def = graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:  # bodies of nested functions and loops
        nodes.extend(function.node_def)
    return [(n.name, n.op, normalize(n.device) if n.device else "") for n in nodes]


def trace(fn, *args, steps: int = 1, placement_of=None, **kwargs) -> list[Event]:
    """Run `fn(*args, **kwargs)` `steps` times under the profiler, after an untraced warm-up; return
    its op events. `fn` runs as a `tf.function`, unless `placement_of` lists (or returns, after the
    warm-up) the concrete functions it calls: their graphs' requests then say where each op ran."""
    steps = checks.whole_number(steps, "steps")
    core_devices.check_workers()  # before the warm-up, which would fail less clearly
    f = fn if placement_of is not None else _as_function(fn)
    timing.wait(f(*args, **kwargs))  # warm-up, not traced
    if placement_of is not None:
        functions = placement_of() if callable(placement_of) else placement_of  # after the warm-up
        # Already run, so already placed: their requests (or the default device) say where ops ran.
        rows = [
            (name, op_type, device or _default_device())
            for concrete in functions
            for name, op_type, device in _graph_placement(concrete.graph)
        ]
    else:
        rows = placement(f, *args, **kwargs)
    where = {name: device for name, _, device in reversed(rows)}  # an op's first row wins
    # Deleted even when fn raises: a class that traces all day must not fill the temporary folder.
    with tempfile.TemporaryDirectory(prefix="tutorial_trace_") as logdir:
        if core_devices.workers:
            from . import worker_traces  # it reads traces with this module's functions

            return worker_traces.trace_cores(f, args, kwargs, steps, logdir, where)
        profile(f, args, kwargs, steps, logdir)
        return as_events(r for space in read_spaces(logdir).values() for r in space_events(space, where))


def profile(f, args, kwargs, steps: int, logdir: str) -> None:
    """Run `f` `steps` times under the profiler, which writes its trace into `logdir`."""
    tf.profiler.experimental.start(logdir)
    try:
        for _ in range(steps):
            result = f(*args, **kwargs)
        timing.wait(result)
    finally:
        tf.profiler.experimental.stop()


def _as_function(fn):
    return fn if hasattr(fn, "get_concrete_function") else tf.function(fn)


def _default_device() -> str:
    gpus = tf.config.list_logical_devices("GPU")
    return normalize(gpus[0].name) if gpus else "/device:CPU:0"


class _Raw(NamedTuple):  # one op run as the profiler recorded it
    device: str
    op: str
    type: str
    start_ps: int
    end_ps: int
    on_gpu_plane: bool


def read_spaces(logdir: str) -> dict:
    """Every trace file under `logdir`, by host (the file's name, as `localhost_12345`)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    spaces = {}
    for path in glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True):
        spaces[Path(path).name.removesuffix(".xplane.pb")] = space = xplane_pb2.XSpace()
        space.ParseFromString(Path(path).read_bytes())
    return spaces


def session_ns(space) -> tuple[int, int] | None:
    """When the profiler session of a trace started and stopped (ns since the epoch), if recorded."""
    for plane in space.planes:
        if plane.name == "Task Environment":
            stats = {plane.stat_metadata[s.metadata_id].name: s.uint64_value for s in plane.stats}
            if "profile_start_time" in stats and "profile_stop_time" in stats:
                return stats["profile_start_time"], stats["profile_stop_time"]
    return None


def space_events(space, where: dict[str, str], device: str | None = None):
    """The ops of one trace file, in picoseconds since the epoch where it records its session's start.
    `device`: the core device that wrote it, or None for this process's trace (then `where` says)."""
    session = session_ns(space)
    start_ps = session[0] * 1000 if session else 0
    for plane in space.planes:
        for r in _plane_events(plane, where, start_ps):
            yield r._replace(device=device) if device else r


def as_events(raw) -> list[Event]:
    """Events in milliseconds from the first op's start, sorted by start."""
    raw = list(raw)
    # On GPUs the host plane only shows kernel launches; keep the GPU plane's kernels.
    gpu_timed = any(r.on_gpu_plane for r in raw)
    raw = [r for r in raw if r.on_gpu_plane or not (gpu_timed and "GPU" in r.device)]
    if not raw:
        return []
    zero = min(r.start_ps for r in raw)
    events = [Event(r.device, r.op, r.type, (r.start_ps - zero) / 1e9, (r.end_ps - zero) / 1e9) for r in raw]
    return sorted(events, key=lambda ev: (ev.start, ev.device))


def _plane_events(plane, where: dict[str, str], start_ps: int):
    """The ops of one profiler plane (a host's threads, or a GPU) that ran on a known device."""
    on_gpu = plane.name.startswith("/device:GPU")
    for line in plane.lines:
        t0 = start_ps + line.timestamp_ns * 1000
        for e in line.events:
            label = _op_label(plane, e) if on_gpu else plane.event_metadata[e.metadata_id].name
            op, _, op_type = label.rpartition(":")
            device = _lookup(where, op)
            if device and op_type not in _SKIP_TYPES:
                start = t0 + e.offset_ps
                yield _Raw(device, op, op_type, start, start + e.duration_ps, on_gpu)


def _op_label(plane, event) -> str:
    for stat in event.stats:
        if plane.stat_metadata[stat.metadata_id].name == "tf_op":
            return stat.str_value or plane.stat_metadata[stat.ref_value].name
    return ""


def _lookup(where: dict[str, str], op: str) -> str | None:
    """Device of an op; inlined function bodies carry their caller's name as a prefix."""
    parts = op.split("/")
    for i in range(len(parts)):
        device = where.get("/".join(parts[i:]))
        if device:
            return device
    return None


# --- reading the events --------------------------------------------------------------


def merged(intervals):
    """Union of [start, end) intervals as a sorted list without overlaps."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def span(events) -> float:
    """Milliseconds from the first op's start to the last op's end."""
    return max(e.end for e in events) - min(e.start for e in events) if events else 0.0


def _busy_ms(events) -> float:
    """Milliseconds during which at least one of `events` ran."""
    return sum(b - a for a, b in merged((e.start, e.end) for e in events))


def _lanes(events, devices) -> list[str]:
    return [normalize(d) for d in devices] if devices else sorted({e.device for e in events})


def busy_fraction(events, devices=None) -> dict[str, float]:
    """For each device, the share of the span during which at least one of its ops ran."""
    if not events:
        raise ValueError("no events: was anything traced? trace() returns [] when no op ran.")
    return {d: _busy_ms(e for e in events if e.device == d) / span(events) for d in _lanes(events, devices)}


def phase_time(events) -> dict[str, dict[str, float]]:
    """Milliseconds each device spent in each phase (forward, backward, reduce, update, other)."""
    return {
        d: {p: _busy_ms(e for e in events if e.device == d and e.phase == p) for p in PHASE_COLORS}
        for d in _lanes(events, None)
    }


def mean_busy_devices(events) -> float:
    """Average number of devices busy at once over the span (1.0 = one at a time)."""
    return sum(busy_fraction(events).values())


def plot(events, devices=None, title="Per-device timeline", ax=None, legend=True, phase_of=None, colors=None):
    """Gantt chart: one lane per device (named by `lane_label`), ops coloured by phase, time in
    milliseconds. `legend=False` for all but one of several charts of one figure. `phase_of(event)`
    and `colors` ({phase: colour}) draw phases of your own, such as zero bubble's W."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not events:
        raise ValueError("no events to plot.")
    devices, phase_of = _lanes(events, devices), phase_of or (lambda e: e.phase)
    colors, phases = {**PHASE_COLORS, **(colors or {})}, [phase_of(e) for e in events]
    if unknown := set(phases) - set(colors):
        raise ValueError(f"phases {sorted(unknown)} have no colour: give colors={{phase: colour}}.")
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 * len(devices) + 1.4), layout="constrained")
    for lane, device in enumerate(devices):
        for phase, color in colors.items():
            mine = zip(events, phases, strict=True)
            bars = [(e.start, e.end - e.start) for e, p in mine if e.device == device and p == phase]
            ax.broken_barh(bars, (lane - 0.4, 0.8), color=color)
    ax.set_yticks(range(len(devices)), [lane_label(d) for d in devices])
    ax.invert_yaxis()
    ax.set(xlabel="time (ms)", ylabel="device", title=title)
    if legend:
        handles = [Patch(color=c, label=p) for p, c in colors.items() if p in set(phases)]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return ax


def lane_label(device: str) -> str:
    """A lane's short name: 'worker 1' for core device 1 (another process), 'CPU:1' for a device of
    this process: the full names would take a third of a chart's width."""
    match = re.fullmatch(r"/job:(\w+)/replica:\d+/task:(\d+)/device:\w+:\d+", device)
    if match and match[1] != "localhost":
        return f"{match[1]} {match[2]}"
    return device.rsplit("device:", 1)[-1]
