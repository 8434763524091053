"""Pipeline schedules in plain Python (notebook 05's cells): each stage's order of forwards and
backwards, what it keeps in memory, how long it idles; `bubble_fraction`.
"""

from __future__ import annotations

import math
import numbers

from . import checks

# lesson: 05_staging_pipeline
SCHEDULES = ("sequential", "gpipe", "1f1b")


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
    """The most micro-batches whose activations a stage keeps at once (a forward adds one, a backward frees one)."""
    live = peak = 0
    for op, _ in order:
        live += 1 if op == "F" else -1
        peak = max(peak, live)
    return peak


# lesson: 05_staging_pipeline
def unroll(orders):
    """(stage, op, m) in an order that respects every stage's order and every data dependency."""
    S, done, plan, next_op = len(orders), set(), [], [0] * len(orders)

    def ready(s, op, m):
        if op == "F":  # a forward needs the previous stage's forward
            return s == 0 or (s - 1, "F", m) in done
        return (s, "F", m) in done and (s == S - 1 or (s + 1, "B", m) in done)  # and the next stage's backward

    while len(plan) < sum(map(len, orders)):
        before = len(plan)
        for s in range(S):
            while next_op[s] < len(orders[s]) and ready(s, *orders[s][next_op[s]]):
                done.add((s, *orders[s][next_op[s]]))
                plan.append((s, *orders[s][next_op[s]]))
                next_op[s] += 1
        if len(plan) == before:
            waiting = {s: orders[s][next_op[s]] for s in range(S) if next_op[s] < len(orders[s])}
            raise ValueError(f"these stage orders wait on each other forever: next ops {waiting}")
    return plan


# lesson: 05_staging_pipeline
def simulated_idle(orders, t_forward=1.0, t_backward=2.0):
    """Each stage's idle share of a step in which every op starts as soon as its inputs and its
    stage are free. Times are one per op kind, or a list of one per stage."""
    S = len(orders)
    t_f = list(t_forward) if isinstance(t_forward, list | tuple) else [t_forward] * S
    t_b = list(t_backward) if isinstance(t_backward, list | tuple) else [t_backward] * S
    if len(t_f) != S or len(t_b) != S:
        raise ValueError(f"need one forward and one backward time per stage ({S}), got {len(t_f)} and {len(t_b)}")
    end, free, busy = {}, [0.0] * S, [0.0] * S
    for s, op, m in unroll(orders):
        if op == "F":
            ready, took = end.get((s - 1, "F", m), 0.0), t_f[s]
        else:
            ready, took = max(end[s, "F", m], end.get((s + 1, "B", m), 0.0)), t_b[s]
        end[s, op, m] = free[s] = max(free[s], ready) + took
        busy[s] += took
    return [1 - b / max(free) for b in busy]


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle share of a GPipe (or 1F1B) step with equal stages: (S-1)/(M+S-1)."""
    S = checks.whole_number(stages, "stages")
    M = checks.whole_number(micro_batches, "micro_batches")
    return (S - 1) / (M + S - 1)


# --- past GPipe's bound: zero bubble and interleaving (not lessons yet; notebook 05 may adopt them) ---
#
# An op here is (kind, m) or (kind, m, chunk). Kinds: "F" forward; "B" the backward, which in an
# order that also has "W" ops is only the input's gradient (zero bubble's B, on the critical
# path) and otherwise the whole backward; "W" the weights' gradient, which needs only its own B.
# Device d's chunk c is virtual stage c * S + d of the model (Megatron-LM's interleaving), so
# micro-batch m flows through stages 0..S-1 of chunk 0, then of chunk 1, and so on.


# lesson: 05_staging_pipeline
def zb_h1(S, M):
    """ZB-H1 (Qi et al., ICLR 2024, arXiv:2401.10241, sec. 2.1): 1F1B's order with each backward
    split into B and W, stage s deferring its first s W's so that every stage holds at most S
    micro-batches (1F1B's first stage); the deferred W's fill the tail of the step."""
    S, M = checks.whole_number(S, "S"), checks.whole_number(M, "M")
    orders = []
    for s in range(S):
        warmup = min(S - 1 - s, M)
        order, weights = [("F", m) for m in range(warmup)], iter(range(M))
        for i in range(M):
            if warmup + i < M:
                order.append(("F", warmup + i))
            order.append(("B", i))
            if i >= s:  # stage s keeps s W's waiting
                order.append(("W", next(weights)))
        orders.append(order + [("W", m) for m in weights])
    return orders


def interleaved(S, M, v=2):
    """Interleaved 1F1B (Narayanan et al., SC'21, arXiv:2104.04473, sec. 2.2) with v model chunks
    per device, in Megatron-LM's order: micro-batches in groups of S, each group through chunk
    0, then chunk 1, ...; backwards through the chunks in reverse; (S-d-1)*2 + (v-1)*S warm-up
    forwards on device d, then one forward and one backward. Ops are (kind, m, chunk)."""
    S, M, v = checks.whole_number(S, "S"), checks.whole_number(M, "M"), checks.whole_number(v, "v")
    if M % S:
        fits = " or M=".join(map(str, sorted({M - M % S or S, M + S - M % S})))  # once each where M < S
        raise ValueError(
            f"interleaving needs M a multiple of S (Megatron-LM runs micro-batches through each chunk in "
            f"groups of S), got M={M} with S={S}: use M={fits}."
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


KINDS = ("F", "B", "W")


def _ops(order):
    """An order's ops as (kind, m, chunk), chunk 0 where none is named; refused unless each op is
    (kind, m) or (kind, m, chunk) with a kind of KINDS and whole numbers m, chunk >= 0."""
    ops = []
    for op in order:
        ok = isinstance(op, tuple | list) and len(op) in (2, 3) and op[0] in KINDS
        try:
            ops.append(
                (
                    op[0],
                    checks.whole_number(op[1], "m", 0),
                    checks.whole_number(op[2] if len(op) > 2 else 0, "chunk", 0),
                )
            )
        except (TypeError, ValueError, IndexError, KeyError):
            ok = False
        if not ok:
            raise ValueError(
                f"{op!r} is not an op: write (kind, m) or (kind, m, chunk), kind one of {KINDS} (F forward, "
                "B backward, W weights' gradient), m and chunk whole numbers >= 0."
            )
    return ops


def _times(**times):
    """Each op kind's time, refused unless finite and >= 0 (a forward's > 0: a step takes some time)."""
    for name, t in times.items():
        if (
            isinstance(t, bool)
            or not isinstance(t, numbers.Real)
            or not 0 <= t < math.inf
            or name == "t_forward"
            and not t
        ):
            raise ValueError(f"{name} must be a finite time >= 0 (t_forward > 0), got {t!r}: e.g. {name}=1.0.")


def _split(orders):
    """Per device, whether its backwards are split into B and W (refusing a W-less B there)."""
    split = []
    for d, order in enumerate(map(_ops, orders)):
        b, w = {o[1:] for o in order if o[0] == "B"}, {o[1:] for o in order if o[0] == "W"}
        if w and b != w:
            raise ValueError(f"device {d} splits its backwards into B and W but not for every (m, chunk): "
                             f"B without W {sorted(b - w)}, W without B {sorted(w - b)}.")  # fmt: skip
        split.append(bool(w))
    return split


def unroll_split(orders):
    """(device, kind, m, chunk) in an order that respects every device's order and every data
    dependency: F needs the previous virtual stage's F; B its own F and the next virtual stage's
    B; W its own B."""
    orders = [_ops(order) for order in orders]
    S = len(orders)
    last = S * (1 + max((c for order in orders for *_, c in order), default=0)) - 1
    done, plan, next_op = set(), [], [0] * S

    def ready(d, kind, m, c):
        k = c * S + d  # the virtual stage
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
                done.add((kind, m, c * S + d))
                plan.append((d, kind, m, c))
                next_op[d] += 1
        if len(plan) == before:
            waiting = {d: orders[d][next_op[d]] for d in range(S) if next_op[d] < len(orders[d])}
            raise ValueError(f"these device orders wait on each other forever: next ops {waiting}")
    return plan


def simulated_busy_idle(orders, t_forward=1.0, t_input=1.0, t_weight=1.0, *, t_send=0.0):
    """Per device, (busy, idle) time of a step in which each op starts as soon as its inputs and
    its device are free. t_* are a whole stage's times, split evenly over its chunks; a B in an
    order without W's is the whole backward, t_input + t_weight. t_send is the time an activation
    or its gradient takes to reach another device (zero bubble's T_comm, added per hop as in its
    ILP constraints (4) and (5)); it delays the receiver only, the sender goes on at once."""
    _times(t_forward=t_forward, t_input=t_input, t_weight=t_weight, t_send=t_send)
    if not len(orders):
        raise ValueError("orders is empty: give one order of ops per device, e.g. zb_h1(S=4, M=8).")
    if idle := [d for d, order in enumerate(orders) if not len(order)]:
        raise ValueError(f"device(s) {idle} have no ops: give every device its order, or leave the device out.")
    split, chunks = _split(orders), 1 + max((c for order in orders for *_, c in _ops(order)), default=0)
    S, end, free, busy = len(orders), {}, [0.0] * len(orders), [0.0] * len(orders)
    hop = t_send if S > 1 else 0.0  # virtual stages k and k +- 1 are on different devices unless S == 1

    def sent(key):  # when the output of op `key` (on a neighbouring virtual stage) has arrived; 0 if none
        return end[key] + hop if key in end else 0.0

    for d, kind, m, c in unroll_split(orders):
        k = c * S + d
        if kind == "F":
            ready, took = sent(("F", m, k - 1)), t_forward
        elif kind == "W":
            ready, took = end["B", m, k], t_weight
        else:
            ready = max(end["F", m, k], sent(("B", m, k + 1)))
            took = t_input if split[d] else t_input + t_weight
        end[kind, m, k] = free[d] = max(free[d], ready) + took / chunks
        busy[d] += took / chunks
    return [(b, max(free) - b) for b in busy]


def bubble_rate(orders, t_forward=1.0, t_input=1.0, t_weight=1.0, *, t_send=0.0):
    """The largest idle time of a device over its busy time: Megatron-LM's bubble time fraction
    (arXiv:2104.04473, sec. 2.2), (S-1)/M for 1F1B with equal stages, (S-1)/(3M) for ZB-H1 with
    equal F, B and W, (S-1)/(vM) interleaved. The zero-bubble paper's "bubble rate" (arXiv:2401.10241,
    sec. 5.3) divides the idle time by the whole step instead: pipeline_cost.bubble_rate."""
    times = simulated_busy_idle(orders, t_forward, t_input, t_weight, t_send=t_send)
    return max(idle / busy for busy, idle in times)


def stash_split(order):
    """The most (micro-batch, chunk) activations a device keeps at once: a forward adds one; its
    W frees it where the backward is split (the weights' gradient still needs the input), else its B."""
    ops = _ops(order)
    frees = "W" if any(kind == "W" for kind, *_ in ops) else "B"
    live = peak = 0
    for kind, *_ in ops:
        live += 1 if kind == "F" else -1 if kind == frees else 0
        peak = max(peak, live)
    return peak
