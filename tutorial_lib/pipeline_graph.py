"""What a traced pipelined step does, read from its graph (`pipeline.Pipeline` or `pipeline_split.SplitPipeline`):
which F, B or W of the schedule built each op (`op_steps`); each device's executed order, each op labelled by what
it computes, not by its name (`executed_orders`); the ops that nothing keeps in their device's order
(`ops_outside_order`); and the activation bytes each device keeps, in total (`kept_bytes`) and per layer and
interval (`kept_per_layer`, `explained_peaks`).
"""

from __future__ import annotations

import collections

from .devices import normalize

_NOT_ACTIVATIONS = ("ReadVariableOp", "Const", "VarHandleOp", "Placeholder", "NoOp")


def graph_of(pipe, x, y):
    """The graph of one traced step of `pipe` on (x, y)."""
    x, y = pipe.check_batch(x, y)
    return pipe.traced_step.get_concrete_function(x, y).graph


def op_steps(pipe, x, y) -> dict[str, int]:
    """{op name: index in `pipe.scopes()` of the F, B or W of the schedule that built it} for one traced step.
    A tape names its gradient ops after the forward (`gradient_tape/stage0/F1/...`), whether B or W built them, so
    the graph's creation order decides: each of the schedule's ops starts with its `start` marker; ops outside
    every stage's scope (the loss's sum, the updates) belong to none."""
    index = {scope: i for i, (scope, _) in enumerate(pipe.scopes())}
    found, step = {}, None
    for op in graph_of(pipe, x, y).get_operations():
        if op.type == "NoOp" and op.name.endswith("/start") and op.name.rpartition("/")[0] in index:
            step = index[op.name.rpartition("/")[0]]
        if step is not None and op.name.startswith(("stage", "gradient_tape/stage")):
            found[op.name] = step
    return found


def _ancestors(op) -> set[str]:
    """The names of every op `op` waits for, through its inputs and control inputs."""
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent.name not in seen:
                seen.add(parent.name)
                todo.append(parent)
    return seen


def _needed(graph) -> set[str]:
    """The ops a call of the function runs: those its outputs and its stateful ops (the updates) wait for."""
    needed = set()
    for op in [t.op for t in graph.outputs] + list(graph.control_outputs):
        needed |= _ancestors(op) | {op.name}
    return needed


def _segments(pipe, x, y):
    """(graph, op_steps, {device lane: [index of each of its schedule ops, in its order]}, start marker by index)."""
    graph, where, scopes = graph_of(pipe, x, y), op_steps(pipe, x, y), pipe.scopes()
    starts = {where[op.name]: op for op in graph.get_operations() if op.type == "NoOp" and op.name.endswith("/start")}
    lanes = collections.defaultdict(list)
    S = len(pipe.orders)
    for i, (scope, _) in enumerate(scopes):
        lanes[int(scope[5 : scope.index("/")]) % S].append(i)
    return graph, where, lanes, starts


def label(ops) -> str:
    """What a schedule op computes, from its MatMul ops: "F" none of a gradient, "B" only inputs' gradients (g @ w.T),
    "W" only weights' gradients (h.T @ g), "B+W" both (a whole backward)."""
    kinds = {(op.get_attr("transpose_a"), op.get_attr("transpose_b")) for op in ops if op.type == "MatMul"}
    grads = {"B": (False, True) in kinds, "W": (True, False) in kinds}
    return "+".join(k for k, found in grads.items() if found) or "F"


def executed_orders(pipe, x, y) -> list[list[str]]:
    """Per device lane, the labels (`label`) of its schedule ops in the order the graph imposes on them: each op's
    `start` marker sorted by how many of the lane's other markers it waits for. Raises if the graph leaves two of a
    lane's ops unordered. Compare with `expected_labels(orders)`: a 1F1B step built under the name ZB-H1 reads
    "B+W" where ZB-H1 has a "B" and a later "W"."""
    graph, where, lanes, starts = _segments(pipe, x, y)
    by_step, needed = collections.defaultdict(list), _needed(graph)
    for op in graph.get_operations():
        if op.name in where and op.name in needed:  # a tape builds gradients nobody asked for: they never run
            by_step[where[op.name]].append(op)
    orders = []
    for d, steps in sorted(lanes.items()):
        before = {i: len(_ancestors(starts[i]) & {starts[j].name for j in steps}) for i in steps}
        if sorted(before.values()) != list(range(len(steps))):
            raise ValueError(f"device lane {d}: the graph does not put its {len(steps)} ops in one order")
        orders.append([label(by_step[i]) for i in sorted(steps, key=before.get)])
    return orders


def expected_labels(orders) -> list[list[str]]:
    """The labels a right step shows for `orders`: F, W, and B where the device splits its backwards, else B+W."""
    split = [any(op[0] == "W" for op in order) for order in orders]
    return [[op[0] if op[0] != "B" or split[d] else "B+W" for op in order] for d, order in enumerate(orders)]


def ops_outside_order(pipe, x, y) -> int:
    """How many ops that run (every op the step's outputs and updates wait for) belong to a device's F, B or W
    but come before none of that device's next op: TensorFlow may run them whenever it likes, out of the order
    the schedule gives the device. 0 for a step that chains everything an op makes."""
    graph, where, lanes, starts = _segments(pipe, x, y)
    needed = _needed(graph)
    waited = {i: _ancestors(start) for i, start in starts.items()}
    next_of = {i: j for steps in lanes.values() for i, j in zip(steps, steps[1:], strict=False)}
    return sum(1 for name, i in where.items() if name in needed and i in next_of and name not in waited[next_of[i]])


# --- activation memory ---


def _kind(scope):
    return scope.split("/")[1][0]  # "stage3/W2" -> "W"


def kept_tensors(pipe, x, y) -> list[dict]:
    """Every activation tensor one step keeps from the F, B or W that makes it to a later one that reads it, as
    {device, maker, reader (indices in `pipe.scopes()`), bytes, layer} (layer: the layer{i} scope it was made in,
    a gradient's being the layer whose backward made it; else "input", the chunk's input and its copy). It counts
    each floating tensor that a forward op makes and a backward reads or a later op takes (a layer's input and
    output, the copy of a micro-batch that arrives, a forward recomputed in a backward), and each gradient that one
    op leaves to a later one (W's output gradients from B, a gradient on its way to the chunk before). It leaves
    out weights, optimizer state, the summed weight gradients (one set per device in every schedule), the
    temporaries that one op makes and frees, and TensorFlow's own buffers."""
    where, scopes, graph = op_steps(pipe, x, y), pipe.scopes(), graph_of(pipe, x, y)

    def gradient(op):
        return op.name.startswith("gradient_tape/")

    def forward(op):  # an F's own ops, or a forward recomputed in a backward
        return not gradient(op) and (_kind(scopes[where[op.name]][0]) == "F" or "/recompute/" in op.name)

    def summing(op):  # adds up weight gradients (a B's or W's own op), or runs after the schedule
        return op.name not in where or not gradient(op) and not forward(op)

    found = []
    for op in graph.get_operations():
        if op.name not in where or op.type in _NOT_ACTIVATIONS or summing(op):
            continue
        i = where[op.name]
        for t in op.outputs:
            last = _last_read(t, i, forward(op), where, summing, gradient)
            if last is not None:
                layer = next((part for part in op.name.split("/") if part.startswith("layer")), "input")
                nbytes = t.shape.num_elements() * t.dtype.size
                found.append(
                    {"device": normalize(op.device), "maker": i, "reader": last, "bytes": nbytes, "layer": layer}
                )
    return found


def _last_read(t, i, forward, where, summing, gradient):
    """The index of the last op of the schedule that reads `t` (made by op i), or None if `t` is not counted: not
    floating or of unknown size, a weight gradient, or a temporary inside one op."""
    if not t.dtype.is_floating or t.shape.num_elements() is None:
        return None
    readers = t.consumers()
    if not forward and (not readers or all(summing(c) for c in readers)):
        return None  # a weight gradient, or a gradient read by nobody
    last = max([i] + [where[c.name] for c in readers if c.name in where])
    if last == i and (not forward or not any(gradient(c) for c in readers)):
        return None  # a gradient's, or a forward's, temporary: freed inside the op that made it
    return last


def _peaks(spans, devices, n_steps) -> dict[str, int]:
    """{device: the most bytes it holds at once} from (device, first, last, bytes) spans over schedule positions."""
    held = {d: [0] * n_steps for d in devices}
    for device, first, last, nbytes in spans:
        for j in range(first, last + 1):
            held[device][j] += nbytes
    return {d: max(per_step) for d, per_step in held.items()}


def kept_bytes(pipe, x, y) -> dict[str, int]:
    """{device: the most activation bytes it holds at once during one step} (`kept_tensors`), each tensor from the
    F, B or W that makes it to the last that reads it, both included, along the executed order. It is not the
    process's peak: on a GPU, `tf.config.experimental.get_memory_info(device)["peak"]` gives the bytes TensorFlow
    used at most since `reset_memory_stats`, all of the above included (on a CPU it raises)."""
    spans = [(t["device"], t["maker"], t["reader"], t["bytes"]) for t in kept_tensors(pipe, x, y)]
    return _peaks(spans, pipe.physical, len(pipe.scopes()))


def kept_per_layer(pipe, x, y, m=0) -> list[dict]:
    """What micro-batch m keeps, per chunk and layer: {chunk, layer, interval, bytes}, the interval being the kinds
    of the ops that make and last read it ("F→B": kept from the forward to the backward, "F→W": to the weights'
    gradient, past B, "B→W": made by B for W; "F→F": a copy on its way to the next chunk, counted there)."""
    scopes, rows = pipe.scopes(), collections.Counter()
    for t in kept_tensors(pipe, x, y):
        maker, reader = scopes[t["maker"]][0], scopes[t["reader"]][0]
        if int(maker.split("/")[1][1:]) == m:
            chunk = int(reader[5 : reader.index("/")])
            rows[chunk, t["layer"], f"{_kind(maker)}→{_kind(reader)}", maker.split("/")[0]] += t["bytes"]
    return [{"chunk": c, "layer": layer, "interval": kind, "maker": by, "bytes": b}
            for (c, layer, kind, by), b in sorted(rows.items())]  # fmt: skip


def explained_peaks(pipe, x, y) -> dict[str, int]:
    """{device: its peak predicted from micro-batch 0's `kept_per_layer` and the schedule alone}: every
    micro-batch keeps what micro-batch 0 keeps, each row from its maker's op of that micro-batch to its reader's,
    along the executed order (`unroll`). Held against `kept_bytes`, it says the peak is made of these rows."""
    scopes = pipe.scopes()
    position = {scope: i for i, (scope, _) in enumerate(scopes)}
    S, M, spans = len(pipe.orders), pipe.micro_batches, []
    for row in kept_per_layer(pipe, x, y):
        reader_kind = row["interval"][-1]
        for m in range(M):
            first = position[f"{row['maker']}/{row['interval'][0]}{m}"]
            last = position[f"stage{row['chunk']}/{reader_kind}{m}"]
            spans.append((pipe.physical[row["chunk"] % S], first, last, row["bytes"]))
    return _peaks(spans, pipe.physical, len(scopes))


def interval_counts(order) -> list[tuple[int, int]]:
    """Along one device's order, after each op: (micro-batches between their F and their B, between B and W)."""
    split, between_fb, between_bw, counts = any(op[0] == "W" for op in order), 0, 0, []
    for kind, *_ in order:
        between_fb += 1 if kind == "F" else -1 if kind == "B" else 0
        between_bw += 1 if kind == "B" and split else -1 if kind == "W" else 0
        counts.append((between_fb, between_bw))
    return counts
