"""Gradient arithmetic every strategy and the model share.

`scaled_gradient` and `summed_gradients` keep a sparse gradient
(`tf.IndexedSlices`) sparse, as Keras's optimizers expect it;
`reduce_op_name` checks the reduce op an `all_reduce` takes.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf


def scaled_gradient(gradient, factor):
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
        return tf.IndexedSlices(tf.concat([g.values for g in gradients], axis=0),
                                tf.concat([g.indices for g in gradients], axis=0),
                                gradients[0].dense_shape)
    return tf.add_n([tf.convert_to_tensor(g) for g in gradients])


def reduce_op_name(op: str) -> str:
    """Validates a reduce op name (`"sum"` or `"mean"`)."""
    if op not in ("sum", "mean"):
        raise ValueError(f"Unknown reduce op {op!r}; use one of ['mean', 'sum'].")
    return op
