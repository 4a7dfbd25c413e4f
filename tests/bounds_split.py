"""Bounds `float_bounds` has no helper for, derived the same way (see its
module doc: float32 rounds each result to within EPS/2 of it, relatively,
and two sums of n terms in other orders differ by at most n * EPS times the
sum of their absolute values, `reordered_sum`): BatchNormalization's moving
statistics, updated from the batches it normalizes in training, and what a
difference in them does to a model's outputs.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from float_bounds import reordered_sum

# The operations of a moving statistic's update s * m + b * (1 - m): the
# rounding of 1 - m, the two products and their sum.
UPDATE_TERMS = 4
# The operations of a row's term of a batch variance besides the sum: the
# subtraction of the mean, the square (doubling the subtraction's relative
# error) and the division by the count.
VARIANCE_TERMS = 3


def input_statistics_apart(batches, momentum: float, mean=0.0, variance=1.0):
    """How far two runs' moving mean and moving variance of a
    `BatchNormalization(momentum=momentum)` may be apart after updates from
    `batches` (in order; each rows by features, the layer's inputs, the same
    in both runs: a layer on the model's inputs), starting from `mean` and
    `variance` in both. Returns (mean bound, variance bound), per feature.

    In training the layer takes each batch's moments (`tf.nn.moments`):
    its mean, the sum of its n rows divided by n, is within
    (n - 1) * EPS/2 * mean|x| (the sum) + EPS/2 * mean|x| (the division) of
    the exact mean in either run: two runs, `reordered_sum(n, mean|x|)`
    apart. Its variance, the mean of (x - mean)**2 over the rows: a shift d
    of the mean moves it by 2 * d * mean(x - mean) + d**2, which is zero to
    first order (the rows' deviations from their mean add up to zero), and
    each row's term rounds in the subtraction and the square (3 * EPS/2 of
    the term, relatively), the sum of n terms and the division by n: two
    runs, `reordered_sum(n + VARIANCE_TERMS, variance)` apart.

    The update s' = s * m + b * (1 - m) of a moving statistic s by the
    batch's b moves the two runs' difference to m * (s's) + (1 - m) * (b's),
    plus the update's own rounding, `UPDATE_TERMS` operations each within
    EPS/2 of m * |s| + (1 - m) * |b|: `reordered_sum(UPDATE_TERMS, ...)`.
    The magnitudes are the exact statistics (float64), first order in EPS.
    """
    moving = [np.asarray(mean, np.float64), np.asarray(variance, np.float64)]
    apart = [np.zeros(()), np.zeros(())]
    for batch in batches:
        batch = np.asarray(batch, np.float64)
        n = len(batch)
        batch_mean = batch.mean(axis=0)
        batch_variance = np.mean((batch - batch_mean) ** 2, axis=0)
        statistics = [batch_mean, batch_variance]
        errors = [
            reordered_sum(n, np.mean(np.abs(batch), axis=0)),
            reordered_sum(n + VARIANCE_TERMS, batch_variance),
        ]
        for i in range(2):
            apart[i] = (
                momentum * apart[i]
                + (1 - momentum) * errors[i]
                + reordered_sum(
                    UPDATE_TERMS, momentum * np.abs(moving[i]) + (1 - momentum) * statistics[i]
                )
            )
            moving[i] = momentum * moving[i] + (1 - momentum) * statistics[i]
    return apart[0], apart[1]


def through_variables(model, x, bounds: list):
    """For each of `model`'s outputs on `x` (a test step's, one output): how
    far another run's may be for variables of `model` (not trained: moving
    statistics) within their bounds of these (`bounds`: pairs of a variable
    and its bound), first order: sum over them of |d output / d variable| *
    bound. (The rounding of the computation itself and the trained weights'
    bounds: `float_bounds.outputs_apart`.)"""
    variables = [variable for variable, _ in bounds]
    with tf.GradientTape(persistent=True) as tape:
        for variable in variables:
            tape.watch(variable.value)
        outputs = model(tf.convert_to_tensor(x), training=False)
    gradients = tape.jacobian(outputs, [variable.value for variable in variables])
    found = np.zeros(outputs.shape)
    for (variable, bound), gradient in zip(bounds, gradients):
        gradient = np.abs(np.asarray(gradient, np.float64))
        found += np.tensordot(gradient, np.asarray(bound, np.float64), axes=len(variable.shape))
    return found
