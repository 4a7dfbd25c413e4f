"""The optimizers a compiled optimizer applies through, and their Keras classes.

A strategy that changes how updates apply (`adopt_optimizer`), or refuses
an optimizer it cannot serve, must reach every optimizer that updates
variables: a LossScaleOptimizer's inner one, each of a MultiOptimizer's.
"""

from __future__ import annotations

from typing import Optional


def optimizers_in(optimizer) -> list:
    """`optimizer` and the optimizers it applies through (a LossScaleOptimizer's
    inner one, a MultiOptimizer's), each once."""
    import keras  # by now imported (a compiled model exists)

    found: list = []
    pending = [optimizer]
    while pending:
        opt = pending.pop()
        if opt is None or any(opt is seen for seen in found):
            continue
        found.append(opt)
        pending.append(getattr(opt, "inner_optimizer", None))
        if isinstance(opt, keras.optimizers.MultiOptimizer):
            pending += list(opt.optimizers)
    return found


def keras_class_among(optimizer, names) -> Optional[str]:
    """The first of `optimizer`'s classes (its own, then its bases) whose name
    is in `names`, else None: Keras's optimizer classes by name, so that a
    subclass counts and an optimizer this Keras lacks needs no import."""
    return next((c.__name__ for c in type(optimizer).__mro__ if c.__name__ in names), None)
