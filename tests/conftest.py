"""Unit tests share one process, so they share one device layout: 4 simulated CPUs.

It is set up here, at import, before any test module builds a tensor (parametrized
tests build some while they are collected)."""

import matplotlib
import pytest

from tutorial_lib import devices

matplotlib.use("Agg")

N_DEVICES = 4
DEVICES = devices.simulate(N_DEVICES)


@pytest.fixture(scope="session")
def devs():
    return DEVICES
