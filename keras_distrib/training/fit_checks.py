"""Checks `DistributedModel` runs around `fit`, `evaluate` and `predict`.

Cheap checks that turn silent failures into one-line errors:

* `sparse_categorical_classes`: what the labels of a sparse categorical
  loss may be (the model checks numpy labels against it before training);
* `FiniteLossCheck`: stops `fit` when the training loss is NaN/Inf;
* `NonFiniteLossVote`: with several processes and Keras's
  `TerminateOnNaN`, every worker stops after the step where any saw a
  NaN/Inf loss;
* `check_same_call`: every worker makes the same call (fit, evaluate or
  predict) with the same batch size and amount of data; otherwise each
  would wait in a collective the others never join;
* `check_same_model` / `same_model_or_error`: every worker built the same
  variables (count, shapes, dtypes); otherwise the broadcast of worker 0's
  values fails deep in TensorFlow ("Shape mismatch in the collective") or
  waits for a variable the other workers never create;
* `check_same_compile`: every worker compiles the model alike (optimizer
  and its settings, loss, metrics); otherwise every worker trains with
  worker 0's optimizer state and the difference goes unnoticed;
* `ReplicasAgree`: at the start of `fit`, every replica holds the same
  weights (naming the first variable that differs).
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import re
import zlib
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib.strategies.base import Strategy


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
        if _compat.loss_function_arguments(loss).get("axis", -1) != -1:
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


class NonFiniteLossVote(keras.callbacks.Callback):
    """With several processes, stops `fit` on every worker after the step
    where any worker's loss was NaN/Inf.

    Keras's `TerminateOnNaN` reads the per-batch logs, which with several
    processes hold each worker's own loss: a NaN in one worker's shard stops
    that worker alone, and the others wait in the next step's all-reduce
    for it. This callback sums the workers' "my loss is not finite" flags
    after every batch (one 8-byte collective a step, only when the user
    passed `TerminateOnNaN` to a multi-process `fit`), so all stop together
    and `TerminateOnNaN` keeps its contract: training ends quietly.
    """

    def on_train_batch_end(self, batch, logs=None):
        mine = np.float64(non_finite_loss(logs) is not None)
        (total,) = self.model.strategy.sync_sum([mine])
        if total > 0:
            self.model.stop_training = True


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


def check_same_call(strategy: Strategy, call: str, x=None, **facts) -> None:
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
    row = (
        [float(_CALLS.index(call))]
        + [float(-1 if facts.get(name) is None else facts[name]) for name in _FACTS[:-2]]
        + [float(input_size(x)), float(facts.get("steps_per_execution") or 1)]
    )
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
    facts = ", ".join(f"{name}={int(value)}" for name, value in zip(_FACTS, row[1:]) if value != -1)
    return f"{call}({facts})"


# -- comparing a table of rows across workers ------------------------------------

# What fills a row or column a worker does not have in the tables compared.
_MISSING = -2.0


def _gathered_rows(strategy: Strategy, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every process's `rows` (a 2-D float array), padded with `_MISSING` to
    the most rows and columns any process has, and each process's number of
    rows: `([process, row, column], [process])`. Two small collectives."""
    head = strategy.sync_gather(np.array(rows.shape, np.float64))
    count, width = (int(n) for n in head.max(axis=0))
    padded = np.full((count, width), _MISSING)
    padded[: rows.shape[0], : rows.shape[1]] = rows
    return strategy.sync_gather(padded), head[:, 0].astype(int)


def _first_difference(table: np.ndarray) -> Optional[tuple[int, int]]:
    """`(worker, row)` of the first row in which a worker's table differs
    from worker 0's, or None when all agree."""
    for rank in range(1, len(table)):
        differs = np.flatnonzero(np.any(table[rank] != table[0], axis=-1))
        if differs.size:
            return rank, int(differs[0])
    return None


# -- every worker compiles alike ----------------------------------------------------

_NUMBER, _OTHER = 0.0, 1.0


# What `compile` is given that must agree across workers.
_COMPILE_ARGUMENTS = ("optimizer", "loss", "loss_weights", "metrics", "weighted_metrics")


def check_same_compile(strategy: Strategy, arguments: dict) -> None:
    """Raises `WorkersDisagreeError` on every worker unless all call
    `compile` with the same settings (optimizer, its learning rate or
    schedule and options, loss, metrics), naming the first that differs,
    with both values when they are numbers.

    Called by `compile` with its arguments before the optimizer is adopted:
    adopting makes its variables again under the strategy, with worker 0's
    values, so afterwards every worker would silently train with worker
    0's learning rate. Two small collectives. A setting is compared by a
    code (the number itself, or a checksum of anything else); objects'
    `name`s are left out (Keras numbers them by creation order, which may
    differ). Skipped when an argument cannot be serialized.
    """
    if strategy.world_size == 1:
        return
    try:
        settings = _flat_settings(
            {
                key: keras.saving.serialize_keras_object(arguments.get(key))
                for key in _COMPILE_ARGUMENTS
            }
        )
    except Exception:  # noqa: BLE001 - a custom object without get_config
        return
    rows = np.array(
        [[_checksum(path), *_value_code(value)] for path, value in settings], np.float64
    ).reshape(-1, 3)
    table, _ = _gathered_rows(strategy, rows)  # [process, setting, (path, kind, value)]
    found = _first_difference(table)
    if found is not None:
        rank, i = found
        name = settings[i][0] if i < len(settings) else "a setting"
        raise WorkersDisagreeError(
            f"worker {rank} compiled the model differently than worker 0: {name} is "
            f"{_describe_value(table[rank, i])} on worker {rank} but "
            f"{_describe_value(table[0, i])} on worker 0; every worker must compile "
            "the same way (same optimizer, learning rate, loss and metrics)."
        )


def _flat_settings(config, path="") -> list:
    """[(dotted path, leaf value)] of a serialized compile config, without
    the `config` level and objects' names, e.g.
    `("optimizer.learning_rate.initial_learning_rate", 0.01)`."""
    if isinstance(config, dict):
        found = []
        for key, value in config.items():
            if path and key in ("name", "registered_name"):
                continue  # an object's name, not a setting
            inner = path if key == "config" else (f"{path}.{key}" if path else key)
            found += _flat_settings(value, inner)
        return found
    if isinstance(config, (list, tuple)):
        return [
            item for i, value in enumerate(config) for item in _flat_settings(value, f"{path}[{i}]")
        ]
    return [(path, config)]


def _checksum(value) -> float:
    return float(zlib.crc32(json.dumps(value, sort_keys=True, default=repr).encode()))


def _value_code(value) -> tuple:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return _NUMBER, float(value)
    return _OTHER, _checksum(value)


def _describe_value(row) -> str:
    if row[1] == _MISSING:
        return "missing"
    return f"{row[2]:g}" if row[1] == _NUMBER else "another value"


# -- every worker builds the same model -----------------------------------------


def check_same_model(strategy: Strategy, variables) -> None:
    """Raises `WorkersDisagreeError` on every worker unless all hold variables
    of the same count, shapes and dtypes, in the same order (names may differ).

    Two small collectives (counts, then one row per variable), before the
    variables are broadcast: a script that builds another architecture on
    one rank (a flag read differently, a file only one host has) would
    otherwise fail inside the broadcast with TensorFlow's "Shape mismatch"
    or, with an extra variable on one side, wait for it until the
    collective timeout.
    """
    if strategy.world_size == 1:
        return
    variables = list(variables)
    ndim = max((len(v.shape) for v in variables), default=0)
    rows = np.full((len(variables), 2 + ndim), _MISSING)  # _MISSING: no such dimension
    for i, variable in enumerate(variables):
        shape = [(-1 if d is None else d) for d in variable.shape]
        rows[i, : 2 + len(shape)] = [_dtype_code(variable), len(shape), *shape]
    table, counts = _gathered_rows(strategy, rows)  # [process, variable, 2 + dimensions]
    found = _first_difference(table)
    if found is not None:
        rank, i = found
        here = f" ({variables[i].path!r} here)" if i < len(variables) else ""
        raise WorkersDisagreeError(
            f"worker {rank} built a different model than worker 0: variable "
            f"{i + 1}{here} is {_describe_variable(table[rank, i])} on worker "
            f"{rank} but {_describe_variable(table[0, i])} on worker 0 (worker "
            f"{rank} has {counts[rank]} variables, worker 0 {counts[0]}); every "
            "worker must build the same model (same code, arguments and input shapes)."
        )


@contextlib.contextmanager
def same_model_or_error(strategy: Strategy):
    """Turns TensorFlow's failed broadcast of a variable of another shape on
    another worker into `WorkersDisagreeError`, for variables created under
    a multi-worker strategy without `check_same_model` first (a subclassed
    model's first call, or `fit`'s build). A variable that exists on one
    worker only still waits until the collective timeout names the worker
    that did not arrive."""
    try:
        yield
    except (tf.errors.InvalidArgumentError, RuntimeError) as error:
        # RuntimeError: Keras's "Unable to automatically build the model"
        # around TensorFlow's error, when `fit` builds the model.
        found = re.search(
            r"Shape mismatch in the collective.*?expected shape (\S+) but "
            r"another member in the group expected shape (\S+?)\.",
            str(error),
        )
        if found is None:
            raise
        raise WorkersDisagreeError(
            f"workers built different models: worker {strategy.rank} made a variable of "
            f"shape {found.group(1)} where another worker's has shape {found.group(2)}; "
            "every worker must build the same model (same code, arguments and input "
            "shapes)."
        ) from None


_DTYPES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int32",
    "int64",
    "int8",
    "uint8",
    "int16",
    "bool",
    "string",
)


def _dtype_code(variable) -> float:
    name = keras.backend.standardize_dtype(variable.dtype)
    return float(_DTYPES.index(name) if name in _DTYPES else 100 + zlib.crc32(name.encode()))


def _describe_variable(row) -> str:
    if row[0] == _MISSING:
        return "missing"
    code, ndim = int(row[0]), int(row[1])
    dtype = _DTYPES[code] if code < len(_DTYPES) else "another dtype"
    shape = tuple(None if d == -1 else int(d) for d in row[2 : 2 + ndim])
    return f"{dtype} {shape}"


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
        mine = np.array(
            [[_checksums(copy) for copy in strategy.local_replica_values(v)] for v in variables],
            np.float64,
        )  # [variable, local replica, 2]
        gathered = strategy.sync_gather(mine)  # [process, variable, replica, 2]
        reference = gathered[0, :, 0]
        for rank, process in enumerate(gathered):
            for replica in range(process.shape[1]):
                same = (process[:, replica] == reference) | (
                    np.isnan(process[:, replica]) & np.isnan(reference)
                )
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
