"""What `DistributedModel.from_model` does to the plain Keras model it wraps.

`check_wrappable`: only a built Functional or Sequential model has the graph
the copy is made of. `compile_like`: the copy is compiled as the original
was. `copy_optimizer_state`: the copy's optimizer gets the original's step
count and slots. The copy itself is `placement.copy_functional`'s.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from keras_distrib import _compat
from keras_distrib import placement


def check_wrappable(model: keras.Model, functional: type) -> None:
    """Raises a one-line ValueError unless `model` is a built Functional
    (of class `functional`, Keras's) or Sequential model."""
    graph = _compat.functional_graph(model)
    if isinstance(model, keras.Sequential) and not isinstance(graph, functional):
        raise ValueError(
            f"from_model needs a built model, but Sequential {model.name!r} has no "
            "input shape yet; start it with keras.Input(shape=...) (e.g. "
            "keras.Sequential([keras.Input((8,)), ...])) or call model.build(shape)."
        )
    if not isinstance(graph, functional):
        raise ValueError(
            f"from_model needs a built Functional or Sequential model, got "
            f"{type(model).__name__}; for a subclassed model, subclass "
            "keras_distrib.DistributedModel instead of keras.Model."
        )


def compile_like(source: keras.Model, target: keras.Model) -> None:
    """Compiles `target` (a DistributedModel) as `source` was: from
    `source`'s compile config, or, where that does not deserialize (a
    metric or loss class Keras cannot locate, as a user's written without
    `get_config` or registration), with copies of the objects `source` was
    compiled with (metrics copied object by object, their state reset; the
    optimizer made from its config, its state carried over afterwards by
    `copy_optimizer_state`)."""
    try:
        target.compile_from_config(source.get_compile_config())
        return
    except (TypeError, ValueError):
        pass
    arguments = dict(_compat.compile_arguments(source))
    optimizer = arguments.get("optimizer")
    if isinstance(optimizer, keras.optimizers.Optimizer):
        arguments["optimizer"] = type(optimizer).from_config(optimizer.get_config())
    for key in ("loss", "metrics", "weighted_metrics"):
        arguments[key] = placement.copy_objects(arguments.get(key))
    target.compile(**arguments)
    if target.built:
        with target.strategy.scope():
            target.optimizer.build(target.trainable_variables)


def copy_optimizer_state(source: keras.Model, target: keras.Model) -> None:
    """Gives `target`'s optimizer the state of `source`'s (step count, slots).

    The state travels as a saved file would carry it (the optimizer's
    `save_own_variables` / `load_own_variables`), in the plain model's
    layout: a strategy that splits weights (tensor_parallel) splits the
    slots on the way in, as it does when loading a file.
    """
    src = source.optimizer
    if src is None or not src.built:
        return
    with target.strategy.scope():
        target.optimizer.build(target.trainable_variables)
    # The strategy's hooks for a built optimizer (tensor_parallel: the file layout).
    target.strategy.sync_initial_state(target)
    saved: dict[str, Any] = {}
    layout: dict[str, Any] = {}
    src.save_own_variables(saved)
    target.optimizer.save_own_variables(layout)
    shapes = [np.shape(saved[str(i)]) for i in range(len(saved))]
    expected = [np.shape(layout[str(i)]) for i in range(len(layout))]
    if shapes != expected:
        raise ValueError(
            "Cannot carry the optimizer state over: the wrapped model's optimizer holds "
            f"{len(shapes)} variables of shapes {shapes}, the copy's "
            f"{len(expected)} of shapes {expected}; compile the copy afresh instead."
        )
    target.optimizer.load_own_variables(saved)
    target.strategy.broadcast_variables(target.optimizer.variables)
