"""Gradient arithmetic every strategy and the model share.

`scaled_gradient` and `summed_gradients` keep a sparse gradient
(`tf.IndexedSlices`) sparse, as Keras's optimizers expect it;
`gather_sparse` is the strategies' reduction of sparse gradients.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf


def scaled_gradient(gradient: Any, factor: Any) -> Any:
    """`gradient * factor`, for dense and sparse (`tf.IndexedSlices`) gradients."""
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        values = gradient.values * tf.cast(factor, gradient.values.dtype)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype)


def summed_gradients(gradients: Sequence[Any]):
    """The sum of several gradients of one variable; sparse ones stay
    sparse, their rows concatenated in order (the sum Keras's optimizers
    apply as one device would: see `Strategy.gather_sparse_gradients`)."""
    if len(gradients) == 1:
        return gradients[0]
    if all(isinstance(g, tf.IndexedSlices) for g in gradients):
        return tf.IndexedSlices(
            tf.concat([g.values for g in gradients], axis=0),
            tf.concat([g.indices for g in gradients], axis=0),
            gradients[0].dense_shape,
        )
    return tf.add_n([tf.convert_to_tensor(g) for g in gradients])


def gather_sparse(
    all_reduce, slots: int, slot, gradients: Sequence[tf.IndexedSlices], num_samples
) -> list:
    """Sparse gradients (`tf.IndexedSlices`: an `Embedding`'s, any
    `tf.gather`'s) of every replica, as one device holds them for the
    global batch: each replica's rows, concatenated in replica order (= the
    global batch's order, see `keras_distrib.input.sharding`), the values
    divided by the global sample count (each replica's are of its loss
    *sum*, as in `Strategy.reduce_gradients`). `all_reduce`: the strategy's
    (replica context); `slots`: the replicas; `slot`: this one's index.

    Keras's optimizers apply a sparse gradient as it is: duplicate rows are
    added where the update densifies (Adam's second moment adds each row's
    squares, not the square of their sum), and rows not in the batch are
    not touched by SGD. Summing the replicas' gradients into one dense
    tensor would change both (and carry the whole table every step); here
    only the batch's rows travel: two all-reduces, the row counts (with the
    sample counts), then each replica's rows in its own slot.
    """
    here = tf.one_hot(slot, slots, dtype=tf.float32)
    counts = tf.stack(
        [tf.cast(tf.shape(g.indices)[0], tf.float32) for g in gradients]
        + [tf.cast(num_samples, tf.float32)]
    )
    (table,) = all_reduce([here[:, None] * counts[None]], "sum")
    total = tf.reduce_sum(table[:, -1])
    rows = tf.cast(table[:, :-1], tf.int32)  # [slot, gradient]
    sent = []
    for k, g in enumerate(gradients):
        longest = tf.reduce_max(rows[:, k])
        for part in (g.values, tf.cast(g.indices, tf.float64)):
            padding = [[0, longest - tf.shape(part)[0]]] + [[0, 0]] * (part.shape.rank - 1)
            mask = tf.reshape(tf.cast(here, part.dtype), [slots] + [1] * part.shape.rank)
            sent.append(mask * tf.pad(part, padding)[None])
    received = all_reduce(sent, "sum")
    out = []
    for k, g in enumerate(gradients):
        values, indices = received[2 * k], received[2 * k + 1]
        values = tf.concat([values[r, : rows[r, k]] for r in range(slots)], axis=0)
        indices = tf.concat([indices[r, : rows[r, k]] for r in range(slots)], axis=0)
        scale = tf.cast(1.0 / tf.maximum(total, 1.0), values.dtype)
        out.append(
            tf.IndexedSlices(values * scale, tf.cast(indices, g.indices.dtype), g.dense_shape)
        )
    return out
