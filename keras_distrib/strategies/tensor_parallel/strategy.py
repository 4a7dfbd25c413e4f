"""`"tensor_parallel"`: Dense and Embedding layers split over the local devices.

One model replica spans all the local devices (Megatron-style tensor
parallelism, Shoeybi et al., 2019, arXiv:1909.08053). The model's own
layers are laid out in place (`place`): each Dense / Embedding the layout
splits then holds one shard of its kernel (embeddings) and bias per
device, created on that device, and a forward pass that computes each part
where its shard lives (see `keras_distrib.strategies.tensor_parallel.layout` for the layout and the default
plan). Other layers are placed whole on one device and run there.

Communication, per split layer, inside the one step (no all-reduce across
replicas: there is one replica, and autodiff through the per-device ops
gives the exact gradient):

* column (`y = concat_i(x @ W_i + b_i)`): the input is copied to every
  device; the parts are concatenated on the first device (a gather), unless
  the layer's only consumer is a row layer, which then takes the parts
  where they are (the concatenation is left unused and pruned from the
  compiled step);
* row (`y = sum_i(x_i @ W_i) + b`): the partial outputs are summed on the
  first device (a reduction), and the bias added once there.

So a column-then-row pair (the default for consecutive Dense layers) costs
one reduction in the forward pass (the row sum) and one in the backward
pass (the sum of the input's gradient parts), as Megatron's `f`/`g` pair
does, plus the copy of the pair's input to each device.

Saving writes whole, unsplit variables under the keys a plain Dense /
Embedding uses (`save_own_variables` concatenates the shards,
`load_own_variables` splits a whole value), so `.keras` and `.weights.h5`
files load into a plain Keras model of the same architecture and back.
The optimizer's slots are created next to their shard (Keras's optimizer
colocates each slot with its variable) and saved whole too, in the plain
model's order, so a plain model also resumes from the optimizer state.
`model.get_weights()` / `set_weights()` (and a split layer's) take and give
whole values, the plain model's list; `model.weights` are the shards.

Under a configured cluster (the launcher) each worker holds one replica
split over its local devices, and the strategy is data-parallel across
workers (`keras_distrib.strategies.hybrid`): the step's one gradient
all-reduce sums each shard's gradient with the same shard of every worker.

A `DistributedModel` subclass is split when its first call has built its
layers (`place`): its direct Dense / Embedding layers, in
the order it tracks them; layers nested in other layers stay whole on the
first device.

The optimizer updates each part as its own variable, which equals one
device's update for element-wise optimizers; `clipnorm` is applied to the
parts together (`adopt_optimizer`).

Not supported: `jit_compile` (XLA compiles for one device; the step runs
without it, `compile` says so); optimizers whose update reads statistics of the whole
variable (Adafactor, Lamb, Muon) while any layer is split, a one-line
error at `fit`.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib import devices as devices_lib
from keras_distrib import replica_seeds
from keras_distrib.strategies.tensor_parallel import layout as tensor_layout
from keras_distrib.strategies import lockstep
from keras_distrib.strategies.base import Strategy
from keras_distrib.strategies.optimizer_tree import keras_class_among, optimizers_in
from keras_distrib.strategies.hybrid import WorkerReplicas
from keras_distrib.topology import Topology


class TensorParallel(WorkerReplicas, Strategy):
    """Splits Dense and Embedding layers over the local devices (one replica).

    Args:
        devices: the local devices to split over (default: all local GPUs,
            else all local CPUs).
        layout: layer-name pattern (a regular expression matched against
            the whole name) -> `"column"`, `"row"` or `"whole"`. Layers it
            does not name follow the default plan (Dense layers alternate
            column, row; Embeddings split by vocabulary; other layers whole,
            see `keras_distrib.strategies.tensor_parallel.layout`).
        workers: under a cluster (hybrid data x tensor parallelism), options
            of the collectives across workers, as `multi_worker` takes them
            (e.g. `{"implementation": "ring"}`; default: its defaults).

    Example:

    ```python
    strategy = kd.strategies.get("tensor_parallel",
                                 layout={"hidden.*": "column", "logits": "row"})
    model = kd.DistributedModel(inputs, outputs, strategy=strategy)
    model.compile(optimizer="adam", loss="mse")
    print(model.strategy.plan())          # variable -> device, bytes per device
    model.fit(x, y, batch_size=64)
    model.save("model.keras")             # whole variables: plain Keras loads it
    ```
    """

    name = "tensor_parallel"
    aliases = ("model_parallel",)
    description = "Dense/Embedding layers split over the local devices (one replica)."

    def __init__(self, devices: Optional[Sequence[str]] = None,
                 layout: Optional[Mapping[str, str]] = None,
                 workers: Optional[Mapping[str, Any]] = None):
        self._layout = tensor_layout.check_layout(layout)
        self._topology = self._join_workers(
            devices_lib.check_devices(devices_lib.local_devices() if devices is None
                                      else devices), workers)
        self._devices = self._topology.devices
        # Variables this strategy placed (place) or saw created in scope().
        self._held: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
        # Layers laid out by `place`, and the split kinds of those with a plan.
        self._laid_out: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._kinds: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
        self._last_layers: list = []

    @property
    def topology(self) -> Topology:
        return self._topology

    @property
    def home(self) -> str:
        """The device where parts are gathered and summed (the first one)."""
        return self._devices[0]

    # -- placement ----------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self):
        def record(next_creator, **kwargs):
            variable = next_creator(**kwargs)
            self._held[id(variable)] = variable
            return variable

        with tf.variable_creator_scope(record):
            yield

    def holds(self, variable: Any) -> bool:
        value = getattr(variable, "value", variable)
        return self._held.get(id(value)) is value

    @contextlib.contextmanager
    def _on(self, device: str):
        """Variables made inside go on `device` and are this strategy's."""
        with tf.device(device), self.scope():
            yield

    def place(self, model) -> list:
        """Lays `model`'s layers out over the devices, in place.

        Each layer not laid out yet has its variables moved to its device
        (a whole layer's: the one its plan names; a layer to split: the
        first) and is then split, trading its whole variables for
        per-device shards. So besides the shards, at most one whole layer
        at a time is held on the first device.

        A subclassed model has no graph to plan from: its direct Dense /
        Embedding layers are split by the layout (the default plan pairs
        them column, row in the order the model tracks them); every other
        layer, and any layer nested inside another, stays whole on the
        first device.
        """
        from keras_distrib import placement  # not at import: it loads Keras

        functional = isinstance(model, _compat.functional_class())
        plans = tensor_layout.plan_layers(model, self._layout, self._devices)
        moved = []
        # Eagerly, and at once: this may run inside fit's symbolic build.
        with tf.init_scope(), _compat.variables_made_at_once():
            for layer in model.layers:
                if layer in self._laid_out or not layer.built:
                    continue  # a subclass's layer is laid out once its first call built it
                plan = plans.get(layer.name)
                if not functional and plan is not None and plan.kind == "whole":
                    plan = None  # stays where it was built
                device = plan.device if plan is not None and plan.device else self.home
                moving = placement.unheld(self, layer.variables, model)
                placement.remake(moving, self, model, where=lambda d=device: self._on(d))
                moved += moving
                with self.scope():  # the shards it makes are this strategy's
                    self._lay_out(layer, plan)
            moving = placement.unheld(self, model.variables, model)
            placement.remake(moving, self, model, where=lambda: self._on(self.home))
        self._adopt(model)
        return moved + moving

    def _adopt(self, model) -> None:
        """Records `model`, just laid out, as this strategy's: its variables
        (`holds`) and its layers (`plan()` without a model)."""
        for variable in model.weights:
            self._held[id(variable.value)] = variable.value
        self._last_layers = [weakref.ref(layer) for layer in model.layers]

    def _lay_out(self, layer, plan) -> None:
        self._laid_out.add(layer)
        if plan is None:
            return
        self._kinds[layer] = plan.kind
        if plan.kind == "whole":
            _run_on(layer, plan.device)
        else:
            _Split.install(layer, plan.kind, self._devices)

    # -- execution ----------------------------------------------------------------

    def sync_initial_state(self, model) -> None:
        # Called once the model and its optimizer are built.
        _OptimizerFiles.install(model)
        super().sync_initial_state(model)  # the broadcast from worker 0, if hybrid

    def adopt_optimizer(self, optimizer) -> None:
        """Makes `clipnorm` clip each split variable by its whole norm.

        Keras clips each variable's gradient by that variable's own norm; the
        parts of a split kernel are variables of their own, so each part
        was clipped by its part's norm (weights 3e-2 off one device with
        Adam(clipnorm=0.02) in 3 epochs). Before Keras's update, the parts'
        gradients are clipped together by their joint norm (the whole
        variable's), with the formula of `tf.clip_by_norm` that Keras uses;
        Keras's own clip then finds each part within the limit. Also for a
        LossScaleOptimizer's and a MultiOptimizer's inner optimizers, and in
        custom train steps (it wraps `apply`).
        """
        for opt in optimizers_in(optimizer):
            opt.apply = self._clipping_split_norms(opt, opt.apply)

    def _clipping_split_norms(self, optimizer, keras_apply):
        def apply(grads, trainable_variables=None):
            if optimizer.clipnorm and trainable_variables is not None:
                grads = _clip_by_joint_norms(grads, list(trainable_variables),
                                             self._split_groups(), optimizer.clipnorm)
            return keras_apply(grads, trainable_variables)

        return apply

    def _split_groups(self) -> list[list]:
        """The variables of each split kernel, embedding or bias, part by part."""
        groups = []
        for layer in list(self._laid_out):
            split = _Split.of(layer)
            if split is not None:
                groups += [shards for shards, axis in split.groups if axis is not None]
        return groups

    def _check_optimizer(self, model) -> None:
        """A one-line error for optimizers whose update reads whole variables."""
        if not self._split_groups():
            return
        for opt in optimizers_in(getattr(model, "optimizer", None)):
            name = keras_class_among(opt, _WHOLE_VARIABLE_OPTIMIZERS)
            if name:
                raise ValueError(
                    f"strategy='tensor_parallel': optimizer {name} updates each variable from "
                    f"statistics of the whole variable ({_WHOLE_VARIABLE_OPTIMIZERS[name]}), "
                    "which on a split kernel would be each part's and differ from one device; "
                    "use an element-wise optimizer (SGD, Adam, AdamW, Nadam, RMSprop, Lion, ...), "
                    "or keep the split layers whole with layout={'<layer name pattern>': 'whole'}."
                )

    def without_xla(self) -> Optional[str]:
        return "XLA compiles the work of one device, and a split layer's step spans all devices"

    def make_step_function(self, model, step, keras_make_function: Callable):
        self._check_laid_out(model)
        self._check_optimizer(model)
        _OptimizerFiles.install(model)
        model.compile_replicas_separately(False)
        if self.world_size > 1 and model.steps_per_execution > 1:
            # Keras's fused steps trace the step inside tf.cond, where the
            # collectives across workers cannot be.
            return lockstep.stepwise(model, lambda data: self.run(step.fn, data))
        return keras_make_function(lambda data: self.run(step.fn, data))

    def make_predict_function(self, model, step, keras_make_predict_function: Callable):
        self._check_laid_out(model)
        if self.world_size > 1:  # every worker's rows, in order
            return lockstep.predict_over_steps(
                model, lambda batch: self.gather_rows(self.run(step.fn, batch)))
        return keras_make_predict_function()

    def _check_laid_out(self, model) -> None:
        missing = [layer.name for layer in model.layers
                   if layer.weights and layer not in self._laid_out]
        if missing:
            raise ValueError(
                f"strategy='tensor_parallel' did not lay out layers {missing} of model "
                f"{model.name!r}: they were built before the model was given the strategy; "
                "use DistributedModel(inputs, outputs, strategy=...), "
                "DistributedModel.from_model(model, strategy=...), or a DistributedModel "
                "subclass whose layers are built by its first call."
            )

    def run(self, replica_fn: Callable, batch: Any):
        # The one replica: split layers place their own parts; the rest (loss,
        # metrics, optimizer bookkeeping) runs on the first device.
        with tf.device(self.home), replica_seeds.as_replica(self.rank):
            return replica_fn(batch)

    # -- the plan and whole weights ----------------------------------------------------

    def plan(self, model=None) -> tensor_layout.Plan:
        """Where each weight of `model` (default: the model laid out last)
        lives, and the bytes of its optimizer's variables per device, read
        from the variables; `print()` it for a table with bytes per device."""
        if model is not None:
            layers = list(model.layers)
        else:
            layers = [layer for layer in (ref() for ref in self._last_layers) if layer is not None]
        kinds = {layer.name: self._kinds[layer] for layer in layers if layer in self._kinds}
        optimizer = getattr(model, "optimizer", None)
        return tensor_layout.describe(layers, kinds, self._devices,
                                      optimizer.variables if optimizer is not None else ())

    def describe(self, model) -> tensor_layout.Plan:
        """`plan(model)`: where each weight of `model` lives."""
        return self.plan(model)

    def whole_weights(self, model) -> list[np.ndarray]:
        """`model.get_weights()`: a plain Keras model's list, each split
        variable's shards gathered into the whole value."""
        return [value for entry in _whole_entries(model)
                for value in (entry.whole_values() if isinstance(entry, _Split)
                              else [entry.numpy()])]

    def set_whole_weights(self, model, weights: Sequence[np.ndarray]) -> None:
        """`model.set_weights(weights)`, from a plain model's `get_weights()` list."""
        entries, weights = _whole_entries(model), list(weights)
        counts = [len(e.whole_shapes()) if isinstance(e, _Split) else 1 for e in entries]
        if len(weights) != sum(counts):
            raise ValueError(
                f"model {model.name!r} has {sum(counts)} weights (a plain Keras model's "
                f"`get_weights()` list), got {len(weights)}; {_SAME_ARCHITECTURE}.")
        for entry, count in zip(entries, counts):
            values, weights = weights[:count], weights[count:]
            if isinstance(entry, _Split):
                entry.assign_whole(values, where=f"layer {entry.layer.name!r}",
                                   fix=_SAME_ARCHITECTURE)
                continue
            value = np.asarray(values[0])
            if tuple(value.shape) != tuple(entry.shape):
                raise ValueError(
                    f"weight {entry.path!r} of model {model.name!r} has shape "
                    f"{tuple(entry.shape)}, got a value of shape {tuple(value.shape)}; "
                    f"{_SAME_ARCHITECTURE}.")
            entry.assign(value)


# -- split layers -----------------------------------------------------------------------

_SAME_ARCHITECTURE = "pass the get_weights() of a model of the same architecture"


# Keras optimizers whose update of a variable reads statistics of the whole
# variable, not of each element alone: name -> what it reads.
_WHOLE_VARIABLE_OPTIMIZERS = {
    "Adafactor": "factored second moments and the update's RMS",
    "Lamb": "the trust ratio of the variable's and the update's norms",
    "Muon": "the orthogonalization of the whole matrix",
}


def _clip_by_joint_norms(grads, variables, groups, clipnorm) -> list:
    """`grads` (one per variable) with the gradients of each group of parts
    scaled by `clipnorm / max(joint norm, clipnorm)`, as `tf.clip_by_norm`
    scales a whole variable's (`values * clip_norm / maximum(l2norm, clip_norm)`,
    a zero norm left zero). Sparse gradients count their values' rows, as
    `tf.clip_by_norm` counts an `IndexedSlices`'s."""
    grads = list(grads)
    position = {id(v): i for i, v in enumerate(variables)}
    for parts in groups:
        where = [position.get(id(v)) for v in parts]
        if None in where or any(grads[i] is None for i in where):
            continue
        squares = [tf.reduce_sum(tf.square(_values(grads[i]))) for i in where]
        with tf.device(squares[0].device):
            l2sum = tf.add_n(squares)
            positive = l2sum > 0
            l2norm = tf.where(positive, tf.sqrt(tf.where(positive, l2sum, tf.ones_like(l2sum))),
                              l2sum)
            limit = tf.cast(clipnorm, l2norm.dtype)
            denominator = tf.maximum(l2norm, limit)
        for i in where:
            grads[i] = _clipped(grads[i], limit, denominator)
    return grads


def _values(gradient):
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def _clipped(gradient, limit, denominator):
    def scale(values):
        return values * tf.cast(limit, values.dtype) / tf.cast(denominator, values.dtype)

    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(scale(gradient.values), gradient.indices, gradient.dense_shape)
    return scale(gradient)


def _whole_entries(model) -> list:
    """`model.weights` in order, with each split layer's shards standing
    once, as that layer's `_Split`, where its first shard is."""
    owners = {id(variable): split for layer in model.layers
              if (split := _Split.of(layer)) is not None for variable in split.variables()}
    entries, done = [], set()
    for variable in model.weights:
        split = owners.get(id(variable))
        if split is None:
            entries.append(variable)
        elif split not in done:
            done.add(split)
            entries.append(split)
    return entries


def _run_on(layer, device: str) -> None:
    """Makes a whole layer compute where its variables live."""
    call = layer.call

    @functools.wraps(call)
    def call_on_device(*args, **kwargs):
        with tf.device(device):
            return call(*args, **kwargs)

    call_on_device._kd_pinned = True  # from_model's copy takes the class's call back
    object.__setattr__(layer, "call", call_on_device)


# A column layer's latest output -> that layer's `_Split`, which keeps the
# output's parts for a row layer that consumes it (matched by identity, so a
# stale entry is never used).
_PRODUCERS: "weakref.WeakValueDictionary[int, _Split]" = weakref.WeakValueDictionary()


class _Split:
    """One Dense / Embedding split over devices: its shards, forward and saving.

    Installed on the layer object itself (its `call`, `save_own_variables`
    and `load_own_variables`), so the layer's config stays a plain Dense /
    Embedding and its files hold the whole variables under their plain keys.
    """

    _BY_LAYER: "weakref.WeakKeyDictionary[Any, _Split]" = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, layer) -> Optional["_Split"]:
        try:
            return cls._BY_LAYER.get(layer)
        except TypeError:
            return None

    @classmethod
    def install(cls, layer, kind: str, devices: Sequence[str]) -> "_Split":
        split = cls(layer, kind, devices)
        cls._BY_LAYER[layer] = split
        object.__setattr__(layer, "call", split.call)
        object.__setattr__(layer, "save_own_variables", split.save_own_variables)
        object.__setattr__(layer, "load_own_variables", split.load_own_variables)
        object.__setattr__(layer, "get_weights", split.whole_values)
        object.__setattr__(layer, "set_weights", functools.partial(
            split.assign_whole, where=f"layer {layer.name!r}", fix=_SAME_ARCHITECTURE))
        return split

    def __init__(self, layer, kind: str, devices: Sequence[str]):
        self.layer = weakref.proxy(layer)
        self.kind, self.devices, self.home = kind, tuple(devices), devices[0]
        self.is_dense = type(layer).__name__ == "Dense"
        self.last_output = None  # (output, parts) of the latest column call
        values = [np.asarray(v) for v in _compat.whole_layer_variables(layer)]
        axis = tensor_layout.split_axis(kind)
        self.sizes = tensor_layout.part_sizes(values[0].shape[axis], len(devices))
        self.offsets = np.cumsum(self.sizes)[:-1]
        _compat.drop_whole_layer_variables(layer)
        # Each entry: (shards, axis they split, or None for one whole variable).
        self.groups: list[tuple[list, Optional[int]]] = []
        role = "kernel" if self.is_dense else "embeddings"
        with _compat.layer_state_unlocked(layer):
            self.groups.append((self._shards(layer, role, values[0], axis), axis))
            if len(values) > 1:  # a Dense bias
                if kind == "column":
                    self.groups.append((self._shards(layer, "bias", values[1], 0), 0))
                else:
                    self.groups.append(([self._variable(layer, "bias", values[1], self.home)],
                                        None))

    def _shards(self, layer, role, value, axis) -> list:
        parts = np.split(value, self.offsets, axis=axis)
        return [self._variable(layer, f"{role}_shard{i}", part, device, role)
                for i, (part, device) in enumerate(zip(parts, self.devices))]

    @staticmethod
    def _variable(layer, name, value, device, role=None):
        role = role or name
        with tf.device(device):
            variable = layer.add_weight(
                name=name, shape=value.shape, initializer="zeros",
                regularizer=getattr(layer, f"{role}_regularizer", None),
                trainable=layer.trainable)
            variable.assign(value)
        devices_lib.mark_split(variable)
        return variable

    # -- forward ----------------------------------------------------------------

    def call(self, inputs, *args, **kwargs):
        if not self.is_dense:
            return self._embedding_call(inputs)
        return self._column_call(inputs) if self.kind == "column" else self._row_call(inputs)

    def _column_call(self, inputs):
        ops = _keras_ops()
        kernels = self.groups[0][0]
        biases = self.groups[1][0] if len(self.groups) > 1 else [None] * len(kernels)
        activation = self.layer.activation
        # Only an elementwise activation may run on each device's columns:
        # softmax over a shard's columns is not a slice of softmax over all.
        on_parts = tensor_layout.is_elementwise(activation)
        parts = []
        for device, kernel, bias in zip(self.devices, kernels, biases):
            with tf.device(device):
                y = ops.matmul(inputs, kernel)
                if bias is not None:
                    y = ops.add(y, bias)
                if activation is not None and on_parts:
                    y = activation(y)
            parts.append(y)
        if on_parts:
            return self._gathered(parts)
        output = self._gathered(parts, keep_parts=False)
        with tf.device(self.home):
            return activation(output)

    def _row_call(self, inputs):
        kernels = self.groups[0][0]
        pieces = self._parts_of(inputs)
        partial = []
        for device, piece, kernel in zip(self.devices, pieces, kernels):
            with tf.device(device):
                partial.append(_keras_ops().matmul(piece, kernel))
        ops = _keras_ops()
        with tf.device(self.home):
            y = functools.reduce(ops.add, partial)
            if len(self.groups) > 1:
                y = ops.add(y, self.groups[1][0][0])
            if self.layer.activation is not None:
                y = self.layer.activation(y)
        return y

    def _embedding_call(self, ids):
        ops = _keras_ops()
        if _keras().backend.standardize_dtype(ids.dtype) not in ("int32", "int64"):
            ids = ops.cast(ids, "int32")
        tables = self.groups[0][0]
        parts = []
        start = 0
        for device, table, size in zip(self.devices, tables, self.sizes):
            with tf.device(device):
                if self.kind == "column":
                    parts.append(ops.take(table, ids, axis=0))
                else:  # this device's vocabulary rows; ids elsewhere give zeros
                    local = ids - start
                    inside = ops.logical_and(local >= 0, local < size)
                    rows = ops.take(table, ops.where(inside, local, 0), axis=0)
                    parts.append(rows * ops.expand_dims(ops.cast(inside, rows.dtype), -1))
            start += size
        if self.kind == "column":
            out = self._gathered(parts)
        else:
            with tf.device(self.home):
                out = functools.reduce(ops.add, parts)
        return ops.cast(out, self.layer.compute_dtype)

    def _gathered(self, parts, keep_parts: bool = True):
        """The parts concatenated on the first device; kept for a row layer
        that consumes this output as it is (`_parts_of`)."""
        with tf.device(self.home):
            output = _keras_ops().concatenate(parts, axis=-1)
        if keep_parts:
            self.last_output = (output, parts)
            _PRODUCERS[id(output)] = self
        return output

    def _parts_of(self, inputs) -> list:
        """The row layer's input, one slice per device: the producing column
        layer's parts when it is that layer's latest output, else slices of it."""
        producer = _PRODUCERS.get(id(inputs))
        if (producer is not None and producer.last_output[0] is inputs
                and producer.sizes == self.sizes and producer.devices == self.devices):
            return list(producer.last_output[1])
        pieces, start = [], 0
        for device, size in zip(self.devices, self.sizes):
            with tf.device(device):
                pieces.append(inputs[..., start:start + size])
            start += size
        return pieces

    # -- whole values, saving ----------------------------------------------------------

    def whole_values(self) -> list[np.ndarray]:
        return [np.asarray(shards[0]) if axis is None
                else np.concatenate([np.asarray(s) for s in shards], axis=axis)
                for shards, axis in self.groups]

    def whole_shapes(self) -> list[tuple]:
        shapes = []
        for shards, axis in self.groups:
            shape = list(shards[0].shape)
            if axis is not None:
                shape[axis] = sum(s.shape[axis] for s in shards)
            shapes.append(tuple(shape))
        return shapes

    def variables(self) -> list:
        return [shard for shards, _ in self.groups for shard in shards]

    def assign_whole(self, values: Sequence[Any], where: str,
                     fix: str = "save from a model of the same architecture") -> None:
        shapes = self.whole_shapes()
        if len(values) != len(shapes):
            raise ValueError(
                f"{where} holds {len(shapes)} whole variables (shapes {shapes}), "
                f"got {len(values)} values; {fix}."
            )
        for (shards, axis), value, shape in zip(self.groups, values, shapes):
            value = np.asarray(value)
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"{where}: a value of shape {tuple(value.shape)} was given for a variable "
                    f"of shape {shape}; {fix}."
                )
            parts = [value] if axis is None else np.split(value, self.offsets, axis=axis)
            for shard, part in zip(shards, parts):
                shard.assign(part)

    def save_own_variables(self, store) -> None:
        for i, value in enumerate(self.whole_values()):
            store[str(i)] = value

    def load_own_variables(self, store) -> None:
        values = [store[str(i)] for i in range(len(store.keys()))]
        self.assign_whole(values, where=f"layer {self.layer.name!r} in the file")


class _OptimizerFiles:
    """The optimizer's state saved as a plain model's optimizer saves it.

    Each split weight has one slot per shard (kept on the shard's device);
    in files they are one whole slot, in the plain model's order: the first
    shard's slot stands for the gathered slot and the others are left out.
    So a plain Keras model loads the optimizer state too (and a file of a
    plain model loads into the split one), as for the weights.
    """

    _HOOKED: "weakref.WeakSet[Any]" = weakref.WeakSet()

    @classmethod
    def install(cls, model) -> None:
        splits = [s for s in (_Split.of(layer) for layer in model.layers) if s is not None]
        # Keras saves each of these on its own (a LossScaleOptimizer's inner
        # one, a MultiOptimizer's and its sub-optimizers: each their `variables`).
        for opt in optimizers_in(getattr(model, "optimizer", None)):
            if opt in cls._HOOKED or not splits:
                continue
            files = cls(opt, splits)
            object.__setattr__(opt, "save_own_variables", files.save_own_variables)
            object.__setattr__(opt, "load_own_variables", files.load_own_variables)
            cls._HOOKED.add(opt)

    def __init__(self, optimizer, splits):
        self.optimizer = weakref.proxy(optimizer)
        self.splits = [weakref.ref(s) for s in splits]

    def _entries(self) -> list[tuple[list, Optional[int]]]:
        """([variables], axis): one whole value each, in file order."""
        shard_of = {}  # slot prefix -> (group id, shard index, axis)
        for split in (ref() for ref in self.splits):
            for shards, axis in (split.groups if split is not None else []):
                if axis is not None:
                    for i, shard in enumerate(shards):
                        shard_of[_compat.optimizer_slot_prefix(shard)] = (id(shards), i, axis)
        slots, order = {}, []
        for variable in self.optimizer.variables:
            owner = next(((p, shard_of[p]) for p in shard_of if variable.name.startswith(p)),
                         None)
            if owner is None:
                order.append(([variable], None))
                continue
            prefix, (group, index, axis) = owner
            key = (group, variable.name[len(prefix):])
            slots.setdefault(key, {})[index] = variable
            if index == 0:
                order.append((key, axis))
        return [(entry, None) if axis is None else
                ([slots[entry][i] for i in sorted(slots[entry])], axis)
                for entry, axis in order]

    def save_own_variables(self, store) -> None:
        for i, (variables, axis) in enumerate(self._entries()):
            store[str(i)] = (np.asarray(variables[0]) if axis is None else
                             np.concatenate([np.asarray(v) for v in variables], axis=axis))

    def load_own_variables(self, store) -> None:
        entries = self._entries()
        if len(store.keys()) != len(entries):
            warnings.warn(
                f"Skipping variable loading for optimizer '{self.optimizer.name}', because "
                f"it has {len(entries)} variables whereas the saved optimizer has "
                f"{len(store.keys())} variables.", stacklevel=2)
            return
        for i, (variables, axis) in enumerate(entries):
            value = np.asarray(store[str(i)])
            if axis is None:
                variables[0].assign(value)
                continue
            offsets = np.cumsum([v.shape[axis] for v in variables])[:-1]
            for variable, part in zip(variables, np.split(value, offsets, axis=axis)):
                variable.assign(part)


def _keras():
    import keras  # not at import: keras_distrib sets up TensorFlow first

    return keras


def _keras_ops():
    return _keras().ops
