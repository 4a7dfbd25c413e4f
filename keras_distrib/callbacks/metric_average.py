"""`MetricAverage`: logs averaged over processes, the same on every rank."""

from __future__ import annotations

import keras
import numpy as np

from keras_distrib.callbacks import _common


class MetricAverage(keras.callbacks.Callback):  # type: ignore[misc]  # Keras has no types
    """Replaces every number in the logs by its mean over the processes.

    At the end of each epoch (and of each training batch with
    `per_batch=True`), all numeric entries of `logs`, in sorted key order,
    travel in one collective; the means replace them in the same `logs`
    dict, so the callbacks after this one (checkpointing, early stopping,
    `History`, the progress bar) see the averages. **Put it first in the
    callback list.** Non-numeric entries are left alone.

    It is a collective: every process must run it, with the same log keys.
    `DistributedModel` already reports the model's compiled metrics over the
    global batch; this is for values that differ per process (from custom
    callbacks, or engines that report per-process metrics).

    Args:
        per_batch: Also average the logs of every training batch (one
            collective per batch).

    Example:

    ```python
    model.fit(x, y, callbacks=[
        keras_distrib.callbacks.MetricAverage(),   # first
        keras.callbacks.EarlyStopping("val_loss"),
    ])
    ```
    """

    def __init__(self, per_batch: bool = False):
        super().__init__()
        if not isinstance(per_batch, (bool, np.bool_)):
            raise TypeError(f"per_batch={per_batch!r} must be True or False.")
        self.per_batch = bool(per_batch)
        if per_batch:
            # Defined only when asked: without a batch-end hook Keras may run
            # the other callbacks' batch ends asynchronously.
            self.on_train_batch_end = self._average_batch

    def on_train_begin(self, logs: _common.Logs = None) -> None:
        self._strategy = _common.strategy_of(self)

    def on_epoch_end(self, epoch: int, logs: _common.Logs = None) -> None:
        self.average(logs)

    def _average_batch(self, batch: int, logs: _common.Logs = None) -> None:
        self.average(logs)

    def average(self, logs: _common.Logs) -> None:
        """Averages the numbers in `logs` over processes, in place."""
        strategy = getattr(self, "_strategy", None) or _common.strategy_of(self)
        if logs is None or strategy.world_size == 1:
            return
        keys = sorted(k for k, v in logs.items() if _common.is_number(v))
        if not keys:
            return
        values = np.array([float(np.asarray(logs[k])) for k in keys], np.float64)
        (sums,) = strategy.sync_sum([values])
        for key, total in zip(keys, sums):
            logs[key] = float(total) / strategy.world_size
