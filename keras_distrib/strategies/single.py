"""`"single"`: one device, no replication."""

from __future__ import annotations

from typing import Optional

from keras_distrib import devices as devices_lib
from keras_distrib.strategies.per_process import PerProcessStrategy


class SingleDevice(PerProcessStrategy):
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
    aliases = ("one_device", "default")
    description = "One device, no replication (plain Keras speed)."

    def __init__(self, device: Optional[str] = None):
        super().__init__(devices_lib.check_device(device))
