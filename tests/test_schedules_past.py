"""Past GPipe's bound: ZB-H1 and interleaved 1F1B in plain Python, held against the papers' figures."""

import re

import pytest

from tutorial_lib import schedules

SHAPES = [(2, 2), (2, 4), (2, 8), (3, 6), (4, 4), (4, 8), (4, 16), (8, 8)]  # M >= S, M a multiple of S


def _idle(orders, *times):
    return [idle for _, idle in schedules.simulated_busy_idle(orders, *times)]


@pytest.mark.parametrize("S, M", SHAPES)
def test_zb_h1_idles_a_third_of_1f1b_for_equal_f_b_w_at_1f1b_memory(S, M):
    one_f_one_b, zb = schedules.schedule(S, M, "1f1b"), schedules.zb_h1(S, M)
    assert _idle(one_f_one_b, 1, 1, 1) == pytest.approx([3 * (S - 1)] * S)  # (S-1)(F+B+W), a backward of 2
    assert _idle(zb, 1, 1, 1) == pytest.approx([S - 1] * S)  # (S-1)(F+B-W): a third
    assert schedules.bubble_rate(one_f_one_b) == pytest.approx((S - 1) / M)  # the papers' bubble rates
    assert schedules.bubble_rate(zb) == pytest.approx((S - 1) / (3 * M))
    assert [schedules.stash_split(o) for o in zb] == [S] * S  # every stage: 1F1B's first stage
    assert max(schedules.stash_split(o) for o in zb) == max(schedules.stash(o) for o in one_f_one_b)


@pytest.mark.parametrize(
    "F, B, W", [(1.0, 1.2, 0.8), (1.0, 1.0, 0.5), (2.0, 1.0, 1.0), (1.5, 1.0, 1.5), (1.0, 2.0, 1.5)]
)
def test_zb_h1_bubble_is_the_papers_formula_where_w_is_at_most_f_and_b(F, B, W):
    for S, M in ((2, 4), (3, 6), (4, 8)):  # arXiv:2401.10241, sec. 2: (S-1)(F+B-W) against (S-1)(F+B+W)
        paper = (S - 1) * (F + B - W) if W <= min(F, B) else None
        ours = (S - 1) * max(F + B - W, F, B)  # a W longer than F or B cannot hide all of the gap
        assert _idle(schedules.zb_h1(S, M), F, B, W) == pytest.approx([paper or ours] * S)
        assert paper is None or paper == pytest.approx(ours)
        assert _idle(schedules.schedule(S, M, "1f1b"), F, B, W) == pytest.approx([(S - 1) * (F + B + W)] * S)


@pytest.mark.parametrize("S, M", SHAPES)
def test_interleaved_with_two_chunks_idles_half_of_1f1b(S, M):
    orders = schedules.interleaved(S, M, 2)
    for F, B in ((1.0, 2.0), (1.0, 1.0), (3.5, 5.5)):  # arXiv:2104.04473, sec. 2.2: (S-1)(F+B)/v
        assert _idle(orders, F, B, 0.0) == pytest.approx([(S - 1) * (F + B) / 2] * S)
        assert _idle(schedules.schedule(S, M, "1f1b"), F, B, 0.0) == pytest.approx([(S - 1) * (F + B)] * S)
    assert schedules.bubble_rate(orders, 1, 2, 0) == pytest.approx((S - 1) / (2 * M))


def test_interleaved_runs_megatrons_order_on_two_devices():
    F, B = "F", "B"
    assert schedules.interleaved(2, 2, 2)[1] == [(F, 0, 0), (F, 1, 0), (F, 0, 1), (F, 1, 1),
                                                 (B, 0, 1), (B, 1, 1), (B, 0, 0), (B, 1, 0)]  # fmt: skip
    device_0 = schedules.interleaved(2, 4, 2)[0]
    assert device_0[:6] == [(F, 0, 0), (F, 1, 0), (F, 0, 1), (F, 1, 1), (F, 2, 0), (B, 0, 1)]  # 4 warm-up forwards
    assert [schedules.stash_split(o) for o in schedules.interleaved(4, 8, 2)] == [11, 9, 7, 5]  # in chunks


@pytest.mark.parametrize("S, M, v", [(1, 3, 2), (2, 2, 2), (2, 6, 3), (3, 3, 2), (4, 8, 2), (4, 12, 3)])
def test_interleaved_runs_each_chunk_of_each_micro_batch_once_in_dependency_order(S, M, v):
    orders = schedules.interleaved(S, M, v)
    for order in orders:
        assert sorted(order) == sorted((k, m, c) for m in range(M) for c in range(v) for k in "FB")
    plan = schedules.unroll_split(orders)
    assert len(plan) == 2 * S * M * v
    done = set()
    for d, kind, m, c in plan:
        k = c * S + d
        assert kind == "B" or k == 0 or ("F", m, k - 1) in done
        assert kind == "F" or (("F", m, k) in done and (k == S * v - 1 or ("B", m, k + 1) in done))
        done.add((kind, m, k))


@pytest.mark.parametrize("S, M", [(1, 1), (1, 4), (2, 1), (3, 2), (4, 4), (5, 7)])
def test_zb_h1_runs_each_op_once_and_each_w_after_its_b_and_stage_0_whole_backwards(S, M):
    orders = schedules.zb_h1(S, M)
    assert orders[0] == schedules.schedule(S, M, "1f1b")[0]  # stage 0: 1F1B's order, B and W merged
    for order in orders[1:]:
        assert sorted(order) == sorted((k, m) for m in range(M) for k in "FBW")
        assert all(order.index(("B", m)) < order.index(("W", m)) for m in range(M))
    plan = schedules.unroll_split(orders)
    assert len(plan) == 3 * S * M - M
    done = set()
    for s, kind, m, _ in plan:
        if kind == "W":
            assert ("B", m, s) in done
        done.add((kind, m, s))


def test_interleaving_refuses_m_not_a_multiple_of_s_and_bad_counts():
    with pytest.raises(ValueError, match=r"interleaving needs M a multiple of S .* got M=6 with S=4: use M=4 or M=8"):
        schedules.interleaved(4, 6, 2)
    with pytest.raises(ValueError, match=r"got M=3 with S=4: use M=4\.$"):  # not "M=4 or M=4"
        schedules.interleaved(4, 3, 2)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="v must be a whole number"):
            schedules.interleaved(2, 4, bad)
        with pytest.raises(ValueError, match="M must be a whole number"):
            schedules.zb_h1(2, bad)


def test_split_orders_refuse_a_b_without_its_w_and_orders_that_deadlock():
    with pytest.raises(ValueError, match=r"device 0 splits its backwards .* B without W \[\(1, 0\)\]"):
        schedules.simulated_busy_idle([[("F", 0), ("F", 1), ("B", 0), ("W", 0), ("B", 1)]])
    with pytest.raises(ValueError, match="wait on each other forever: next ops {0: \\('W', 0, 0\\)"):
        schedules.unroll_split([[("W", 0), ("F", 0), ("B", 0)]])


@pytest.mark.parametrize(
    "op", [("X", 0), ("f", 0), ("F",), "F0", ("F", -1), ("F", 0.5), ("F", 0, True), ("B", 0, 0, 0)]
)
@pytest.mark.parametrize("function", ["unroll_split", "simulated_busy_idle", "bubble_rate", "stash_split"])
def test_an_op_of_unknown_kind_or_shape_is_refused_not_read_as_a_backward(op, function):
    order = [("F", 0), op, ("B", 0)]
    with pytest.raises(ValueError, match=rf"{re.escape(repr(op))} is not an op: write \(kind, m\)"):
        getattr(schedules, function)(order if function == "stash_split" else [order])


@pytest.mark.parametrize(
    "orders, times, message",
    [
        ([], {}, "orders is empty"),
        ([[("F", 0), ("B", 0)], []], {}, r"device\(s\) \[1\] have no ops"),
        (schedules.zb_h1(2, 2), {"t_forward": -1}, "t_forward must be a finite time >= 0"),
        (schedules.zb_h1(2, 2), {"t_forward": 0}, r"\(t_forward > 0\)"),
        (schedules.zb_h1(2, 2), {"t_weight": float("nan")}, "t_weight must be a finite time"),
        (schedules.zb_h1(2, 2), {"t_input": "1"}, "t_input must be a finite time"),
    ],
)
def test_bubble_rate_refuses_empty_orders_and_times_no_step_takes(orders, times, message):
    with pytest.raises(ValueError, match=message):
        schedules.bubble_rate(orders, **times)


@pytest.mark.parametrize("S, M", SHAPES + [(4, 1), (4, 3), (8, 4), (3, 1)])
@pytest.mark.parametrize("F, B, W", [(1.0, 1.0, 1.0), (1.0, 2.0, 0.5), (2.0, 1.0, 1.5)])
def test_merging_stage_0s_b_and_w_changes_no_time_and_keeps_1f1bs_memory_there(S, M, F, B, W):
    merged = schedules.zb_h1(S, M)
    split = [[("B", m), ("W", m)] if kind == "B" else [(kind, m)] for kind, m in merged[0]]  # W right after its B
    times = [schedules.simulated_busy_idle(orders, F, B, W) for orders in (merged, [sum(split, []), *merged[1:]])]
    assert [t for pair in times[0] for t in pair] == pytest.approx([t for pair in times[1] for t in pair])
    assert schedules.stash_split(merged[0]) == schedules.stash(schedules.schedule(S, M, "1f1b")[0])


@pytest.mark.parametrize("S, M, share", [(4, 1, 2 / 3), (8, 4, 0.524), (2, 1, 2 / 3), (4, 4, 1 / 3), (8, 8, 1 / 3)])
def test_zb_h1_idles_a_third_of_1f1b_only_where_m_is_at_least_s(S, M, share):
    zb, one_f_one_b = (
        schedules.bubble_rate(schedules.zb_h1(S, M)),
        schedules.bubble_rate(schedules.schedule(S, M, "1f1b")),
    )
    assert zb / one_f_one_b == pytest.approx(share, abs=1e-3)
