"""`LearningRateScaling`: the linear scaling rule, applied once."""

from __future__ import annotations

from typing import Optional

import keras

from keras_distrib.callbacks import _common
from keras_distrib.callbacks import _learning_rate as lr_lib
from keras_distrib.callbacks.scaled_schedule import ScaledSchedule


class LearningRateScaling(keras.callbacks.Callback):  # type: ignore[misc]  # Keras has no types
    """Multiplies the learning rate by the number of replicas, once.

    The linear scaling rule (Goyal et al. 2017): with N replicas the global
    batch is N times larger, so the rate is N times larger. Applied at the
    start of the first `fit` only: a second `fit`, or a second instance on
    the same optimizer, does not scale again.

    * Float learning rate: the rate variable is multiplied in place.
    * `keras.optimizers.schedules.LearningRateSchedule`: the schedule is
      replaced by `ScaledSchedule(schedule, multiplier)` (registered with
      Keras, so saved models keep it and reloaded ones are not rescaled).
      A reloaded model with a float rate has its scaled rate saved in it:
      do not scale it again.

    Use it alone for scaling without warmup. `LearningRateWarmup` already
    ends at the scaled rate; combining both on one optimizer is an error.

    Args:
        multiplier: The factor; default the strategy's `num_replicas`.

    Example:

    ```python
    model = keras_distrib.DistributedModel(inputs, outputs, strategy="mirrored")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    model.fit(x, y, batch_size=256,
              callbacks=[keras_distrib.callbacks.LearningRateScaling()])
    ```
    """

    def __init__(self, multiplier: Optional[float] = None):
        super().__init__()
        if multiplier is not None and multiplier <= 0:
            raise ValueError(f"multiplier={multiplier!r} must be > 0.")
        self.multiplier = multiplier
        # The factor this callback applied (None: it found the rate scaled).
        self.applied_multiplier: Optional[float] = None
        self._done = False

    def on_train_begin(self, logs: _common.Logs = None) -> None:
        if self._done:
            return
        self._done = True
        multiplier = float(self.multiplier or _common.strategy_of(self).num_replicas)
        optimizer = lr_lib.optimizer_of(self)
        schedule = lr_lib.schedule_of(optimizer)
        if schedule is None:
            rate = lr_lib.read_rate(optimizer)
            _, first = lr_lib.claim(optimizer, "scaling", rate)
            if first:
                optimizer.learning_rate = rate * multiplier
                self.applied_multiplier = multiplier
            return
        if isinstance(schedule, ScaledSchedule):
            if schedule.warmup_steps:
                raise ValueError(lr_lib.CONFLICT)
            return  # scaled before, or saved scaled and reloaded
        _, first = lr_lib.claim(optimizer, "scaling", schedule)
        if first:
            lr_lib.install_schedule(self.model, optimizer, ScaledSchedule(schedule, multiplier))
            self.applied_multiplier = multiplier
