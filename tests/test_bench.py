import time

import pytest

from tutorial_lib import bench


def test_median_time_measures_the_call():
    calls = []

    def sleepy(seconds):
        calls.append(seconds)
        time.sleep(seconds)

    t = bench.median_time(sleepy, 0.01, repeats=3, warmup=2)
    assert len(calls) == 5
    assert t >= 0.01


def test_median_time_rejects_bad_counts():
    with pytest.raises(ValueError):
        bench.median_time(lambda: None, repeats=0)


def test_cores_used_is_about_one_for_busy_python_and_zero_for_sleep():
    def spin():
        end = time.perf_counter() + 0.005
        while time.perf_counter() < end:
            pass

    assert 0.5 < bench.cores_used(spin, repeats=20) <= 1.2
    assert bench.cores_used(time.sleep, 0.005, repeats=10) < 0.5
