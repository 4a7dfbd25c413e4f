"""A split layer's forward pass: the collectives between split layers.

Each device computes its part where its shard lives, and the parts meet on
the first device (`home`):

* column (`y = concat_i(x @ W_i + b_i)`): the input is copied to every
  device; the parts are concatenated on the first device (a gather),
  unless the layer's only consumer is a row layer, which then takes the
  parts where they are (the concatenation is left unused and pruned from
  the compiled step);
* row (`y = sum_i(x_i @ W_i) + b`): the partial outputs are summed on the
  first device (a reduction), and the bias added once there;
* Embedding: split by vocabulary rows (each device looks up its own ids,
  the others give zeros, and the parts are summed) or by columns
  (gathered, as a column Dense).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Optional

import tensorflow as tf

from keras_distrib.strategies.tensor_parallel import layout as tensor_layout

# A column layer's latest output -> that layer's split, which keeps the
# output's parts for a row layer that consumes it (matched by identity, so a
# stale entry is never used).
_PRODUCERS: "weakref.WeakValueDictionary[int, SplitForward]" = weakref.WeakValueDictionary()


class SplitForward:
    """The forward pass of a split Dense / Embedding (`SplitLayer`, which
    holds what it reads: `layer`, `kind`, `devices`, `home`, `sizes`,
    `groups` of shards, `is_dense`, and `last_output`, the latest column
    output with its parts)."""

    # `SplitLayer`'s, as its __init__ makes them.
    devices: tuple[str, ...]
    home: str
    sizes: list[int]
    last_output: Optional[tuple[Any, list]]

    def call(self, inputs, *args, **kwargs):
        if not self.is_dense:
            if isinstance(inputs, tf.RaggedTensor):
                # Ids of variable-length rows: looked up as one flat vector
                # and given the rows back. Keras's ops on the ragged ids
                # themselves trace into graphs many times larger.
                return inputs.with_flat_values(self._embedding_call(inputs.flat_values))
            return self._embedding_call(inputs)
        return self._column_call(inputs) if self.kind == "column" else self._row_call(inputs)

    def _column_call(self, inputs):
        ops = _keras_ops()
        kernels = self.groups[0][0]
        biases = self.groups[1][0] if len(self.groups) > 1 else [None] * len(kernels)
        activation = self.layer.activation
        # Only an elementwise activation may run on each device's columns:
        # softmax over a shard's columns is not a slice of softmax over all.
        on_parts = tensor_layout.is_elementwise(activation)
        parts = []
        for device, kernel, bias in zip(self.devices, kernels, biases):
            with tf.device(device):
                y = ops.matmul(inputs, kernel)
                if bias is not None:
                    y = ops.add(y, bias)
                if activation is not None and on_parts:
                    y = activation(y)
            parts.append(y)
        if on_parts:
            return self._gathered(parts)
        output = self._gathered(parts, keep_parts=False)
        with tf.device(self.home):
            return activation(output)

    def _row_call(self, inputs):
        kernels = self.groups[0][0]
        pieces = self._parts_of(inputs)
        partial = []
        for device, piece, kernel in zip(self.devices, pieces, kernels):
            with tf.device(device):
                partial.append(_keras_ops().matmul(piece, kernel))
        ops = _keras_ops()
        with tf.device(self.home):
            y = functools.reduce(ops.add, partial)
            if len(self.groups) > 1:
                y = ops.add(y, self.groups[1][0][0])
            if self.layer.activation is not None:
                y = self.layer.activation(y)
        return y

    def _embedding_call(self, ids):
        ops = _keras_ops()
        if _keras().backend.standardize_dtype(ids.dtype) not in ("int32", "int64"):
            ids = ops.cast(ids, "int32")
        tables = self.groups[0][0]
        parts = []
        start = 0
        for device, table, size in zip(self.devices, tables, self.sizes):
            with tf.device(device):
                if self.kind == "column":
                    parts.append(ops.take(table, ids, axis=0))
                else:  # this device's vocabulary rows; ids elsewhere give zeros
                    local = ids - start
                    inside = ops.logical_and(local >= 0, local < size)
                    rows = ops.take(table, ops.where(inside, local, 0), axis=0)
                    parts.append(rows * ops.expand_dims(ops.cast(inside, rows.dtype), -1))
            start += size
        if self.kind == "column":
            out = self._gathered(parts)
        else:
            with tf.device(self.home):
                out = functools.reduce(ops.add, parts)
        return ops.cast(out, self.layer.compute_dtype)

    def _gathered(self, parts, keep_parts: bool = True):
        """The parts concatenated on the first device; kept for a row layer
        that consumes this output as it is (`_parts_of`)."""
        with tf.device(self.home):
            output = _keras_ops().concatenate(parts, axis=-1)
        if keep_parts:
            self.last_output = (output, parts)
            _PRODUCERS[id(output)] = self
        return output

    def _parts_of(self, inputs) -> list:
        """The row layer's input, one slice per device: the producing column
        layer's parts when it is that layer's latest output, else slices of it."""
        producer = _PRODUCERS.get(id(inputs))
        if (
            producer is not None
            and producer.last_output is not None
            and producer.last_output[0] is inputs
            and producer.sizes == self.sizes
            and producer.devices == self.devices
        ):
            return list(producer.last_output[1])
        pieces, start = [], 0
        for device, size in zip(self.devices, self.sizes):
            with tf.device(device):
                pieces.append(inputs[..., start : start + size])
            start += size
        return pieces


def _keras():
    import keras  # not at import: keras_distrib sets up TensorFlow first

    return keras


def _keras_ops():
    return _keras().ops
