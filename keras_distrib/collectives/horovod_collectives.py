"""Horovod's collectives (`horovod.tensorflow`) as a transport, one replica per process.

`horovod.tensorflow.keras` does not work with Keras 3 (docs/design.md 1.3,
row 2), but the low-level `horovod.tensorflow` ops do, and only those are
used: `grouped_allreduce` for the step's all-reduces (the gradients with
the sample count riding along), `allgather` for all-gathers and the
predict step's rows, `reducescatter`, an eager `allreduce` between steps,
and `broadcast` for the initial state. Horovod is optional: this module
never imports it; whoever made sure it loads (the `horovod` strategy)
hands its `horovod.tensorflow` in.

Horovod pairs the collectives of the ranks by name, and by default names a
traced one after its input tensor, whose name holds the Keras layer's
(`HorovodGroupedAllreduce_gradient_tape_functional_1_dense_1_...`). Keras
numbers layer and model names per process, so a rank that made one more
layer or model before (a chief-only summary model, a second model of a
sweep) named every collective differently, and all ranks waited for each
other for good, silently. Every collective traced here is named by its kind
and its position in the traced function instead (`_collective_name`), the
same on every rank whatever the Keras names; the broadcast of variables is
our own traced loop for the same reason (`horovod.tensorflow`'s
`broadcast_variables` names each broadcast after its variable).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf

from keras_distrib.collectives.transport import Transport, reduce_op

# Dtypes Horovod 0.28.1's TensorFlow allreduce kernels take (not bfloat16);
# others travel as a wider dtype and are cast back (see _wire_dtype).
_ALLREDUCE_DTYPES = {tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16, tf.float32, tf.float64}

# Traced graph -> the count of Horovod collectives named in it so far.
_NAMED: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


class HorovodCollectives(Transport):
    """The collectives of Horovod's ranks (Gloo, MPI, NCCL).

    Args:
        hvd: `horovod.tensorflow`, imported; this initializes it (`hvd.init()`).
    """

    name = "horovod"

    def __init__(self, hvd: Any):
        hvd.init()
        self._hvd = hvd

    # -- in the step --------------------------------------------------------------------

    def all_reduce(self, values: Any, op: str = "sum") -> Any:
        hvd = self._hvd
        flat = tf.nest.flatten(values)
        reduced = _grouped_all_reduce(
            hvd, flat, {"sum": hvd.Sum, "mean": hvd.Average}[reduce_op(op)]
        )
        return tf.nest.pack_sequence_as(values, reduced)

    def all_gather(self, value: Any) -> Any:
        return self._hvd.allgather(
            tf.convert_to_tensor(value)[None],
            name=_collective_name("allgather"),
            ignore_name_scope=True,
        )

    def reduce_scatter(self, tables: Sequence[Any]) -> list[Any]:
        # One reducescatter of the tables side by side: Horovod splits the
        # first dimension over the ranks, so rank r gets row r of each.
        tables = [tf.convert_to_tensor(t) for t in tables]
        block = self._hvd.reducescatter(
            tf.concat(tables, axis=1),
            op=self._hvd.Sum,
            name=_collective_name("reducescatter"),
            ignore_name_scope=True,
        )
        return list(tf.split(tf.reshape(block, [-1]), [int(t.shape[1]) for t in tables]))

    def gather_rows(self, per_replica: Any) -> Any:
        # Rank r holds rows [start_r, start_r + count_r) of every global batch
        # (keras_distrib.input.sharding), so rank order is the global batch order.
        def gather(value: Any) -> Any:
            value = tf.convert_to_tensor(value)
            if value.shape.rank == 0:
                value = tf.reshape(value, [1])
            return self._hvd.allgather(
                value, name=_collective_name("allgather"), ignore_name_scope=True
            )

        return tf.nest.map_structure(gather, per_replica)

    # -- between steps: eager ---------------------------------------------------------

    def sum_over_processes(self, flat: np.ndarray) -> np.ndarray:
        flat = np.asarray(flat)
        wire = flat.dtype
        if tf.as_dtype(wire) not in _ALLREDUCE_DTYPES:
            wire = np.dtype(np.float64 if np.issubdtype(wire, np.floating) else np.int64)
        summed = self._hvd.allreduce(tf.constant(flat.astype(wire)), op=self._hvd.Sum)
        return np.asarray(summed).astype(flat.dtype)

    def broadcast(self, variables: Sequence[Any], root: int = 0) -> list[Any]:
        # Horovod's broadcast traces a tf.function over the variables, which
        # needs TensorFlow variables (a Keras variable would be traced as a
        # tensor): the one under each Keras variable. Others (e.g. bool) are
        # left to the sums.
        native, others = [], []
        for v in variables:
            tf_var = v if isinstance(v, tf.Variable) else getattr(v, "value", None)
            if isinstance(tf_var, tf.Variable) and tf_var.dtype in _ALLREDUCE_DTYPES:
                native.append(tf_var)
            else:
                others.append(v)
        if native:
            _broadcast_in_place(self._hvd, native, root)
        return others


def _wire_dtype(dtype: tf.DType, kind: str) -> tf.DType:
    """The dtype `dtype` travels as: its own where Horovod takes it."""
    if kind == "mean" and not dtype.is_floating:
        return tf.float64
    if dtype in _ALLREDUCE_DTYPES:
        return dtype
    if dtype.is_floating:
        return tf.float32 if dtype == tf.bfloat16 else tf.float64
    return tf.int64  # bool (a sum is then a logical or), int16, uint16, ...


def _grouped_all_reduce(hvd: Any, tensors: Sequence[Any], op: Any) -> list[Any]:
    """`hvd.grouped_allreduce` over mixed dtypes, order kept.

    Horovod groups take one dtype: one group per (wire) dtype, in order of
    first appearance (the same on every rank). bfloat16 travels as float32;
    IndexedSlices are made dense (a sum of their gathered rows would need a
    different scaling downstream). Means travel as sums divided here:
    Horovod fuses only collectives of the same reduction, so a metric mean
    can share a cycle (and a buffer) with the gradient sum of the same step.
    """
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    kind = "mean" if op == hvd.Average else "sum"
    groups: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(_wire_dtype(t.dtype, kind), []).append(i)
    out: list[Any] = [None] * len(tensors)
    for wire, indices in groups.items():
        sent = [tf.cast(tensors[i], wire) for i in indices]
        summed = hvd.grouped_allreduce(
            sent, op=hvd.Sum, name=_collective_name("sum"), ignore_name_scope=True
        )
        for i, got in zip(indices, summed):
            if kind == "mean":
                got = got / tf.cast(hvd.size(), wire)
            out[i] = tf.cast(got, tensors[i].dtype)
    return out


def _collective_name(kind: str) -> Optional[str]:
    """The name of a Horovod collective traced now: `kind` and its position
    among those traced into the same graph (None when eager: Horovod pairs
    eager collectives in the order they run).

    Tracing runs the same code on every rank, so the n-th collective of a
    step gets the same name everywhere, unlike a name taken from a tensor
    (which carries Keras's per-process layer numbering).
    """
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    counter = _NAMED.setdefault(graph, itertools.count())
    return f"kd_{kind}_{next(counter)}"


def _broadcast_in_place(hvd: Any, variables: Sequence[tf.Variable], root: int) -> None:
    """Sets every variable to its value on rank `root`: one traced function,
    its broadcasts named by position (`_collective_name`)."""

    @tf.function(autograph=False)
    def broadcast() -> None:
        for variable in variables:
            variable.assign(
                hvd.broadcast(
                    variable, root, name=_collective_name("broadcast"), ignore_name_scope=True
                )
            )

    broadcast()
