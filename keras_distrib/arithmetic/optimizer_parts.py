"""How optimizer sharding splits a variable, and its gradients, into parts.

Replica r of N owns elements `[r*k, (r+1)*k)` of a variable's flattened
values (`k = ceil(size / N)`; the last parts end in padding): its `Part`.
These functions cut a whole value (a variable, a dense gradient, a sparse
one, an array read from a file) into the part one replica owns, or into
the `[N, k]` table of every replica's part. No state: the sharded
optimizer (`keras_distrib.arithmetic.optimizer_shards`) keeps it.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf


class Part:
    """One trainable variable (`whole`, `size` elements) and this replica's
    part (`piece`, `length` of them; the last replicas' parts end in padding)."""

    def __init__(self, whole, piece, size: int, length: int, replicas: int):
        self.whole, self.piece = whole, piece
        self.size, self.length, self.replicas = size, length, replicas


def table(value, part: Part) -> tf.Tensor:
    """`value` (a whole variable or gradient) as `[replicas, length]`: row r
    is replica r's part (the last rows end in zeros; no copy when the parts
    fill it exactly)."""
    flat = tf.reshape(tf.convert_to_tensor(value), [-1])
    if part.length * part.replicas != part.size:
        flat = tf.pad(flat, [[0, part.length * part.replicas - part.size]])
    return tf.reshape(flat, [part.replicas, part.length])


def piece_of(value, part: Part, here) -> tf.Tensor:
    """Replica `here`'s part of `value` (a whole variable or gradient)."""
    return tf.gather(table(value, part), tf.cast(here, tf.int32))


def part_of(gradient, part: Part, here):
    """Replica `here`'s part of a whole gradient, sparse or dense."""
    if isinstance(gradient, tf.IndexedSlices):
        return sparse_piece_of(gradient, part, here)
    return piece_of(gradient, part, here)


def sparse_piece_of(gradient: tf.IndexedSlices, part: Part, here) -> tf.IndexedSlices:
    """Replica `here`'s part of a sparse gradient, still sparse: the elements
    of its rows that fall in the part, each indexed in the flat piece, in
    the order of the rows (duplicates kept). Keras's update of the piece
    then does, element by element, what its update of the whole variable
    does with the rows: Adam adds the squares of duplicate rows, SGD and
    Adagrad leave the elements of absent rows as they were."""
    row = int(np.prod(gradient.values.shape[1:]))
    values = tf.reshape(gradient.values, [-1])
    columns = tf.range(row, dtype=tf.int64)
    flat = tf.reshape(tf.cast(gradient.indices, tf.int64)[:, None] * row + columns[None], [-1])
    start = tf.cast(here, tf.int64) * part.length
    inside = (flat >= start) & (flat < start + part.length)
    return tf.IndexedSlices(
        tf.boolean_mask(values, inside),
        tf.boolean_mask(flat, inside) - start,
        tf.constant([part.length], tf.int64),
    )


def piece_of_array(value, part: Part, here: int) -> np.ndarray:
    """`piece_of` for a numpy value, eagerly."""
    flat = np.asarray(value).reshape(-1)
    padded = np.zeros(part.length * part.replicas, flat.dtype)
    padded[: part.size] = flat
    return padded[here * part.length : (here + 1) * part.length]
