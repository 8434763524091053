"""Where each op of a step is, for the placement audit (`placement`), and how that is known: the device
it asks for (a traced step: `Requested`), or the device it ran on (a step run once: `Ran`).

A run does not hold every op of the traced graph: the runtime inlines function bodies under new names
(`placement_graph`), fuses ops (Conv2D, BiasAdd and Relu become one `_FusedConv2D` named after the
last), folds constants, prunes ops whose result nobody reads, rewrites others under new names, and
compiles XLA bodies into one program. The placer has given each of them a device before (placement
precedes grappler), and `Ran.where` says which by other evidence, each way named:
- "in its XLA cluster": an op of a compiled body runs where the call ran;
- "requested": the device the op asked for (its own `tf.device`, or the one its call gives a body's
  op that asks for none), where the placer puts it when that device has a kernel for it;
- "fused": an op that asked for none, whose consumer ran as a fused kernel (found within three
  consumers), ran in it;
- "colocated": the op an op is colocated with (`tf.gradients` colocates each gradient with its op);
- "beside its variable": an op that reads a variable is placed where the variable is;
- "beside its input": an op that asks for no device and only reads a shape (Shape, ShapeN, Size, Rank)
  is placed beside its input (the placer's heuristic B, `placer.cc`);
- "default device": any other op that asks for no device is placed on the placer's default device,
  which is where the same graph's other such ops ran, when the run shows them all on one device.
An op that none of these resolves (a shape read of an unresolved input; an op that asks for nothing in
a graph whose other such ops the run does not show on one device) is unresolved: the audit counts it
and fails, never skips it. Put the code that makes it under a `tf.device`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import tensorflow as tf

from .devices import normalize

_METADATA_TYPES = ("Shape", "ShapeN", "Size", "Rank")  # what the placer places beside their input


@dataclass(frozen=True)
class Frame:
    """One graph that the audit walks: the step's own, or a function body inside it."""

    path: str = ""  # the enclosing calls, as "call/": the name scopes an op is in are read through it
    run_prefix: str | None = ""  # how the run names this graph's ops; None: compiled by XLA, not in the run
    requested: str = ""  # the device a body's op that asks for none gets from its call
    cluster: str | None = None  # the device of the XLA cluster that runs every op here
    record: bool = True  # False while a loop's lineage settles: nothing is reported


def requested(op, frame: Frame) -> str:
    """The device `op` asks for, its call's device filling what it leaves unsaid ('' if none)."""
    own, inherited = op.device, frame.requested
    if own and inherited:
        own = tf.DeviceSpec.from_string(inherited).make_merged_spec(tf.DeviceSpec.from_string(own)).to_string()
    return normalize(own or inherited) if own or inherited else ""


def colocated_with(op) -> list[str]:
    """The ops that `op` must share a device with (`tf.colocate_with`, as tf.gradients does)."""
    return [g.decode().removeprefix("loc:@") for g in op.colocation_groups() if g != b"loc:@" + op.name.encode()]


def _unrequested(op, beside: str | None, inputs_at, colocated_at) -> tuple[str, str] | None:
    """Where the placer puts an op that asks for no device, when its rule leaves no doubt."""
    if beside:
        return beside, "beside its variable"
    if known := set(colocated_at) - {None}:
        return (known.pop(), "colocated") if len(known) == 1 else None
    inputs_at = set(inputs_at) - {None}
    if op.type in _METADATA_TYPES and len(inputs_at) == 1:
        return next(iter(inputs_at)), "beside its input"
    return None


def _placed_by_default(op, frame: Frame) -> bool:
    """Does the placer put `op` on its default device (no request, no input to follow, no colocation)?"""
    follows = op.type in (*_METADATA_TYPES, "Identity", "IdentityN") or not op.inputs  # heuristics A and B
    reads_variable = any(t.dtype == tf.resource for t in op.inputs)
    return not (follows or reads_variable or requested(op, frame) or colocated_with(op))


class Requested:
    """A traced step: each op is where it asks to be; an op that asks for nothing is where the placer's
    rules put it (beside the variable it reads, the op it is colocated with, or the input whose shape it
    reads), else on `default` (where TensorFlow puts a function's other unplaced ops)."""

    def __init__(self, default: str):
        self.default = normalize(default)

    def where(self, op, frame: Frame, beside: str | None, inputs_at=(), colocated_at=()) -> tuple[str | None, str]:
        """Where `op` is, and how that is known; `beside` the owner of the variable it reads, if one;
        `inputs_at` the devices of the ops whose outputs it reads; `colocated_at` the devices of the ops
        it is colocated with (None where unknown)."""
        if frame.cluster:
            return frame.cluster, "in its XLA cluster"
        if device := requested(op, frame):
            return device, "requested"
        return _unrequested(op, beside, inputs_at, colocated_at) or (self.default, "default device")

    def body_prefix(self, *_) -> None:
        return None  # nothing ran


class Ran:
    """A step run once: `rows` are (op name, op type, device) for every node of the run's partition
    graphs (`timeline.placement`)."""

    def __init__(self, rows):
        self.ran: dict[str, tuple[str, str]] = {}
        for name, op_type, device in rows:
            self.ran.setdefault(name, (op_type, device))
        self._defaults: dict[tuple, str | None] = {}

    def where(self, op, frame: Frame, beside: str | None, inputs_at=(), colocated_at=()) -> tuple[str | None, str]:
        """As `Requested.where`, from the run first, then from the evidence the module's docstring names."""
        if frame.run_prefix is not None and (hit := self.ran.get(frame.run_prefix + op.name)):
            return hit[1], "ran"
        if frame.cluster:
            return frame.cluster, "in its XLA cluster"
        if device := requested(op, frame):
            return device, "requested"
        if device := self._fused_into(op, frame):
            return device, "fused"
        if found := _unrequested(op, beside, inputs_at, colocated_at):
            return found
        device = None if op.type in _METADATA_TYPES else self._default(op.graph, frame)
        return (device, "default device") if device else (None, "unresolved")

    def _default(self, graph, frame: Frame) -> str | None:
        """Where the run shows this graph's ops that ask for no device and follow no other op, if on one."""
        key = (id(graph), frame.run_prefix, frame.requested)
        if key not in self._defaults:
            seen = set()
            for op in graph.get_operations():
                if _placed_by_default(op, frame) and (hit := self.ran.get(f"{frame.run_prefix}{op.name}")):
                    seen.add(hit[1])
            self._defaults[key] = seen.pop() if len(seen) == 1 else None
        return self._defaults[key]

    def _fused_into(self, op, frame: Frame) -> str | None:
        """The device of the fused kernel that ran `op`, if one of its next three consumers ran as one."""
        if frame.run_prefix is None:
            return None
        layer = [op]
        for _ in range(3):
            layer = [c for o in layer for t in o.outputs for c in t.consumers()]
            for consumer in layer:
                hit = self.ran.get(frame.run_prefix + consumer.name)
                if hit and "Fused" in hit[0]:
                    return hit[1]
            layer = [c for c in layer if frame.run_prefix + c.name not in self.ran]  # removed too: look further
        return None

    def body_prefix(self, op, frame: Frame, infix: str | None) -> str | None:
        """How the run names the ops of a body that `op` runs: `<call>/<op>`, or for a lowered branch
        `<op>/<infix>/_N/<op>` with the N the runtime chose."""
        if frame.run_prefix is None:
            return None
        base = frame.run_prefix + op.name + "/"
        if infix is None:
            return base
        pattern = re.compile(re.escape(f"{base}{infix}/_") + r"\d+/")
        for name in self.ran:
            if match := pattern.match(name):
                return match.group(0)
        return f"{base}{infix}/_?/"  # none of its ops ran under its name: each is resolved another way
