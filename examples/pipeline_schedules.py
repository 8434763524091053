"""Pipeline schedules in plain Python: the order of forwards and backwards each device runs, how many micro-batches
it keeps, and how long it idles. Notebook 05 teaches the functions below their `# lesson:` lines; pipeline_parallel.py
runs these orders in TensorFlow.

An op is (kind, m) or (kind, m, chunk). Kinds: "F" a forward; "B" a backward, which in an order that also holds
"W" ops is only the gradient of the chunk's input (zero bubble's B) and otherwise the whole backward; "W" the
gradient of the chunk's weights, which needs only its own B. m is the micro-batch. A placement says which device
holds each virtual stage k of the model (its k-th chunk of consecutive layers), and device d's chunk c is the c-th
stage it holds: by default stage c * S + d (Megatron-LM's interleaving; chunk 0 where none is said), so micro-batch
m flows through devices 0..S-1 with chunk 0, then again with chunk 1; in ZB-V's V (`placement_of`), down the
devices with chunk 0 and back up with chunk 1.
"""

import numbers

# lesson: 05_staging_pipeline
SCHEDULES = ("sequential", "gpipe", "1f1b")

EVERY_SCHEDULE = (*SCHEDULES, "zb_h1", "interleaved", "zb_v")


# lesson: 05_staging_pipeline
def schedule(S, M, kind="gpipe"):
    """For each of S stages, its order of ("F", m) and ("B", m) over M micro-batches."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {kind!r}.")
    if kind == "sequential":
        return [[op for m in range(M) for op in (("F", m), ("B", m))] for _ in range(S)]
    if kind == "gpipe":
        return [[("F", m) for m in range(M)] + [("B", m) for m in range(M)] for _ in range(S)]
    orders = []  # 1F1B: S-1-s warm-up forwards, then one forward and one backward, then the last backwards
    for s in range(S):
        warmup = min(S - 1 - s, M)
        order = [("F", m) for m in range(warmup)]
        for m in range(M - warmup):
            order += [("F", warmup + m), ("B", m)]
        orders.append(order + [("B", m) for m in range(M - warmup, M)])
    return orders


# lesson: 05_staging_pipeline
def stash(order):
    """The most micro-batches (of any chunk) whose activations a device keeps at once: a forward adds one, and
    its backward frees it, or its W where the device splits its backwards (W still reads them)."""
    frees = "W" if any(op[0] == "W" for op in order) else "B"
    live = peak = 0
    for kind, *_ in order:
        live += 1 if kind == "F" else -1 if kind == frees else 0
        peak = max(peak, live)
    return peak


def stages_of(orders, placement=None):
    """{(device, chunk): virtual stage} for these orders, `placement[k]` being the device of virtual stage k (by
    default k mod S): device d's chunk c is the c-th stage that d holds."""
    S, chunks = len(orders), 1 + max((op[2] for order in orders for op in order if len(op) > 2), default=0)
    placement = [k % S for k in range(S * chunks)] if placement is None else list(placement)
    held = [[k for k, d in enumerate(placement) if d == device] for device in range(S)]
    if len(placement) != S * chunks or any(len(h) != chunks for h in held):
        raise ValueError(f"placement {placement} does not give each of the {S} devices its {chunks} chunk(s)")
    return {(d, c): k for d in range(S) for c, k in enumerate(held[d])}


# lesson: 05_staging_pipeline
def unroll(orders, placement=None):
    """(device, kind, m, chunk) of every op, in an order that respects every device's order and every data
    dependency: F needs the previous virtual stage's F; B its own F and the next virtual stage's B; W its own B."""
    orders = [[(op[0], op[1], op[2] if len(op) > 2 else 0) for op in order] for order in orders]
    S, done, plan, next_op = len(orders), set(), [], [0] * len(orders)
    stage = stages_of(orders, placement)
    last = max(stage.values())  # the last virtual stage

    def ready(d, kind, m, c):
        k = stage[d, c]
        if kind == "F":
            return k == 0 or ("F", m, k - 1) in done
        if kind == "W":
            return ("B", m, k) in done
        return ("F", m, k) in done and (k == last or ("B", m, k + 1) in done)

    while len(plan) < sum(map(len, orders)):
        before = len(plan)
        for d in range(S):
            while next_op[d] < len(orders[d]) and ready(d, *orders[d][next_op[d]]):
                kind, m, c = orders[d][next_op[d]]
                done.add((kind, m, stage[d, c]))
                plan.append((d, kind, m, c))
                next_op[d] += 1
        if len(plan) == before:
            waiting = {d: orders[d][next_op[d]] for d in range(S) if next_op[d] < len(orders[d])}
            raise ValueError(f"these device orders wait on each other forever: next ops {waiting}")
    return plan


# lesson: 05_staging_pipeline
def simulate(orders, t_forward=1.0, t_input=1.0, t_weight=1.0, t_send=0.0, placement=None):
    """(device, kind, m, chunk, start, took) of each op of a step in which every op starts as soon as its inputs
    and its device are free. A time is one number, or a list of one per device: a whole stage's time for one
    micro-batch, split evenly over a device's chunks; a B in an order without W's is the whole backward, t_input +
    t_weight. An output reaches another device t_send after its op ends (the receiver waits, the sender goes on)."""
    S, stage = len(orders), stages_of(orders, placement)
    t_f, t_b, t_w = (list(t) if isinstance(t, list | tuple) else [t] * S for t in (t_forward, t_input, t_weight))
    chunks = len(stage) // S
    device = {k: d for (d, _), k in stage.items()}
    split = [any(op[0] == "W" for op in order) for order in orders]
    end, free, boxes = {}, [0.0] * S, []

    def arrives(kind, m, k, d):  # when the output of op (kind, m) on virtual stage k reaches device d
        return end.get((kind, m, k), 0.0) + (t_send if (kind, m, k) in end and device[k] != d else 0.0)

    for d, kind, m, c in unroll(orders, placement):
        k = stage[d, c]  # the virtual stage
        if kind == "F":
            ready, took = arrives("F", m, k - 1, d), t_f[d]
        elif kind == "W":
            ready, took = end["B", m, k], t_w[d]
        else:
            ready, took = max(end["F", m, k], arrives("B", m, k + 1, d)), t_b[d] + t_w[d] * (not split[d])
        start = max(free[d], ready)
        end[kind, m, k] = free[d] = start + took / chunks
        boxes.append((d, kind, m, c, start, took / chunks))
    return boxes


def busy_idle(orders, t_forward=1.0, t_input=1.0, t_weight=1.0, t_send=0.0, placement=None):
    """Per device, (busy, idle) time of the simulated step (`simulate`): idle is the rest of the whole step."""
    boxes, busy = simulate(orders, t_forward, t_input, t_weight, t_send, placement), [0.0] * len(orders)
    for d, *_, took in boxes:
        busy[d] += took
    step = max(start + took for *_, start, took in boxes)
    return [(b, step - b) for b in busy]


def bubble_rate(orders, t_forward=1.0, t_input=1.0, t_weight=1.0, t_send=0.0, placement=None):
    """The largest idle time of a device over its busy time: Megatron-LM's bubble time fraction (arXiv:2104.04473,
    sec. 2.2). Equal stages, F = B = W: (S-1)/M for GPipe and 1F1B, (S-1)/(vM) interleaved, for ZB-H1
    (S-1)/(3M) where M >= S (a third of 1F1B's; with fewer micro-batches than stages, more: 2/3 at S = 4, M = 1),
    and (S-1)/(6M) for ZB-V where M >= 2S (half of ZB-H1's; its placement: `placement_of("zb_v", S)`)."""
    times = busy_idle(orders, t_forward, t_input, t_weight, t_send, placement)
    return max(idle / busy for busy, idle in times)


def expected(orders, placement=None):
    """(bubble, ideal speed-up over the naive split) of `orders` on equal stages with F = B = W: the largest idle
    share of a step, and the work of every device over the step's time (the naive split does it one at a time)."""
    times = busy_idle(orders, placement=placement)
    step = times[0][0] + times[0][1]
    return max(idle for _, idle in times) / step, sum(busy for busy, _ in times) / step


def bubble_fraction(S, M):
    """Idle share of a GPipe (or 1F1B) step with equal stages: (S-1)/(M+S-1)."""
    return (S - 1) / (M + S - 1)


def whole_number(value, name, least=1):
    """`value` if it is a whole number >= least (not a bool), else a ValueError that says what to give."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}.")
    return int(value)


# lesson: 05_staging_pipeline
def zb_h1(S, M):
    """ZB-H1 (Qi et al., ICLR 2024, arXiv:2401.10241, sec. 2.1): 1F1B's order with each backward split into B and
    W, stage s deferring its first s W's so that no stage holds more micro-batches than 1F1B's first; the deferred
    W's fill the tail of the step. Stage 0 defers none: there each W follows its own B, and nothing waits for the
    input's gradient of the first stage, so its B and W stay one backward (as torch.distributed.pipelining merges
    them), which keeps 1F1B's memory and work there."""
    S, M = whole_number(S, "S"), whole_number(M, "M")
    orders = []
    for s in range(S):
        warmup = min(S - 1 - s, M)
        order, weights = [("F", m) for m in range(warmup)], iter(range(M))
        for i in range(M):
            if warmup + i < M:
                order.append(("F", warmup + i))
            order.append(("B", i))
            if s and i >= s:  # stage s > 0 keeps s W's waiting
                order.append(("W", next(weights)))
        orders.append(order + ([("W", m) for m in weights] if s else []))
    return orders


def interleaved(S, M, v=2):
    """Interleaved 1F1B (Narayanan et al., SC'21, arXiv:2104.04473, sec. 2.2) with v model chunks per device, in
    Megatron-LM's order: micro-batches in groups of S, each group through chunk 0, then chunk 1, ...; backwards
    through the chunks in reverse; (S-d-1)*2 + (v-1)*S warm-up forwards on device d, then one forward and one
    backward. Ops are (kind, m, chunk)."""
    S, M, v = whole_number(S, "S"), whole_number(M, "M"), whole_number(v, "v")
    if M % S:
        fits = " or M=".join(map(str, sorted({M - M % S or S, M + S - M % S})))  # once each where M < S
        raise ValueError(
            f"interleaving needs M a multiple of S (Megatron-LM runs micro-batches through each chunk in groups of "
            f"S), got M={M} with S={S}: use M={fits}."
        )
    total = M * v

    def op(kind, k):  # the k-th forward or backward of a device: which micro-batch, which chunk
        group, within = divmod(k, S * v)
        chunk = within // S if kind == "F" else v - 1 - within // S
        return (kind, group * S + within % S, chunk)

    orders = []
    for d in range(S):
        warmup = total if M == S else min((S - d - 1) * 2 + (v - 1) * S, total)
        order = [op("F", k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [op("F", warmup + k), op("B", k)]
        orders.append(order + [op("B", k) for k in range(total - warmup, total)])
    return orders


def zb_v(S, M):
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv:2401.10241, sec. 6 of its later version, and the
    authors' repository sail-sg/zero-bubble-pipeline-parallelism): 2S chunks, two a device in a V, device d holding
    virtual stages d and 2S-1-d (`placement_of`), so that a micro-batch goes down the devices with chunk 0 and comes
    back up with chunk 1, turning on the last device without a send; every backward split into B and W. Device d
    warms up with 2(S-d)-1 forwards of chunk 0, then runs both chunks' F, B and W in turn, and ends with its
    deferred W's. With F = B = W and M >= 2S no device idles but at the step's ends, and none keeps more than 2S
    chunks' activations (1F1B's S stages'). Ops are (kind, m, chunk). The pattern is built for at least 2S-1
    micro-batches; those past M are left out."""
    S, M = whole_number(S, "S"), whole_number(M, "M")
    n = max(M, 2 * S - 1)
    orders = []
    for d in range(S):
        steps = ["F0"] * (2 * (S - d) - 1) + ["F1", "F0"] * d + ["F1", "B1", "W1"] * (S - d)  # warm-up
        steps += ["F0", "B0", "W0", "F1", "B1", "W1"] * (n - 2 * S + d + 1)  # steady, until chunk 0's last F
        steps += ["B0", "W0", "F1", "B1", "W1"] * (S - d - 1) + ["B0", "B1"] * d + ["B0", "W0"] * (S - d)
        steps += ["W1"] * d + ["W0"] * d  # the W's still waiting
        count, order = {}, []
        for step in steps:  # the k-th "B0" is chunk 0's backward of micro-batch k
            m = count[step] = count.get(step, -1) + 1
            order.append((step[0], m, int(step[1])))
        orders.append([op for op in order if op[1] < M])
    return orders


def placement_of(kind, S, v=1):
    """Which device holds each virtual stage of `kind`'s orders on S devices: k mod S for all but ZB-V (v chunks a
    device, chunk c of device d being stage c * S + d), and for ZB-V a V, 0..S-1 then S-1..0."""
    return [*range(S), *reversed(range(S))] if kind == "zb_v" else [k % S for k in range(S * v)]


def orders_of(kind, S, M, v=1):
    """Each of S devices' order for `kind` (one of EVERY_SCHEDULE) over M micro-batches; v chunks per device, 2 or
    more for "interleaved", 2 for "zb_v" and 1 for the others."""
    if kind not in EVERY_SCHEDULE:
        raise ValueError(f"schedule must be one of {EVERY_SCHEDULE}, got {kind!r}.")
    if kind == "interleaved" and v < 2:
        raise ValueError(f"interleaving needs v >= 2 chunks per device, got {v} (one chunk is 1F1B).")
    if kind == "zb_v" and v != 2:
        raise ValueError(f"ZB-V runs two chunks a device in a V, got v={v}: give v=2.")
    if kind not in ("interleaved", "zb_v") and v != 1:
        raise ValueError(f"{kind} runs one chunk per device, got v={v}: give v=1, or the schedule 'interleaved'.")
    if kind == "interleaved":
        return interleaved(S, M, v)
    if kind == "zb_v":
        return zb_v(S, M)
    return zb_h1(S, M) if kind == "zb_h1" else schedule(whole_number(S, "S"), whole_number(M, "M"), kind)
