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
