"""What `strategy=` may be, resolved to one keras_distrib strategy: `get`.

* a name (`"mirrored"`, an alias, `"auto"`) with options: built by the
  registry (`registry.create`);
* a keras_distrib `Strategy` object: itself (an object always beats a
  string);
* a `tf.distribute.Strategy` object: ours that trains as it would
  (`from_tf.adopt`);
* anything, inside a strategy's `scope()` (ours, or the user's
  tf.distribute scope, where TensorFlow's tutorials build and load
  models): that scope's strategy, as Keras's models do.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import tensorflow as tf

from keras_distrib.strategies import from_tf, registry
from keras_distrib.strategies.base import Strategy
from keras_distrib.strategies.tf_distribute import entered


def get(
    strategy: Union[str, Strategy, tf.distribute.Strategy] = registry.AUTO, **options: Any
) -> Strategy:
    """Builds or adopts the strategy `strategy` names.

    Raises:
        ValueError: unknown name (the message lists the valid ones), an
            option the strategy does not take, options with an object, or
            another strategy asked for inside a scope.
        TypeError: `strategy` is none of the above.
    """
    scope: Optional[Strategy] = entered()
    if scope is None and tf.distribute.has_strategy() and not isinstance(strategy, Strategy):
        # A tf.distribute strategy's scope (the user's): models built there
        # train on it, as Keras's do.
        scope = from_tf.adopt(tf.distribute.get_strategy())
    if scope is not None and not options:
        return _the_entered(scope, strategy)
    if isinstance(strategy, tf.distribute.Strategy):
        if options:
            raise ValueError(
                f"Options {sorted(options)} were given with a tf.distribute strategy object; "
                "pass them to its constructor instead."
            )
        return from_tf.adopt(strategy)
    if isinstance(strategy, Strategy):
        if options:
            raise ValueError(
                f"Options {sorted(options)} were given with a strategy object; "
                "pass them to the strategy's constructor instead."
            )
        return strategy
    if not isinstance(strategy, str):
        raise TypeError(
            "strategy must be a name from keras_distrib.strategies.available(), "
            f"a keras_distrib Strategy object or a tf.distribute strategy, got "
            f"{type(strategy).__name__}."
        )
    return registry.create(strategy, **options)


def _the_entered(
    scope: Strategy, strategy: Union[str, Strategy, tf.distribute.Strategy]
) -> Strategy:
    """Inside a strategy's `scope()` (e.g. `keras.models.load_model` there, as
    TensorFlow's tutorials do) models use that strategy, as Keras's do.
    """
    if strategy is scope:
        return scope
    if isinstance(strategy, str) and registry.canonical(strategy) in (registry.AUTO, scope.name):
        return scope
    if isinstance(strategy, tf.distribute.Strategy) and from_tf.adopt(strategy) is scope:
        return scope
    named = strategy if isinstance(strategy, str) else getattr(strategy, "name", strategy)
    raise ValueError(
        f"Strategy {named!r} was asked for inside the scope of strategy {scope.name!r}; "
        "build the model outside that scope, or leave strategy= out to use the scope's."
    )
