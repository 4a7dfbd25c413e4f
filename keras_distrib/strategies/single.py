"""`"single"`: one device, no replication."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from keras_distrib import devices as devices_lib
from keras_distrib.strategies.base import Strategy


class SingleDevice(Strategy):
    """Trains on one device with no replication and no collectives.

    The step runs exactly as plain `keras.Model.fit` runs it, so this
    strategy costs next to nothing over plain Keras.

    Args:
        device: Optional device name (e.g. `"/gpu:1"`) to place variables
            and computation on. `None` lets TensorFlow choose.

    Example:

    ```python
    model = keras_distrib.DistributedModel(inputs, outputs, strategy="single")
    ```
    """

    name = "single"
    description = "One device, no replication (plain Keras speed)."
    replicates = False

    def __init__(self, device: Optional[str] = None):
        self._device = devices_lib.check_device(device)
        super().__init__(tf.distribute.get_strategy())

    @property
    def devices(self) -> Sequence[str]:
        return (self._device or devices_lib.local_devices()[0],)

    @contextlib.contextmanager
    def scope(self):
        if self._device is None:
            yield
        else:
            with tf.device(self._device):
                yield

    def holds(self, variable: Any) -> bool:
        return devices_lib.holds_plain(variable, self._device)

    def run(self, replica_fn: Callable, batch: Any):
        with self.scope():
            return replica_fn(batch)

    def all_reduce(self, values: Any, op: str = "sum") -> Any:
        return values

    def reduce_mean(self, per_replica: Any) -> Any:
        return per_replica

    def concat(self, per_replica: Any) -> Any:
        return per_replica

    def local_replica_values(self, variable: Any) -> list:
        import numpy as np

        return [np.asarray(variable)]
