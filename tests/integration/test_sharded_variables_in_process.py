"""Keras 3 variables sharded as ParameterServerStrategy shards them, in one
process (keras_distrib.strategies.parameter_server.sharded_variables): a variable creator splits
variables into `ShardedVariable`s here, as the strategy does with a
partitioner. Gradients, updates and `install()` against a plain Keras twin.

A real cluster of ps and worker servers: tests/distributed/test_sharded_variables.py
(the model and data of both: tests/workers/sharded_ps.py).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from helpers import WORKERS

sys.path.insert(0, WORKERS)
from sharded_ps import (  # noqa: E402
    EXPECTED_PARTS,
    LENGTH,
    OPTIMIZERS,
    VOCAB,
    build_model,
    data,
    initial_weights,
    loss_fn,
    make_optimizer,
    plain_replay,
)


def _split_in_two(next_creator, **kwargs):
    """A variable creator that, like ParameterServerStrategy with a
    partitioner, splits variables of >= 512 bytes in two along axis 0
    (parts on this process's device) and never a colocated one."""
    import tensorflow as tf

    from keras_distrib import _compat

    if kwargs.pop("colocate_with", None) is not None:
        return next_creator(**kwargs)
    value = kwargs.pop("initial_value")
    value = tf.convert_to_tensor(value() if callable(value) else value, dtype=kwargs.get("dtype"))
    if value.shape.rank == 0 or value.shape.num_elements() * value.dtype.size < 512:
        return next_creator(initial_value=value, **kwargs)
    kwargs.pop("shape", None)
    name, cut = kwargs.pop("name", "v"), (value.shape[0] + 1) // 2
    return _compat.sharded_variable_class()(
        [
            next_creator(initial_value=value[:cut], name=f"{name}/part_0", **kwargs),
            next_creator(initial_value=value[cut:], name=f"{name}/part_1", **kwargs),
        ]
    )


def _sharded_in_process(optimizer_name=None, install_first=True):
    import tensorflow as tf

    from keras_distrib.strategies.parameter_server import sharded_variables

    with tf.variable_creator_scope(_split_in_two):
        model = build_model()
        model.set_weights(initial_weights())
        if optimizer_name is None:
            return model, None
        optimizer = make_optimizer(optimizer_name)
        if install_first:
            sharded_variables.install(optimizer)
            optimizer.build(model.trainable_variables)
            return model, optimizer
    # Built outside: unsharded slots, as Keras makes them under the strategy.
    optimizer.build(model.trainable_variables)
    return model, optimizer


IN_PROCESS_OPTIMIZERS = {
    "sgd": ("SGD", dict(learning_rate=0.1), True),
    "sgd_nesterov": ("SGD", dict(learning_rate=0.1, momentum=0.9, nesterov=True), True),
    **OPTIMIZERS,
}


def _writes(function, variables):
    """{variable part name: op types that write it} in a traced function."""
    names = {id(p.handle): p.name for v in variables for p in _parts(v)}
    captured = {
        inner.name: names[id(outer)]
        for outer, inner in function.graph.captures
        if id(outer) in names
    }
    writes = {}
    for op in function.graph.get_operations():
        if op.inputs and op.inputs[0].name in captured:
            if "Assign" in op.type or "Scatter" in op.type:
                writes.setdefault(captured[op.inputs[0].name], set()).add(op.type)
    return writes


def _parts(variable):
    from keras_distrib.strategies.parameter_server import sharded_variables

    return sharded_variables.shards(variable)


def test_gradients_of_sharded_variables_are_whole_variable_gradients():
    import tensorflow as tf

    from keras_distrib.strategies.parameter_server import sharded_variables

    model, _ = _sharded_in_process()
    assert [sharded_variables.is_sharded(v) for v in model.weights] == [
        len(rows) > 1 for rows in EXPECTED_PARTS.values()
    ]
    plain = build_model()
    plain.set_weights(initial_weights())
    x, y = data(n=32)
    with tf.GradientTape() as tape:
        value = loss_fn()(y, model(x, training=True))
    ours = sharded_variables.gradients(tape, value, model.trainable_variables)
    with tf.GradientTape() as tape:
        value = loss_fn()(y, plain(x, training=True))
    theirs = tape.gradient(value, plain.trainable_variables)
    assert [type(g) for g in ours] == [type(g) for g in theirs]
    assert isinstance(ours[0], tf.IndexedSlices)
    assert ours[0].dense_shape.numpy().tolist() == [VOCAB, 16]
    # Within what other orders of the step's sums allow (the parts' rows
    # are gathered and their products added apart).
    from float_bounds import Trace, assert_within, gradient_errors, gradient_terms

    plain.compile(optimizer="sgd", loss=loss_fn())
    trace = Trace(model=plain)
    trace.record(x, y)
    bounds = gradient_errors(trace, gradient_terms(plain, len(x)))[0]
    for v, a, b, bound in zip(model.trainable_variables, ours, theirs, bounds):
        assert tuple(a.shape) == tuple(v.shape)
        assert_within(tf.convert_to_tensor(a), tf.convert_to_tensor(b), bound, v.path)


@pytest.mark.parametrize("name", list(IN_PROCESS_OPTIMIZERS))
def test_sharded_updates_are_assign_sub_or_scatter_sub_of_parts(name, monkeypatch):
    import tensorflow as tf

    from keras_distrib.strategies.parameter_server import sharded_variables

    monkeypatch.setitem(OPTIMIZERS, name, IN_PROCESS_OPTIMIZERS[name])
    model, optimizer = _sharded_in_process(name)
    x, y = data(n=64)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss_fn()(y, model(x, training=True))
        grads = sharded_variables.gradients(tape, value, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    writes = _writes(step.get_concrete_function(x, y), model.trainable_variables)
    # Never an assignment of a value computed from the weight: the increments
    # of asynchronous workers add up. The embedding's sparse gradient stays
    # sparse where Keras's update keeps it so (plain SGD).
    allowed = {"AssignSubVariableOp", "AssignAddVariableOp"}
    for v in model.trainable_variables:
        for part in _parts(v):
            sparse = name == "sgd" and "embedding" in v.path
            expected = {"ResourceScatterSub"} if sparse else allowed
            assert writes[part.name] and writes[part.name] <= expected, (part.name, writes)
    xs, ys = x.reshape(4, 16, LENGTH), y.reshape(4, 16)
    for xb, yb in zip(xs, ys):
        step(xb, yb)
    # Plain Keras on the same four batches, traced: the bounds of the same
    # math in other orders of sums.
    import as_reference
    from float_bounds import assert_within

    _, plain_optimizer, _, reference = plain_replay(name, xs, ys)
    as_reference.assert_weights(reference, model)
    assert len(optimizer.variables) == len(reference.slots)
    for a, b, bound in zip(optimizer.variables, plain_optimizer.variables, reference.slots):
        assert_within(a.numpy(), np.asarray(b), bound, a.path)


def test_install_after_build_shards_the_slots_keeping_values():
    import tensorflow as tf

    from keras_distrib.strategies.parameter_server import sharded_variables

    model, optimizer = _sharded_in_process("adam", install_first=False)
    slots = list(optimizer.variables)
    sharded = [v.path for v in slots if sharded_variables.is_sharded(v)]
    assert sharded == []  # Keras alone: one unsharded slot per weight
    for v in slots:
        v.assign(tf.random.normal(v.shape) if v.shape.rank else v + 3)
    before = [v.numpy() for v in slots]
    with tf.variable_creator_scope(_split_in_two):
        sharded_variables.install(optimizer)
    assert optimizer.variables == slots  # the same Keras variables
    expected = {
        f"{optimizer.name}/{w.path.replace('/', '_')}_{slot}"
        for w in model.trainable_variables
        if sharded_variables.is_sharded(w)
        for slot in ("momentum", "velocity")
    }
    assert {v.path for v in slots if sharded_variables.is_sharded(v)} == expected
    for v, value in zip(slots, before):
        np.testing.assert_array_equal(v.numpy(), value)


def test_gradients_is_tape_gradient_when_nothing_is_sharded():
    import tensorflow as tf

    from keras_distrib.strategies.parameter_server import sharded_variables

    model = build_model()
    model.set_weights(initial_weights())
    x, y = data(n=32)
    with tf.GradientTape(persistent=True) as tape:
        value = loss_fn()(y, model(x, training=True))
    ours = sharded_variables.gradients(tape, value, model.trainable_variables)
    theirs = tape.gradient(value, model.trainable_variables)
    assert [type(g) for g in ours] == [type(g) for g in theirs]
    assert isinstance(ours[0], tf.IndexedSlices)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(tf.convert_to_tensor(a), tf.convert_to_tensor(b))
    assert not any(sharded_variables.is_sharded(v) for v in model.weights)


def test_install_leaves_unsharded_training_unchanged():
    import tensorflow as tf

    from keras_distrib.strategies.parameter_server import sharded_variables

    x, y = data(n=64)
    results = []
    for install in (False, True):
        model = build_model()
        model.set_weights(initial_weights())
        optimizer = make_optimizer("adamw")
        if install:
            sharded_variables.install(optimizer)
            sharded_variables.install(optimizer)  # idempotent
        for xb, yb in zip(np.split(x, 4), np.split(y, 4)):
            with tf.GradientTape() as tape:
                value = loss_fn()(yb, model(xb, training=True))
            grads = sharded_variables.gradients(tape, value, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        results.append(model.get_weights() + [v.numpy() for v in optimizer.variables])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
