"""The function Keras's `fit` / `evaluate` loop calls for each step: one compiled call.

Keras 3.15's TensorFlow trainer (`TensorFlowTrainer._make_function`) turns
a step into `function(iterator)` as two compiled functions, one nested in
the other (the outer reads the batch, the inner runs the step), and wraps
the step's logs in a `tf.experimental.Optional` that two more eager ops
unwrap after every call. The Optional serves `steps_per_execution > 1`,
where a `tf.while_loop` may run out of data mid-call; with one step per
call Keras itself reads the batch with `get_next()`, whose end of data
(`OutOfRangeError`) Keras's epoch iterator turns into the end of the epoch.

`one_call_per_step` makes that case one compiled function that reads the
batch and runs the step, returning the logs as they are: the same math and
the same end-of-epoch behaviour, without the nested call and the
Optional's two eager ops per step (what that saves on a small model:
`benchmarks/overhead.py`). Everything else (several steps per call,
`run_eagerly`, an iterator that is not a tf.data one) is Keras's own
function. With `jit_compile` the step stays a nested XLA function, as in
Keras (the batch read cannot be compiled by XLA).
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from keras_distrib import _compat


def one_call_per_step(model, step_function: Callable, keras_make_function: Callable):
    """`keras_make_function(step_function)`, as one compiled call per step
    when the model runs one step per call in graph mode."""
    keras_function = keras_make_function(step_function)
    if model.run_eagerly or model.steps_per_execution != 1:
        return keras_function

    def run_step(data):
        # As Keras: absent elements reach the step as None, and the step runs
        # in Keras's (default) strategy's replica context.
        return model.distribute_strategy.run(step_function, args=(_compat.absent_as_none(data),))

    if model.jit_compile:
        run_step = tf.function(run_step, reduce_retracing=True, jit_compile=True, autograph=False)

    # Not converted by AutoGraph, as Keras's step functions are not.
    @tf.function(reduce_retracing=True, autograph=False)
    def one_step_on_iterator(iterator):
        return run_step(iterator.get_next())

    def function(iterator):
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            return one_step_on_iterator(iterator)
        return keras_function(iterator)

    # What each step calls (its graph is tested).
    setattr(function, "compiled", one_step_on_iterator)
    return function
