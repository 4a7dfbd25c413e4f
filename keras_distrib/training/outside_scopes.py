"""`outside_scopes`: a `DistributedModel` method run outside the caller's
tf.distribute scope.

The model distributes itself on its own strategy, so its `compile`, `fit`,
`evaluate`, `predict` and the adoption of its variables step out of any
scope the caller entered (see `_compat.outside_strategy_scopes`).
"""

from __future__ import annotations

import functools

import tensorflow as tf

from keras_distrib import _compat


def outside_scopes(method):
    """`method`, run outside any tf.distribute scope the caller is in (see
    `_compat.outside_strategy_scopes`): the model distributes itself."""

    @functools.wraps(method)
    def run_outside(self, *args, **kwargs):
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            with _compat.outside_strategy_scopes():
                return method(self, *args, **kwargs)
        return method(self, *args, **kwargs)

    return run_outside
