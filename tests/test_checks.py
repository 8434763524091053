import numpy as np
import pytest

from tutorial_lib import checks


@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3), np.uint8(3)])
def test_whole_number_takes_python_and_numpy_integers(value):
    n = checks.whole_number(value, "towers")
    assert n == 3 and type(n) is int


@pytest.mark.parametrize("value", [True, False, 2.0, 2.5, 0, -1, "2", None, np.float64(2.0)])
def test_whole_number_refuses_the_rest_and_names_the_argument(value):
    with pytest.raises(ValueError, match=r"towers must be a whole number >= 1, got "):
        checks.whole_number(value, "towers")


def test_whole_number_minimum():
    assert checks.whole_number(0, "warmup", minimum=0) == 0
    with pytest.raises(ValueError, match=">= 2, got 1"):
        checks.whole_number(1, "workers", minimum=2)


def test_same_length_says_how_to_pair_them_up():
    checks.same_length("towers", [1, 2], "devices", ["a", "b"])
    message = "3 towers but 2 devices: they pair up one to one, so pass one device per tower"
    with pytest.raises(ValueError, match=message):
        checks.same_length("towers", [1, 2, 3], "devices", ["a", "b"])


def test_device_list_refuses_a_lone_string_and_an_empty_list():
    with pytest.raises(
        TypeError,
        match=r"devices must be a list of device names, got the string 'cpu:0'; "
        r"write \['cpu:0'\]",
    ):
        checks.device_list("cpu:0")
    with pytest.raises(ValueError, match="stage_devices is empty: pass at least one device name"):
        checks.device_list([], name="stage_devices")


def test_device_list_returns_a_list():
    assert checks.device_list(("/cpu:0", "/cpu:1")) == ["/cpu:0", "/cpu:1"]
    assert checks.device_list(d for d in ["/cpu:0"]) == ["/cpu:0"]
