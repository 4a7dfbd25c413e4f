"""Global and per-replica batch arithmetic.

`batch_size` always means the global batch: the number of samples that one
optimizer step consumes, across all replicas.

The split rule (documented in README, tested in tests/test_data.py): a
batch of B samples over N replicas gives replica r the contiguous rows
`[start_r, start_r + n_r)` with n_r = B // N + (1 if r < B % N else 0). No
sample is dropped; a replica may get zero rows when B < N. The gradient is
exact whatever the split (see `DistributedModel.reduce_gradients`).
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf


def check_batch_size(batch_size: Optional[int], num_replicas: int, strategy: str) -> None:
    """Rejects an explicit global batch that the replicas cannot share evenly."""
    if batch_size is None or num_replicas <= 1:
        return
    if batch_size % num_replicas:
        lower = batch_size - batch_size % num_replicas
        examples = " or ".join(str(b) for b in (lower, lower + num_replicas) if b > 0)
        raise ValueError(
            f"batch_size={batch_size} is not divisible by the {num_replicas} "
            f"replicas of strategy {strategy!r}; use a multiple of "
            f"{num_replicas} (e.g. {examples})."
        )


def replica_sizes(global_size: tf.Tensor, num_replicas: int) -> list[tf.Tensor]:
    """Rows each replica gets from a global batch of `global_size` rows."""
    base = global_size // num_replicas
    extra = global_size % num_replicas
    return [base + tf.cast(r < extra, global_size.dtype) for r in range(num_replicas)]


def split_batch(batch: Any, num_replicas: int) -> list:
    """Splits a batch into `num_replicas` shards, in replica order.

    Args:
        batch: A nested structure of tensors sharing the first (batch)
            dimension; `None` leaves are kept as `None` in every shard.
        num_replicas: How many shards to make.

    Returns:
        A list of `num_replicas` structures like `batch`.
    """
    leaves = tf.nest.flatten(batch)
    tensors = [t for t in leaves if t is not None]
    if not tensors:
        raise ValueError("Cannot split a batch that holds no tensors.")
    for t in tensors:
        if isinstance(t, (tf.SparseTensor, tf.RaggedTensor)):
            raise ValueError(
                "Sparse and ragged inputs cannot be split across replicas yet; "
                "densify them in the input pipeline or use strategy='single'."
            )
    if num_replicas == 1:
        return [batch]
    global_size = tf.shape(tensors[0], out_type=tf.int32)[0]
    size_vector = tf.stack(replica_sizes(global_size, num_replicas))
    parts = [
        [None] * num_replicas if t is None else tf.split(t, size_vector, num=num_replicas)
        for t in leaves
    ]
    return [
        tf.nest.pack_sequence_as(batch, [p[r] for p in parts])
        for r in range(num_replicas)
    ]
