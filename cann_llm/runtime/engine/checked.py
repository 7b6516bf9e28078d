"""Settings given from Python checked for their type where they are made (`SamplingParams`, `EngineConfig`):
numpy's integers and floats are taken as Python's, anything else is a TypeError naming the setting, so a
wrong value is refused by the call that passed it rather than failing later inside a step."""

from __future__ import annotations

import numbers
import os

import numpy as np


def integer(name: str, value) -> int:
    """`value` as an int; TypeError for a bool, a float or anything not integral."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, not {type(value).__name__} ({value!r})")
    return int(value)


def real(name: str, value) -> float:
    """`value` as a float; TypeError for a bool or anything not a real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, not {type(value).__name__} ({value!r})")
    return float(value)


def boolean(name: str, value) -> bool:
    """`value` as a bool (True, False, or numpy's); TypeError for anything else, such as the string "0"."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, not {type(value).__name__} ({value!r})")
    return bool(value)


def text(name: str, value) -> str:
    """`value` as a str (a path may be an os.PathLike); TypeError for anything else."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, not {type(value).__name__} ({value!r})")
    return value
