"""A transport whose collectives are a NumPy engine's, run in the step through `tf.numpy_function`.

Our engines (shared memory on one host, the TCP ring across hosts, the
hierarchical all-reduce of both) take and return NumPy arrays; here their
collectives become ops of the step. The ops are stateful: never pruned,
and kept in program order with any other stateful op of the same function
(TensorFlow's automatic control dependencies), so every worker runs the
same collectives in the same order, which each engine needs.

With `bytes_per_pack`, the step's gradients travel in packs of about that
many bytes, the last variables' first: the backward pass makes the last
layers' gradients first, and a pack's op runs as soon as its gradients
exist, while the backward pass goes on making the others, as TensorFlow's
own collectives do with their packs. Each pack is one collective, so small
packs pay the engine's per-call cost more often (see docs/performance.md).
The sums are elementwise, so packing changes no result on one host and
only the order of additions in a ring of more than two workers.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from keras_distrib.collectives.transport import Transport, reduce_op


def packs(sizes: Sequence[int], bytes_per_pack: int) -> list[list[int]]:
    """The indices of values of `sizes` bytes, grouped into packs of at
    least `bytes_per_pack` bytes (the last may be smaller), last index
    first: the order in which a backward pass makes them. One pack of all
    of them, in order, when `bytes_per_pack` is 0."""
    if not bytes_per_pack:
        return [list(range(len(sizes)))] if sizes else []
    grouped: list[list[int]] = []
    pack: list[int] = []
    filled = 0
    for i in reversed(range(len(sizes))):
        pack.append(i)
        filled += sizes[i]
        if filled >= bytes_per_pack:
            grouped.append(pack)
            pack, filled = [], 0
    if pack:
        grouped.append(pack)
    return grouped


def by_packs(
    values: Sequence[Any], bytes_per_pack: int, reduce: Callable[[list[Any]], Sequence[Any]]
) -> list[Any]:
    """`reduce` of each pack of `values` (`packs` of their bytes), its
    results put back in the values' order: one collective per pack."""
    sizes = [(v.shape.num_elements() or 0) * v.dtype.size for v in values]
    results: list[Any] = [None] * len(values)
    for pack in packs(sizes, bytes_per_pack):
        for i, result in zip(pack, reduce([values[i] for i in pack])):
            results[i] = result
    return results


class NumpyEngineTransport(Transport):
    """All-reduces, all-gathers and reduce-scatters through `engine`.

    Args:
        rows: the transport the predict step's rows travel by (the engines
            gather no rows of their own).
        engine: the engine: `all_reduce(*arrays)`, `mean_by_count(*arrays,
            count)`, `all_gather(array)`, `reduce_scatter(*tables)`, each
            returning arrays shaped as its inputs (the gather's and
            scatter's as documented there), and `close()`.
        world_size: the workers (one replica each).
        bytes_per_pack: the step's gradients in packs of about this many
            bytes, each reduced as soon as it exists (0: one collective).
    """

    _ops = "kd_engine"  # the prefix of its ops' names

    def __init__(self, rows: Transport, engine: Any, world_size: int, bytes_per_pack: int = 0):
        self._rows = rows
        self._engine = engine
        self._world_size = world_size
        self._bytes_per_pack = bytes_per_pack

    # -- in a replica's step ----------------------------------------------------------

    def all_reduce(self, values: Sequence[Any], op: str = "sum") -> list[Any]:
        reduce_op(op)  # validates op, as TensorFlow's path does
        values = [tf.convert_to_tensor(v) for v in values]
        reduced = _in_step(self._engine.all_reduce, values, f"{self._ops}_all_reduce")
        if op == "mean":
            return [total / tf.cast(self._world_size, total.dtype) for total in reduced]
        return reduced

    def mean_by_count(
        self, values: Sequence[Any], num_samples: Any, compression: Optional[Any] = None
    ) -> list[Any]:
        if compression is not None or any(v.dtype != tf.float32 for v in values):
            return super().mean_by_count(values, num_samples, compression)
        # The division by the global count rides in each pack's all-reduce
        # (the same float32 math as the default).
        count = tf.cast(num_samples, tf.float32)
        return by_packs(
            values,
            self._bytes_per_pack,
            lambda pack: _in_step(
                self._engine.mean_by_count, [*pack, count], f"{self._ops}_mean_by_count"
            ),
        )

    def all_gather(self, value: Any) -> Any:
        value = tf.convert_to_tensor(value)
        (table,) = tf.numpy_function(
            self._engine.all_gather,
            [value],
            [value.dtype],
            stateful=True,
            name=f"{self._ops}_all_gather",
        )
        table.set_shape([self._world_size, *value.shape])
        return table

    def reduce_scatter(self, tables: Sequence[Any]) -> list[Any]:
        tables = [tf.convert_to_tensor(t) for t in tables]
        rows = tf.numpy_function(
            self._engine.reduce_scatter,
            tables,
            [t.dtype for t in tables],
            stateful=True,
            name=f"{self._ops}_reduce_scatter",
        )
        for row, table in zip(rows, tables):
            row.set_shape([table.shape[1]])
        return list(rows)

    def gather_rows(self, per_replica: Any) -> Any:
        return self._rows.gather_rows(per_replica)

    # -- between steps ------------------------------------------------------------------

    def sum_over_processes(self, flat: np.ndarray) -> np.ndarray:
        # On the engine too: it notices a stopped or exited peer within
        # seconds.
        (total,) = self._engine.all_reduce(flat)
        summed: np.ndarray = total
        return summed

    def close(self) -> None:
        self._engine.close()


def _in_step(function: Callable[..., Any], values: list[Any], name: str) -> list[Any]:
    """`function(*values)` (an engine's collective) in the step, with each
    result shaped like its input."""
    reduced = tf.numpy_function(
        function, values, [v.dtype for v in values], stateful=True, name=name
    )
    for value, result in zip(values, reduced):
        result.set_shape(value.shape)
    return list(reduced)
