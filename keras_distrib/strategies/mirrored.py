"""`"mirrored"`: synchronous all-reduce over all local devices."""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import tensorflow as tf

from keras_distrib import _compat
from keras_distrib import devices as devices_lib
from keras_distrib.strategies.tf_distribute import TFDistributeStrategy
from keras_distrib.arithmetic import optimizer_sharding as sharding_option

_CROSS_DEVICE_OPS = {
    "nccl": lambda: tf.distribute.NcclAllReduce(),
    "hierarchical_copy": lambda: tf.distribute.HierarchicalCopyAllReduce(),
    "reduction_to_one_device": lambda: tf.distribute.ReductionToOneDevice(),
}
_GPU_ONLY = ("nccl", "hierarchical_copy")

# Each of ours gets its own collective key range (see
# _compat.set_collective_key_base).
_KEY_RANGES = itertools.count(start=1_000, step=1_000)


class _KeyedMirroredStrategy(tf.distribute.MirroredStrategy):
    def __init__(self, devices, cross_device_ops):
        _compat.set_collective_key_base(self, next(_KEY_RANGES))
        super().__init__(devices=devices, cross_device_ops=cross_device_ops)


class Mirrored(TFDistributeStrategy):
    """Replicates the model on every local device and all-reduces gradients.

    With GPUs, all local GPUs are used (NCCL all-reduce by default); with no
    GPU, all visible CPU devices are, including logical CPUs configured with
    `tf.config.set_logical_device_configuration`.

    Args:
        devices: Device names to replicate on (default: all local devices).
        cross_device_ops: How gradients are reduced across devices:
            `"auto"` (TensorFlow's choice: NCCL on GPUs, reduction to one
            device on CPUs), `"nccl"`, `"hierarchical_copy"` (both GPU only)
            or `"reduction_to_one_device"`.
        optimizer_sharding: None (every device keeps the optimizer's
            slots for every variable), `"optimizer"` (ZeRO stage 1: each
            device keeps them for its part of every variable, 1/N of it, and
            updates that part) or `"gradients"` (stage 2: the reduced
            gradients are scattered too); see
            `keras_distrib.arithmetic.optimizer_sharding`.

    Example:

    ```python
    model = keras_distrib.DistributedModel(
        inputs, outputs, strategy=keras_distrib.strategies.get(
            "mirrored", devices=["/gpu:0", "/gpu:1"], cross_device_ops="nccl"))
    ```
    """

    name = "mirrored"
    aliases = ("mirror", "data_parallel")
    description = "Sync all-reduce over all local GPUs (or all visible CPUs)."

    def __init__(
        self,
        devices: Optional[Sequence[str]] = None,
        cross_device_ops: str = "auto",
        optimizer_sharding: Optional[str] = None,
    ):
        devices = (
            devices_lib.local_devices() if devices is None else devices_lib.check_devices(devices)
        )
        self.optimizer_sharding = sharding_option.check(self.name, optimizer_sharding)
        ops = _cross_device_ops(cross_device_ops, devices)
        super().__init__(_KeyedMirroredStrategy(devices=devices, cross_device_ops=ops))
        self.cross_device_ops = cross_device_ops

    @classmethod
    def around(cls, engine: tf.distribute.MirroredStrategy) -> "Mirrored":
        """The strategy on a `tf.distribute.MirroredStrategy` the user made
        (its devices and cross-device ops, see `strategies.from_tf`)."""
        _compat.rekey_collectives(engine, next(_KEY_RANGES))
        strategy = cls.__new__(cls)
        TFDistributeStrategy.__init__(strategy, engine)
        ops = type(_compat.cross_device_ops(engine)).__name__
        strategy.cross_device_ops = {
            "NcclAllReduce": "nccl",
            "HierarchicalCopyAllReduce": "hierarchical_copy",
            "ReductionToOneDevice": "reduction_to_one_device",
        }.get(ops, "auto")
        return strategy


def _cross_device_ops(name: str, devices: Sequence[str]):
    if name == "auto":
        return None
    if name not in _CROSS_DEVICE_OPS:
        raise ValueError(
            f"Unknown cross_device_ops={name!r}; use one of {['auto', *_CROSS_DEVICE_OPS]}."
        )
    if name in _GPU_ONLY and not all("GPU" in d.upper() for d in devices):
        raise ValueError(
            f"cross_device_ops={name!r} needs GPU devices but got {list(devices)}; "
            "use 'reduction_to_one_device' (or 'auto') on CPUs."
        )
    return _CROSS_DEVICE_OPS[name]()
