"""TEST_FILE_ORDER (tests/conftest.py): the files reversed, each file's own order kept."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest


def load_tests_conftest():
    # Loaded by its path: the root conftest.py is also named conftest.
    spec = importlib.util.spec_from_file_location("tests_conftest", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ITEMS = [
    SimpleNamespace(path=Path(file), name=f"{file}::{test}")
    for file, test in [("a.py", 1), ("a.py", 2), ("b.ipynb", 1), ("b.ipynb", 2), ("b.ipynb", 3), ("c.py", 1)]
]


def names(items):
    return [item.name for item in items]


def test_reversed_runs_the_last_file_first_and_each_file_in_its_own_order():
    ordered = load_tests_conftest().in_file_order(ITEMS, "reversed")
    assert names(ordered) == ["c.py::1", "b.ipynb::1", "b.ipynb::2", "b.ipynb::3", "a.py::1", "a.py::2"]


def test_files_keeps_the_collected_order():
    assert names(load_tests_conftest().in_file_order(ITEMS, "files")) == names(ITEMS)


def test_an_unknown_order_says_which_ones_exist():
    with pytest.raises(pytest.UsageError, match="TEST_FILE_ORDER='backwards': use one of files, reversed"):
        load_tests_conftest().in_file_order(ITEMS, "backwards")
