"""Keras 3 variables split over parameter servers (TensorFlow `ShardedVariable`).

`tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=...)`
splits a variable created in its scope along axis 0 when the partitioner
asks for more than one part: a Keras variable's `.value` is then a
`ShardedVariable` whose `.variables` are the parts, each a variable on its own
ps. Keras 3 does not handle these in training (TensorFlow 2.21, Keras 3.15):

- `tape.gradient(loss, model.trainable_variables)` fails ("'ShardedVariable'
  object has no attribute 'handle'"): use `gradients(tape, loss, variables)`.
- the optimizer's update fails ("ShardedVariable doesn't support being used
  as a reference"), and the slot variables Keras creates for a sharded
  weight (SGD momentum, Adam m and v) are one unsharded variable placed on
  the coordinator: call `install(optimizer)`.

Saving: `save_weights`, `model.save(".keras")`, `get_weights`, `set_weights`
and `load_weights` read a sharded variable whole and write it slice by
slice, so files are those of an unsharded model of the same architecture,
and load into either. Keras's writers call `np.asarray(variable)`, which
TensorFlow's ShardedVariable lacks; importing this module adds it.

A train step under the strategy::

    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    grads = sharded_variables.gradients(tape, loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

with `sharded_variables.install(optimizer)` called once before the step is
traced (before or after `optimizer.build`).

Not handled: Keras's `gradient_accumulation_steps` and `use_ema` paths, which
call `strategy.extended.update` on the slots themselves, and a
`LossScaleOptimizer` (untested).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import keras
import tensorflow as tf

from keras_distrib import _compat

__all__ = ["gradients", "install", "is_sharded", "shards"]

# Keras saves `np.asarray(variable)`, which a ShardedVariable does not support
# by itself (see _compat); process-wide, from the import of this module.
_compat.convert_sharded_variables_to_numpy()


def _tf_variable(variable: Any) -> Any:
    """The TensorFlow object behind a Keras variable (itself otherwise)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def is_sharded(variable: Any) -> bool:
    """Whether `variable` (a Keras variable or a TF variable) is a
    `ShardedVariable`, i.e. is split over several parameter servers."""
    return isinstance(_tf_variable(variable), _compat.sharded_variable_class())


def shards(variable: Any) -> list:
    """The parts of a sharded variable, in row order (axis 0); `[variable]`'s
    TF variable when it is not sharded."""
    value = _tf_variable(variable)
    if isinstance(value, _compat.sharded_variable_class()):
        return list(value.variables)
    return [value]


def _row_offsets(parts: Sequence) -> list[int]:
    offsets = [0]
    for part in parts[:-1]:
        offsets.append(offsets[-1] + int(part.shape[0]))
    return offsets


def _join(parts: Sequence, grads: Sequence, shape: tf.TensorShape):
    """One whole-variable gradient from the gradients of the parts."""
    if all(g is None for g in grads):
        return None
    offsets = _row_offsets(parts)
    if not any(isinstance(g, tf.IndexedSlices) for g in grads):
        return tf.concat(
            [tf.zeros(p.shape, p.dtype) if g is None else g for p, g in zip(parts, grads)],
            axis=0,
        )
    # Sparse: rows of every part, with indices shifted to the whole variable.
    index_dtype = next(g.indices.dtype for g in grads if isinstance(g, tf.IndexedSlices))
    values, indices = [], []
    for part, grad, offset in zip(parts, grads, offsets):
        if grad is None:
            continue
        if isinstance(grad, tf.IndexedSlices):
            values.append(grad.values)
            indices.append(tf.cast(grad.indices, index_dtype) + offset)
        else:  # a dense part next to sparse ones: all of its rows
            values.append(grad)
            indices.append(tf.range(offset, offset + int(part.shape[0]), dtype=index_dtype))
    return tf.IndexedSlices(
        tf.concat(values, axis=0),
        tf.concat(indices, axis=0),
        dense_shape=tf.constant(shape.as_list(), dtype=index_dtype),
    )


def gradients(tape: tf.GradientTape, target, variables: Sequence, **kwargs) -> list:
    """`tape.gradient(target, variables)` for Keras variables, sharded or not.

    Returns one gradient per variable, shaped like the whole variable: the
    gradients of a sharded variable's parts are joined along axis 0 (a dense
    tensor; or, when the parts' gradients are `tf.IndexedSlices`, as for an
    `Embedding`, one `tf.IndexedSlices` with row indices of the whole
    variable and its full `dense_shape`). `None` where `target` does not
    depend on a variable. Exactly `tape.gradient(target, variables,
    **kwargs)` when no variable is sharded. `kwargs` (`output_gradients`,
    `unconnected_gradients`) are passed to `tape.gradient`.
    """
    variables = list(variables)
    if not any(is_sharded(v) for v in variables):
        return tape.gradient(target, variables, **kwargs)
    sources: list[Any] = []
    spans: list[tuple[int, Optional[list[Any]]]] = []  # (start in `sources`, its shards)
    for variable in variables:
        if is_sharded(variable):
            pieces = shards(variable)
            spans.append((len(sources), pieces))
            sources.extend(pieces)
        else:
            spans.append((len(sources), None))
            sources.append(variable)
    flat = tape.gradient(target, sources, **kwargs)
    result = []
    for variable, (start, parts) in zip(variables, spans):
        if parts is None:
            result.append(flat[start])
        else:
            result.append(
                _join(parts, flat[start : start + len(parts)], tf.TensorShape(variable.shape))
            )
    return result


def _sharded_slot_creator(reference):
    """A variable creator making a variable sharded like `reference` (a
    ShardedVariable): part i has part i's rows and lives on its ps."""

    def creator(next_creator, **kwargs):
        kwargs.pop("colocate_with", None)
        kwargs.pop("shape", None)
        name = kwargs.pop("name", None)
        initial_value = kwargs.pop("initial_value")
        if callable(initial_value):
            initial_value = initial_value()
        initial_value = tf.convert_to_tensor(initial_value, dtype=kwargs.get("dtype"))
        parts = list(reference.variables)
        made = []
        for i, (part, offset) in enumerate(zip(parts, _row_offsets(parts))):
            rows = initial_value[offset : offset + int(part.shape[0])]
            # ParameterServerStrategy's creator places a variable created
            # with `colocate_with` on that variable's ps, unpartitioned.
            with tf.device(part.device):
                made.append(
                    next_creator(
                        initial_value=rows,
                        shape=part.shape,
                        name=None if name is None else f"{name}/part_{i}",
                        colocate_with=part,
                        **kwargs,
                    )
                )
        return _compat.sharded_variable_class()(made)

    return creator


def _reshard_built_slots(optimizer) -> None:
    """Replaces, value kept, the unsharded slot of each sharded weight."""
    weights = [w for w in _compat.optimizer_trainable_variables(optimizer) if is_sharded(w)]
    if not weights:
        return
    # Keras names the slot of weight `a/b` `a_b_<slot name>`; longest first
    # so that `a/b_c` is not taken for `a/b`.
    prefixes = sorted(
        ((w.path.replace("/", "_") + "_", w) for w in weights), key=lambda item: -len(item[0])
    )
    with tf.init_scope(), _compat.optimizer_strategy(optimizer).scope():
        for slot in optimizer.variables:
            if is_sharded(slot):
                continue
            for prefix, weight in prefixes:
                if slot.name.startswith(prefix) and slot.shape == weight.shape:
                    with tf.variable_creator_scope(_sharded_slot_creator(weight.value)):
                        value = tf.Variable(
                            tf.convert_to_tensor(slot.value), trainable=False, name=slot.name
                        )
                    _compat.replace_variable_value(slot, value)
                    break


def install(optimizer) -> None:
    """Makes a Keras optimizer train sharded variables. Idempotent.

    Call before the training step that applies gradients is traced, in the
    strategy's scope when the optimizer is not built yet (its slots are made
    at `optimizer.build` or the first `apply_gradients`). Then:

    - the slots it creates for a sharded weight (momentum, Adam's m and v,
      ...) are sharded like the weight: part i has the rows of weight part i
      and lives on the same ps (Keras alone makes one unsharded variable on
      the coordinator). Each slot stays one Keras variable, so saved
      optimizer state matches an unsharded model's.
    - `apply_gradients` takes whole-variable gradients (as `gradients`
      returns) for sharded weights and runs the optimizer's own
      `update_step` on the ShardedVariable, whose writes are TensorFlow ops
      on each part: `assign_sub`/`assign_add` of the part's slice of a dense
      delta, `scatter_sub` of the part's rows of an `IndexedSlices` one.
      Weights are only ever incremented that way (SGD, momentum, Adam,
      AdamW's decay), never assigned a value read from them, so the updates
      of asynchronous workers add up as for unsharded variables; slots are
      written as Keras writes them (SGD's momentum by `assign`). The update's
      arithmetic runs on the worker, on whole-variable tensors (Keras runs
      it on the ps of an unsharded variable).

    Unsharded variables are updated by Keras's code, unchanged.

    On an optimizer already built (e.g. by `model.fit`'s build, or by
    `keras.models.load_model` in the strategy's scope), the unsharded slots
    Keras made for sharded weights are replaced by sharded ones, values
    kept; the slot Keras variables stay the same objects.
    """
    add_slot = optimizer.add_variable_from_reference
    if getattr(add_slot, "shards_slots", False):
        return
    if optimizer.built:
        _reshard_built_slots(optimizer)
    _compat.route_sharded_updates(optimizer, is_sharded)

    def add_variable_from_reference(reference_variable, *args, **kwargs):
        value = _tf_variable(reference_variable)
        if not isinstance(value, _compat.sharded_variable_class()):
            return add_slot(reference_variable, *args, **kwargs)
        with tf.variable_creator_scope(_sharded_slot_creator(value)):
            return add_slot(reference_variable, *args, **kwargs)

    setattr(add_variable_from_reference, "shards_slots", True)
    optimizer.add_variable_from_reference = add_variable_from_reference
