"""Where a pipelined model lives: `PipelinePlan`, what `Pipeline.describe` reports.

Read from the variables' actual placement, not from the cut: a variable
that did not go where its stage runs shows up here (and `stages` refuses
to cut around it).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf


@dataclasses.dataclass
class PipelinePlan:
    """Where a pipelined model lives, from `Pipeline.describe(model)`.

    Attributes:
        devices: stage `s` runs on `devices[s]`.
        layers: layer names per stage.
        variables: each model variable's path -> the device it is on.
        bytes_per_device: model variables' bytes on each device.
        optimizer_bytes_per_device: the optimizer's variables' bytes (its
            slots sit with their variables).
        num_micro_batches, schedule: the step's options.
        peak_live_activations: per stage, the most micro-batches whose
            activations the schedule keeps at once.
    """

    devices: list
    layers: list
    variables: dict
    bytes_per_device: dict
    optimizer_bytes_per_device: dict
    num_micro_batches: int
    schedule: str
    peak_live_activations: list

    def __str__(self) -> str:
        lines = [
            f"pipeline: {len(self.devices)} stages, {self.num_micro_batches} "
            f"micro-batches, schedule {self.schedule!r}"
        ]
        for s, device in enumerate(self.devices):
            lines.append(
                f"  stage {s} on {device}: {self.bytes_per_device.get(device, 0):,} bytes "
                f"(+{self.optimizer_bytes_per_device.get(device, 0):,} optimizer), "
                f"peak live activations {self.peak_live_activations[s]}, layers "
                f"{', '.join(self.layers[s])}"
            )
        return "\n".join(lines)


def device_of(variable) -> str:
    """The device `variable` lives on, in the short form stages are named by."""
    spec = tf.DeviceSpec.from_string(getattr(variable, "value", variable).device)
    return f"/device:{spec.device_type}:{spec.device_index}"


def bytes_per_device(variables) -> dict:
    """Device -> the bytes of those of `variables` that live there."""
    sizes: dict = {}
    for v in variables:
        nbytes = (
            int(np.prod(v.shape)) * np.dtype(getattr(v.dtype, "as_numpy_dtype", v.dtype)).itemsize
        )
        sizes[device_of(v)] = sizes.get(device_of(v), 0) + nbytes
    return sizes
