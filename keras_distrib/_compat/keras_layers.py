"""Keras's layer and model internals: the Functional class and graph
(nodes, replaying a graph), layers' added losses and own metrics, saving
under Keras's public class name, loading's message for a damaged `.keras`
file, and taking whole variables off a built Dense or Embedding. Verified
on Keras 3.15.1 / TensorFlow 2.21.0."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import zipfile
from typing import Any, Iterator

import keras
import tensorflow as tf

_LAYER = "keras.src.layers.layer:Layer"

# Private names the shims below use (checked at import, see `versions`).
PRIVATE = (
    # name_damaged_keras_files
    "keras.src.saving.saving_api:load_model",
    # functional_class, functional_graph, graph_of, inlined_functional,
    # layer_tensors
    "keras.src.models.functional:Functional",
    "keras.src.models.sequential:Sequential._functional",
    "keras.src.ops.function:Function._run_through_graph",
    "keras.src.ops.function:Function._nodes_by_depth",
    "keras.src.ops.node:Node.operation",
    "keras.src.ops.node:Node.is_input",
    "keras.src.ops.node:Node.input_tensors",
    "keras.src.ops.node:Node.outputs",
    # clone_functional: a Keras tensor's `_keras_history`, set by the Node
    # that outputs it
    "keras.src.ops.node:Node._keras_history",
    "keras.src.ops.node:KerasHistory.operation",
    # node_lists, own_metrics
    "keras.src.ops.operation:Operation._inbound_nodes",
    "keras.src.ops.operation:Operation._outbound_nodes",
    f"{_LAYER}._metrics",
    # is_functional_call, functional_arguments, save_as_keras_model
    "keras.src.models.model:functional_init_arguments",
    "keras.src.api_export:REGISTERED_OBJS_TO_NAMES",
    # take_added_losses, added_losses_per_thread, all_layers, direct_layers,
    # call_has_training_arg
    f"{_LAYER}._get_own_losses",
    f"{_LAYER}._clear_losses",
    f"{_LAYER}._losses",
    f"{_LAYER}._flatten_layers",
    f"{_LAYER}._call_has_training_arg",
    # whole_layer_variables, drop_whole_layer_variables, layer_state_unlocked
    "keras.src.layers.core.dense:Dense._kernel",
    "keras.src.layers.core.embedding:Embedding._embeddings",
    f"{_LAYER}._untrack_variable",
    f"{_LAYER}._tracker",
    "keras.src.utils.tracking:Tracker.locked",
    "keras.src.utils.tracking:Tracker.lock",
    "keras.src.utils.tracking:Tracker.unlock",
)


def functional_class() -> type:
    """Keras's `Functional` model class (not exported; needed to subclass it).

    `FunctionalDistributedModel` is a `DistributedModel` and a `Functional`,
    so `DistributedModel(inputs, outputs)` behaves as `keras.Model(inputs,
    outputs)` does.
    """
    from keras.src.models.functional import Functional

    return Functional


def clone_functional(template, **kwargs):
    """`keras.models.clone_model(template, **kwargs)` for a Functional
    `template`, whose inputs keep their kind.

    Keras 3.15 makes each input of a Functional clone as
    `Input(batch_shape=..., dtype=..., name=...)`
    (`keras/src/models/cloning.py`, `_clone_functional_model`): a sparse or
    ragged input comes back dense, and the clone then densifies sparse
    batches (more memory, dense math) and fails on layers that read the
    ragged structure (`row_lengths`). Here each input is made from its
    `InputLayer`'s config (shape, dtype, sparse, ragged, name, optional).
    """
    inputs = tf.nest.map_structure(
        lambda x: keras.Input(**x._keras_history.operation.get_config()), template.input
    )
    return keras.models.clone_model(template, input_tensors=inputs, **kwargs)


def functional_graph(model):
    """The Functional graph of a Functional or Sequential `model`: a
    Sequential's inner Functional (`Sequential._functional`, None while it
    has no input shape), else `model` itself. Keras has no public accessor;
    `from_model` checks and copies that graph."""
    return getattr(model, "_functional", model)


def node_lists(layer) -> tuple:
    """`layer`'s lists of the graph nodes that call it and that its outputs
    feed (`Operation._inbound_nodes`, `_outbound_nodes`): what links it
    into Functional graphs, which a copy of the layer leaves behind."""
    return layer._inbound_nodes, layer._outbound_nodes


def own_metrics(layer) -> list:
    """The metrics `layer` tracks itself (`Layer._metrics`, e.g. a `Mean`
    made in a custom layer's `__init__`): their variables are not in
    `layer.variables`, and copying the layer copies them too. The public
    `metrics` adds the sub-layers' (and a model's compiled metrics)."""
    return list(getattr(layer, "_metrics", []))


def functional_arguments(args, kwargs) -> bool:
    """Whether `Model.__init__(*args, **kwargs)` takes the functional form:
    Keras's own rule (`functional_init_arguments`), which `keras.Model`
    applies to what a subclass passes up to it."""
    from keras.src.models.model import functional_init_arguments

    return functional_init_arguments(args, kwargs)


def is_functional_call(args, kwargs) -> bool:
    """Whether `Model(*args, **kwargs)` is the functional form (inputs, outputs).

    Keras's own test (`functional_init_arguments`, used by `Model.__new__`)
    counts arguments only; a subclass taking two models (the keras-io VAE:
    `VAE(encoder, decoder)`) passes it too. Keras itself decides in
    `Model.__init__`, from what the subclass passes up; here the inputs
    must also be Keras tensors.
    """
    from keras.src.models.model import functional_init_arguments

    if not functional_init_arguments(args, kwargs):
        return False
    inputs = args[0] if args else kwargs.get("inputs")
    return all(isinstance(t, keras.KerasTensor) for t in keras.tree.flatten(inputs))


def name_damaged_keras_files() -> None:
    """`keras.models.load_model` (`keras.saving.load_model`) of a `.keras`
    file that exists but is no zip archive says so in one line.

    Keras tells a zip archive from anything else by `zipfile.is_zipfile`
    and then reports "File not found: filepath=... Please ensure the file
    is an accessible `.keras` zip file", also for a file that is there but
    truncated (a copy cut short: our own saves are atomic) or of another
    format. Idempotent; names taken with `from keras.models import
    load_model` before keras_distrib's import keep Keras's message.
    """
    from keras.src.saving import saving_api

    keras_load = saving_api.load_model
    if getattr(keras_load, "_kd_wrapped", False):
        return

    @functools.wraps(keras_load)
    def load_model(filepath, *args, **kwargs):
        try:
            return keras_load(filepath, *args, **kwargs)
        except ValueError as error:
            path = os.fspath(filepath) if isinstance(filepath, (str, os.PathLike)) else None
            if (
                path is None
                or not str(error).startswith("File not found")
                or not path.endswith(".keras")
                or not os.path.isfile(path)
                or zipfile.is_zipfile(path)
            ):
                raise
            raise ValueError(
                f"{path} is not a valid .keras file: it exists ({os.path.getsize(path)} "
                "bytes) but is no zip archive, i.e. truncated (a copy cut short) or of "
                "another format; copy it again, or load an earlier checkpoint."
            ) from None

    setattr(load_model, "_kd_wrapped", True)
    for module in (saving_api, keras.saving, keras.models):
        if getattr(module, "load_model", None) is keras_load:
            module.load_model = load_model


def save_as_keras_model(cls: type, marker: str, load: Any) -> None:
    """Files of `cls` name Keras's public `keras.Model` as their class, and
    `keras.Model.from_config` of a config holding `marker` is `load(config,
    custom_objects)`.

    Keras writes a model's class into its `.keras` file: its public name
    when it has one (`serialize_with_public_class`, from the symbol table
    `api_export.REGISTERED_OBJS_TO_NAMES`), else its module and registered
    name, which a process without that module cannot load ("Could not
    locate class 'FunctionalDistributedModel'"). Registered as the public
    `keras.Model`, a file loads anywhere as Keras's own Functional model
    (`Model.from_config` of a Functional config). Loading it where
    keras_distrib is imported, the marker key routes it back to `load`
    (Horovod keeps a wrapped optimizer's class name for the same reason).
    Idempotent.
    """
    from keras.src import api_export

    api_export.REGISTERED_OBJS_TO_NAMES[cls] = "keras.Model"
    keras_from_config = keras.Model.__dict__["from_config"].__func__
    if getattr(keras_from_config, "_kd_wrapped", False):
        return

    def from_config(model_cls, config, custom_objects=None):
        if model_cls is keras.Model and isinstance(config, dict) and marker in config:
            return load(config, custom_objects)
        return keras_from_config(model_cls, config, custom_objects=custom_objects)

    setattr(from_config, "_kd_wrapped", True)
    functools.update_wrapper(from_config, keras_from_config)
    keras.Model.from_config = classmethod(from_config)


def take_added_losses(model) -> list:
    """The losses `model`'s layers added in their latest call (`add_loss`,
    activity regularizers: `Layer._get_own_losses`), which are then cleared
    (`Layer._clear_losses`), so that `model.losses` of an enclosing model
    no longer lists them (weight regularization losses are not among them:
    Keras computes those from the weights when asked)."""
    losses = [loss for layer in [model, *all_layers(model)] for loss in layer._get_own_losses()]
    model._clear_losses()
    return losses


def added_losses_per_thread(model) -> None:
    """Gives `model` and each of its layers one list of added losses per
    thread (`Layer._losses`: what `add_loss` and activity regularizers add,
    cleared by the outermost call, read by `Layer.losses`).

    tf.distribute runs each in-process replica in a thread of its own, one
    at a time, switching at every `merge_call`; under CentralStorage every
    assignment to a variable in a replica (a metric's update inside Keras's
    `compute_loss`, a BatchNormalization or seed update in the forward pass)
    is one. With shared lists the next replica's forward pass clears and
    refills them, and the first replica's `compute_loss` reads the other's
    losses (weights 1e-3 off one device's with an activity regularizer and
    two outputs). With a list per thread each replica reads its own.
    """
    for layer in [model, *all_layers(model)]:
        if not isinstance(layer._losses, _PerThreadList):
            object.__setattr__(layer, "_losses", _PerThreadList(layer._losses))


class _PerThreadList:
    """The list operations Keras's `Layer` uses on `_losses`, on a list of
    the calling thread's own (the creating thread starts with `items`)."""

    def __init__(self, items):
        self._local = threading.local()
        self._local.items = list(items)

    def _items(self) -> list:
        if not hasattr(self._local, "items"):
            self._local.items = []
        return self._local.items

    def append(self, item):
        self._items().append(item)

    def extend(self, items):
        self._items().extend(items)

    def clear(self):
        self._items().clear()

    def __getitem__(self, index):
        return self._items()[index]

    def __iter__(self):
        return iter(self._items())

    def __len__(self):
        return len(self._items())


def graph_of(layer):
    """The Functional graph of a nested Functional or Sequential model
    (`Sequential._functional`), or None for another layer."""
    functional = functional_class()
    if isinstance(layer, functional):
        return layer
    inner = getattr(layer, "_functional", None) if isinstance(layer, keras.Sequential) else None
    return inner if isinstance(inner, functional) else None


def inlined_functional(model):
    """A Functional model computing what Functional `model` computes, with
    each nested Functional or Sequential model replaced by the calls of
    its own layers (recursively), on `model`'s inputs. The layers are the
    same objects (each gets one more call in its node list); Keras's
    `Function._run_through_graph` replays a graph with a `call_fn` per
    operation, which here replays a nested model's graph instead of calling
    it."""

    def call(operation, *args, **kwargs):
        inner = graph_of(operation)
        if inner is None:
            return operation(*args, **kwargs)
        return inner._run_through_graph(args[0] if len(args) == 1 else args, call_fn=call)

    outputs = model._run_through_graph(model.input, call_fn=call)
    return keras.Model(model.input, outputs, name=f"{model.name}_inlined")


def layer_tensors(model) -> dict:
    """`id(layer) -> (input tensors, output tensors)` of each layer's calls
    in `model`'s own graph (all its calls, for a shared layer), read from
    the graph's nodes (`Function._nodes_by_depth`; `node.input_tensors`,
    `node.outputs`). A nested model's `input` / `output` properties give the
    tensors of its own graph instead, which are not in `model`'s."""
    found: dict = {}
    for depth in sorted(model._nodes_by_depth, reverse=True):
        for node in model._nodes_by_depth[depth]:
            if not node.operation or node.is_input:
                continue
            inputs, outputs = found.setdefault(id(node.operation), ([], []))
            inputs.extend(node.input_tensors)
            outputs.extend(node.outputs)
    return found


def all_layers(model) -> list:
    """Every layer nested in `model` (`Layer._flatten_layers`), found through
    custom layers too, which `model.layers` does not descend into."""
    return list(model._flatten_layers(include_self=False, recursive=True))


def direct_layers(model) -> list:
    """`model.layers` (its direct sub-layers, `Layer._flatten_layers`),
    also for a layer mixed with a trainer, which has no `layers` property
    (Keras's trainer_test builds models that way)."""
    return list(model._flatten_layers(include_self=False, recursive=False))


def call_has_training_arg(model) -> bool:
    """Whether `model.call` takes `training` (`Layer._call_has_training_arg`)."""
    return model._call_has_training_arg


# -- tensor parallel ---------------------------------------------------------------
# `strategy="tensor_parallel"` replaces the whole variables of a built Dense /
# Embedding by per-device shards. Keras has no public way to take a variable
# away from a built layer or to add one after its build. Verified on Keras
# 3.15.1 / TensorFlow 2.21.0.

# The attributes behind `Dense.kernel` / `Dense.bias` / `Embedding.embeddings`
# (keras/src/layers/core/dense.py, embedding.py), in the order of the keys
# ("0", "1") their `save_own_variables` writes.
_WHOLE_VARIABLE_ATTRIBUTES = {"Dense": ("_kernel", "bias"), "Embedding": ("_embeddings",)}


def whole_layer_variables(layer) -> list:
    """The variables a plain built Dense (kernel, then bias if any) or
    Embedding (embeddings) saves, in its file order."""
    names = _WHOLE_VARIABLE_ATTRIBUTES[type(layer).__name__]
    return [v for v in (getattr(layer, n, None) for n in names) if v is not None]


def drop_whole_layer_variables(layer) -> None:
    """Makes a built Dense / Embedding forget its whole variables.

    What `Layer.__delattr__` does for a variable attribute: Keras's tracker
    forgets it (`_untrack_variable`) and TensorFlow's AutoTrackable drops
    its dependency, so nothing keeps the whole variable alive; but not the
    `gc.collect()` Keras then runs, costly in a process holding many
    objects (docs/design.md, section 1.1, row 22; a split layer drops two). `bias` is
    then None, as with `use_bias=False`.
    """
    for name in _WHOLE_VARIABLE_ATTRIBUTES[type(layer).__name__]:
        variable = getattr(layer, name, None)
        if variable is not None:
            layer._untrack_variable(variable)
            super(keras.layers.Layer, layer).__delattr__(name)
    if type(layer).__name__ == "Dense":
        layer.bias = None


@contextlib.contextmanager
def layer_state_unlocked(layer) -> Iterator[None]:
    """Lets `layer.add_weight` run on a built layer.

    Keras locks a layer's variable tracker (`layer._tracker`) after `build`;
    the shard variables are added to the built layer, then it is locked
    again.
    """
    tracker = layer._tracker
    was_locked = tracker.locked
    tracker.unlock()
    try:
        yield
    finally:
        if was_locked:
            tracker.lock()
