"""Bounds of tests/float_bounds.py, computed as the distributed tests need them.

`outputs_apart_by_rows`: `float_bounds.outputs_apart` of a model on many
rows, a chunk of rows at a time.
"""

from __future__ import annotations

import numpy as np

from float_bounds import outputs_apart

# float_bounds computes a Jacobian of more elements than this one output
# element at a time (`float_bounds._large`), each a backward pass of its own.
_VECTORIZED = 10**7


def outputs_apart_by_rows(model, x, weights_apart=None) -> np.ndarray:
    """`float_bounds.outputs_apart(model, x, weights_apart)` for an array
    `x` (rows first) and a model of one output in which each row's outputs
    depend on that row alone (no layer mixes the rows of a batch at
    inference: Dense layers, activations): each row's bound is then the
    same whichever rows are computed with it, so it is computed on chunks
    of rows whose Jacobian is small enough to be computed at once
    (vectorized) rather than one output element at a time."""
    x = np.asarray(x)
    per_row = sum(int(np.prod(w.shape)) for w in model.trainable_weights) * int(
        np.prod(model.output.shape[1:])
    )
    rows = max(1, _VECTORIZED // per_row)
    return np.concatenate(
        [outputs_apart(model, x[i : i + rows], weights_apart) for i in range(0, len(x), rows)]
    )
