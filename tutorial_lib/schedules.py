"""Pipeline schedules in plain Python (notebook 05's cells): each stage's order of forwards and
backwards, what it keeps in memory, how long it idles; `bubble_fraction`.
"""

from __future__ import annotations

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
