"""Pipeline schedules: the take-away's `pipeline_schedules` (examples/, notebook 05's lessons, the one copy), and
beside it the checks that refuse what the lessons take on trust (ops of no known kind, times no step takes, a
device split into B without its W), with messages that say what to pass.
"""

from __future__ import annotations

import math
import numbers

import pipeline_schedules as lesson
from pipeline_schedules import (  # noqa: F401 (the package's names for them)
    EVERY_SCHEDULE,
    SCHEDULES,
    expected,
    interleaved,
    orders_of,
    placement_of,
    schedule,
    simulate,
    stages_of,
    stash,
    unroll,
    zb_h1,
    zb_v,
)

from . import checks

KINDS = ("F", "B", "W")


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle share of a GPipe (or 1F1B) step with equal stages: (S-1)/(M+S-1)."""
    return lesson.bubble_fraction(
        checks.whole_number(stages, "stages"), checks.whole_number(micro_batches, "micro_batches")
    )


def simulated_idle(orders, t_forward=1.0, t_backward=2.0):
    """Each stage's idle share of a step in which every op starts as soon as its inputs and its stage are free.
    Times are one per op kind, or a list of one per stage; a backward is whole (t_backward)."""
    for name, t in (("forward", t_forward), ("backward", t_backward)):
        if isinstance(t, list | tuple) and len(t) != len(orders):
            raise ValueError(f"need one forward and one backward time per stage ({len(orders)}), got {len(t)} {name}")
    return [idle / (busy + idle) for busy, idle in lesson.busy_idle(checked(orders), t_forward, t_backward, 0.0)]


def checked_ops(order):
    """An order's ops as (kind, m, chunk), chunk 0 where none is named; refused unless each op is (kind, m) or
    (kind, m, chunk) with a kind of KINDS and whole numbers m, chunk >= 0."""
    ops = []
    for op in order:
        try:
            ok = isinstance(op, tuple | list) and len(op) in (2, 3) and op[0] in KINDS
            ops.append((op[0], checks.whole_number(op[1], "m", 0), checks.whole_number((*op, 0)[2], "chunk", 0)))
        except (TypeError, ValueError, IndexError, KeyError):
            ok = False
        if not ok:
            raise ValueError(
                f"{op!r} is not an op: write (kind, m) or (kind, m, chunk), kind one of {KINDS} (F forward, "
                "B backward, W weights' gradient), m and chunk whole numbers >= 0."
            )
    return ops


def checked(orders):
    """`orders` with every op checked (`checked_ops`), one non-empty order per device, and a device that splits its
    backwards into B and W doing so for every (m, chunk)."""
    if not len(orders):
        raise ValueError("orders is empty: give one order of ops per device, e.g. zb_h1(S=4, M=8).")
    if idle := [d for d, order in enumerate(orders) if not len(order)]:
        raise ValueError(f"device(s) {idle} have no ops: give every device its order, or leave the device out.")
    orders = [checked_ops(order) for order in orders]
    for d, order in enumerate(orders):
        b, w = {o[1:] for o in order if o[0] == "B"}, {o[1:] for o in order if o[0] == "W"}
        if w and b != w:
            raise ValueError(f"device {d} splits its backwards into B and W but not for every (m, chunk): "
                             f"B without W {sorted(b - w)}, W without B {sorted(w - b)}.")  # fmt: skip
    return orders


def _times(**times):
    """Each op kind's time, refused unless finite and >= 0 (a forward's > 0: a step takes some time)."""
    for name, t in times.items():
        bad = isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 <= t < math.inf
        if bad or name == "t_forward" and not t:
            raise ValueError(f"{name} must be a finite time >= 0 (t_forward > 0), got {t!r}: e.g. {name}=1.0.")


def unroll_split(orders, placement=None):
    """`unroll` of checked orders: (device, kind, m, chunk) in an order that respects every device's order and every
    data dependency."""
    return unroll(checked(orders), placement)


def simulated_busy_idle(orders, t_forward=1.0, t_input=1.0, t_weight=1.0, *, t_send=0.0, placement=None):
    """Per device, (busy, idle) time of a step in which each op starts as soon as its inputs and its device are
    free (the take-away's `busy_idle`, its times and orders checked). t_* are a whole stage's times, split evenly
    over its chunks; a B in an order without W's is the whole backward, t_input + t_weight. t_send is the time an
    activation or its gradient takes to reach another device (zero bubble's T_comm, added per hop as in its ILP
    constraints (4) and (5)); it delays the receiver only, where the two stages are on two devices. `placement`: the
    device of each virtual stage (`placement_of`; ZB-V's V)."""
    _times(t_forward=t_forward, t_input=t_input, t_weight=t_weight, t_send=t_send)
    return lesson.busy_idle(checked(orders), t_forward, t_input, t_weight, t_send, placement)


def bubble_rate(orders, t_forward=1.0, t_input=1.0, t_weight=1.0, *, t_send=0.0, placement=None):
    """The largest idle time of a device over its busy time: Megatron-LM's bubble time fraction (arXiv:2104.04473,
    sec. 2.2), (S-1)/M for 1F1B with equal stages, (S-1)/(vM) interleaved, and (S-1)/(3M) for ZB-H1 with equal F,
    B and W where M >= S (a third of 1F1B's; with M < S more: 2/3 at S = 4, M = 1), and (S-1)/(6M) for ZB-V where
    M >= 2S (half of ZB-H1's: only its start, a half-stage forward per device, is idle). The zero-bubble paper's
    "bubble rate" (arXiv:2401.10241, sec. 5.3) divides the idle time by the whole step instead, its cost being the
    longest span of a stage from its first op to its last (pipeline_cost.bubble_rate), in which ZB-V has none."""
    _times(t_forward=t_forward, t_input=t_input, t_weight=t_weight, t_send=t_send)
    return lesson.bubble_rate(checked(orders), t_forward, t_input, t_weight, t_send, placement)


def stash_split(order):
    """`stash` of a checked order: the most (micro-batch, chunk) activations a device keeps at once."""
    return stash(checked_ops(order))
