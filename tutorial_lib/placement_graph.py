"""The shape of a traced step's graph, for the placement audit (`placement`): the function bodies that
an op calls, how the runtime names their ops once it has inlined them, and the forward op that a
gradient op differentiates.

Function bodies (checked on TensorFlow 2.21):
- a call of another `tf.function` is a `PartitionedCall` or `StatefulPartitionedCall` op whose `f`
  attribute names its body; before placement the runtime inlines the body into the caller, each op
  named `<call>/<op>`, and an op of the body that asks for no device gets the call's requested device
  (`inline_function_utils.cc`, `MultiDeviceFunctionBodyPlacer::BodyNodeDevice`);
- `tf.cond` and `tf.switch_case` are `If`/`StatelessIf` and `Case`/`StatelessCase` ops, `tf.while_loop` a
  `While`/`StatelessWhile` op; the runtime lowers them to Switch and Merge ops around one call per
  branch, named `<op>/then/_N`, `<op>/else/_N`, `<op>/branch<i>/_N`, `<op>/body/_N` and `<op>/cond/_N`
  (`lower_if_op.cc`, `CondBuilder::NewName`), each placed on the functional op's requested device, and
  inlines those calls as above: the body's ops run as `<op>/then/_N/<body op>`;
- a call of a `jit_compile=True` function carries `_XlaMustCompile`; the runtime does not inline it:
  XLA compiles the whole body into one program that runs on the call's device (the run records the
  call, not the body's ops).

Bodies are read with `Graph._get_function(name).graph` (private; the public route,
`graph.as_graph_def().library`, gives FunctionDef protos without `tf.Operation`s to follow).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CALL_TYPES = ("PartitionedCall", "StatefulPartitionedCall")
# The functional ops the runtime lowers: their function attributes and the infix of the inlined names.
_BRANCHES = {"If": (("then_branch", "then"), ("else_branch", "else")), "While": (("cond", "cond"), ("body", "body"))}
_BRANCHES |= {"Stateless" + kind: attrs for kind, attrs in _BRANCHES.items()}

# The name of a gradient op: `gradient_tape/<forward op>/...` (a tape) or
# `gradients/<forward op>_grad/...` (tf.gradients), possibly inside a name scope.
_TAPE = re.compile(r"(?:^|/)gradient_tape/(?P<rest>.+)$")
_GRADIENTS = re.compile(r"(?:^|/)gradients(?:_\d+)?/(?P<rest>.+)$")


@dataclass(frozen=True)
class Body:
    """One function body that an op runs: its graph, which of the op's inputs feed its arguments, and
    the infix of its ops' names in the run (None for a called function: `<call>/<op>`)."""

    graph: object  # a FuncGraph
    first_input: int  # the op's inputs from this one on are the body's arguments, in order
    infix: str | None


def bodies(op) -> list[Body] | None:
    """The bodies `op` runs, or None if it runs none. Raises if TensorFlow's graph does not hold one."""
    if op.type in CALL_TYPES:
        return [Body(_function_graph(op, op.get_attr("f").name), 0, None)]
    if op.type in _BRANCHES:
        first = 0 if op.type.endswith("While") else 1  # If's first input is the predicate
        return [Body(_function_graph(op, op.get_attr(key).name), first, infix) for key, infix in _BRANCHES[op.type]]
    if op.type in ("Case", "StatelessCase"):  # the first input is the branch index
        return [Body(_function_graph(op, f.name), 1, f"branch{i}") for i, f in enumerate(op.get_attr("branches"))]
    return None


def is_compiled(op) -> bool:
    """Does XLA compile this call into one program (`jit_compile=True`)?"""
    try:
        return bool(op.get_attr("_XlaMustCompile"))
    except ValueError:  # no such attribute
        return False


def _function_graph(op, name: str):
    graph = op.graph
    while graph is not None:  # a body's own library, else the library of a graph around it
        function = graph._get_function(name)  # private: see the module's docstring
        if function is not None:
            return function.graph
        graph = getattr(graph, "outer_graph", None)
    raise RuntimeError(f"the graph of {op.name} ({op.type}) holds no function {name}: cannot audit its body.")


def in_order(graph) -> list:
    """The graph's ops, each after the ops whose outputs it reads (creation order does so for the graphs
    that Python traced; a body that TensorFlow rebuilt from its FunctionDef need not)."""
    seen, ordered = set(), []
    for root in graph.get_operations():
        if root.name in seen:
            continue
        seen.add(root.name)
        stack = [(root, iter(root.inputs))]
        while stack:  # depth first, without recursion: a graph may be thousands of ops deep
            op, inputs = stack[-1]
            for t in inputs:
                if t.op.name not in seen and t.op.graph is graph:
                    seen.add(t.op.name)
                    stack.append((t.op, iter(t.op.inputs)))
                    break
            else:
                stack.pop()
                ordered.append(op)
    return ordered


class ForwardIndex:
    """The forward ops of one graph, to find the op that a gradient op of the same graph differentiates."""

    def __init__(self, ops):
        forward = [op for op in ops if not is_gradient(op.name)]
        self.ops = {op.name: op for op in forward}
        self.inside: dict[str, list] = {}
        for op in forward:
            self.inside.setdefault(op.name.rpartition("/")[0], []).append(op)

    def of(self, name: str) -> list | None:
        """The forward ops that a gradient op named `name` differentiates, or None if it is no gradient
        op. tf.gradients names it `gradients/<forward op>_grad/...`: that op. A tape names it
        `gradient_tape/<the forward op's name scope>/...`: the ops of that scope (the op named like the
        scope, as `conv2d/convolution`, or the ops inside it)."""
        match = _GRADIENTS.search(name)
        if match:
            parts = match["rest"].split("/")
            for end in range(len(parts), 0, -1):
                candidate = "/".join(parts[:end])
                if candidate.endswith("_grad") and candidate[:-5] in self.ops:
                    return [self.ops[candidate[:-5]]]
        match = _TAPE.search(name)
        if match:
            parts = match["rest"].split("/")[:-1]
            for end in range(len(parts), 0, -1):
                scope = "/".join(parts[:end])
                found = [self.ops[scope]] if scope in self.ops else self.inside.get(scope, [])
                if found:
                    return found
        return None


def is_gradient(name: str) -> bool:
    return bool(_TAPE.search(name) or _GRADIENTS.search(name))
