"""Keras's TensorFlow backend internals: the TensorFlow variable under a
Keras variable, its `assign_add`, variable creation inside a
`StatelessScope`, the backend's seed draws, and its rematerialization.
Verified on Keras 3.15.1 / TensorFlow 2.21.0."""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import numpy as np
import tensorflow as tf

# Private names the shims below use (checked at import, see `versions`).
PRIVATE = (
    # backing_variable, variable_value, replace_variable_value
    "keras.src.backend.common.variables:Variable._value",
    # set_variable_value
    "keras.src.backend.tensorflow.core:Variable._initialize",
    # variables_made_at_once
    "keras.src.backend.common.global_state:get_global_attribute",
    "keras.src.backend.common.global_state:set_global_attribute",
    # remat_in_graphs
    "keras.src.backend.tensorflow.core:remat",
    # wrap_backend_draw_seed
    "keras.src.backend.tensorflow.random:draw_seed",
    "keras.src.backend.tensorflow.image:draw_seed",
)


def add_through_tensorflow(variable) -> None:
    """Makes `variable.assign_add(v)` TensorFlow's own `assign_add`.

    Keras 3 implements `Variable.assign_add(v)` as `assign(self + v)`
    (keras/src/backend/common/variables.py). Under a strategy that keeps one
    aggregating copy of a variable for several replicas (CentralStorage), each
    replica's `assign` is summed: the result is `R * self + sum(v)` instead of
    `self + sum(v)`. TensorFlow's `assign_add` aggregates the increments.
    """
    tf_variable = variable.value

    def assign_add(value):
        return tf_variable.assign_add(tf.cast(value, tf_variable.dtype))

    variable.assign_add = assign_add


def backing_variable(variable):
    """The TensorFlow variable under Keras variable `variable`
    (`Variable._value`), or None while it is not initialized. The public
    `value` is a tensor (autocast, or the initializer's value while
    uninitialized), not that object; copying a layer leaves it out, to be
    made again (`set_variable_value`)."""
    return variable._value


def variable_value(variable):
    """The whole value of Keras variable `variable` (numpy), or None when
    it is not initialized yet (`_value` None: it is made where it is first
    used, so it needs no moving)."""
    if variable._value is None:
        return None
    return np.asarray(variable.numpy())


def set_variable_value(variable, value) -> None:
    """Makes the TensorFlow variable under Keras variable `variable` again,
    holding `value`, where the current scope and device say: Keras's TF
    `Variable._initialize` (keras/src/backend/tensorflow/core.py), which is
    how Keras made it first, with its name, trainability, aggregation and
    synchronization.

    Keras has no public way to move a variable under a tf.distribute
    strategy or onto a device other than a config round trip of the whole
    layer (`clone_model`); this keeps the Keras variable object, so every
    layer, optimizer list and saving path that refers to it stays right.
    """
    variable._initialize(value)


def replace_variable_value(variable, value) -> None:
    """Points a Keras variable at another TF variable (`variable._value`).

    Keras's only public ways to set a variable's backing TF variable are at
    construction; an optimizer's slots, once built, are referenced from its
    own lists and tracking, so replacing the backing variable in place keeps
    them all consistent.
    """
    variable._value = value


@contextlib.contextmanager
def variables_made_at_once() -> Iterator[None]:
    """Variables created inside exist at once, where `tf.device` says, even
    within Keras's `StatelessScope` (fit's symbolic build, keras
    backend/tensorflow/core.py `compute_output_spec`): there Keras defers
    creating them to the scope's exit, outside any device scope, so a
    shard made for device 1 would land on device 0."""
    from keras.src.backend.common import global_state

    scope = global_state.get_global_attribute("stateless_scope")
    global_state.set_global_attribute("stateless_scope", None)
    try:
        yield
    finally:
        global_state.set_global_attribute("stateless_scope", scope)


def wrap_backend_draw_seed(wrapper) -> None:
    """Routes the TensorFlow backend's seed draws through
    `wrapper(keras_draw_seed, seed)` (see `keras_distrib.replica_seeds`).

    Every random op of the backend (`keras/src/backend/tensorflow/random.py`
    and `image.py`) turns its `seed` argument into a seed tensor with
    `draw_seed`, imported by name into those modules; no public hook sees
    the seed between the generator and the op.
    """
    from keras.src.backend.tensorflow import image as tf_image
    from keras.src.backend.tensorflow import random as tf_random

    def wrapped(keras_draw_seed):
        @functools.wraps(keras_draw_seed)
        def draw_seed(seed):
            return wrapper(keras_draw_seed, seed)

        return draw_seed

    for module in (tf_random, tf_image):
        module.draw_seed = wrapped(module.draw_seed)


def remat_in_graphs() -> None:
    """Makes Keras's rematerialization (`keras.RematScope`, `keras.remat`)
    work in `fit` on TensorFlow.

    The TensorFlow backend's `remat(f)` is `tf.recompute_grad(f)`, whose
    `tf.custom_gradient` takes keyword arguments only when executing
    eagerly; Keras calls a rematerialized layer with some (`training`,
    `mask`), so every traced step failed ("The custom_gradient decorator
    currently supports keywords arguments only when eager execution is
    enabled"). Here the tensors among the arguments (composite tensors as
    their components) are passed to `tf.recompute_grad` positionally and
    everything else is closed over: the same function, recomputed in the
    backward pass. Idempotent.
    """
    from keras.src.backend.tensorflow import core

    if getattr(core.remat, "_kd_wrapped", False):
        return

    def remat(f):
        @functools.wraps(f)
        def rematerialized(*args, **kwargs):
            flat = tf.nest.flatten((args, kwargs), expand_composites=True)
            is_tensor = [isinstance(v, tf.Tensor) for v in flat]

            def positional(*tensors):
                given = iter(tensors)
                values = [next(given) if t else v for v, t in zip(flat, is_tensor)]
                call_args, call_kwargs = tf.nest.pack_sequence_as(
                    (args, kwargs), values, expand_composites=True
                )
                return f(*call_args, **call_kwargs)

            return tf.recompute_grad(positional)(*[v for v, t in zip(flat, is_tensor) if t])

        return rematerialized

    setattr(remat, "_kd_wrapped", True)
    core.remat = remat
