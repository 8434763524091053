"""The placement audit: does every op of a training step run on the device that owns it, and does
every variable live there? Placement changes no number, so only this check can see it.

You say who owns what: `owners = {device: variables}`, a replica's, a stage's or a shard's weights,
optimizer state (step counter, slots) and random-seed state. Every op then gets an owner:

- an op that reads or writes a variable: the variable's owner (TensorFlow runs it beside the variable);
- a gradient op (built by `GradientTape` or `tf.gradients`): the device of the forward op it
  differentiates, whose tensors it reads;
- an op of an all-reduce (by name scope, or a collective or NCCL type), and a copy (`tf.identity`):
  any owner, since it moves data between them;
- an op inside a name scope given in `scopes` ({scope: device}, as `tower_0` for notebook 02's
  towers, whose variables all live on the controller): that device;
- any other op: a device that one of its inputs belongs to.

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
_COPY_TYPES = ("Identity", "IdentityN")


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


def audit(step, *args, owners, scopes=None, run: bool = False, **kwargs) -> Report:
    """Check `step(*args, **kwargs)` (a tf.function or a Python function) against `owners`,
    {device: iterable of variables}, and `scopes`, {name scope: device}: by requested devices, or by
    where each op ran (`run=True`)."""
    owner_of = _owner_map(owners)
    if not callable(step):
        raise TypeError(f"step is the training step to audit, a function or tf.function, got {type(step).__name__}.")
    if scopes is not None and not isinstance(scopes, dict):
        raise TypeError(f"scopes is a dict {{name scope: device}}, e.g. {{'tower_0': '/GPU:0'}}, got {scopes!r}.")
    function = step if hasattr(step, "get_concrete_function") else tf.function(step)
    graph = function.get_concrete_function(*args, **kwargs).graph
    default = normalize("/GPU:0" if any("GPU" in d for d in owner_of.values()) else "/CPU:0")
    ran = {name: device for name, _, device in timeline.placement(function, *args, **kwargs)} if run else {}
    captured = {inner.op.name: owner_of[id(ext)] for ext, inner in graph.captures if id(ext) in owner_of}
    where = lambda op, beside=None: _where(op, beside, ran, run, default)  # noqa: E731
    scoped = {scope: normalize(device) for scope, device in (scopes or {}).items()}
    report = _check_ops(graph, captured, set(owner_of.values()) | set(scoped.values()), where, scoped)
    if not captured and not report.ops_checked:  # an empty audit would say ok
        raise ValueError(
            "the step reads none of the owners' variables, so no op could be checked: give owners the variables "
            "the step was built with (its replicas', stages' and optimizers'), not new copies."
        )
    _check_variables(owners, report)
    return report


def _owner_map(owners) -> dict[int, str]:
    """id of each variable's handle -> its owner's canonical device name."""
    if not isinstance(owners, dict) or not owners:
        raise TypeError("owners is a dict {device: variables}, e.g. {d: replica.variables for d, replica in ...}.")
    owner_of = {}
    for device, variables in owners.items():
        if isinstance(variables, tf.Variable | tf.Tensor) or not hasattr(variables, "__iter__"):
            raise TypeError(f"owners[{device!r}] is a list of variables, e.g. model.variables, "
                            f"got a {type(variables).__name__}.")  # fmt: skip
        for v in variables:
            if not (isinstance(v, tf.Variable) or isinstance(getattr(v, "value", None), tf.Variable)):
                raise TypeError(f"owners[{device!r}] holds a {type(v).__name__}, not a variable: give variables, "
                                "e.g. model.variables.")  # fmt: skip
            key = id(tf_variable(v).handle)
            if owner_of.setdefault(key, normalize(device)) != normalize(device):
                raise ValueError(f"{getattr(v, 'path', v.name)} is given to two owners, {owner_of[key]} and "
                                 f"{normalize(device)}: a variable lives on one device; name it once.")  # fmt: skip
    return owner_of


def _where(op, beside, ran: dict[str, str], run: bool, default: str) -> str | None:
    """Where op ran (run mode; None if the run optimized it away), else where it asked to run: an op
    that asks for no device runs beside the variable it reads (TensorFlow colocates them), if any,
    else on the default device."""
    if run:
        return ran.get(op.name)
    return normalize(op.device) if op.device else beside or default


def _check_ops(graph, captured: dict[str, str], devices: set[str], where, scoped: dict[str, str]) -> Report:
    returned = {t.op.name for t in graph.outputs}  # handed to the caller, wherever it runs
    ops = [op for op in graph.get_operations() if op.name not in returned]
    scopes = _scopes(ops)
    home: dict[str, str | None] = dict(captured)  # the device each owned op belongs to
    report = Report(0, 0)
    for op in ops:  # in creation order: inputs before their consumers
        if op.name in captured or op.type in ("Placeholder", "Const", "NoOp"):
            continue
        variables = {captured[t.op.name] for t in op.inputs if t.op.name in captured}
        in_scope = {scoped[part] for part in op.name.split("/") if part in scoped}
        allowed = set(variables) or in_scope or _allowed(op, scopes, home, devices, where)
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


def _allowed(op, scopes, home, devices, where) -> set[str]:
    """The devices an op that touches no variable may run on (empty: not checked)."""
    if op.type.startswith(_COMMUNICATION_TYPES) or op.type in _COPY_TYPES or timeline.is_communication(op.name):
        return set(devices)
    forward = _forward_ops(op.name, scopes)
    if forward is not None:
        return {where(f) for f in forward if home.get(f.name)} - {None}
    return {home[t.op.name] for t in op.inputs if home.get(t.op.name)}


def _forward_ops(name: str, scopes: dict) -> list | None:
    """The forward ops that a gradient op named `name` differentiates, or None if it is no gradient op.
    tf.gradients names it `gradients/<forward op>_grad/...`: that op. A tape names it
    `gradient_tape/<the forward op's name scope>/...`: the ops of that scope (the op named like the
    scope, as `conv2d/convolution`, or the ops inside it)."""
    match = _GRADIENTS.search(name)
    if match:
        parts = match["rest"].split("/")
        for end in range(len(parts), 0, -1):
            candidate = "/".join(parts[:end])
            if candidate.endswith("_grad") and candidate[:-5] in scopes["ops"]:
                return [scopes["ops"][candidate[:-5]]]
    match = _TAPE.search(name)
    if match:
        parts = match["rest"].split("/")[:-1]
        for end in range(len(parts), 0, -1):
            scope = "/".join(parts[:end])
            found = [scopes["ops"][scope]] if scope in scopes["ops"] else scopes["inside"].get(scope, [])
            if found:
                return found
    return None


def _scopes(ops) -> dict:
    """{"ops": name -> op, "inside": name scope -> the ops directly in it}, for the forward ops."""
    forward = [op for op in ops if not (_TAPE.search(op.name) or _GRADIENTS.search(op.name))]
    inside: dict[str, list] = {}
    for op in forward:
        inside.setdefault(op.name.rpartition("/")[0], []).append(op)
    return {"ops": {op.name: op for op in forward}, "inside": inside}


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
