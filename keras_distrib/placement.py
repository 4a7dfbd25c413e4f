"""A model's variables moved where its strategy keeps them, in place.

A graph, an optimizer or a metric that the user made outside the strategy
holds plain variables. Keras's own way to make them again elsewhere is a
config round trip (`keras.models.clone_model`, `from_config`), which
refuses a `Lambda` holding a Python lambda, fails on a layer or metric
whose `__init__` takes no `**kwargs`, and loses whatever a layer keeps
outside its config. Plain Keras never needs a config to train a model, so
neither do we: each Keras variable keeps its identity (the layer, the
optimizer's slot lists and the saving code all still refer to it), and only
the TensorFlow variable under it is made again, with the same value, under
the strategy's scope and device (`_compat.set_variable_value`).

A variable lives under one strategy. A `DistributedModel` made from the
layers of another live `DistributedModel` (the Functional API lets two
models share layers) therefore gets copies of them (`copy_functional`, as
`from_model` does), and a subclassed one that takes such layers is refused
in one line. A `DistributedModel` nested in another as a layer is not
another model but part of it: the outer one takes its variables over
(`nested_in`), as a Keras model trains its sub-models.

`copy_functional` is what `DistributedModel.from_model` wraps: a copy of
a Functional graph whose layers are copies of the originals, object by
object (`structural_copy`), not re-creations from their configs.
"""

from __future__ import annotations

import copy
import copyreg
import types
import weakref
from typing import Any, Iterable, Sequence, Union

import numpy as np

from keras_distrib import _compat
from keras_distrib import devices as devices_lib

# id(Keras variable) -> weak references to (that variable, the model that
# holds it, that model's strategy). By id: a variable's `==` is elementwise.
_OWNERS: dict[int, tuple] = {}


def unheld(strategy, variables: Iterable[Any], model=None) -> list:
    """The variables among `variables` that `strategy` does not hold yet,
    each once.

    Raises:
        ValueError: one of them was moved for another live model, on
            another strategy (layers shared between two models).
    """
    found, seen = [], set()
    for variable in variables:
        if id(variable) in seen or strategy.holds(variable):
            continue
        seen.add(id(variable))
        _check_not_taken(variable, strategy, model)
        found.append(variable)
    return found


def remake(variables: Sequence[Any], strategy, model=None, where=None) -> None:
    """Makes each variable again, with its value, inside `where()` (a
    context manager factory: the strategy's scope by default, or a device's),
    and records it as `model`'s. The values are read first, outside it: a
    variable made under another tf.distribute strategy (the user's scope)
    can only be read outside ours."""
    values = [_compat.variable_value(v) for v in variables]
    with (where or strategy.scope)():
        for variable, value in zip(variables, values):
            if value is not None:
                _compat.set_variable_value(variable, value)
    if model is not None:
        claim(variables, strategy, model)


def claim(variables: Iterable[Any], strategy, model) -> None:
    """Records `variables` as `model`'s, under `strategy`."""
    for key in [k for k, entry in _OWNERS.items() if entry[0]() is None]:
        del _OWNERS[key]  # variables gone
    for variable in variables:
        try:
            _OWNERS[id(variable)] = (
                weakref.ref(variable),
                weakref.ref(model),
                weakref.ref(strategy),
            )
        except TypeError:  # not weak-referenceable: not tracked
            pass


def _owner(variable):
    """`(model, strategy)` that hold `variable`, both alive, or None."""
    entry = _OWNERS.get(id(variable))
    if entry is None or entry[0]() is not variable:
        return None
    model, strategy = entry[1](), entry[2]()
    return None if model is None or strategy is None else (model, strategy)


def owned_by_another(variables: Iterable[Any], model=None) -> bool:
    """Whether any of `variables` belongs to a live `DistributedModel` other
    than one nested in `model` (a sub-model used as a layer of it)."""
    return any(
        owner is not None and not nested_in(owner[0], model) for owner in map(_owner, variables)
    )


def nested_in(layer, model) -> bool:
    """Whether `layer` is one of `model`'s layers, at any depth. A model
    nested in another trains as part of it, as in Keras, so the outer
    model takes over the variables the inner one held."""
    return model is not None and any(layer is inner for inner in _compat.all_layers(model))


def _check_not_taken(variable, strategy, model) -> None:
    owner = _owner(variable)
    if owner is None:
        return
    other_model, other_strategy = owner
    if other_model is model or other_strategy is strategy or nested_in(other_model, model):
        return
    raise ValueError(
        f"Variable {variable.path!r} belongs to model {other_model.name!r} on strategy "
        f"{other_strategy.name!r}, and a variable lives under one strategy; build the layers "
        "again for this model, or copy the trained model with "
        "keras_distrib.DistributedModel.from_model(model, strategy=...)."
    )


# -- from_model: a copy without configs ---------------------------------------------


def copy_graph(inputs: Any, outputs: Any) -> tuple[Any, Any]:
    """`(inputs, outputs)` of a copy of the graph between `inputs` and
    `outputs` (see `copy_functional`)."""
    import keras

    copied = copy_functional(keras.Model(inputs, outputs))
    return copied.input, copied.output


def copy_functional(model: Any) -> Any:
    """A Functional copy of the Functional (or Sequential) `model`: new
    inputs, and a copy of each of its layers called on them in its graph's
    order. Shared layers stay shared, nested models are copied whole, and
    each copied variable is a new plain variable holding the original's
    whole value (a layer that a strategy split comes back whole).

    Layers are copied object by object (`structural_copy`), not from their
    configs, so `Lambda` layers, user layers without `get_config` and
    layers holding callables, arrays or other layers copy as they are.
    """
    import keras

    graph = _compat.functional_graph(model)
    template = keras.Model(graph.input, graph.output, name=model.name)
    memo: dict[int, Any] = {}
    for layer in template.layers:
        # The copies are linked into the new graph only: none of the old
        # graph's nodes (or the layers and models they lead to) is copied.
        for nodes in _compat.node_lists(layer):
            memo[id(nodes)] = []
    copies: dict[int, Any] = {}

    def copy_layer(layer):
        if id(layer) not in copies:
            copies[id(layer)] = _copy_layer(layer, memo)
        return copies[id(layer)]

    return _compat.clone_functional(template, clone_function=copy_layer)


def copy_objects(structure):
    """Copies of the metric and loss objects in `structure` (as passed to
    `compile`), object by object (`structural_copy`), each metric's state
    reset; names and other values as they are."""
    import keras

    def copied(item):
        if isinstance(item, keras.metrics.Metric):
            memo = {
                id(_compat.backing_variable(v)): None  # made afresh below
                for v in item.variables
            }
            twin = structural_copy(item, memo)
            for variable in item.variables:
                _compat.set_variable_value(memo[id(variable)], np.asarray(variable.numpy()))
            twin.reset_state()
            return twin
        if isinstance(item, keras.losses.Loss):
            return structural_copy(item, {})
        return item

    return keras.tree.map_structure(copied, structure) if structure is not None else None


def _copy_layer(layer, memo: dict):
    """`layer` copied with its whole values, not linked into the old graph."""
    if any(devices_lib.is_split(v) for v in getattr(layer, "weights", ())):
        # Split by tensor_parallel (a plain Dense / Embedding): a new plain
        # layer from its config, given the whole values its `get_weights`
        # gathers.
        twin = layer.__class__.from_config(layer.get_config())
        twin.build_from_config(layer.get_build_config())
        twin.set_weights(layer.get_weights())
        return twin
    try:
        return _copy_with_values(layer, memo)
    except Exception as structural:  # noqa: BLE001 (any object a layer may hold)
        try:
            # Keras's own copy: through a `.keras` file in memory (config,
            # weights and assets), `KerasSaveable.__reduce__`.
            return copy.deepcopy(layer)
        except Exception:  # noqa: BLE001
            raise ValueError(
                f"Layer {layer.name!r} ({type(layer).__name__}) cannot be copied "
                f"({type(structural).__name__}: {structural}); build the model with "
                "keras_distrib.DistributedModel(inputs, outputs, strategy=...) instead of "
                "from_model (it takes the layers themselves)."
            ) from structural


def _copy_with_values(layer, memo: dict):
    """`structural_copy(layer)`, its variables given new plain TensorFlow
    variables holding the original's values, and a `call` a strategy pinned
    to a device the class's again."""
    variables = _unique(list(getattr(layer, "variables", ())) + _metric_variables(layer))
    for variable in variables:
        memo[id(_compat.backing_variable(variable))] = None  # made afresh below, not copied
    twin = structural_copy(layer, memo)
    _relink_trackers(memo)
    for variable in variables:
        copied = memo[id(variable)]
        if _compat.backing_variable(copied) is None:
            _compat.set_variable_value(copied, np.asarray(variable.numpy()))
    if getattr(vars(twin).get("call"), "_kd_pinned", False):
        del vars(twin)["call"]
    return twin


def _relink_trackers(memo: dict) -> None:
    """Keras's `Tracker` (behind each layer's variable and sub-layer lists)
    remembers what it tracks by `id()`; in a copy those are the originals'
    ids, and untracking a copied variable (a layer split by
    tensor_parallel drops its whole kernel) found nothing. Each copied
    tracker's ids become those of the copies."""
    for copied in list(memo.values()):
        if type(copied).__name__ != "Tracker":
            continue
        stored = getattr(copied, "stored_ids", None)
        if not isinstance(stored, dict):
            continue
        for name, ids in stored.items():
            stored[name] = {id(memo[i]) if i in memo else i for i in ids}


_ATOMIC = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type,
    range,
    slice,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.ModuleType,
    weakref.ref,
    property,
    type(Ellipsis),
    type(NotImplemented),
)


def structural_copy(obj, memo: dict):
    """`copy.deepcopy(obj, memo)`, except that Keras objects (layers,
    models, metrics...) are copied attribute by attribute.

    `copy.deepcopy` of a Keras object goes through `KerasSaveable.__reduce__`,
    which saves it to a `.keras` file in memory and loads it back: a config
    round trip (with `safe_mode=False`), which fails for a layer whose
    `__init__` takes no `**kwargs` and loses what a layer keeps outside its
    config. Here every object is rebuilt from its class and its state as
    the pickle protocol describes it (`object.__reduce_ex__(4)`), the state
    copied with this same function.
    """
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, _ATOMIC):
        return obj
    # As `copy.deepcopy`: what was copied stays alive while `memo` does, so
    # that no id in it is reused by a temporary (a state dict).
    memo.setdefault(id(memo), []).append(obj)
    cls = type(obj)
    copied: Any  # a list, dict, tuple or bound method, as `obj` is
    reduced: Union[str, tuple[Any, ...]]  # `obj` as the pickle protocol describes it
    if cls is list:
        copied = memo[id(obj)] = []
        copied.extend(structural_copy(item, memo) for item in obj)
        return copied
    if cls is dict:
        copied = memo[id(obj)] = {}
        for key, value in obj.items():
            copied[structural_copy(key, memo)] = structural_copy(value, memo)
        return copied
    if cls is tuple:
        copied = tuple(structural_copy(item, memo) for item in obj)
        return memo.setdefault(id(obj), copied)
    if isinstance(obj, types.MethodType):
        copied = types.MethodType(obj.__func__, structural_copy(obj.__self__, memo))
        return memo.setdefault(id(obj), copied)
    own_deepcopy = getattr(cls, "__deepcopy__", None)
    if own_deepcopy is not None:
        return own_deepcopy(obj, memo)
    if _is_keras_saveable(cls):
        # The protocol's default for a plain class: `object.__reduce_ex__`
        # itself would defer to `KerasSaveable.__reduce__`.
        newobj = copyreg.__newobj__  # type: ignore[attr-defined]  # not in typeshed's copyreg
        reduced = (newobj, (cls,), object.__getstate__(obj))
    elif cls.__reduce__ is not object.__reduce__ or cls.__reduce_ex__ is not object.__reduce_ex__:
        return copy.deepcopy(obj, memo)  # the class's own protocol
    else:
        reduced = object.__reduce_ex__(obj, 4)
    if isinstance(reduced, str):  # a global, by name
        return obj
    return _reconstruct(obj, memo, *reduced)


def _is_keras_saveable(cls) -> bool:
    return any(base.__name__ == "KerasSaveable" for base in cls.__mro__)


def _reconstruct(obj, memo, factory, args, state=None, items=None, pairs=None, *_):
    copied = factory(*(structural_copy(a, memo) for a in args))
    memo[id(obj)] = copied
    if state is not None:
        state = structural_copy(state, memo)
        if hasattr(copied, "__setstate__") and not _default_setstate(copied):
            copied.__setstate__(state)
        else:
            slots = None
            if isinstance(state, tuple) and len(state) == 2:
                state, slots = state
            if state:
                copied.__dict__.update(state)
            for name, value in (slots or {}).items():
                setattr(copied, name, value)
    # Items go in as the list or dict itself holds them: Keras's tracked
    # containers would otherwise track them again, in a locked layer.
    for item in items or ():
        (list.append if isinstance(copied, list) else type(copied).append)(
            copied, structural_copy(item, memo)
        )
    for key, value in pairs or ():
        (dict.__setitem__ if isinstance(copied, dict) else type(copied).__setitem__)(
            copied, structural_copy(key, memo), structural_copy(value, memo)
        )
    return copied


def _default_setstate(obj) -> bool:
    """Whether `obj.__setstate__` is `object`'s (Python 3.11 has none)."""
    return getattr(type(obj), "__setstate__", None) is getattr(object, "__setstate__", None)


def _metric_variables(layer) -> list:
    return [v for metric in _compat.own_metrics(layer) for v in metric.variables]


def _unique(variables) -> list:
    seen, found = set(), []
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            found.append(variable)
    return found
