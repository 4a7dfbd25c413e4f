"""Local device discovery and validation shared by the strategies."""

from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf


def normalize(device: str) -> str:
    """`"/gpu:1"` -> `"/device:GPU:1"`; job/task parts are kept if given."""
    return tf.DeviceSpec.from_string(device).to_string()


def local_devices() -> list[str]:
    """All local GPUs, or all local (possibly logical) CPUs when no GPU.

    Once the collective runtime has started (multi-worker), TensorFlow lists
    every worker's devices; only this process's are local.
    """
    gpus = _on_this_task(tf.config.list_logical_devices("GPU"))
    return [d.name for d in (gpus or _on_this_task(tf.config.list_logical_devices("CPU")))]


def local_devices_of_all_types() -> list[str]:
    """Every device of this process (CPUs, GPUs, TPUs...)."""
    return [d.name for d in _on_this_task(tf.config.list_logical_devices())]


def _on_this_task(devices) -> list:
    here = tf.DeviceSpec.from_string(tf.constant(0).device)
    return [d for d in devices if _same_task(tf.DeviceSpec.from_string(d.name), here)]


def _same_task(spec: tf.DeviceSpec, here: tf.DeviceSpec) -> bool:
    return spec.job is None or (spec.job, spec.replica, spec.task) == (
        here.job, here.replica, here.task)


def check_devices(devices: Sequence[str], option: str = "devices") -> list[str]:
    """Normalizes `devices`, raising a one-line error for unknown names."""
    if isinstance(devices, str):
        raise ValueError(
            f"{option}={devices!r} must be a list of device names, "
            f"e.g. [{devices!r}]."
        )
    if not devices:
        raise ValueError(f"{option} is empty; name at least one device.")
    # This process's devices, by full name or short form, to the short form
    # ("/device:CPU:1": TensorFlow places it on this process, and it reads
    # the same with one process and in a cluster).
    visible = {}
    for full in (normalize(d) for d in local_devices_of_all_types()):
        spec = tf.DeviceSpec.from_string(full)
        short = tf.DeviceSpec(device_type=spec.device_type,
                              device_index=spec.device_index).to_string()
        visible[full] = visible[short] = short
    result = []
    for device in devices:
        name = visible.get(normalize(device))
        if name is None:
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
