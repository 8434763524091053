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
    median, spread, samples = timing.measure(clocks.calls([3, 1, 4, 1, 5]), repeats=5, warmup=0)
    # sorted 1 1 3 4 5: median 3; quartiles (exclusive method) 1 and 4.5
    assert (median, spread, samples) == (3, 3.5, 5)


def test_warmup_calls_are_made_but_not_timed(monkeypatch):
    clocks = FakeClocks(monkeypatch)
    fn = clocks.calls([100, 100, 3, 1, 4, 1, 5])
    assert timing.measure(fn, repeats=5, warmup=2) == (3, 3.5, 5)
    with pytest.raises(StopIteration):  # exactly 2 + 5 calls were made
        fn()


def test_median_time_is_the_median(monkeypatch):
    clocks = FakeClocks(monkeypatch)
    assert timing.median_time(clocks.calls([9, 2, 7, 4]), repeats=3, warmup=1) == 4


def test_a_single_repeat_has_no_spread(monkeypatch):
    clocks = FakeClocks(monkeypatch)
    assert timing.measure(clocks.calls([50, 6]), repeats=1) == (6, 0.0, 1)


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


# --- interleaved rounds, ratios and verdicts ----------------------------------------------


def test_interleaved_calls_the_variants_in_turns_after_their_warmups(monkeypatch):
    clocks = FakeClocks(monkeypatch)
    calls = []

    def variant(name, seconds):
        def fn():
            calls.append(name)
            clocks.wall += seconds
            return name

        return fn

    result = timing.interleaved({"a": variant("a", 2), "b": variant("b", 5)}, rounds=3, warmup=1)
    assert calls == ["a", "b"] * 4  # one warm-up round, then 3 timed rounds, never a then a
    assert result == {"a": (2, 0.0, 3), "b": (5, 0.0, 3)}
    assert result["a"].median == 2 and result["b"].spread == 0.0


def test_interleaved_takes_each_variants_median_and_spread_over_its_own_rounds(monkeypatch):
    clocks = FakeClocks(monkeypatch)
    a = clocks.calls([100, 3, 1, 4, 1, 5])  # warm-up, then 5 rounds
    b = clocks.calls([100, 10, 10, 10, 10, 10])
    result = timing.interleaved({"a": a, "b": b}, rounds=5, warmup=1)
    assert result == {"a": (3, 3.5, 5), "b": (10, 0.0, 5)}  # as measure() on the same times


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: timing.interleaved({}), "at least one variant"),
        (lambda: timing.interleaved({"a": lambda: None}, rounds=0), "rounds must be a whole number >= 1"),
        (lambda: timing.interleaved({"a": lambda: None}, warmup=-1), "warmup must be a whole number >= 0"),
    ],
)
def test_interleaved_refuses_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_ratio_range_pairs_the_half_spreads_least_and_most_favourably():
    slow, fast = timing.Timing(10.0, 2.0, 5), timing.Timing(4.0, 2.0, 5)
    # 10 +- 1 over 4 +- 1: from 9/5 to 11/3
    assert timing.ratio(slow, fast) == pytest.approx((2.5, 1.8, 11 / 3))


def test_ratio_range_is_open_when_the_spread_reaches_zero():
    assert timing.ratio(timing.Timing(1.0, 0.0, 5), timing.Timing(1.0, 2.0, 5))[2] == float("inf")


def test_ratio_range_never_goes_below_zero():
    # A spread wider than twice the median (one very slow round) must not give a negative time.
    assert timing.ratio(timing.Timing(1.0, 3.0, 5), timing.Timing(2.0, 0.0, 5)) == (0.5, 0.0, 1.25)


@pytest.mark.parametrize(
    "variant, baseline, expected",
    [
        ((4.0, 1.0), (10.0, 1.0), "faster"),  # ratio 2.5, range 9.5/4.5 .. 10.5/3.5: above 1
        ((10.0, 1.0), (4.0, 1.0), "slower"),
        ((9.0, 1.0), (10.0, 1.0), "no significant difference"),  # ratio 1.11, range 9.5/9.5 = 1 .. 10.5/8.5: touches 1
        ((9.0, 0.2), (10.0, 0.2), "faster"),  # the same medians with less noise: 1.09 .. 1.13
        ((5.0, 0.0), (5.0, 0.0), "no significant difference"),
    ],
)
def test_verdict_needs_the_whole_range_on_one_side_of_one(variant, baseline, expected):
    assert timing.verdict(timing.Timing(*variant, 5), timing.Timing(*baseline, 5)) == expected


@pytest.mark.parametrize("samples", [1, 2])
def test_no_verdict_from_fewer_than_three_samples(samples):
    # One sample has no spread, so any difference would look significant.
    few, many = timing.Timing(1.0, 0.0, samples), timing.Timing(10.0, 0.0, 5)
    assert timing.verdict(few, many) == timing.verdict(many, few) == "too few samples"


def test_no_times_cannot_be_summarized():
    with pytest.raises(ValueError, match="no times"):
        timing.summarize([])


def test_busy_warning_only_above_the_core_count_and_says_what_it_does_to_the_figures():
    assert timing.busy_warning(2.0, 2) is None
    message = timing.busy_warning(3.5, 2)
    assert "load average 3.5 on 2 cores" in message
    assert "ratios become noisy and speedups shrink" in message


def test_cores_taken_sees_another_program_spinning_and_not_this_ones_own_work():
    import subprocess
    import sys

    spin = "import time\nend = time.time() + 3\nwhile time.time() < end: pass"
    spinner = subprocess.Popen([sys.executable, "-c", spin])
    try:
        taken = timing.cores_taken(1.0)
    finally:
        spinner.kill()
        spinner.wait()
    assert taken is not None and taken >= 0.6, taken  # the spinner holds about one core


def test_machine_state_says_busy_with_the_cores_taken_and_quiet_below_a_quarter_core():
    busy, sentence = timing.machine_state(1.3, 2)
    assert busy and sentence.startswith("busy machine: other programs kept 1.3 of 2 cores busy")
    assert timing.machine_state(0.1, 2) == (False, "quiet machine: other programs kept 0.10 of 2 cores busy")
    assert timing.machine_state(None, 2)[0] is False
    fast, slow = timing.Timing(1.0, 0.1, 9), timing.Timing(2.0, 0.1, 9)
    assert timing.verdict(fast, slow) == "faster" and timing.verdict(fast, slow, busy=True) == "busy machine"


@pytest.mark.parametrize("seconds", [0, -1, 0.01, float("nan"), float("inf"), True, "1"])
def test_cores_taken_refuses_a_window_too_short_to_measure_instead_of_saying_quiet(seconds):
    with pytest.raises(ValueError, match=r"seconds must be a finite number >= 0.1 .*e.g. cores_taken\(1.0\)"):
        timing.cores_taken(seconds)


@pytest.mark.parametrize("taken, cores", [(-1.0, 2), (float("nan"), 2), ("0.5", 2), (0.5, 0), (0.5, 2.0)])
def test_machine_state_refuses_what_cores_taken_never_returns(taken, cores):
    with pytest.raises(ValueError, match="taken is what cores_taken|cores must be a whole number"):
        timing.machine_state(taken, cores)
