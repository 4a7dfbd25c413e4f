"""Local device discovery and validation shared by the strategies."""

from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf


def normalize(device: str) -> str:
    """`"/gpu:1"` -> `"/device:GPU:1"`; job/task parts are kept if given."""
    return tf.DeviceSpec.from_string(device).to_string()


def local_devices() -> list[str]:
    """All local GPUs, or all local (possibly logical) CPUs when no GPU."""
    gpus = tf.config.list_logical_devices("GPU")
    return [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]


def check_devices(devices: Sequence[str], option: str = "devices") -> list[str]:
    """Normalizes `devices`, raising a one-line error for unknown names."""
    if isinstance(devices, str):
        raise ValueError(
            f"{option}={devices!r} must be a list of device names, "
            f"e.g. [{devices!r}]."
        )
    if not devices:
        raise ValueError(f"{option} is empty; name at least one device.")
    visible = {normalize(d.name) for d in tf.config.list_logical_devices()}
    result = []
    for device in devices:
        name = normalize(device)
        if name not in visible:
            raise ValueError(
                f"{option}: device {device!r} does not exist; visible devices "
                f"are {sorted(visible)}."
            )
        if name in result:
            raise ValueError(f"{option}: device {device!r} is listed twice.")
        result.append(name)
    return result


def check_device(device: Optional[str], option: str = "device") -> Optional[str]:
    if device is None:
        return None
    return check_devices([device], option)[0]


def holds_plain(variable, device: Optional[str]) -> bool:
    """Whether `variable` is an unreplicated variable on `device` (any if None)."""
    value = getattr(variable, "value", variable)
    if isinstance(value, tf.distribute.DistributedValues):
        return False
    placed = getattr(value, "device", "")
    if device is None or not placed:
        return True
    return normalize(placed).endswith(device)
