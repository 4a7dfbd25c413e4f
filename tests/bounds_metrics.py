"""Bounds, derived as in `float_bounds` (see its module doc), where its
`Reference` has none or counts too few roundings:

* a model of Dense layers trained under the "mixed_float16" policy, whose
  float16 results round to float16's precision (`mixed_float16_fit`);
* an accuracy weighed by sample or class weights (`weighted_accuracy_apart`).

Each is derived where it is defined, below.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from float_bounds import (
    Reference,
    Trace,
    compression_terms,
    gradient_terms,
    reordered_sum,
)


# -- a model of Dense layers under the "mixed_float16" policy ------------------------------
#
# Each Dense layer computes in float16 (its float32 kernel and bias cast to
# float16): its matmuls add in float32 and round the result to float16 once
# (TensorFlow's CPU kernels, oneDNN's and Eigen's alike), the bias's add
# rounds its result, and so, backward, do the gradients of the kernel and of
# the layer's input, and the outputs' gradient where it enters the float16
# layers. Each such rounding may go to the other float16 neighbour in
# another run (float16's eps relative to the value: `compression_terms`
# terms of float32's EPS), where its inputs differ. A bias's gradient,
# though, adds the rows' gradients with TensorFlow's Sum of float16, which
# rounds its running sums to float16 as it goes: a sum of n rows in any
# order is within n float16 eps of their magnitudes.

FLOAT16_ROUNDINGS_PER_DENSE = 6  # kernel and bias casts, matmul, add; two gradients


class DenseChainTrace(Trace):
    """A `float_bounds.Trace` (for SGD's bounds: each step's weights and
    mean |row gradient|) of a model whose layers each take the one before's
    output, Dense layers the only ones with weights, trained by SGD (also
    in a LossScaleOptimizer, which applies its inner SGD to the gradients
    divided by its scale, a power of 2: exact). A Dense layer's kernel
    gradient for a row is the outer product of the row's input to the
    layer and the gradient of the row's loss for the layer's output before
    its activation (its bias's: that gradient), so their mean absolute
    value over the rows is |inputs|^T |gradients| / rows, from one backward
    pass of the batch's summed loss (the rows are independent): what
    `Trace` finds from the Jacobian of every row's loss, at a cost that
    grows with the rows squared."""

    @property
    def optimizers(self) -> list:
        optimizer = self.model.optimizer
        return [getattr(optimizer, "inner_optimizer", optimizer)]

    def record(self, x, y, sample_weight=None, count=None):
        model = self.model
        count = len(x) if count is None else count
        loss = model.loss
        per_row = loss.__class__.from_config({**loss.get_config(), "reduction": None})
        weight = tf.constant(
            np.ones(count, "float32") if sample_weight is None else sample_weight, "float32"
        )
        inputs, befores, dense = [], [], []
        with tf.GradientTape() as tape:
            h = tf.convert_to_tensor(x)
            for layer in model.layers:
                if isinstance(layer, keras.layers.InputLayer):
                    continue
                if not isinstance(layer, keras.layers.Dense):
                    assert not layer.weights, f"a layer with weights not Dense: {layer.name}"
                    h = layer(h, training=True)
                    continue
                dtype = layer.compute_dtype
                h = keras.ops.cast(h, dtype)
                before = keras.ops.matmul(h, keras.ops.cast(layer.kernel, dtype))
                if layer.use_bias:
                    before = keras.ops.add(before, keras.ops.cast(layer.bias, dtype))
                inputs.append(h)
                befores.append(before)
                dense.append(layer)
                h = layer.activation(before)
            losses = tf.cast(per_row(y, h), "float32") * weight
            total = tf.reduce_sum(losses)
        slopes = tape.gradient(total, befores)
        found = {}
        for layer, h, slope in zip(dense, inputs, slopes):
            h, slope = np.abs(np.asarray(h, np.float64)), np.abs(np.asarray(slope, np.float64))
            found[id(layer.kernel)] = h.T @ slope / count
            if layer.use_bias:
                found[id(layer.bias)] = slope.sum(axis=0) / count
        self.gradients = None
        self.weights.append([np.asarray(v, np.float64) for v in model.trainable_weights])
        self.magnitudes.append([found[id(v)] for v in model.trainable_weights])
        self.losses.append(float(np.abs(np.asarray(losses, np.float64)).sum() / count))
        self.rows.append(count)
        self.end = [np.asarray(v, np.float64) for v in model.trainable_weights]


def mixed_float16_fit(model, x, y, batch_size: int, epochs: int = 1):
    """A traced `fit` of `model` (see `DenseChainTrace`) under the
    "mixed_float16" policy, in order, as `as_reference.fit`'s, with the
    bounds of its kernels counting the float16 roundings above, and those
    of its biases the float16 sums too."""
    half = compression_terms("float16")
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    kernels = (
        gradient_terms(model, batch_size) + (FLOAT16_ROUNDINGS_PER_DENSE * len(dense) + 1) * half
    )
    trace = DenseChainTrace(x, y, batch_size, model.loss)
    model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, callbacks=[trace]
    )
    steps_per_epoch = -(-len(x) // batch_size)
    reference = Reference(model, trace, steps_per_epoch, kernels)
    biases = Reference(model, trace, steps_per_epoch, kernels + batch_size * half)
    return reference.taking(biases, lambda variable: len(variable.shape) < 2)


# -- an accuracy weighed by sample weights ---------------------------------------------------


def weighted_accuracy_apart(reference, weights, key: str = "accuracy") -> list:
    """Per epoch, how far another run's accuracy `key` may be where each row
    of the reference's `fit` (in order) weighs `weights` (sample or class
    weights, all positive): Keras's accuracy is then sum(w * right) /
    sum(w) over the epoch's rows.

    The rows another run may count otherwise are those `float_bounds`
    finds for the unweighted accuracy (`Reference.history`): their weight's
    share of the epoch's is at most max(w) / min(w) times their number's.
    Each run's two sums add the epoch's N rows' weights, batch by batch
    (N + steps terms), within (N + steps) * EPS of sum(w) each; their
    quotient, at most 1, rounds once more."""
    weights = np.asarray(weights, np.float64)
    assert (weights > 0).all(), "a row weighing 0: no bound here"
    ratio = float(weights.max() / weights.min())
    trace, per_epoch = reference.trace, reference.steps_per_epoch
    found = []
    for epoch, bound in enumerate(reference.history()[key]):
        rows = trace.rows[epoch * per_epoch : (epoch + 1) * per_epoch]
        terms = 2 * (sum(rows) + len(rows)) + 1
        found.append(ratio * bound + reordered_sum(terms, 1.0))
    return found
