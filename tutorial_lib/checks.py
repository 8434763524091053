"""Argument checks shared by every module, so that the same mistake gets the same message.

Each returns the checked value (normalized where that helps) or raises a `ValueError`
(a `TypeError` for the wrong kind of object) that names the argument, what it got, and
what to pass instead.
"""

from __future__ import annotations

import numbers


def whole_number(value, name: str, minimum: int = 1) -> int:
    """`value` as an int if it is a whole number >= `minimum` (Python or NumPy integer, not bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}.")
    return int(value)


def same_length(name_a: str, a, name_b: str, b) -> None:
    """Refuse two lists that are meant to pair up one to one but do not."""
    if len(a) != len(b):
        raise ValueError(
            f"{len(a)} {name_a} but {len(b)} {name_b}: they pair up one to one, "
            f"so pass one {name_b.rstrip('s')} per {name_a.rstrip('s')}."
        )


def device_list(devices, name: str = "devices") -> list[str]:
    """A non-empty list of device names; a lone string is refused, not read letter by letter."""
    if isinstance(devices, str):
        raise TypeError(f"{name} must be a list of device names, got the string {devices!r}; write [{devices!r}].")
    devices = list(devices)
    if not devices:
        raise ValueError(f"{name} is empty: pass at least one device name, such as '/device:CPU:0'.")
    return devices
