"""`"tensor_parallel"`: Dense and Embedding layers split over the local devices.

One model replica spans all the local devices (Megatron-style tensor
parallelism, Shoeybi et al., 2019, arXiv:1909.08053). The model's own
layers are laid out in place (`place`): each Dense / Embedding the layout
splits then holds one shard of its kernel (embeddings) and bias per
device, created on that device, and a forward pass that computes each part
where its shard lives (see `keras_distrib.strategies.tensor_parallel.layout`
for the layout and the default plan). Other layers are placed whole on one device and run there.

Communication, per split layer, inside the one step (no all-reduce across
replicas: there is one replica, and autodiff through the per-device ops
gives the exact gradient; `split_forward` runs it):

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
Embedding uses (`split_layer`: `save_own_variables` concatenates the shards,
`load_own_variables` splits a whole value), so `.keras` and `.weights.h5`
files load into a plain Keras model of the same architecture and back.
The optimizer's slots are created next to their shard (Keras's optimizer
colocates each slot with its variable) and saved whole too, in the plain
model's order (`optimizer.OptimizerFiles`), so a plain model also resumes
from the optimizer state.
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
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib import devices as devices_lib
from keras_distrib import replica_seeds
from keras_distrib.strategies.tensor_parallel import layout as tensor_layout
from keras_distrib.strategies.tensor_parallel import optimizer as tp_optimizer
from keras_distrib.strategies.tensor_parallel.split_layer import SAME_ARCHITECTURE, SplitLayer
from keras_distrib.strategies import lockstep
from keras_distrib.strategies.base import Strategy
from keras_distrib.arithmetic.optimizer_tree import optimizers_in
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

    def __init__(
        self,
        devices: Optional[Sequence[str]] = None,
        layout: Optional[Mapping[str, str]] = None,
        workers: Optional[Mapping[str, Any]] = None,
    ):
        self._layout = tensor_layout.check_layout(layout)
        self._topology = self._join_workers(
            devices_lib.check_devices(devices_lib.local_devices() if devices is None else devices),
            workers,
        )
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
            for layer in _compat.direct_layers(model):
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
        self._last_layers = [weakref.ref(layer) for layer in _compat.direct_layers(model)]

    def _lay_out(self, layer, plan) -> None:
        self._laid_out.add(layer)
        if plan is None:
            return
        self._kinds[layer] = plan.kind
        if plan.kind == "whole":
            _run_on(layer, plan.device)
        else:
            SplitLayer.install(layer, plan.kind, self._devices)

    # -- execution ----------------------------------------------------------------

    def sync_initial_state(self, model) -> None:
        # Called once the model and its optimizer are built.
        tp_optimizer.OptimizerFiles.install(model)
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
                grads = tp_optimizer.clip_by_joint_norms(
                    grads, list(trainable_variables), self._split_groups(), optimizer.clipnorm
                )
            return keras_apply(grads, trainable_variables)

        return apply

    def _split_groups(self) -> list[list]:
        """The variables of each split kernel, embedding or bias, part by part."""
        groups = []
        for layer in list(self._laid_out):
            split = SplitLayer.of(layer)
            if split is not None:
                groups += [shards for shards, axis in split.groups if axis is not None]
        return groups

    def _check_optimizer(self, model) -> None:
        """A one-line error for optimizers whose update reads whole variables."""
        if not self._split_groups():
            return
        tp_optimizer.check_element_wise(getattr(model, "optimizer", None))

    def without_xla(self) -> Optional[str]:
        return "XLA compiles the work of one device, and a split layer's step spans all devices"

    def make_step_function(self, model, step, keras_make_function: Callable):
        self._check_laid_out(model)
        self._check_optimizer(model)
        tp_optimizer.OptimizerFiles.install(model)
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
                model, lambda batch: self.gather_rows(self.run(step.fn, batch))
            )
        return keras_make_predict_function()

    def _check_laid_out(self, model) -> None:
        missing = [
            layer.name
            for layer in _compat.direct_layers(model)
            if layer.weights and layer not in self._laid_out
        ]
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
            layers = list(_compat.direct_layers(model))
        else:
            layers = [layer for layer in (ref() for ref in self._last_layers) if layer is not None]
        kinds = {layer.name: self._kinds[layer] for layer in layers if layer in self._kinds}
        optimizer = getattr(model, "optimizer", None)
        return tensor_layout.describe(
            layers, kinds, self._devices, optimizer.variables if optimizer is not None else ()
        )

    # Not `Strategy.describe`'s ReplicaMemory: the shards' placement, per device.
    def describe(self, model) -> tensor_layout.Plan:  # type: ignore[override]
        """`plan(model)`: where each weight of `model` lives."""
        return self.plan(model)

    def whole_weights(self, model) -> list[np.ndarray]:
        """`model.get_weights()`: a plain Keras model's list, each split
        variable's shards gathered into the whole value."""
        return [
            value
            for entry in _whole_entries(model)
            for value in (
                entry.whole_values() if isinstance(entry, SplitLayer) else [entry.numpy()]
            )
        ]

    def set_whole_weights(self, model, weights: Sequence[np.ndarray]) -> None:
        """`model.set_weights(weights)`, from a plain model's `get_weights()` list."""
        entries, weights = _whole_entries(model), list(weights)
        counts = [len(e.whole_shapes()) if isinstance(e, SplitLayer) else 1 for e in entries]
        if len(weights) != sum(counts):
            raise ValueError(
                f"model {model.name!r} has {sum(counts)} weights (a plain Keras model's "
                f"`get_weights()` list), got {len(weights)}; {SAME_ARCHITECTURE}."
            )
        for entry, count in zip(entries, counts):
            values, weights = weights[:count], weights[count:]
            if isinstance(entry, SplitLayer):
                entry.assign_whole(
                    values, where=f"layer {entry.layer.name!r}", fix=SAME_ARCHITECTURE
                )
                continue
            value = np.asarray(values[0])
            if tuple(value.shape) != tuple(entry.shape):
                raise ValueError(
                    f"weight {entry.path!r} of model {model.name!r} has shape "
                    f"{tuple(entry.shape)}, got a value of shape {tuple(value.shape)}; "
                    f"{SAME_ARCHITECTURE}."
                )
            entry.assign(value)


def _whole_entries(model) -> list:
    """`model.weights` in order, with each split layer's shards standing
    once, as that layer's `SplitLayer`, where its first shard is."""
    owners = {
        id(variable): split
        for layer in _compat.direct_layers(model)
        if (split := SplitLayer.of(layer)) is not None
        for variable in split.variables()
    }
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

    setattr(call_on_device, "_kd_pinned", True)  # from_model's copy takes the class's call back
    object.__setattr__(layer, "call", call_on_device)
