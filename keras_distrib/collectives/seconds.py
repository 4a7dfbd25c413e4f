"""Timeouts in seconds: options and environment variables, checked in one line."""

from __future__ import annotations

import os

from keras_distrib import cluster as cluster_lib


def positive_seconds(value) -> bool:
    """Whether `value` is a number of seconds > 0 (bools and strings are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def check_seconds(name: str, value, none_ok: bool = False) -> None:
    """Raises a one-line ValueError naming option `name` unless `value` is a
    number of seconds > 0 (or None, when `none_ok`)."""
    if (value is None and none_ok) or positive_seconds(value):
        return
    raise ValueError(
        f"{name}={value!r} must be a number of seconds > 0{', or None' if none_ok else ''}."
    )


def seconds_from_env(name: str, default: float, default_note: str = "") -> float:
    """The number of seconds > 0 in environment variable `name`, `default`
    when it is unset or blank.

    Raises:
        ClusterConfigError: anything else (one line; `default_note` goes
            before its full stop).
    """
    text = os.environ.get(name, "")
    if not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not positive_seconds(value):
        raise cluster_lib.ClusterConfigError(
            f"{name}={text!r} must be a positive number of seconds{default_note}."
        )
    return value
