"""What `LearningRateWarmup` and `LearningRateScaling` share: reading and
changing an optimizer's rate, and remembering which of them changed it."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import keras
import numpy as np

from keras_distrib import _compat
from keras_distrib.callbacks.scaled_schedule import ScaledSchedule

# optimizer -> (kind, the rate or schedule it had before we changed it).
_ADJUSTED: "weakref.WeakKeyDictionary[Any, tuple[str, Any]]" = weakref.WeakKeyDictionary()


def optimizer_of(callback: Any) -> Any:
    """The optimizer whose rate counts (the inner one of a LossScaleOptimizer)."""
    optimizer = getattr(callback.model, "optimizer", None)
    if optimizer is None:
        raise ValueError(f"{type(callback).__name__} needs a compiled model with an optimizer.")
    return getattr(optimizer, "inner_optimizer", None) or optimizer


def schedule_of(optimizer: Any) -> Optional[keras.optimizers.schedules.LearningRateSchedule]:
    rate = _compat.learning_rate_or_schedule(optimizer)
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        return rate
    if callable(rate) and not isinstance(rate, keras.Variable):
        raise TypeError(
            "The optimizer's learning_rate is a plain callable; use a float or a "
            "keras.optimizers.schedules.LearningRateSchedule."
        )
    return None


def read_rate(optimizer: Any) -> float:
    return float(np.asarray(optimizer.learning_rate))


CONFLICT = (
    "LearningRateWarmup already ends at the scaled rate (lr * multiplier); "
    "do not combine it with LearningRateScaling on the same optimizer."
)


def claim(optimizer: Any, kind: str, original: Any) -> tuple[Any, bool]:
    """Records that `kind` adjusts `optimizer`.

    Returns `(rate before any adjustment, whether this is the first claim)`.
    A later callback of the same kind on the same optimizer thus starts from
    the rate the optimizer had before any of them. Warmup and scaling on one
    optimizer would scale twice: an error.
    """
    if optimizer in _ADJUSTED:
        previous_kind, previous = _ADJUSTED[optimizer]
        if previous_kind != kind:
            raise ValueError(CONFLICT)
        return previous, False
    _ADJUSTED[optimizer] = (kind, original)
    return original, True


def install_schedule(model: Any, optimizer: Any, schedule: Any) -> None:
    """Makes `optimizer` use `schedule` from the next step on.

    The train function may already be traced with the old schedule inside
    (a second `fit`), so it is made again.
    """
    optimizer.learning_rate = schedule
    model.make_train_function(force=True)


def unwrap(schedule: Any) -> tuple[Any, Optional[ScaledSchedule]]:
    """(inner schedule, the ScaledSchedule around it or None)."""
    if isinstance(schedule, ScaledSchedule):
        return schedule.schedule, schedule
    return schedule, None
