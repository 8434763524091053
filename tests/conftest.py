"""Unit tests share one process, so they share one device layout: 4 simulated CPUs."""

import matplotlib
import pytest

matplotlib.use("Agg")

N_DEVICES = 4


@pytest.fixture(scope="session")
def devs():
    from tutorial_lib import devices

    return devices.simulate(N_DEVICES)
