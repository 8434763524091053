import numpy as np
import pytest

from tutorial_lib import schedules


def test_bubble_fraction():
    assert schedules.bubble_fraction(1, 8) == 0
    assert schedules.bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert schedules.bubble_fraction(np.int64(4), np.int64(4)) == pytest.approx(3 / 7)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="stages must be a whole number"):
            schedules.bubble_fraction(bad, 4)
        with pytest.raises(ValueError, match="micro_batches must be a whole number"):
            schedules.bubble_fraction(2, bad)


def test_simulated_idle_is_the_formula_for_equal_stages_and_more_for_gpipe_with_unequal_phases():
    for S, M in ((2, 1), (2, 8), (3, 4), (4, 6)):
        for kind in ("gpipe", "1f1b"):
            idle = schedules.simulated_idle(schedules.schedule(S, M, kind), 1.0, 2.0)
            assert idle == pytest.approx([schedules.bubble_fraction(S, M)] * S)
    # notebook 05's MLP in matrix products: stage 0 does 3.5 forward and 5.5 backward, stage 1 does 3 and 6
    for M, gpipe in ((2, 0.345), (4, 0.226), (8, 0.148)):
        idle = schedules.simulated_idle(schedules.schedule(2, M, "gpipe"), [3.5, 3.0], [5.5, 6.0])
        assert np.mean(idle) == pytest.approx(gpipe, abs=1e-3)
        one_f_one_b = schedules.simulated_idle(schedules.schedule(2, M, "1f1b"), [3.5, 3.0], [5.5, 6.0])
        assert np.mean(one_f_one_b) == pytest.approx(schedules.bubble_fraction(2, M))
    with pytest.raises(ValueError, match="one forward and one backward time per stage"):
        schedules.simulated_idle(schedules.schedule(2, 2), [1.0], 2.0)


def test_two_stage_orders():
    F, B = "F", "B"
    assert schedules.schedule(2, 3, "gpipe") == [[(F, 0), (F, 1), (F, 2), (B, 0), (B, 1), (B, 2)]] * 2
    assert schedules.schedule(2, 3, "1f1b") == [
        [(F, 0), (F, 1), (B, 0), (F, 2), (B, 1), (B, 2)],  # one warm-up forward on stage 0
        [(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2)],
    ]
    assert schedules.schedule(2, 2, "sequential")[0] == [(F, 0), (B, 0), (F, 1), (B, 1)]


@pytest.mark.parametrize("kind", schedules.SCHEDULES)
@pytest.mark.parametrize("stages, micro_batches", [(1, 3), (2, 1), (2, 8), (3, 2), (4, 8), (8, 3)])
def test_each_stage_runs_each_forward_then_its_backward_once(kind, stages, micro_batches):
    orders = schedules.schedule(stages, micro_batches, kind)
    assert len(orders) == stages
    for order in orders:
        assert sorted(order) == sorted([(op, m) for m in range(micro_batches) for op in "FB"])
        assert all(order.index(("F", m)) < order.index(("B", m)) for m in range(micro_batches))
    plan = schedules.unroll(orders)  # and nothing waits forever
    assert len(plan) == 2 * stages * micro_batches
    done = set()
    for s, op, m, _ in plan:  # every op after its inputs
        if op == "F":
            assert s == 0 or (s - 1, "F", m) in done
        else:
            assert (s, "F", m) in done and (s == stages - 1 or (s + 1, "B", m) in done)
        done.add((s, op, m))


@pytest.mark.parametrize("stages, micro_batches", [(2, 1), (2, 8), (3, 2), (4, 4), (4, 16), (8, 3)])
def test_stash_bound_of_each_schedule(stages, micro_batches):
    def bound(kind):
        return [schedules.stash(order) for order in schedules.schedule(stages, micro_batches, kind)]

    assert bound("sequential") == [1] * stages
    assert bound("gpipe") == [micro_batches] * stages
    assert bound("1f1b") == [min(stages - s, micro_batches) for s in range(stages)]  # PipeDream-Flush


def test_schedule_rejects_unknown_kind():
    with pytest.raises(ValueError, match="schedule must be one of"):
        schedules.schedule(2, 2, "zigzag")


def test_orders_that_wait_on_each_other_are_refused():
    backward_first = [[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]]
    with pytest.raises(ValueError, match="wait on each other forever: next ops {0: \\('B', 0, 0\\)"):
        schedules.unroll(backward_first)
