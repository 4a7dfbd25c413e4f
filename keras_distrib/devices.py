"""Local device discovery and validation shared by the strategies."""

from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence

import tensorflow as tf

# Variables of layers that tensor_parallel split over devices (by id; a
# variable's `==` is elementwise, so no WeakSet). No other strategy takes
# such a layer as its own: `from_model` copies it whole instead.
_SPLIT_LAYER_VARIABLES: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def mark_split(variable) -> None:
    """Records `variable` as a part of a layer split over devices."""
    value = getattr(variable, "value", variable)
    _SPLIT_LAYER_VARIABLES[id(value)] = value


def is_split(variable) -> bool:
    """Whether `variable` is a part of a layer split over devices."""
    value = getattr(variable, "value", variable)
    return _SPLIT_LAYER_VARIABLES.get(id(value)) is value


def normalize(device: str) -> str:
    """`"/gpu:1"` -> `"/device:GPU:1"`; job/task parts are kept if given."""
    return tf.DeviceSpec.from_string(device).to_string()


def local_devices() -> list[str]:
    """All local GPUs, or all local (possibly logical) CPUs when no GPU."""
    mine = this_process_devices()
    gpus = [d for d in mine if tf.DeviceSpec.from_string(d).device_type == "GPU"]
    return gpus or [d for d in mine if tf.DeviceSpec.from_string(d).device_type == "CPU"]


def this_process_devices() -> list[str]:
    """Every device of this process (CPUs, GPUs, TPUs...), in short form
    (`"/device:CPU:1"`), which TensorFlow places on this process and which
    reads the same with one process and in a cluster.

    Once the collective runtime has started (multi-worker), TensorFlow lists
    every worker's devices as logical devices; only this process's task's
    (that of a fresh tensor) are local.
    """
    specs = [tf.DeviceSpec.from_string(d.name) for d in tf.config.list_logical_devices()]
    return [_short(spec) for spec in specs if _is_mine(spec)]


def _is_mine(spec: tf.DeviceSpec) -> bool:
    """Whether `spec` names a device of this process (no job: it does)."""
    if spec.job is None:
        return True
    here = tf.DeviceSpec.from_string(tf.constant(0).device)
    return (spec.job, spec.replica, spec.task) == (here.job, here.replica, here.task)


def short(device: str) -> str:
    """`"/job:localhost/replica:0/task:0/device:CPU:1"` -> `"/device:CPU:1"`."""
    return _short(tf.DeviceSpec.from_string(device))


def _short(spec: tf.DeviceSpec) -> str:
    return tf.DeviceSpec(device_type=spec.device_type, device_index=spec.device_index).to_string()


def check_devices(devices: Sequence[str], option: str = "devices") -> list[str]:
    """Normalizes `devices`, raising a one-line error for unknown names."""
    if isinstance(devices, str):
        raise ValueError(
            f"{option}={devices!r} must be a list of device names, e.g. [{devices!r}]."
        )
    if not devices:
        raise ValueError(f"{option} is empty; name at least one device.")
    # This process's devices (short form, see `this_process_devices`); a
    # full name of one of them ("/job:worker/.../device:CPU:1") names it too.
    visible = set(this_process_devices())
    result = []
    for device in devices:
        spec = tf.DeviceSpec.from_string(normalize(device))
        name = _short(spec) if _is_mine(spec) else None
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
    """Whether `variable` is an unreplicated variable on `device` (any if
    None), and not a part of a layer split over devices (`mark_split`)."""
    value = getattr(variable, "value", variable)
    if isinstance(value, tf.distribute.DistributedValues):
        return False
    if _SPLIT_LAYER_VARIABLES.get(id(value)) is value:
        return False
    placed = getattr(value, "device", "")
    if device is None or not placed:
        return True
    return normalize(placed).endswith(device)
