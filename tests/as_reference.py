"""A run against a reference run of the same math: weights, logs, `evaluate`
and `predict` each within the bound `float_bounds` derives from float32's
rounding and the number of operations (see its module doc), element by
element, not within a fixed tolerance.

The reference is a `float_bounds.Reference`: `fit` trains the reference
model (plain Keras, or `"single"`) with it. A run that differs from it by a
wrong reduction, a lost or repeated batch or a scaled update ends far
outside these bounds; two runs adding in other orders stay inside.
"""

from __future__ import annotations

import numpy as np

from float_bounds import Reference, aligned, assert_within


def fit(model, x, y, batch_size, epochs=1, **fit) -> Reference:
    """`model.fit(x, y, batch_size, epochs, shuffle=False)`, traced."""
    return Reference.fit(model, x, y, batch_size, epochs, **fit)


def assert_weights(reference: Reference, got, want=None, others=None, err_msg="weight") -> None:
    """`got` (a model, or its `get_weights()`) within the bounds of the
    reference model's weights (`want`: those, as the reference ended, by
    default); `others`: the bound of weights not trained (see
    `float_bounds.aligned`)."""
    got = got.get_weights() if hasattr(got, "get_weights") else list(got)
    want = reference.model.get_weights() if want is None else list(want)
    bounds = (
        reference.weights
        if others is None
        else aligned(reference.model, reference.trainable, others)
    )
    assert len(got) == len(want) == len(bounds), (len(got), len(want), len(bounds))
    for i, (g, w, b) in enumerate(zip(got, want, bounds)):
        assert_within(g, w, b, f"{err_msg} {i}")


def assert_history(reference: Reference, got: dict, keys=None, steps_per_epoch=None) -> None:
    """A `fit`'s history (`got`: `History.history`) within the bounds of the
    reference's, for `keys` (the loss, each output's loss and the
    accuracies, by default)."""
    bounds = reference.history(steps_per_epoch)
    for key in keys or bounds:
        assert_within(got[key], reference.logs[key], bounds[key], key)


def assert_validation(reference: Reference, got: dict, x, y, batch_size=None) -> None:
    """A `fit`'s validation logs on (`x`, `y`) within the reference's."""
    bounds = reference.validation(x, y, batch_size)
    for key, bound in bounds.items():
        assert_within(got[key], reference.logs[key], bound, key)


def assert_evaluate(reference: Reference, got, x, y, batch_size=None) -> None:
    """`evaluate(x, y, batch_size)`'s results (a list, or one value) within
    the bounds of the reference model's, at its weights now."""
    want = reference.model.evaluate(x, y, batch_size=batch_size, verbose=0)
    assert_within(
        np.ravel(got), np.ravel(want), np.ravel(reference.evaluate(x, y, batch_size)), "evaluate"
    )


def assert_predict(reference: Reference, got, x, batch_size=None) -> None:
    """`predict(x)` within the bounds of the reference model's, at its
    weights now."""
    want = reference.model.predict(x, batch_size=batch_size, verbose=0)
    assert_within(got, want, reference.predict(x), "predict")
