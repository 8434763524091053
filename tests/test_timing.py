"""The timing arithmetic on a fake clock (exact), and only load-proof orderings on the real one."""

import time

import pytest

from tutorial_lib import timing


class FakeClocks:
    """A wall clock and a CPU clock that move only when a fake call says so."""

    def __init__(self, monkeypatch):
        self.wall = 0.0
        self.cpu = 0.0
        monkeypatch.setattr(timing, "_clock", lambda: self.wall)
        monkeypatch.setattr(timing, "_cpu_clock", lambda: self.cpu)

    def calls(self, durations, cpu_per_wall=1.0):
        """A function whose i-th call takes durations[i] seconds (whole numbers: exact sums)."""
        durations = iter(durations)

        def fn():
            seconds = next(durations)
            self.wall += seconds
            self.cpu += cpu_per_wall * seconds

        return fn


def test_median_and_interquartile_spread_on_a_fake_clock(monkeypatch):
    clocks = FakeClocks(monkeypatch)
    median, spread = timing.measure(clocks.calls([3, 1, 4, 1, 5]), repeats=5, warmup=0)
    # sorted 1 1 3 4 5: median 3; quartiles (exclusive method) 1 and 4.5
    assert (median, spread) == (3, 3.5)


def test_warmup_calls_are_made_but_not_timed(monkeypatch):
    clocks = FakeClocks(monkeypatch)
    fn = clocks.calls([100, 100, 3, 1, 4, 1, 5])
    assert timing.measure(fn, repeats=5, warmup=2) == (3, 3.5)
    with pytest.raises(StopIteration):  # exactly 2 + 5 calls were made
        fn()


def test_median_time_is_the_median(monkeypatch):
    clocks = FakeClocks(monkeypatch)
    assert timing.median_time(clocks.calls([9, 2, 7, 4]), repeats=3, warmup=1) == 4


def test_a_single_repeat_has_no_spread(monkeypatch):
    clocks = FakeClocks(monkeypatch)
    assert timing.measure(clocks.calls([50, 6]), repeats=1) == (6, 0.0)


def test_cores_used_is_cpu_time_over_wall_time_after_one_uncounted_call(monkeypatch):
    clocks = FakeClocks(monkeypatch)
    fn = clocks.calls([1000, 2, 2, 2, 2], cpu_per_wall=1.5)
    assert timing.cores_used(fn, repeats=4) == 1.5
    with pytest.raises(StopIteration):  # 1 uncounted + 4 counted calls
        fn()


def test_arguments_reach_the_timed_function(monkeypatch):
    FakeClocks(monkeypatch)
    seen = []
    timing.median_time(lambda a, b=0: seen.append((a, b)), 1, b=2, repeats=2, warmup=1)
    assert seen == [(1, 2)] * 3


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: timing.median_time(lambda: None, repeats=0), "repeats must be a whole number >= 1"),
        (lambda: timing.measure(lambda: None, repeats=2.5), "repeats must be a whole number >= 1"),
        (lambda: timing.measure(lambda: None, warmup=-1), "warmup must be a whole number >= 0"),
        (lambda: timing.cores_used(lambda: None, repeats=0), "repeats must be a whole number >= 1"),
    ],
)
def test_bad_counts_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_real_clock_times_the_whole_call():
    # A sleep lasts at least what was asked, however busy the machine is.
    assert timing.median_time(time.sleep, 0.01, repeats=3, warmup=1) >= 0.01


def test_busy_python_uses_more_cpu_per_wall_second_than_sleeping():
    # Only the ordering: other processes on the same cores lower the first figure, but a
    # sleeping thread uses almost no CPU whatever the load.
    def spin():
        end = time.perf_counter() + 0.005
        while time.perf_counter() < end:
            pass

    assert timing.cores_used(spin, repeats=20) > timing.cores_used(time.sleep, 0.005, repeats=20)
