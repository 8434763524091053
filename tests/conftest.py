"""Unit tests share one process, so they share one device layout: 4 simulated CPUs.

It is set up when pytest configures the session, before any test module builds a tensor
(parametrized tests build some while they are collected). pytest-xdist's controller runs no
test: it starts no TensorFlow, which would delay every worker's start by an import."""

import pytest

from tutorial_lib import devices

N_DEVICES = 4
DEVICES: list[str] = []


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # the xdist controller
    import matplotlib

    matplotlib.use("Agg")
    DEVICES[:] = devices.simulate(N_DEVICES)


@pytest.fixture(scope="session")
def devs():
    return DEVICES
