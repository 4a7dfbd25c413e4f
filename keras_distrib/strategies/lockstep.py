"""Execution in lockstep: every replica runs each step at the same time.

The mixin for synchronous data-parallel engines (tf.distribute, Horovod):
the per-replica step runs on every local replica through the strategy's
`run`, the step's collectives keep the processes in step, and the
per-replica results become plain numbers for Keras's callbacks
(`step_logs`). With `jit_compile=True` XLA compiles each replica's math
(forward and backward pass) and not the whole step: collectives cannot run
inside one XLA cluster.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable

import tensorflow as tf

from keras_distrib import _compat

if TYPE_CHECKING:
    from keras_distrib.collectives.transport import Transport


class Lockstep(abc.ABC):
    """`make_step_function` / `make_predict_function` for lockstep engines."""

    if TYPE_CHECKING:  # the strategy's (`Strategy.run`, `Strategy.transport`)
        transport: Transport

        def run(self, replica_fn: Callable, batch: Any) -> Any: ...

    @abc.abstractmethod
    def step_logs(self, model, outputs: Any) -> Any:
        """Per-batch logs as plain tensors, from what `run` returned."""

    def concat(self, per_replica: Any) -> Any:
        """All replicas' outputs concatenated in global replica order, on
        every process (the transport's `gather_rows`)."""
        return self.transport.gather_rows(per_replica)

    def make_step_function(self, model, step, keras_make_function: Callable):
        model.compile_replicas_separately(model.jit_compile)

        def distributed_step(data):
            return self.step_logs(model, self.run(step.fn, data))

        if model.steps_per_execution > 1:
            return stepwise(model, distributed_step)
        with _compat.jit_compile_off(model):
            return keras_make_function(distributed_step)

    def make_predict_function(self, model, step, keras_make_predict_function: Callable):
        model.compile_replicas_separately(model.jit_compile)

        def predict_step(batch):
            return model.replica_compiled(step.fn)(batch)

        return predict_over_steps(model, lambda step: self.concat(self.run(predict_step, step)))


def predict_over_steps(model, predict_one: Callable):
    """The function Keras's predict loop calls with the batches of one
    execution (`steps_per_execution` of them): `predict_one` on each, the
    outputs concatenated in order; compiled unless `model.run_eagerly`."""

    def predict_function(steps):
        outputs = [predict_one(step) for step in steps]
        if len(outputs) == 1:
            return outputs[0]
        return tf.nest.map_structure(lambda *t: tf.concat(t, axis=0), *outputs)

    if not model.run_eagerly:
        # Not converted by AutoGraph, as Keras's own step functions are not
        # (`do_not_convert`): the same semantics, and errors raised while
        # tracing (a wrong input shape) reach the user as Keras raised them.
        predict_function = tf.function(predict_function, reduce_retracing=True, autograph=False)
    return predict_function


def stepwise(model, distributed_step):
    """`steps_per_execution` steps per call, one compiled step at a time.

    Keras fuses the steps with `tf.while_loop` + `tf.cond`, but
    `tf.distribute` replicas cannot be traced inside `tf.cond` (TensorFlow
    fails with "You must feed a value for placeholder"), so the steps run
    from Python; results are identical.
    """
    one_step = distributed_step
    if not model.run_eagerly:
        one_step = tf.function(
            distributed_step, reduce_retracing=True, autograph=False
        )  # as Keras's (see predict_over_steps)

    def function(iterator):
        outputs = None
        for _ in range(model.steps_per_execution):
            try:
                data = next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                break
            outputs = one_step(data)
        if outputs is None:
            raise StopIteration
        return outputs

    return function
