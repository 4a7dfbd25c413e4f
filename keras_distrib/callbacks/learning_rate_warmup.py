"""`LearningRateWarmup`: gradual warmup to the scaled learning rate."""

from __future__ import annotations

from typing import Optional

import keras
import numpy as np

from keras_distrib.callbacks import _common
from keras_distrib.callbacks import _learning_rate as lr_lib
from keras_distrib.callbacks.scaled_schedule import ConstantRate, ScaledSchedule


class LearningRateWarmup(keras.callbacks.Callback):  # type: ignore[misc]  # Keras has no types
    """Raises the learning rate linearly, per batch, to `lr * multiplier`.

    The gradual warmup of Goyal et al. (2017), "Accurate, Large Minibatch
    SGD": training with N replicas (an N times larger global batch) wants an
    N times larger rate, but starting there diverges; so the rate goes
    linearly from the single-worker rate `lr0` at step 0 to
    `lr0 * target_multiplier` at step `warmup_epochs * steps_per_epoch`, and
    stays there:

        lr(step) = lr0 * (1 + (target_multiplier - 1) * min(step / warmup_steps, 1))

    * Float learning rate: `step = epoch * steps_per_epoch + batch`; the
      optimizer's rate is assigned before each batch of the warmup (the
      first `fit` call's rate is `lr0`; later `fit` calls, and other
      instances on the same optimizer, start from it too). After the warmup
      the rate is left alone, so e.g. `ReduceLROnPlateau` can take over.
    * `keras.optimizers.schedules.LearningRateSchedule`: nothing is
      assigned. The optimizer's schedule is replaced by
      `ScaledSchedule(schedule, target_multiplier, warmup_steps)`: the
      schedule's own rate times the warmup factor of the *optimizer step*
      (`optimizer.iterations`, from 0), so resumed training continues the
      warmup where it was. The wrapper is registered with Keras: saved
      models keep it. Under an asynchronous strategy (`"parameter_server"`)
      a float rate is treated this way too, as a `ConstantRate` schedule:
      each worker's step then warms up by the true global step.

    Warmup already ends at the scaled rate: do not add `LearningRateScaling`
    too (that is an error); use `LearningRateScaling` alone for scaling
    without warmup.

    Every batch's logs get `"lr"`, the rate that batch trained with;
    `lr_history` holds `(step, lr)` for each step of the warmup.

    Args:
        warmup_epochs: Length of the warmup in epochs (may be fractional).
        steps_per_epoch: Batches per epoch; default `self.params["steps"]`
            (known unless the input has unknown length).
        target_multiplier: Factor reached at the end of the warmup; default
            the strategy's `num_replicas`.
        verbose: 1 prints (on the chief) when the warmup ends.

    Example:

    ```python
    model = keras_distrib.DistributedModel(inputs, outputs, strategy="multi_worker")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=256, epochs=30,
              callbacks=[keras_distrib.callbacks.LearningRateWarmup(warmup_epochs=5)])
    ```
    """

    def __init__(
        self,
        warmup_epochs: float,
        steps_per_epoch: Optional[int] = None,
        target_multiplier: Optional[float] = None,
        verbose: int = 0,
    ):
        super().__init__()
        if not warmup_epochs or warmup_epochs <= 0:
            raise ValueError(
                f"warmup_epochs={warmup_epochs!r} must be > 0; for scaling without "
                "warmup use LearningRateScaling."
            )
        if steps_per_epoch is not None and steps_per_epoch <= 0:
            raise ValueError(f"steps_per_epoch={steps_per_epoch!r} must be > 0.")
        if target_multiplier is not None and target_multiplier <= 0:
            raise ValueError(f"target_multiplier={target_multiplier!r} must be > 0.")
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.target_multiplier = target_multiplier
        self.verbose = verbose
        self.lr_history: list[tuple[int, float]] = []
        self._epoch = 0
        self._lr: Optional[float] = None

    def on_train_begin(self, logs: _common.Logs = None) -> None:
        strategy = _common.strategy_of(self)
        self._is_chief = strategy.is_chief
        self._optimizer = lr_lib.optimizer_of(self)
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise ValueError(
                "LearningRateWarmup does not know the number of steps per epoch "
                "(the input has unknown length); pass steps_per_epoch=."
            )
        self._steps_per_epoch = int(steps)
        self.warmup_steps = max(1, int(round(self.warmup_epochs * self._steps_per_epoch)))
        self.multiplier = float(self.target_multiplier or strategy.num_replicas)

        schedule = lr_lib.schedule_of(self._optimizer)
        if schedule is None and strategy.capabilities.asynchronous:
            # Workers apply steps on their own: the warmup must follow the
            # optimizer's step inside each step, not the batches seen here.
            schedule = ConstantRate(lr_lib.read_rate(self._optimizer))
        if schedule is None:
            self._schedule: Optional[ScaledSchedule] = None
            self.initial_lr, _ = lr_lib.claim(
                self._optimizer, "warmup", lr_lib.read_rate(self._optimizer)
            )
            return
        inner, wrapper = lr_lib.unwrap(schedule)
        if wrapper is not None and wrapper.warmup_steps == 0:
            raise ValueError(lr_lib.CONFLICT)
        lr_lib.claim(self._optimizer, "warmup", inner)
        if (
            wrapper is not None
            and wrapper.multiplier == self.multiplier
            and wrapper.warmup_steps == self.warmup_steps
        ):
            self._schedule = wrapper  # installed before (or loaded with the model)
        else:
            self._schedule = ScaledSchedule(inner, self.multiplier, self.warmup_steps)
            lr_lib.install_schedule(self.model, self._optimizer, self._schedule)

    def on_epoch_begin(self, epoch: int, logs: _common.Logs = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: _common.Logs = None) -> None:
        if self._schedule is not None:
            step = int(np.asarray(self._optimizer.iterations))
            self._lr = float(np.asarray(self._schedule(step)))
        else:
            step = self._epoch * self._steps_per_epoch + batch
            if step > self.warmup_steps:
                self._lr = None
                return
            self._lr = self.initial_lr * self._factor(step)
            self._optimizer.learning_rate = self._lr
        if step <= self.warmup_steps:
            self.lr_history.append((step, self._lr))
        if step == self.warmup_steps and self.verbose and self._is_chief:
            print(
                f"\nEpoch {self._epoch + 1}: finished gradual learning rate warmup "
                f"to {self._lr:.6g}."
            )

    def on_train_batch_end(self, batch: int, logs: _common.Logs = None) -> None:
        if logs is not None:
            lr = self._lr if self._lr is not None else lr_lib.read_rate(self._optimizer)
            logs["lr"] = lr

    def _factor(self, step: int) -> float:
        return 1.0 + (self.multiplier - 1.0) * min(step / self.warmup_steps, 1.0)
