"""The model cut into stages: which layer runs in which stage, and each
stage as a Keras sub-model of the model's own layers.

* `cut_graph`: the graph the stages are cut from (the model's own, or the
  same computation with nested models inlined);
* `stage_of_layers`: layer name -> stage (balanced by parameter count, or
  where `split_at` says);
* `Stages`: the stage sub-models, from the tensors entering a stage to those
  leaving it (skip connections that jump a stage are carried through it);
* `batch_rows`, `row_share`, `concat_micro_batches`: the arithmetic of
  micro-batches every step that runs the stages shares.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Optional

import tensorflow as tf

from keras_distrib import _compat
from keras_distrib.strategies.pipeline import schedule as pipeline_schedule
from keras_distrib.strategies.pipeline.plan import device_of


class Stages:
    """A functional model cut into stage sub-models.

    `boundary[s]` lists the tensors entering stage `s` (for `s = 0`, the
    model's inputs; for `s = p`, its outputs): those made before stage `s`
    and used by it or later. Stage `s` maps `boundary[s]` to
    `boundary[s + 1]`: its sub-model computes the tensors it makes, and
    the others pass through.
    """

    def __init__(self, strategy, graph):
        """`strategy`: the `Pipeline` (its devices, `num_stages`, `split_at`);
        `graph`: what the stages are cut from (`cut_graph`: the model, or the
        same computation with nested models inlined)."""
        self.strategy = strategy
        p = strategy.num_stages
        stage_of = stage_of_layers(graph, p, strategy.split_at)
        self.layers = [(layer, stage_of[layer.name]) for layer in pipelined_layers(graph)]
        walk = _walk_calls(graph, [layer for layer, _ in self.layers], stage_of, strategy.devices)
        outputs = list(graph.outputs)
        for t in outputs:
            walk.used_at[id(t)] = p
        self.boundary = [list(graph.inputs)]
        for s in range(1, p):
            self.boundary.append(
                [t for t in walk.known if walk.made_at[id(t)] < s <= walk.used_at.get(id(t), -1)]
            )
        self.boundary.append(outputs)
        self._output_structure = graph.output
        self.models, self.inputs, self.made = [], [], []
        for s in range(p):
            self._add_stage(graph, s, walk)

    def _add_stage(self, graph, s: int, walk: "_Walk") -> None:
        """Makes stage `s`'s sub-model, from the tensors its calls take to
        those it makes that later stages use."""
        import keras

        mine = [t for t in self.boundary[s + 1] if walk.made_at[id(t)] == s]
        if s == 0:
            # The model's own input structure: Keras maps x onto it.
            inputs, mine = graph.input, self.boundary[1]
        else:
            consumed = walk.consumed_at.get(s, set())
            inputs = [t for t in self.boundary[s] if id(t) in consumed]
        if not mine:
            raise ValueError(
                f"Pipeline stage {s} makes none of the tensors later stages use; "
                "choose split_at (or num_stages) differently."
            )
        try:
            stage = keras.Model(inputs, mine, name=f"{graph.name}_stage_{s}")
        except ValueError as error:
            if "not connected" not in str(error):
                raise
            # Keras: "Output with path `0` is not connected to `inputs`".
            names = [layer.name for layer, stage_ in self.layers if stage_ == s]
            raise ValueError(
                f"Pipeline stage {s} (layers {names}) computes from a tensor that no "
                "call of the model's graph hands over from the stage before it; "
                "choose split_at so that the layers it joins are in one stage."
            ) from None
        self.models.append(stage)
        self.inputs.append([self.boundary[s].index(t) for t in _flat(inputs)] if s else None)
        self.made.append([id(t) for t in mine])

    def forward(self, s: int, inputs, training: bool) -> list:
        """Stage `s`'s outputs (`boundary[s + 1]`, as a list) from its inputs
        (the batch's `x` for stage 0, else `boundary[s]` as a list)."""
        if s == 0:
            return _flat(self.models[0](inputs, training=training))
        made = _flat(self.models[s]([inputs[k] for k in self.inputs[s]], training=training))
        by_id = dict(zip(self.made[s], made))
        entering = {id(t): v for t, v in zip(self.boundary[s], inputs)}
        return [
            by_id[id(t)] if id(t) in by_id else tf.identity(entering[id(t)])
            for t in self.boundary[s + 1]
        ]

    def take_added_losses(self, s: int, share):
        """The losses stage `s`'s layers added in its latest call (`add_loss`,
        activity regularizers), summed and weighted by `share` (the
        micro-batch's rows over the batch's: Keras normalizes an activity
        loss by the rows it saw), or None; cleared from the layers, so that
        the last stage's `compute_loss` counts only its own (a loss added
        in another stage's pass is a tensor of that pass's tape)."""
        losses = _compat.take_added_losses(self.models[s])
        if not losses:
            return None
        total = tf.add_n([tf.cast(loss, tf.float32) for loss in losses])
        return total * tf.cast(share, tf.float32)

    def pack_outputs(self, flat: list):
        """The model's outputs as `model(x)` returns them."""
        return tf.nest.pack_sequence_as(self._output_structure, list(flat))


@dataclasses.dataclass
class _Walk:
    """What the stages' boundaries are read from, by tensor id: the stage
    that makes each tensor (-1: the model's inputs), the latest stage that
    uses it, the tensors each stage's calls take, and every tensor in the
    order the graph makes them."""

    made_at: dict
    used_at: dict
    consumed_at: dict
    known: list


def _walk_calls(model, layers: list, stage_of: dict, devices) -> _Walk:
    """Every call in `model`'s graph, inputs first, with its tensors there
    (a nested model's `input`/`output` are those of its own graph): the
    layers' (those of `layers`), and the operations between them
    (`h + a`), which are computed in the stage of their latest input."""
    by_id = {id(layer): layer for layer in layers}
    walk = _Walk(
        made_at={id(t): -1 for t in model.inputs},
        used_at={},
        consumed_at={},
        known=list(model.inputs),
    )
    for operation, (inputs, outputs) in _compat.layer_tensors(model).items():
        layer = by_id.get(operation)
        if layer is not None:
            stage = stage_of[layer.name]
            _check_placement(layer, devices[stage])
        else:
            stage = max([walk.made_at.get(id(t), -1) for t in inputs] + [0])
        for t in inputs:
            if walk.made_at.get(id(t), -1) > stage:
                assert layer is not None  # an operation is in the stage of its latest input
                raise ValueError(
                    f"Layer {layer.name!r} (stage {stage}) uses a tensor made in a later "
                    "stage; pipeline stages must follow the layer graph (a shared layer "
                    "called at two depths cannot be cut); choose split_at differently."
                )
            walk.used_at[id(t)] = max(walk.used_at.get(id(t), -1), stage)
            walk.consumed_at.setdefault(stage, set()).add(id(t))
        for t in outputs:
            walk.made_at[id(t)] = stage
            walk.known.append(t)
    return walk


def cut_graph(model, num_stages: int, split_at: Optional[list]):
    """The graph the stages are cut from: the model's own, or, where it
    has too few layers for the stages or `split_at` names a layer inside
    a nested model, the same computation with each nested Functional or
    Sequential model replaced by the layers inside it (the same layers,
    called again: the same variables). Made once per model, and kept
    in a plain holder: Keras's saving walks a model's attributes, and
    an attribute holding the model itself (or the inlined copy) would
    send it round in circles."""
    cached = model.__dict__.get("_kd_pipeline_graph")
    if cached is not None:
        return cached.graph
    graph = model
    names = {layer.name for layer in pipelined_layers(model)}
    wants_inside = any(name not in names for name in split_at or ())
    if (len(names) < num_stages or wants_inside) and any(
        _compat.graph_of(layer) is not None for layer in model.layers
    ):
        graph = _compat.inlined_functional(model)
    model.__dict__["_kd_pipeline_graph"] = types.SimpleNamespace(graph=graph)
    return graph


def pipelined_layers(model) -> list:
    """`model`'s layers that a stage runs (all but its inputs)."""
    import keras

    return [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]


def stage_of_layers(model, num_stages: int, split_at: Optional[list]) -> dict:
    """Layer name -> stage, for the model's layers in graph order."""
    layers = pipelined_layers(model)
    names = [layer.name for layer in layers]
    if num_stages > len(layers):
        raise ValueError(
            f"Cannot cut model {model.name!r} ({len(layers)} layers) into {num_stages} "
            f"stages; use num_stages <= {len(layers)}."
        )
    if split_at is None:
        stages = pipeline_schedule.partition([layer.count_params() for layer in layers], num_stages)
        return dict(zip(names, stages))
    starts = []
    for name in split_at:
        if name not in names:
            shown = names if len(names) <= 12 else names[:6] + ["..."] + names[-5:]
            raise ValueError(
                f"split_at: {name!r} is not a layer of model {model.name!r}; "
                f"its layers are {shown}."
            )
        starts.append(names.index(name))
    if starts != sorted(set(starts)) or starts[0] == 0:
        raise ValueError(
            f"split_at={split_at} must name distinct layers in the model's order, after its "
            f"first layer {names[0]!r} (each starts a stage)."
        )
    return {name: sum(i >= start for start in starts) for i, name in enumerate(names)}


def _check_placement(layer, device: str) -> None:
    for variable in layer.variables:
        placed = device_of(variable)
        if placed != device:
            raise ValueError(
                f"Layer {layer.name!r} belongs to a stage on {device} but its variable "
                f"{variable.path!r} is on {placed}; build the layers outside "
                "strategy.scope() and let DistributedModel place them."
            )


def _flat(structure) -> list:
    return tf.nest.flatten(structure)


def concat_micro_batches(per_micro_batch: list) -> list:
    """Flat outputs of each micro-batch -> flat outputs of the batch."""
    return [tf.concat(parts, axis=0) for parts in zip(*per_micro_batch)]


def row_share(x_part, rows):
    """A micro-batch's rows over the batch's `rows` (float32)."""
    return tf.cast(batch_rows(x_part), tf.float32) / tf.cast(rows, tf.float32)


def batch_rows(x):
    """The rows of a batch's inputs `x` (its first tensor's first dimension)."""
    return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]
