"""Keras's own all-reduce of an optimizer, switched off where the model's
step reduced the gradients already.

Keras's TF optimizer sums gradients across replicas inside
`apply_gradients`. The model's training step reduces them once itself, so
each optimizer the model adopts gets the model's `ReductionSwitch`
(`install_reduction_switch`): while the step applies reduced gradients the
sum is skipped; gradients a custom `train_step` applies itself are reduced
by the strategy instead. The sharded optimizer (`optimizer_shards`) reads
the same switch.
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

from keras_distrib import _compat


class ReductionSwitch:
    """Whether the gradients an optimizer applies now were reduced by the
    model's step: one per model, read by the optimizers it adopted.

    Trace-time state: how many replica threads are applying already reduced
    gradients. Not thread-local: a loss-scale optimizer under
    MirroredStrategy applies them from `merge_call`, in other threads than
    the replicas' (see `install_reduction_switch`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._applying = 0

    @property
    def reduced(self) -> bool:
        """Whether a replica is applying gradients the step reduced."""
        return self._applying > 0

    @contextlib.contextmanager
    def applying_reduced(self):
        """Marks the block as applying already reduced gradients."""
        with self._lock:
            self._applying += 1
        try:
            yield
        finally:
            with self._lock:
                self._applying -= 1


def install_reduction_switch(optimizer, strategy, switch: ReductionSwitch) -> None:
    """Lets our step make Keras's optimizer skip its own gradient all-reduce,
    and gives a custom `train_step`'s `apply_gradients` the strategy's.

    Keras's TF optimizer sums gradients across replicas inside
    `apply_gradients` when called in a replica context. `train_step` has
    already reduced them (reducing twice multiplies them by the replica
    count), so while `apply_reduced_gradients` runs (`switch.reduced`) the
    sum is skipped, in whichever thread the optimizer applies them (a
    `LossScaleOptimizer` applies through `merge_call` and
    `call_for_each_replica`). Gradients a custom `train_step` applies
    itself are averaged over the replicas instead
    (`Strategy.reduce_applied_gradients`: Keras's losses are not divided by
    the replica count under our engines, so its sum would be too large).
    The switch acts at trace time.
    """

    def unless_reduced(_keras_sum):
        def all_reduce_unless_reduced(grads_and_vars):
            if switch.reduced or tf.distribute.in_cross_replica_context():
                # Reduced by our step, or applied once for all replicas
                # (central_storage reduced them in the replicas first).
                return list(grads_and_vars)
            return strategy.reduce_applied_gradients(list(grads_and_vars))

        return all_reduce_unless_reduced

    _compat.wrap_optimizer_all_reduce(optimizer, unless_reduced)
