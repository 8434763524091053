"""The placement audit: does every op of a training step run on the device that owns it, and does
every variable live there? Placement changes no number, so only this check can see it.

You say who owns what: `owners = {device: variables}`, a replica's, a stage's or a shard's weights,
optimizer state (step counter, slots) and random-seed state. Every op then gets an owner:

- an op that reads or writes a variable: the variable's owner (TensorFlow runs it beside the variable);
- a gradient op (built by `GradientTape` or `tf.gradients`): the device of the forward op it
  differentiates, whose tensors it reads;
- an op of an all-reduce (by name scope, or a collective or NCCL type): any owner, since it moves
  data between them;
- any other op: a device that one of its inputs belongs to (a copy to the next device is fine).

Ops fed only by the batch and constants (the split of the batch) have no owner and are not checked.

`audit(step, *args, owners=...)` reads the devices the step's graph *requests*: it needs no GPU, so
a step traced with `/GPU:i` names is checked on a laptop. With `run=True` it runs the step once and
reads where each op *ran* (the partition graphs of the run, see `timeline.placement`). Variables are
checked wherever their owners are devices of this process.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import tensorflow as tf

from . import timeline
from .devices import normalize

# The name of a gradient op: `gradient_tape/<forward op>/...` (a tape) or
# `gradients/<forward op>_grad/...` (tf.gradients), possibly inside a name scope.
_TAPE = re.compile(r"(?:^|/)gradient_tape/(?P<rest>.+)$")
_GRADIENTS = re.compile(r"(?:^|/)gradients(?:_\d+)?/(?P<rest>.+)$")
_COMMUNICATION_TYPES = ("NcclAllReduce", "CollectiveReduce", "CollectiveGather", "CollectiveAllToAll")


@dataclass(frozen=True)
class Misplaced:
    name: str  # the op's or the variable's name
    type: str  # the op's type, or "variable"
    device: str  # where it is (requested or run)
    owner: str  # where it belongs: one device, or several joined by " or "


@dataclass
class Report:
    ops_checked: int
    variables_checked: int
    misplaced: list[Misplaced] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.misplaced

    def counts(self) -> Counter:
        """How many misplaced ops of each (type, device, owner)."""
        return Counter((m.type, m.device, m.owner) for m in self.misplaced)

    def __str__(self) -> str:
        head = (
            f"placement: {self.ops_checked} ops and {self.variables_checked} variables checked, "
            f"{len(self.misplaced)} misplaced"
        )
        rows = [f"  {n:3d} x {t} on {d}, owner {o}" for (t, d, o), n in self.counts().most_common(12)]
        return "\n".join([head, *rows])


def tf_variable(v) -> tf.Variable:
    """The tf.Variable behind a Keras 3 variable (which has no `.device`), or `v` itself."""
    return v if isinstance(v, tf.Variable) else v.value


def audit(step, *args, owners, run: bool = False, **kwargs) -> Report:
    """Check `step(*args, **kwargs)` (a tf.function or a Python function) against `owners`,
    {device: iterable of variables}: by requested devices, or by where each op ran (`run=True`)."""
    owner_of = _owner_map(owners)
    function = step if hasattr(step, "get_concrete_function") else tf.function(step)
    graph = function.get_concrete_function(*args, **kwargs).graph
    default = normalize("/GPU:0" if any("GPU" in d for d in owner_of.values()) else "/CPU:0")
    ran = {name: device for name, _, device in timeline.placement(function, *args, **kwargs)} if run else {}
    captured = {inner.op.name: owner_of[id(ext)] for ext, inner in graph.captures if id(ext) in owner_of}
    where = lambda op, beside=None: _where(op, beside, ran, run, default)  # noqa: E731
    report = _check_ops(graph, captured, set(owner_of.values()), where)
    _check_variables(owners, report)
    return report


def _owner_map(owners) -> dict[int, str]:
    """id of each variable's handle -> its owner's canonical device name."""
    if not isinstance(owners, dict) or not owners:
        raise TypeError("owners is a dict {device: variables}, e.g. {d: replica.variables for d, replica in ...}.")
    owner_of = {}
    for device, variables in owners.items():
        for v in variables:
            owner_of[id(tf_variable(v).handle)] = normalize(device)
    return owner_of


def _where(op, beside, ran: dict[str, str], run: bool, default: str) -> str | None:
    """Where op ran (run mode; None if the run optimized it away), else where it asked to run: an op
    that asks for no device runs beside the variable it reads (TensorFlow colocates them), if any,
    else on the default device."""
    if run:
        return ran.get(op.name)
    return normalize(op.device) if op.device else beside or default


def _check_ops(graph, captured: dict[str, str], devices: set[str], where) -> Report:
    ops = graph.get_operations()
    by_name = {op.name: op for op in ops}
    home: dict[str, str | None] = dict(captured)  # the device each owned op belongs to
    report = Report(0, 0)
    for op in ops:  # in creation order: inputs before their consumers
        if op.name in captured or op.type in ("Placeholder", "Const", "NoOp"):
            continue
        variables = {captured[t.op.name] for t in op.inputs if t.op.name in captured}
        allowed = set(variables) or _allowed(op, by_name, home, devices, where)
        device = where(op, next(iter(variables), None))
        if not allowed or device is None:  # not owned, or optimized away by the run
            home[op.name] = next(iter(allowed)) if len(allowed) == 1 else None
            continue
        report.ops_checked += 1
        if device in allowed:
            home[op.name] = device
            continue
        report.misplaced.append(Misplaced(op.name, op.type, device, " or ".join(sorted(allowed))))
        home[op.name] = next(iter(allowed)) if len(allowed) == 1 else None  # its consumers belong there too
    return report


def _allowed(op, by_name, home, devices, where) -> set[str]:
    """The devices an op that touches no variable may run on (empty: not checked)."""
    if op.type.startswith(_COMMUNICATION_TYPES) or timeline.is_communication(op.name):
        return set(devices)
    forward = _forward_op(op.name, by_name)
    if forward is not None:
        return {where(forward)} - {None} if home.get(forward.name) else set()
    return {home[t.op.name] for t in op.inputs if home.get(t.op.name)}


def _forward_op(name: str, by_name: dict):
    """The forward op that a gradient op named `name` differentiates, or None."""
    for pattern, suffix in ((_TAPE, ""), (_GRADIENTS, "_grad")):
        match = pattern.search(name)
        if match:
            parts = match["rest"].split("/")
            for end in range(len(parts), 0, -1):
                candidate = "/".join(parts[:end])
                if suffix and not candidate.endswith(suffix):
                    continue
                forward = by_name.get(candidate[: len(candidate) - len(suffix)])
                if forward is not None and forward.name != name:
                    return forward
    return None


def _check_variables(owners, report: Report) -> None:
    """Each variable on its owner's device, where the owners are devices of this process."""
    here = {normalize(d.name) for d in tf.config.list_logical_devices()}
    for device, variables in owners.items():
        owner = normalize(device)
        if owner not in here:  # e.g. /GPU:i names traced on a machine without GPUs
            continue
        for v in variables:
            report.variables_checked += 1
            actual = normalize(tf_variable(v).device)
            if actual != owner:
                report.misplaced.append(Misplaced(getattr(v, "path", v.name), "variable", actual, owner))
