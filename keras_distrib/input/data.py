"""Global and per-replica batch arithmetic.

`batch_size` always means the global batch: the number of samples that one
optimizer step consumes, across all replicas.

The split rule (docs/training.md; tested in tests/integration/test_data.py): a
batch of B samples over N replicas gives replica r the contiguous rows
`[start_r, start_r + n_r)` with n_r = B // N + (1 if r < B % N else 0). No
sample is dropped; a replica may get zero rows when B < N. The gradient is
exact whatever the split (see `DistributedModel.reduce_gradients`).

The last section holds the checks `fit` makes of its input before training
(empty input, labels out of range, NaN/Inf): each reads only numpy arrays
or facts TensorFlow knows without reading a dataset, and fails in one line.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

import numpy as np
import tensorflow as tf


def is_positive_int(value) -> bool:
    """An integer >= 1 (numpy integers too), not a bool."""
    return (
        isinstance(value, numbers.Integral)
        and not isinstance(value, (bool, np.bool_))
        and int(value) >= 1
    )


def check_batch_size(batch_size: Optional[int], name: str = "batch_size") -> None:
    """Rejects a global batch that is not a positive integer. `None` (the
    default batch) passes. Any other global batch trains, as with
    `tf.distribute`: a batch the replicas cannot share evenly is split into
    sizes one apart (`replica_sizes`; smaller than the replica count, some
    get none), and the reduction weighs each replica's part by its sample
    count, so the step is the one-device step on the whole batch."""
    if batch_size is None:
        return
    if not is_positive_int(batch_size):
        raise ValueError(
            f"{name}={batch_size!r} must be a positive integer (the global batch), "
            "or None for the default."
        )


def replica_sizes(global_size: tf.Tensor, num_replicas: int) -> list[tf.Tensor]:
    """Rows each replica gets from a global batch of `global_size` rows."""
    base = global_size // num_replicas
    extra = global_size % num_replicas
    return [base + tf.cast(r < extra, global_size.dtype) for r in range(num_replicas)]


def split_batch(batch: Any, num_replicas: int) -> list:
    """Splits a batch into `num_replicas` shards, in replica order.

    Args:
        batch: A nested structure of tensors (dense, `tf.SparseTensor` or
            `tf.RaggedTensor`) sharing the first (batch) dimension; `None`
            leaves are kept as `None` in every shard.
        num_replicas: How many shards to make.

    Returns:
        A list of `num_replicas` structures like `batch`.
    """
    leaves = tf.nest.flatten(batch)
    tensors = [t for t in leaves if t is not None]
    if not tensors:
        raise ValueError("Cannot split a batch that holds no tensors.")
    if num_replicas == 1:
        return [batch]
    global_size = num_rows(tensors[0])
    sizes = replica_sizes(global_size, num_replicas)
    size_vector = tf.stack(sizes)
    parts = [[None] * num_replicas if t is None else _split(t, sizes, size_vector) for t in leaves]
    return [tf.nest.pack_sequence_as(batch, [p[r] for p in parts]) for r in range(num_replicas)]


def num_rows(tensor) -> tf.Tensor:
    """The batch dimension of a dense, sparse or ragged tensor (int32)."""
    if isinstance(tensor, tf.RaggedTensor):
        return tensor.nrows(out_type=tf.int32)
    return tf.shape(tensor, out_type=tf.int32)[0]


def _split(tensor, sizes: list, size_vector: tf.Tensor) -> list:
    """`tensor` cut into consecutive runs of rows of the given `sizes`
    (`size_vector` is `tf.stack(sizes)`)."""
    if not isinstance(tensor, (tf.SparseTensor, tf.RaggedTensor)):
        return tf.split(tensor, size_vector, num=len(sizes))
    parts, start = [], tf.zeros([], sizes[0].dtype)
    for size in sizes:
        parts.append(take_rows(tensor, start, size))
        start += size
    return parts


def take_rows(tensor, start, count):
    """Rows `[start, start + count)` of a dense, ragged or sparse tensor (a
    sparse part's indices start again at row 0, with the same inner shape)."""
    if not isinstance(tensor, tf.SparseTensor):
        return tensor[start : start + count]
    start, count = tf.cast(start, tf.int64), tf.cast(count, tf.int64)
    inner = tensor.dense_shape[1:]
    part = tf.sparse.slice(
        tensor, tf.concat([[start], tf.zeros_like(inner)], 0), tf.concat([[count], inner], 0)
    )
    part.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    return part


# -- bad input caught before training (numpy arrays and static facts only) ------


def check_not_empty(x: Any) -> None:
    """Rejects training input that is known to be empty without reading it.

    Arrays (and tensors) with 0 rows; a `tf.data.Dataset` whose cardinality
    (computed from the pipeline, no element is read) is 0. Input whose
    size is unknown passes (see `DistributedModel._maybe_symbolic_build`).
    """
    if isinstance(x, tf.data.Dataset):
        if int(x.cardinality()) == 0:
            raise ValueError(
                "The training data is empty: the tf.data.Dataset has no elements "
                "(cardinality 0); check its source and any take/skip/shard/batch "
                "(drop_remainder=True) that leaves nothing."
            )
        return
    for leaf in tf.nest.flatten(x):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) >= 1 and shape[0] == 0:
            raise ValueError(
                f"The training data is empty: x has 0 rows (shape {tuple(shape)}); "
                "pass at least one sample."
            )


def check_same_length(**arrays: Any) -> None:
    """Rejects arrays (`x=..., y=..., sample_weight=...`, each possibly a
    structure of arrays) whose first dimensions differ: one row per sample."""
    rows = {}
    for name, value in arrays.items():
        found = sorted(
            {
                int(leaf.shape[0])
                for leaf in tf.nest.flatten(value)
                if leaf is not None and len(getattr(leaf, "shape", ())) >= 1
            }
        )
        if found:
            rows[name] = found
    if len({n for found in rows.values() for n in found}) > 1:
        listed = ", ".join(f"{name} {'/'.join(map(str, found))}" for name, found in rows.items())
        raise ValueError(
            f"The input arrays do not have one row per sample (rows: {listed}); pass x, y "
            "and sample_weight with the same number of samples."
        )


def check_sparse_labels(y: Any, num_classes: int, ignore_class: Optional[int] = None) -> None:
    """Rejects integer numpy labels outside `[0, num_classes)` (one pass).

    For sparse categorical crossentropy, where TensorFlow would otherwise
    fail inside the training step with an op error.
    """
    if not isinstance(y, np.ndarray) or not np.issubdtype(y.dtype, np.integer) or not y.size:
        return
    labels = y.reshape(-1)
    if ignore_class is not None:
        labels = labels[labels != ignore_class]
        if not labels.size:
            return
    if labels.min() >= 0 and labels.max() < num_classes:
        return
    bad = (y < 0) | (y >= num_classes)
    if ignore_class is not None:
        bad &= y != ignore_class
    index = np.argwhere(bad)[0]
    value = y[tuple(index)]
    raise ValueError(
        f"y holds label {value} (row {index[0]}) but the model's output has "
        f"{num_classes} classes; sparse categorical crossentropy needs integer labels "
        f"in 0..{num_classes - 1}: fix the labels or the size of the output layer."
    )


def check_finite(name: str, value: Any) -> None:
    """Rejects float numpy arrays in `value` that hold NaN or Inf.

    One pass without a temporary array (a float64 sum, which NaN and Inf
    reach); the element-wise test only runs to confirm and locate.
    """
    for leaf in tf.nest.flatten(value):
        if not (
            isinstance(leaf, np.ndarray) and np.issubdtype(leaf.dtype, np.floating) and leaf.size
        ):
            continue
        if np.isfinite(np.sum(leaf, dtype=np.float64)):
            continue
        bad = ~np.isfinite(leaf)
        if not bad.any():
            continue  # a sum that overflowed float64; every value is finite
        index = np.argwhere(bad)[0]
        raise ValueError(
            f"{name} holds {leaf[tuple(index)]} at row {index[0]}; NaN/Inf input makes "
            "the weights NaN: clean the data, or set model.check_finite = False to "
            "train on it anyway."
        )


def peek(generator):
    """`(first, rest)`: the first element of the Python generator
    `generator`, and a generator that yields it again and then the rest.

    Keras takes a Python generator only as a real generator object
    (`types.GeneratorType`), so the element read to build a model is put
    back this way rather than by `itertools.chain`.

    Raises:
        ValueError: the generator yields nothing.
    """
    try:
        first = next(generator)
    except StopIteration:
        raise ValueError(
            "The input generator is empty: it yielded no batch; check that it yields at least one."
        ) from None

    def again():
        yield first
        yield from generator

    return first, again()
