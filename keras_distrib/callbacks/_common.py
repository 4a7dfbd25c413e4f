"""Helpers shared by the callbacks: the model's strategy, numbers in logs."""

from __future__ import annotations

import numbers
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from keras_distrib.strategies.base import Strategy

# The `logs` Keras passes a callback's hooks: metric name -> value, or None.
Logs = Optional[dict[str, Any]]

_fallback: Optional[Strategy] = None


def strategy_of(callback: Any) -> Strategy:
    """The strategy `callback.model` trains on.

    A `DistributedModel` answers with `model.strategy`. A plain `keras.Model`
    that runs on one replica gets a single-process strategy, under which every
    cross-process step of the callbacks is a no-op. A plain model under a
    replicating `tf.distribute` strategy cannot be served (its replicas are
    not reachable through the `Strategy` interface): that is an error.
    """
    model = callback.model
    strategy = getattr(model, "strategy", None)
    if isinstance(strategy, Strategy):
        return strategy
    tf_strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
    if tf_strategy.num_replicas_in_sync > 1:
        raise ValueError(
            f"{type(callback).__name__} needs a keras_distrib.DistributedModel, got a "
            f"plain {type(model).__name__} under {type(tf_strategy).__name__} with "
            f"{tf_strategy.num_replicas_in_sync} replicas; wrap it with "
            "keras_distrib.DistributedModel.from_model(model, strategy=...)."
        )
    global _fallback
    if _fallback is None:
        from keras_distrib.strategies.single import SingleDevice

        _fallback = SingleDevice()
    return _fallback


def is_number(value: Any) -> bool:
    """Whether a log value is one real number (bools and strings are not)."""
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, numbers.Real):
        return True
    if isinstance(value, (np.ndarray, tf.Tensor)) or hasattr(value, "__array__"):
        try:
            array = np.asarray(value)
        except (TypeError, ValueError):
            return False
        return array.size == 1 and np.issubdtype(array.dtype, np.number)
    return False


class StepCounter:
    """Counts training steps across epochs from `on_train_batch_end` indices.

    With `steps_per_execution > 1` Keras reports every k-th batch index;
    the count still advances by the steps that ran.
    """

    def __init__(self) -> None:
        self.total = 0
        self._seen_in_epoch = 0

    def new_epoch(self) -> None:
        self._seen_in_epoch = 0

    def advance(self, batch: int) -> int:
        """Records `on_train_batch_end(batch)`; returns the steps it covered."""
        steps = max(batch + 1 - self._seen_in_epoch, 0)
        self._seen_in_epoch = batch + 1
        self.total += steps
        return steps
