"""Checks `DistributedModel` runs around `fit`, `evaluate` and `predict`.

Cheap checks that turn silent failures into one-line errors:

* `sparse_categorical_classes`: what the labels of a sparse categorical
  loss may be (the model checks numpy labels against it before training);
* `FiniteLossCheck`: stops `fit` when the training loss is NaN/Inf;
* `check_same_call`: every worker makes the same call (fit, evaluate or
  predict) with the same batch size and amount of data; otherwise each
  would wait in a collective the others never join;
* `ReplicasAgree`: at the start of `fit`, every replica holds the same
  weights (naming the first variable that differs).
"""

from __future__ import annotations

import math

import keras
import numpy as np


def sparse_categorical_classes(model):
    """`(num_classes, ignore_class)` when `model` is compiled with one sparse
    categorical crossentropy loss over a single output whose last dimension
    (the classes) is known; else None."""
    loss = getattr(model, "loss", None)
    if isinstance(loss, (list, tuple)) and len(loss) == 1:
        loss = loss[0]
    elif isinstance(loss, dict) and len(loss) == 1:
        loss = next(iter(loss.values()))
    if isinstance(loss, str):
        try:
            loss = keras.losses.get(loss)
        except ValueError:
            return None
    ignore_class = None
    if isinstance(loss, keras.losses.SparseCategoricalCrossentropy):
        if getattr(loss, "_fn_kwargs", {}).get("axis", -1) != -1:
            return None
        ignore_class = loss.ignore_class
    elif loss is not keras.losses.sparse_categorical_crossentropy:
        return None
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        return None
    if not isinstance(outputs, (list, tuple)) or len(outputs) != 1:
        return None
    shape = getattr(outputs[0], "shape", None)
    classes = shape[-1] if shape else None
    if not isinstance(classes, int) or classes < 1:
        return None
    return classes, ignore_class


class FiniteLossCheck(keras.callbacks.Callback):
    """Stops `fit` with a one-line `ValueError` when the training loss is NaN/Inf.

    Reads the logs Keras already made (no extra device sync or collective).
    With `per_batch`, every batch's logs (exact global values with one
    process; the step is named); otherwise each epoch's logs, which are
    global on every strategy, so every worker stops at the same point.
    `DistributedModel.fit` puts it first, before checkpointing callbacks.
    """

    # It neither reads nor changes the model: Keras may run it off the loop.
    async_safe = True

    def __init__(self, per_batch: bool):
        super().__init__()
        self._epoch = 0
        if per_batch:
            self.on_train_batch_end = self._check_batch

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def _check_batch(self, batch, logs=None):
        loss = non_finite_loss(logs)
        if loss is not None:
            _raise_non_finite(loss, f"at epoch {self._epoch + 1}, step {batch + 1}")

    def on_epoch_end(self, epoch, logs=None):
        loss = non_finite_loss(logs)
        if loss is not None:
            _raise_non_finite(loss, f"in epoch {epoch + 1}")


def non_finite_loss(logs):
    try:
        value = float(np.asarray((logs or {}).get("loss")))
    except (TypeError, ValueError):
        return None
    return None if math.isfinite(value) else value


def _raise_non_finite(loss, where):
    raise ValueError(
        f"The training loss is {loss} {where}: NaN/Inf in the data, or a diverging "
        "step (lower the learning rate?); fix the cause, or set "
        "model.check_finite = False to train on."
    )


# -- every worker makes the same call ------------------------------------------

_CALLS = ("fit", "evaluate", "predict")
# The facts compared, in order; -1 where one does not apply.
_FACTS = ("batch_size", "epochs", "initial_epoch", "steps", "samples", "steps_per_execution")


class WorkersDisagreeError(RuntimeError):
    """Workers made different calls, or the same call with different input."""


def check_same_call(strategy, call: str, x=None, **facts) -> None:
    """Raises `WorkersDisagreeError` on every worker unless all make this call alike.

    Under a multi-process strategy every worker must call `fit`, `evaluate`
    and `predict` in the same order with the same batch size and the same
    amount of data: otherwise one waits in a collective the others never
    join (a hang), or they exchange tensors of different steps. One small
    collective per call (not per step) compares what each worker is about
    to do, and all workers raise the same one-line error naming the first
    worker that differs from worker 0 and what differs.

    Args:
        strategy: The model's strategy (nothing is checked with one process).
        call: `"fit"`, `"evaluate"` or `"predict"`.
        x: The input, for its number of samples (or batches).
        **facts: Integers (or None) among `_FACTS` other than `samples`.
    """
    if strategy.world_size == 1:
        return
    row = [float(_CALLS.index(call))] + [
        float(-1 if facts.get(name) is None else facts[name]) for name in _FACTS[:-2]
    ] + [float(input_size(x)), float(facts.get("steps_per_execution") or 1)]
    table = strategy.sync_gather(np.array(row, np.float64))
    for rank in range(1, len(table)):
        if not np.array_equal(table[rank], table[0], equal_nan=True):
            raise WorkersDisagreeError(
                f"worker {rank} called {_describe(table[rank])} while worker 0 called "
                f"{_describe(table[0])}; every worker must make the same calls with "
                "the same batch size and data (e.g. no evaluate/fit on the chief only)."
            )


def input_size(x) -> int:
    """Samples of array input, batches of a PyDataset/dataset (-1: unknown/none)."""
    if x is None:
        return -1
    if isinstance(x, keras.utils.PyDataset):
        return len(x)
    cardinality = getattr(x, "cardinality", None)
    if callable(cardinality):  # tf.data.Dataset: -1 infinite, -2 unknown
        return int(cardinality())
    leaves = [leaf for leaf in keras.tree.flatten(x) if hasattr(leaf, "shape")]
    if leaves and len(leaves[0].shape):
        return int(leaves[0].shape[0])
    return -1


def _describe(row) -> str:
    call = _CALLS[int(row[0])]
    facts = ", ".join(
        f"{name}={int(value)}" for name, value in zip(_FACTS, row[1:]) if value != -1
    )
    return f"{call}({facts})"


# -- every replica starts fit from the same weights -----------------------------


class ReplicasDisagreeError(RuntimeError):
    """Replicas hold different weights when `fit` starts."""


class ReplicasAgree(keras.callbacks.Callback):
    """At the start of `fit`, checks that every replica holds the same weights.

    Worker 0's values are broadcast when variables are created, but a
    script can still change one worker's weights afterwards (loading a file
    only the chief has, `set_weights` from a local computation); replicas
    would then train apart for the whole run with identical-looking global
    logs. Each replica's per-variable checksums (float64 sum and sum of
    squares) travel in one collective; every worker compares them with
    global replica 0's and all raise the same one-line error naming the
    first variable that differs. `DistributedModel.fit` runs it after the
    user's callbacks' `on_train_begin` (where `BroadcastInitialWeights` and
    `BackupAndRestore` set the weights), with more than one process.
    """

    def on_train_begin(self, logs=None):
        strategy = self.model.strategy
        variables = self.model.weights
        if not variables:
            return
        mine = np.array([
            [_checksums(copy) for copy in strategy.local_replica_values(v)]
            for v in variables
        ], np.float64)  # [variable, local replica, 2]
        gathered = strategy.sync_gather(mine)  # [process, variable, replica, 2]
        reference = gathered[0, :, 0]
        for rank, process in enumerate(gathered):
            for replica in range(process.shape[1]):
                same = (process[:, replica] == reference) | (
                    np.isnan(process[:, replica]) & np.isnan(reference))
                differs = np.flatnonzero(~np.all(same, axis=-1))
                if differs.size:
                    i = int(differs[0])
                    raise ReplicasDisagreeError(
                        f"replicas disagree at the start of fit: {variables[i].path!r} "
                        f"on worker {rank} (local replica {replica}) differs from worker 0 "
                        f"(checksum {process[i, replica, 0]:.9g} vs {reference[i, 0]:.9g}); "
                        "set the weights on every worker alike, or add "
                        "keras_distrib.callbacks.BroadcastInitialWeights() to the callbacks."
                    )


def _checksums(value) -> tuple:
    values = np.asarray(value, np.float64)
    return float(values.sum()), float(np.square(values).sum())
