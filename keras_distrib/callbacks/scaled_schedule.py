"""`ScaledSchedule`: a learning-rate schedule times a (warming-up) factor."""

from __future__ import annotations

from typing import Any

import keras
from keras import ops
from keras.optimizers.schedules import LearningRateSchedule


@keras.saving.register_keras_serializable(package="keras_distrib")
class ScaledSchedule(LearningRateSchedule):  # type: ignore[misc]  # Keras has no types
    """Multiplies a schedule by `multiplier`, reached linearly over a warmup.

    `rate(step) = schedule(step) * factor(step)` where, with `step` the
    optimizer's step (`optimizer.iterations`, counted from 0):

    * `warmup_steps == 0`: `factor = multiplier` (the linear scaling rule);
    * otherwise `factor = 1 + (multiplier - 1) * min(step / warmup_steps, 1)`:
      the gradual warmup of Goyal et al. (2017), from the schedule's own rate
      at step 0 to `multiplier` times it from `warmup_steps` on.

    `LearningRateWarmup` and `LearningRateScaling` install it in place of an
    optimizer's schedule. It is registered with Keras, so models saved with
    it load wherever `keras_distrib` is imported.

    Args:
        schedule: The wrapped `keras.optimizers.schedules.LearningRateSchedule`.
        multiplier: The factor reached at the end of the warmup.
        warmup_steps: Optimizer steps of linear warmup (0: none).

    Example:

    ```python
    base = keras.optimizers.schedules.ExponentialDecay(0.1, 1000, 0.9)
    optimizer = keras.optimizers.SGD(
        keras_distrib.callbacks.ScaledSchedule(base, multiplier=4, warmup_steps=500))
    ```
    """

    def __init__(self, schedule: LearningRateSchedule, multiplier: float, warmup_steps: int = 0):
        if not isinstance(schedule, LearningRateSchedule):
            raise TypeError(
                "ScaledSchedule wraps a keras.optimizers.schedules.LearningRateSchedule, "
                f"got {type(schedule).__name__}."
            )
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be >= 0.")
        self.schedule = schedule
        self.multiplier = float(multiplier)
        self.warmup_steps = int(warmup_steps)

    def factor(self, step: Any) -> Any:
        """The multiplier applied at optimizer step `step`."""
        if self.warmup_steps == 0:
            return ops.convert_to_tensor(self.multiplier, "float32")
        progress = ops.minimum(ops.cast(step, "float32") / float(self.warmup_steps), 1.0)
        return 1.0 + (self.multiplier - 1.0) * progress

    def __call__(self, step: Any) -> Any:
        rate = ops.convert_to_tensor(self.schedule(step))
        return rate * ops.cast(self.factor(step), rate.dtype)

    def get_config(self) -> dict[str, Any]:
        return {
            "schedule": keras.saving.serialize_keras_object(self.schedule),
            "multiplier": self.multiplier,
            "warmup_steps": self.warmup_steps,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ScaledSchedule":
        config = dict(config)
        config["schedule"] = keras.saving.deserialize_keras_object(config["schedule"])
        return cls(**config)


@keras.saving.register_keras_serializable(package="keras_distrib")
class ConstantRate(LearningRateSchedule):  # type: ignore[misc]  # Keras has no types
    """A learning rate that does not change: `rate(step) = rate`.

    `LearningRateWarmup` wraps a float rate in it (inside a `ScaledSchedule`)
    where the warmup must follow the optimizer's own step rather than the
    batches the callback sees, as under `"parameter_server"`, whose workers
    apply steps asynchronously.
    """

    def __init__(self, rate: float):
        self.rate = float(rate)

    def __call__(self, step: Any) -> Any:
        return ops.convert_to_tensor(self.rate, "float32")

    def get_config(self) -> dict[str, Any]:
        return {"rate": self.rate}
