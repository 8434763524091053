"""Unit tests share one process, so they share one device layout: 4 simulated CPUs.

It is set up when pytest configures the session, before any test module builds a tensor
(parametrized tests build some while they are collected). pytest-xdist's controller runs no
test: it starts no TensorFlow, which would delay every worker's start by an import.

TEST_FILE_ORDER=reversed runs the test files last to first, each file's tests in their own order
(nbval's cells must run in order): a test that leaves state behind for another then fails in one of
the two orders."""

import os

import pytest

from tutorial_lib import devices

N_DEVICES = 4
DEVICES: list[str] = []
FILE_ORDERS = ("files", "reversed")


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # the xdist controller
    import matplotlib

    matplotlib.use("Agg")
    DEVICES[:] = devices.simulate(N_DEVICES)


def in_file_order(items, order):
    """`items` with their files in `order` ("files": as collected, "reversed": last file first), each
    file's items kept together and in their own order."""
    if order not in FILE_ORDERS:
        raise pytest.UsageError(f"TEST_FILE_ORDER={order!r}: use one of {', '.join(FILE_ORDERS)} (or leave it unset)")
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(str(item.path), []).append(item)
    files = list(by_file.values())
    if order == "reversed":
        files.reverse()
    return [item for file_items in files for item in file_items]


def pytest_collection_modifyitems(items):
    items[:] = in_file_order(items, os.environ.get("TEST_FILE_ORDER", "files"))


@pytest.fixture(scope="session")
def devs():
    return DEVICES
