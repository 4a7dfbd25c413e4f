"""The transport: the collectives a strategy's replicas and processes run together.

A strategy composes one `Transport` (`Strategy.transport`) and runs every
collective on it; it never asks which one it holds. The interface is what
the strategies call:

* in a replica's step (its replica context, traced or eager): `all_reduce`,
  `mean_by_count` (the step's gradient all-reduce, each replica's sample
  count riding along), `all_gather`, `reduce_scatter`, and `gather_rows`
  (every replica's rows of the predict step's outputs, in order);
* outside the replicas' step: `all_reduce_across_processes` (each process
  contributing once, from a step that spans its devices itself: hybrid
  parallelism), and, eager between steps, `sum_over_processes` (which the
  strategies' cross-process helpers build on) and `broadcast`;
* `close`, which releases what the transport holds of its own
  (connections, shared memory): a strategy closes the engines it tried
  and did not keep;
* `explain`, one line on a failure its engine's error does not name.

No strategy waits in a barrier of its own: an eager sum serves where the
processes must meet.

The transports, each in its own module, are named in
`keras_distrib.collectives.registry`, which builds them by name.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Optional, Sequence

import numpy as np
import tensorflow as tf

REDUCE_OPS = ("mean", "sum")


def reduce_op(op: str) -> str:
    """Validates the reduce op an `all_reduce` takes (`"sum"` or `"mean"`)."""
    if op not in REDUCE_OPS:
        raise ValueError(f"Unknown reduce op {op!r}; use one of {list(REDUCE_OPS)}.")
    return op


def gather_by_sum(transport: "Transport", value: Any, index: Any, count: int) -> Any:
    """An all-gather built on `transport`'s all-reduce: each of the `count`
    replicas puts its `value` at its own row (`index`) of zeros, and the
    sum is every replica's value stacked in replica order."""
    value = tf.convert_to_tensor(value)
    padding = [[index, count - 1 - index]] + [[0, 0]] * value.shape.rank
    (table,) = transport.all_reduce([tf.pad(value[None], padding)], "sum")
    return table


def scatter_by_sum(transport: "Transport", tables: Sequence[Any], index: Any) -> list[Any]:
    """A reduce-scatter built on `transport`'s all-reduce: the whole tables
    summed, and of each the row `index` (this replica's)."""
    return [tf.gather(t, index) for t in transport.all_reduce(list(tables), "sum")]


class Transport(abc.ABC):
    """The collectives between a strategy's replicas and processes.

    A subclass implements the abstract methods on its engine; the others
    have defaults built on them, which it overrides where its engine does
    better. `name` is the name it is registered under
    (`keras_distrib.collectives.registry`).
    """

    name: ClassVar[str] = ""

    # -- in a replica's step --------------------------------------------------------

    @abc.abstractmethod
    def all_reduce(self, values: Sequence[Any], op: str = "sum") -> list[Any]:
        """Each of `values` summed (`op="sum"`) or averaged (`"mean"`) over
        all replicas, in order."""

    def mean_by_count(
        self, values: Sequence[Any], num_samples: Any, compression: Optional[Any] = None
    ) -> list[Any]:
        """Each of `values` summed over all replicas and divided by the sum
        of every replica's `num_samples` (at least 1): the step's gradient
        all-reduce. The count travels in the same all-reduce as the values,
        so no process needs to know the global batch. `compression` (a
        `keras_distrib.optimizers.Compression`) casts the values for the
        wire, and back before the division."""
        total = tf.cast(num_samples, tf.float32)
        dtypes = [v.dtype for v in values]
        if compression is not None:
            values = [compression.compress(v) for v in values]
        *summed, total = self.all_reduce([*values, total], "sum")
        if compression is not None:
            summed = [compression.decompress(v, d) for v, d in zip(summed, dtypes)]
        scale = 1.0 / tf.maximum(total, 1.0)
        return [v * tf.cast(scale, v.dtype) for v in summed]

    @abc.abstractmethod
    def all_gather(self, value: Any) -> Any:
        """Every replica's `value` (one shape on all), stacked in replica
        order: `[replicas, *value.shape]`."""

    @abc.abstractmethod
    def reduce_scatter(self, tables: Sequence[Any]) -> list[Any]:
        """Of each of `tables` (`[replicas, k]`, shapes the same on all),
        the row of this replica's index of its sum over the replicas."""

    @abc.abstractmethod
    def gather_rows(self, per_replica: Any) -> Any:
        """Every replica's rows of each tensor in `per_replica` (what this
        process's replicas returned), concatenated in replica order (= the
        global batch's order, see `keras_distrib.input.sharding`), on every
        process."""

    # -- outside the replicas' step ---------------------------------------------------

    def all_reduce_across_processes(self, values: Sequence[Any], op: str = "sum") -> list[Any]:
        """`all_reduce` with each process contributing `values` once, called
        outside the replicas' step (eager, or in a `tf.function` of the
        process's own). By default `all_reduce`: the same where each
        process runs one replica."""
        return self.all_reduce(values, op)

    @abc.abstractmethod
    def sum_over_processes(self, flat: np.ndarray) -> np.ndarray:
        """The elementwise sum over processes of one 1-D array per process
        (eager)."""

    def close(self) -> None:
        """Releases what the transport holds of its own (connections,
        shared memory); by default nothing."""
        return None

    def explain(self, error: BaseException) -> Optional[str]:
        """One line on what ended a collective of this transport, when
        `error` is such an ending and the engine's own error does not say
        (None by default: it does, or `error` is none of its own)."""
        return None

    def broadcast(self, variables: Sequence[Any], root: int = 0) -> list[Any]:
        """Gives every process `root`'s values of those of `variables` this
        transport broadcasts itself (eager), and returns the others, which
        the strategy sends as sums (`broadcast_variables`). By default it
        broadcasts none."""
        return list(variables)
