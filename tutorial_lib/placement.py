"""The placement audit: does every op of a training step run on the device that owns it, and does
every variable live there? Placement changes no number, so only this check can see it.

You say who owns what: `owners = {device: variables}`, a replica's, a stage's or a shard's weights,
optimizer state (step counter, slots) and random-seed state. Every op then gets its owners by lineage,
following the data from the variables through every op, function body and loop:

- an op that reads or writes a variable: the variable's owner (TensorFlow runs it beside the variable);
- an op inside a name scope given in `scopes` ({scope: device}, as `tower_0` for notebook 02's towers,
  whose variables all live on the controller): that device;
- communication: an all-reduce op (NCCL or collective by type, or an op in an all-reduce name scope,
  `timeline.is_communication`) or a copy (an `Identity` that a `tf.device` puts on another device than
  its input's): any owner, since it moves data between them; what it outputs belongs to the device it
  sits on (a replica's all-reduced gradient is that replica's);
- a gradient op (built by `GradientTape` or `tf.gradients`): the owners of the forward op it
  differentiates, wherever that forward op ran;
- any other op: "strong" owners, the owners of the variables in its history: an op derived from one
  owner's variables belongs to that owner alone, even when it also reads data that another device holds
  (a batch share, augmentation noise made on device 0). An op that mixes two strong owners and is no
  communication (the sum of the replicas' losses, for reporting) may run on either of them.
- Data with no variable in its history gives "weak" owners, used only where no strong owner exists:
  a tensor that a `tf.device` puts on an owner's device (a batch share copied there, noise made there)
  belongs weakly to that device, and an op that asks for no device and reads it belongs there too.
  Random numbers are such data whatever their seed's history: a draw is weakly its seed's owner's.
  Ops fed only by the batch and constants have no owner and are not checked.

Function bodies are entered (`placement_graph`): a `tf.function` that the step calls, `tf.cond`,
`tf.switch_case` and `tf.while_loop` branches, each with its call's device as the default of its ops and
its inputs' owners flowing into its arguments. An XLA-compiled call (`jit_compile=True`) runs its whole
body as one program on the call's device: the call belongs with its inputs' owners, and every op of its
body is checked on the call's device.

`audit(step, *args, owners=...)` reads the devices the step's graph *requests*: it needs no GPU, so a
step traced with `/GPU:i` names is checked on a laptop. With `run=True` it runs the step once and reads
where each op *ran* (the partition graphs of the run, `timeline.placement`); an op the runtime removed
or rewrote is checked where other evidence puts it (`placement_run`), and one that nothing resolves
fails the report. Variables are checked wherever their owners are devices of this process.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import tensorflow as tf

from . import placement_graph, timeline
from .devices import normalize
from .placement_run import Frame, Ran, Requested, colocated_with, requested

_COMMUNICATION_TYPES = ("Nccl", "Collective")  # NcclAllReduce, CollectiveReduceV2, CollectiveGatherV2, ...
_COPY_TYPES = ("Identity", "IdentityN")
_NOT_CHECKED = ("Const", "NoOp", "Placeholder")


@dataclass(frozen=True)
class Misplaced:
    name: str  # the op's or the variable's name (an op of a function body: "<call>/<op>")
    type: str  # the op's type, or "variable"
    device: str  # where it is (requested or run)
    owner: str  # where it belongs: one device, or several joined by " or "


@dataclass
class Report:
    ops_checked: int
    variables_checked: int
    misplaced: list[Misplaced] = field(default_factory=list)
    # run mode: ops of the traced graph that neither the run nor any other evidence places: not checked
    unresolved: list[str] = field(default_factory=list)
    how: Counter = field(default_factory=Counter)  # how each checked op's device was known: "ran", "requested", ...

    @property
    def ok(self) -> bool:
        return not self.misplaced and not self.unresolved

    def counts(self) -> Counter:
        """How many misplaced ops of each (type, device, owner)."""
        return Counter((m.type, m.device, m.owner) for m in self.misplaced)

    def __str__(self) -> str:
        head = (
            f"placement: {self.ops_checked} ops and {self.variables_checked} variables checked, "
            f"{len(self.misplaced)} misplaced"
        )
        if self.unresolved:
            head += f", {len(self.unresolved)} unresolved (not in the run, and nothing says where they ran)"
        rows = [f"  {n:3d} x {t} on {d}, owner {o}" for (t, d, o), n in self.counts().most_common(12)]
        rows += [f"  unresolved: {name}" for name in self.unresolved[:6]]
        if self.how and set(self.how) != {"ran"} and "ran" in self.how:  # run mode: say what was not seen run
            rows.append("  devices known: " + ", ".join(f"{n} {how}" for how, n in self.how.most_common()))
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
    if run:
        places = Ran(timeline.placement(function, *args, **kwargs))
    else:
        places = Requested("/GPU:0" if any("GPU" in d for d in owner_of.values()) else "/CPU:0")
    scoped = {scope: normalize(device) for scope, device in (scopes or {}).items()}
    handles = {inner.name: owner_of[id(ext)] for ext, inner in graph.captures if id(ext) in owner_of}
    report = Report(0, 0)
    walker = _Walker(set(owner_of.values()) | set(scoped.values()), scoped, places, report)
    walker.walk(graph, Frame(), [_Lineage(handle=handles.get(t.name)) for t in graph.inputs],
                [handles.get(t.name) for t in graph.inputs])  # a variable's handle is where its owner is  # fmt: skip
    if not handles and not report.ops_checked:  # an empty audit would say ok
        raise ValueError(
            "the step reads none of the owners' variables, so no op could be checked: give owners the variables "
            "the step was built with (its replicas', stages' and optimizers'), not new copies."
        )
    if run and report.ops_checked and not (report.how["ran"] or report.how["in its XLA cluster"]):
        raise RuntimeError(f"none of the {report.ops_checked} ops checked was found in the run by its name: the "
                           "audit cannot read where they ran (has TensorFlow changed how it names ops?).")  # fmt: skip
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


@dataclass(frozen=True)
class _Lineage:
    """Who a tensor belongs to: `strong`, the owners of the variables in its history; `weak`, the devices
    that data without variables was put on; `handle`, the owner of the variable a resource handle names."""

    strong: frozenset = frozenset()
    weak: frozenset = frozenset()
    handle: str | None = None

    def __or__(self, other: _Lineage) -> _Lineage:
        return _Lineage(self.strong | other.strong, self.weak | other.weak, self.handle or other.handle)


_NONE = _Lineage()


def _union(lineages) -> _Lineage:
    total = _NONE
    for lineage in lineages:
        total = total | lineage
    return total


@dataclass
class _Graph:
    """What the walk of one graph remembers: each tensor's lineage, each op's device and owners."""

    forward: placement_graph.ForwardIndex
    lineage: dict = field(default_factory=dict)  # tensor name -> _Lineage
    sits: dict = field(default_factory=dict)  # op name -> its device (None: unresolved)
    owners: dict = field(default_factory=dict)  # op name -> the devices it belongs on


class _Walker:
    """Walks a graph and the bodies it calls, giving each op its owners and checking its device."""

    def __init__(self, devices: set[str], scopes: dict[str, str], places, report: Report):
        self.devices, self.scopes, self.places, self.report = frozenset(devices), scopes, places, report

    def walk(self, graph, frame: Frame, args: list[_Lineage], args_at=None) -> list[_Lineage]:
        """Check every op of `graph`, whose inputs carry `args` (and sit on `args_at`); returns its outputs'
        lineage."""
        if len(args) != len(graph.inputs):
            raise RuntimeError(f"{frame.path or 'the step'}: {len(args)} inputs for {len(graph.inputs)} arguments.")
        ops = placement_graph.in_order(graph)
        g = _Graph(placement_graph.ForwardIndex(ops), dict(zip((t.name for t in graph.inputs), args, strict=True)))
        g.sits.update(zip((t.op.name for t in graph.inputs), args_at or (), strict=False))
        returned = {t.op.name for t in graph.outputs}  # handed to the caller, wherever it runs
        for op in ops:
            ins = [g.lineage.get(t.name, _NONE) for t in op.inputs]
            if op.type in _NOT_CHECKED:
                continue
            if (bodies := placement_graph.bodies(op)) is not None:
                outs = self._functional(op, ins, bodies, frame, [g.sits.get(t.op.name) for t in op.inputs])
            elif op.name in returned:
                outs = [_union(ins)] * len(op.outputs)
            else:
                outs = [self._op(op, ins, frame, g)] * len(op.outputs)
            g.lineage.update(zip((t.name for t in op.outputs), outs, strict=True))
        return [g.lineage.get(t.name, _NONE) for t in graph.outputs]

    def _op(self, op, ins: list[_Lineage], frame: Frame, g: _Graph) -> _Lineage:
        """Give `op` its owners, check it, and return its outputs' lineage."""
        handles = frozenset(lineage.handle for lineage in ins if lineage.handle)
        beside = next(iter(handles)) if len(handles) == 1 else None
        at = [g.sits.get(t.op.name) for t in op.inputs]
        device, how = self.places.where(op, frame, beside, at, [g.sits.get(name) for name in colocated_with(op)])
        g.sits[op.name] = device
        path = frame.path + op.name
        if handles:  # a variable's reader or writer; an op passing the handle on names the same variable
            owners, out = handles, _Lineage(strong=handles, handle=beside if _passes_handle(op) else None)
        else:
            owners, out = self._owners(op, _union(ins), path, device, requested(op, frame), g)
        if "Random" in op.type or op.type.startswith("Rng"):  # random numbers are data, whatever made their seed
            out = _Lineage(weak=out.strong | out.weak)
        if owners:
            self._check(op, path, device, how, owners, frame)
            g.owners.setdefault(op.name, owners)
        return out

    def _owners(self, op, merged: _Lineage, path: str, device, asked: str, g: _Graph) -> tuple[frozenset, _Lineage]:
        """The owners of an op that reads no variable (empty: not checked), and its outputs' lineage."""
        if scoped := frozenset(self.scopes[part] for part in path.split("/") if part in self.scopes):
            return scoped, _Lineage(strong=scoped)
        if self._moves_data(op, path, device, asked, g):  # its output is the device's it sits on
            here = frozenset({device} if device else ())
            g.owners[op.name] = here  # where its gradient belongs
            out = merged if device is None else _Lineage(strong=here) if merged.strong else _Lineage(weak=here)
            return self.devices, out
        forward = g.forward.of(op.name)
        if forward_owners := frozenset().union(*(g.owners.get(f.name, ()) for f in forward or ())):
            return forward_owners, _Lineage(strong=forward_owners)  # a gradient op belongs with its forward op
        if merged.strong:
            return merged.strong, _Lineage(strong=merged.strong)
        if merged.weak and not asked:
            return merged.weak, _Lineage(weak=merged.weak)
        # Data that a tf.device put on an owner's device is that device's, weakly; nothing is checked here.
        return frozenset(), _Lineage(weak=frozenset({asked}) if asked in self.devices else merged.weak)

    def _moves_data(self, op, path: str, device: str | None, asked: str, g: _Graph) -> bool:
        """Is `op` communication: an all-reduce's, or a copy that a tf.device puts on another device?"""
        if op.type.startswith(_COMMUNICATION_TYPES) or timeline.is_communication(path):
            return True
        if op.type not in _COPY_TYPES or not asked or device is None:
            return False
        return bool({g.sits.get(t.op.name) for t in op.inputs} - {device, None})

    def _check(self, op, path: str, device: str | None, how: str, owners: frozenset, frame: Frame) -> None:
        if not frame.record:
            return
        if device is None:
            self.report.unresolved.append(f"{path} ({op.type})")
            return
        self.report.ops_checked += 1
        self.report.how[how] += 1
        if device not in owners:
            self.report.misplaced.append(Misplaced(path, op.type, device, " or ".join(sorted(owners))))

    def _functional(self, op, ins: list[_Lineage], bodies, frame: Frame, at: list) -> list[_Lineage]:
        """A call, branch or loop: walk each body with the op's inputs (`ins`, on devices `at`); an XLA call is
        checked as one op, its body on its device."""
        compiled, device = placement_graph.is_compiled(op), None
        if compiled:
            device, how = self.places.where(op, frame, None, at)
            merged = _union(ins)
            handles = frozenset(lineage.handle for lineage in ins if lineage.handle)
            if owners := handles | merged.strong or merged.weak:
                self._check(op, frame.path + op.name, device, how, owners, frame)
        if op.type.endswith("While"):
            return self._loop(op, ins, bodies, frame, device, compiled, at)
        outs = None
        for body in bodies:
            inner, first = self._inner(op, body, frame, device, compiled), body.first_input
            result = self.walk(body.graph, inner, ins[first:], at[first:])
            outs = result if outs is None else [a | b for a, b in zip(outs, result, strict=True)]
        return outs

    def _inner(self, op, body, frame: Frame, device, compiled: bool, record: bool = True) -> Frame:
        name = op.name if body.infix is None else f"{op.name}/{body.infix}"
        return Frame(
            path=f"{frame.path}{name}/",
            run_prefix=None if compiled else self.places.body_prefix(op, frame, body.infix),
            requested=requested(op, frame),
            cluster=device if compiled else frame.cluster,
            record=frame.record and record,
        )

    def _loop(self, op, ins, bodies, frame: Frame, device, compiled: bool, at: list) -> list[_Lineage]:
        """A while loop: the body's outputs feed its arguments again, so its lineage is settled first."""
        cond, body = bodies
        args = list(ins)
        for _ in range(2 * len(self.devices) + 3):  # lineage only grows, and is made of the devices
            quiet = self._inner(op, body, frame, device, compiled, record=False)
            again = [a | b for a, b in zip(args, self.walk(body.graph, quiet, args, at), strict=True)]
            if again == args:
                break
            args = again
        for part in (cond, body):
            self.walk(part.graph, self._inner(op, part, frame, device, compiled), args, at)
        return args


def _passes_handle(op) -> bool:
    return any(t.dtype == tf.resource for t in op.outputs)


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
