"""Prints the devices a process's strategies take on a machine with GPUs,
which this one does not have: TensorFlow's device lists answer as CUDA
would on a machine of `FAKE_GPUS` GPUs, each process seeing those its
`CUDA_VISIBLE_DEVICES` names (all when unset), numbered from 0. CUDA reads
the variable when TensorFlow first lists GPUs, after `import keras_distrib`
has set it; so does this stand-in.

Prints one line: `rank R visible V mirrored D1,D2 auto NAME:D1,D2`.
"""

import os

import tensorflow as tf

_REAL = {"logical": tf.config.list_logical_devices, "physical": tf.config.list_physical_devices}


def _gpus_cuda_shows() -> int:
    machine = int(os.environ["FAKE_GPUS"])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return machine
    return len([g for g in visible.split(",") if g.strip() and int(g) < machine])


def _lister(kind, device_class):
    def listed(device_type=None):
        found = [] if device_type == "GPU" else _REAL[kind](device_type)
        if device_type not in (None, "GPU"):
            return found
        # Named as the process's CPU is (a cluster's process names its
        # devices by its job and task).
        cpu = _REAL[kind]("CPU")[0].name
        prefix = cpu[: cpu.rindex("CPU:")] + "GPU:"
        return found + [device_class(f"{prefix}{i}", "GPU") for i in range(_gpus_cuda_shows())]

    return listed


tf.config.list_logical_devices = _lister("logical", tf.config.LogicalDevice)
tf.config.list_physical_devices = _lister("physical", tf.config.PhysicalDevice)

import keras_distrib as kd  # noqa: E402  (after the stand-in, as CUDA reads the variable late)


def _short(devices):
    return ",".join(kd.devices.short(d).replace("/device:", "") for d in devices)


mirrored = kd.strategies.get("mirrored")
auto = kd.strategies.get("auto") if os.environ.get("KERAS_DISTRIB_WORLD_SIZE", "1") == "1" else None
print(
    f"rank {os.environ.get('KERAS_DISTRIB_RANK', '-')} "
    f"visible {os.environ.get('CUDA_VISIBLE_DEVICES', '-')} "
    f"mirrored {_short(mirrored.devices)} "
    f"auto {auto.name + ':' + _short(auto.devices) if auto else '-'}",
    flush=True,
)
