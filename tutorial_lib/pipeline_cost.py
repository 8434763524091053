"""Pipeline step times in closed form: GPipe, 1F1B, interleaved 1F1B and ZB-H1, and their bubble.

S stages (one per device), M micro-batches; F, B and W are one stage's time for one micro-batch's
forward, input gradient (zero bubble's B) and weights' gradient (its W). A schedule that does not
split the backward runs B + W as one op. t_send is the time an activation or its gradient takes to
reach the neighbouring device, zero bubble's T_comm, paid once per hop (arXiv:2401.10241, appendix G,
constraints (4) and (5)); the sender goes on at once. Every formula is held against
schedules.simulated_busy_idle, and the 1F1B and ZB-H1 ones against the zero-bubble paper's own
bubble rates, in tests/test_pipeline_cost.py.
"""

from __future__ import annotations

import math
import numbers

from . import checks


def _check(S, M, F, B, W, t_send):
    """S and M as ints; times refused unless finite and >= 0, F > 0 (a step takes some time)."""
    for name, t in (("F", F), ("B", B), ("W", W), ("t_send", t_send)):
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 <= t < math.inf or name == "F" and not t:
            raise ValueError(f"{name} must be a finite time >= 0 (F > 0), got {t!r}: e.g. {name}=1.0.")
    return checks.whole_number(S, "S"), checks.whole_number(M, "M")


def ideal_step(M, F, B, W):
    """M (F + B + W): every device busy all the step, no bubble and no exposed send. The zero-bubble
    paper's optimum, m (T_F + T_B + T_W) (sec. 5.3)."""
    _, M = _check(1, M, F, B, W, 0.0)
    return M * (F + B + W)


def gpipe_step(S, M, F, B, W, *, t_send=0.0):
    """(M + S - 1)(F + B + W) + 2 (S - 1) t_send: all forwards, then all backwards (GPipe, Huang et
    al., NeurIPS 2019, sec. 2.3: the bubble (S - 1)/(M + S - 1) of the step). The sends are paid
    only by the first forward on its way down and the last backward on its way up; every other
    send overlaps a forward or backward. Exact for every S, M and t_send."""
    S, M = _check(S, M, F, B, W, t_send)
    hop = t_send if S > 1 else 0.0
    return (M + S - 1) * (F + B + W) + 2 * (S - 1) * hop


def one_f_one_b_step(S, M, F, B, W, *, t_send=0.0):
    """(M + S - 1)(F + B + W) plus 2 t_send ((S - 1) + (M - 1) - ceil((M - 1)/S)): 1F1B (PipeDream-
    flush, Narayanan et al., SC'21, arXiv:2104.04473, sec. 2.2) has GPipe's bubble without sends.
    With sends, stage 0 keeps at most S micro-batches in flight and waits for each one's round trip
    of 2 (S - 1) hops, so every micro-batch after the first adds two hops but one in each S. The
    send term was found with schedules.simulated_busy_idle and is held against it over a grid of S,
    M, times and t_send in the tests (no paper prints it); the zero-bubble paper's 1F1B bubble
    rates (Table 5) follow from it."""
    S, M = _check(S, M, F, B, W, t_send)
    hops = 2 * ((S - 1) + (M - 1) - math.ceil((M - 1) / S)) if S > 1 else 0
    return (M + S - 1) * (F + B + W) + hops * t_send


def interleaved_step(S, M, F, B, W, v=2, *, t_send=0.0):
    """M (F + B + W) + (S - 1)(F + B + W)/v + 2 (S v - 1) t_send: interleaved 1F1B (Narayanan et
    al., SC'21, sec. 2.2: v chunks per device divide the bubble by v). Without sends it is exact
    for M a multiple of S (Megatron-LM's order, schedules.interleaved). The send term is one round
    trip through all S v chunks: exact for M = S; for larger M more hops fall on the critical
    path (a micro-batch crosses S v - 1 links each way, about v times 1F1B's): a lower bound."""
    S, M = _check(S, M, F, B, W, t_send)
    v = checks.whole_number(v, "v")
    if M % S:
        raise ValueError(f"interleaving needs M a multiple of S (Megatron-LM's order), got M={M} with S={S}.")
    hop = t_send if S > 1 else 0.0
    return M * (F + B + W) + (S - 1) * (F + B + W) / v + 2 * (S * v - 1) * hop


def zb_h1_step(S, M, F, B, W, *, t_send=0.0):
    """ZB-H1 (Qi et al., ICLR 2024, arXiv:2401.10241, sec. 2.1): 1F1B's order with each backward
    split into B and W, stage s deferring its first s W's so that it keeps 1F1B's memory
    (schedules.zb_h1). M > S: M (F + B + W) + (S - 1)(F + B - W), the paper's bubble (sec. 2.3,
    Table 2), true only while W <= min(F, B): a longer W cannot fill the whole gap, which is then
    (S - 1) max(F + B - W, F, B). M <= S: (M + S - 1)(F + B) + W, the paper's rough count for
    few micro-batches (appendix H); for M = S the two agree.
    Sends (found with schedules.simulated_busy_idle, not printed in the paper): M > S adds 4 (S - 1)
    hops, twice GPipe's, while 2 t_send <= W (a steady 1F-1B-1W round then has a W to cover its two
    sends); M <= S adds 2 (S - 1) + 2 max(M - 2, 0).
    Exact where W <= min(F, B) and (M <= S or 2 t_send <= W); a lower bound where W <= min(F, B)
    otherwise, and where W > min(F, B) with M <= S; exact where W > min(F, B) with M > S and no
    sends. Refused where W > min(F, B) with M > S and sends: simulate the order instead."""
    S, M = _check(S, M, F, B, W, t_send)
    hop = t_send if S > 1 else 0.0
    if M <= S:
        return (M + S - 1) * (F + B) + W + 2 * ((S - 1) + max(M - 2, 0)) * hop
    if hop and W > min(F, B):
        raise ValueError(
            f"ZB-H1's step has no closed form here (W={W!r} > min(F, B) with sends, M > S): a long W "
            "hides some sends; simulate it: schedules.simulated_busy_idle(schedules.zb_h1(S, M), F, B, W, t_send=...)."
        )
    return M * (F + B + W) + (S - 1) * max(F + B - W, F, B) + 4 * (S - 1) * hop


def _bubble(step, ideal):
    """step - ideal, refused unless 0 < ideal <= step (no schedule beats every device busy)."""
    if not 0 < ideal <= step < math.inf:
        raise ValueError(f"need 0 < ideal <= step, got step={step!r}, ideal={ideal!r}: ideal is ideal_step(M, F, B, W)")
    return step - ideal


def bubble_rate(step, ideal):
    """The zero-bubble paper's bubble rate, (cost - m (T_F + T_B + T_W)) / cost (arXiv:2401.10241,
    sec. 5.3, Tables 5 and 8): the idle share of the whole step, (S - 1)/(M + S - 1) for GPipe and
    1F1B without sends. `ideal` is ideal_step(M, F, B, W); `step` the whole step, the paper's cost
    (the longest time from one stage's first op to its last) where stage 0 also ends last."""
    return _bubble(step, ideal) / step


def bubble_over_ideal(step, ideal):
    """The bubble over the ideal step, Megatron-LM's "bubble time fraction" (arXiv:2104.04473,
    sec. 2.2): (S - 1)/M for GPipe and 1F1B, (S - 1)/(v M) interleaved; schedules.bubble_rate."""
    return _bubble(step, ideal) / ideal


# --- the zero-bubble paper's own figures (held against this model in tests/test_pipeline_cost.py) ---
#
# The zero-bubble paper, arXiv:2401.10241v1. Appendix D, Table 9: T_F, T_B, T_W and T_comm profiled
# in ZB-2p's runs, per model, #stage p and #microbatch m (milliseconds). Section 5.3 says these
# values give the bubble rates of Table 5, "(cost - m(T_F + T_B + T_W))/cost", cost the largest
# execution time of all stages. Table 5's columns 1F1B, 1F1B-I, ZB-H1; Table 3 the layers per model.
ZERO_BUBBLE_TABLES = [  # model, layers, p, m, T_F, T_B, T_W, T_comm, 1F1B, 1F1B-I, ZB-H1
    ("1.5B", 22, 8, 24, 18.522, 18.086, 9.337, 0.601, 0.2431, 0.1055, 0.1585),
    ("1.5B", 22, 8, 32, 18.513, 18.086, 9.331, 0.626, 0.1985, 0.0818, 0.1242),
    ("1.5B", 22, 8, 64, 18.546, 18.097, 9.321, 0.762, 0.1240, 0.0443, 0.0674),
    ("6.2B", 30, 8, 24, 29.718, 29.444, 19.927, 0.527, 0.2347, 0.0808, 0.1323),
    ("6.2B", 30, 8, 32, 29.802, 29.428, 19.530, 0.577, 0.1898, 0.0628, 0.1045),
    ("6.2B", 30, 8, 64, 29.935, 29.621, 19.388, 0.535, 0.1091, 0.0320, 0.0554),
    ("14.6B", 46, 16, 48, 11.347, 11.248, 8.132, 0.377, 0.2552, 0.1104, 0.1397),
    ("14.6B", 46, 16, 64, 11.307, 11.254, 8.101, 0.379, 0.2082, 0.0852, 0.1088),
    ("14.6B", 46, 16, 128, 11.325, 11.308, 8.109, 0.378, 0.1251, 0.0445, 0.0576),
    ("28.3B", 62, 32, 96, 10.419, 10.207, 7.715, 0.408, 0.2646, 0.1493, 0.1421),
    ("28.3B", 62, 32, 128, 10.408, 10.204, 7.703, 0.408, 0.2168, 0.1164, 0.1106),
    ("28.3B", 62, 32, 256, 10.402, 10.248, 7.698, 0.460, 0.1352, 0.0624, 0.0594),
]

# Table 4 (measured samples per GPU per second on A100s): ZB-1p, the searched schedule with 1F1B's
# memory, has ZB-H1's bubble rate in every row of Table 5, so the bubble rates predict its speed-up
# over 1F1B, (1 - rate ZB-H1)/(1 - rate 1F1B). Table 4's throughputs are printed to 3 digits.
ZERO_BUBBLE_TABLE_4 = [(12.9, 11.8), (13.4, 12.5), (14.2, 13.6), (3.88, 3.50), (4.00, 3.70), (4.20, 4.03),
            (1.61, 1.40), (1.67, 1.49), (1.76, 1.64), (0.87, 0.76), (0.90, 0.80), (0.96, 0.88)]  # fmt: skip


def table_4_residuals() -> list[dict]:
    """Each row of the zero-bubble paper's Table 4: ZB-1p's measured speed-up over 1F1B (samples per GPU per
    second, A100s, three digits), the one `zb_h1_step` and `one_f_one_b_step` predict from Table 9's T_F, T_B, T_W
    and T_comm, and the residual, measured / predicted - 1. Left out of the model: the optimizer step and ZB's
    post-validation of it, a split backward's smaller and slower kernels, and sends that overlap imperfectly."""
    rows = []
    for (model, _, p, m, F, B, W, comm, *_), (zb, one) in zip(ZERO_BUBBLE_TABLES, ZERO_BUBBLE_TABLE_4, strict=True):
        predicted = one_f_one_b_step(p, m, F, B, W, t_send=comm) / zb_h1_step(p, m, F, B, W, t_send=comm)
        rows.append({"model": model, "stages": p, "micro_batches": m, "predicted": predicted, "measured": zb / one,
                     "residual": zb / one / predicted - 1})  # fmt: skip
    return rows
