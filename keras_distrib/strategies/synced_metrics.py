"""Metric variables synced on read, read and reset in one go.

Keras's metric variables are created `synchronization="on_read"`; under a
tf.distribute engine each replica keeps its own part, and a read outside
the step reduces the parts. TensorFlow does that one variable at a time,
eagerly: one all-reduce per variable (and, under
`MultiWorkerMirroredStrategy`, a thread pool per call), and an `assign` to
such a variable reads its value back, which is one more all-reduce. Keras
reads and resets every metric at each epoch's end and start and around
`evaluate`, so a model compiled with five metrics paid dozens of
collectives per epoch.

Here the reads are one batched reduction per aggregation kind
(`extended.batch_reduce_to`) whose results Keras reads through a
`keras.StatelessScope`, and a reset is Keras's own, its assignments
gathered in a `StatelessScope` and applied without the read-back. Values
are those TensorFlow's own read gives (the same reduction of the same
parts).
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

_REDUCE_OPS = {
    tf.VariableAggregation.SUM: tf.distribute.ReduceOp.SUM,
    tf.VariableAggregation.MEAN: tf.distribute.ReduceOp.MEAN,
}


def _metric_variables(model: Any) -> list:
    return [v for metric in model.metrics for v in metric.variables]


def _synced_on_read(variable: Any) -> Any:
    """The engine's variable behind Keras's `variable` when it is synced on
    read, else None."""
    held = getattr(variable, "value", None)
    if not isinstance(held, tf.distribute.DistributedValues):
        return None
    if getattr(held, "synchronization", None) != tf.VariableSynchronization.ON_READ:
        return None
    return held


def reduced_values(engine: tf.distribute.Strategy, model: Any) -> list[tuple[Any, Any]]:
    """`(variable, value)` for each of `model`'s metric variables synced on
    read with a summing or averaging aggregation: its value across all
    replicas, from one batched reduction per aggregation (eager, outside
    the step). Others are left out (Keras reads them as they are)."""
    by_op: dict[Any, list] = {}
    for variable in _metric_variables(model):
        held = _synced_on_read(variable)
        op = _REDUCE_OPS.get(getattr(held, "aggregation", None)) if held is not None else None
        if op is not None:
            by_op.setdefault(op, []).append((variable, held))
    values = []
    for op, pairs in by_op.items():
        with engine.scope():
            reduced = engine.extended.batch_reduce_to(op, [(held, held) for _, held in pairs])
        values += [
            (variable, engine.experimental_local_results(value)[0])
            for (variable, _), value in zip(pairs, reduced)
        ]
    return values


def read(engine: tf.distribute.Strategy, model: Any, read_results: Callable[[], Any]) -> Any:
    """`read_results()` (Keras's `get_metrics_result`) reading `model`'s
    metric variables from one batched reduction (`reduced_values`)."""
    with keras.StatelessScope(state_mapping=reduced_values(engine, model)):
        return read_results()


def reset(model: Any, reset_metrics: Callable[[], None]) -> None:
    """`reset_metrics()` (Keras's) with its assignments to `model`'s metric
    variables applied without reading the variables back. When it assigned
    anything else (a metric resetting a variable it does not own), it runs
    again as it is, so nothing is lost."""
    with keras.StatelessScope() as scope:
        reset_metrics()
    variables = {id(v): v for v in _metric_variables(model)}
    if not set(scope.state_mapping) <= set(variables):
        reset_metrics()
        return
    for key, value in scope.state_mapping.items():
        variable = variables[key]
        held = _synced_on_read(variable)
        if held is None:
            variable.assign(value)
        else:
            held.assign(tf.cast(value, held.dtype), read_value=False)
