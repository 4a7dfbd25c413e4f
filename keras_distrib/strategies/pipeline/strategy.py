"""`"pipeline"`: the model cut into stages, one stage per device, fed micro-batches.

One replica spans the stage devices (`num_replicas=1`): stage `s` holds
its layers' variables (and their optimizer slots, which Keras colocates
with them) on `devices[s]`. Each step splits the global batch into
`num_micro_batches` micro-batches; while stage 1 works on micro-batch `i`,
stage 0 already works on `i + 1`, so the devices overlap except for the
pipeline's fill and drain (the "bubble", `(p-1)/(m+p-1)` of the step).

The gradient is the unsplit model's: each micro-batch's loss is Keras's
own `compute_loss` on its rows, weighted by its share of the global batch,
so the sum over micro-batches is the mean loss over the global batch
(for losses reduced with Keras's default `"sum_over_batch_size"`). One
`optimizer.apply_gradients` per step; metrics and the loss log are
computed on the whole batch, as with one device.

How a step runs (`keras_distrib.strategies.pipeline.schedule` holds the orders):

* each stage is a Keras sub-model of the model's own layers, from the
  tensors entering the stage to those leaving it (skip connections that
  jump a stage are carried through it);
* a forward pass of stage `s` on micro-batch `i` runs under
  `tf.device(devices[s])` inside its own `tf.GradientTape`; its backward
  pass is `tape.gradient(stage outputs, variables + stage inputs,
  output_gradients=the gradients from stage s+1)`, summed over
  micro-batches;
* the passes of one stage are chained with control dependencies in the
  schedule's order, so the schedule is what TensorFlow runs, not a
  suggestion: under `"1f1b"` a stage cannot start a forward before the
  backward that frees an earlier micro-batch's activations, which bounds
  the activations held to `p - s` micro-batches on stage `s` (GPipe
  holds all `m`).

Behaviour across micro-batches, by design:

* Random layers (Dropout): each micro-batch's forward draws its own seed
  from the layer's seed generator, in micro-batch order (every schedule
  runs a stage's forwards in that order), so a run is reproducible under
  `keras.utils.set_random_seed`, both schedules give the same result, and
  masks differ between micro-batches. The masks are not those of one
  device running the whole batch.
* BatchNormalization in training normalizes each micro-batch with that
  micro-batch's statistics, and updates its moving mean and variance once
  per micro-batch (`m` momentum updates per step), as GPipe does. With
  `num_micro_batches=1` it matches one device exactly. A batch with fewer
  rows than micro-batches gives empty micro-batches, whose statistics are
  NaN: keep the last batch of an epoch at least `num_micro_batches` rows
  (or use `drop_remainder`) with BatchNormalization.
* Evaluation and prediction run the stages on micro-batches too (no
  tapes), with results identical to one device.

Not supported (one-line errors): subclassed models (the stages are cut
from a Functional or Sequential graph), a custom `train_step`,
`DistributedOptimizer(backward_passes_per_step>1)` (raise
`num_micro_batches` instead: micro-batches already accumulate gradients
within a step). Losses added in `call` (`add_loss`, activity regularizers)
count where they were added: each stage's pass differentiates its own
(weighted by the micro-batch's share of the rows), and the loss log and
`evaluate` include them, as one device's; weight regularizers are counted
by the last stage.

Under a configured cluster (the launcher) each worker runs the whole
pipeline on its local devices and the strategy is data-parallel across
workers (`keras_distrib.strategies.hybrid`): after the last backward pass
of a step, the summed gradients are all-reduced once with every worker's.
An explicit `batch_size` must then be divisible by `num_micro_batches`
times the number of workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib.input import data as data_lib
from keras_distrib import devices as devices_lib
from keras_distrib.strategies.pipeline import schedule as pipeline_schedule
from keras_distrib import replica_seeds
from keras_distrib.strategies import lockstep
from keras_distrib.strategies.base import Strategy
from keras_distrib.strategies.gradients import scaled_gradient, summed_gradients
from keras_distrib.strategies.hybrid import WorkerReplicas
from keras_distrib.topology import Topology

BALANCES = ("params",)


class Pipeline(WorkerReplicas, Strategy):
    """Pipeline parallelism: stages on devices, micro-batches, GPipe or 1F1B.

    Args:
        devices: the stage devices in stage order (default: every local GPU,
            or every logical CPU when there is none).
        num_stages: how many stages (default: `len(split_at) + 1` when
            `split_at` is given, else one per device). Stage `s` runs on
            `devices[s]`.
        num_micro_batches: micro-batches per global batch (default
            `4 * num_stages`: GPipe's measurements show the bubble becomes
            negligible from about 4 micro-batches per stage, and 8 divides
            the default batch of 32 for 2 stages). An explicit `batch_size`
            must be divisible by it.
        schedule: `"1f1b"` (default: one forward, one backward; holds at
            most `num_stages - s` micro-batches of activations on stage
            `s`) or `"gpipe"` (all forwards, then all backwards; holds all
            of them). Both give the same gradients.
        split_at: names of the layers that start stages 2..p, in the
            model's order (default: cut automatically).
        balance: how automatic cuts balance the stages: `"params"` (by
            parameter count, the largest stage as small as can be).
        workers: under a cluster (hybrid data x pipeline parallelism),
            options of the collectives across workers, as `multi_worker`
            takes them (e.g. `{"implementation": "ring"}`).

    Example:

    ```python
    import keras, keras_distrib as kd

    inputs = keras.Input((784,))
    h = keras.layers.Dense(1024, activation="relu", name="a")(inputs)
    h = keras.layers.Dense(1024, activation="relu", name="b")(h)
    outputs = keras.layers.Dense(10, name="logits")(h)
    strategy = kd.strategies.get("pipeline", num_micro_batches=4, schedule="1f1b")
    model = kd.DistributedModel(inputs, outputs, strategy=strategy)
    print(strategy.describe(model))   # layers, variables and bytes per device
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=64)
    ```
    """

    name = "pipeline"
    aliases = ("pipeline_parallel",)
    description = ("Model cut into stages, one per device; micro-batches in a GPipe or 1F1B "
                   "schedule (one process).")

    def __init__(self, devices: Optional[Sequence[str]] = None,
                 num_stages: Optional[int] = None,
                 num_micro_batches: Optional[int] = None,
                 schedule: str = "1f1b",
                 split_at: Optional[Sequence[str]] = None,
                 balance: str = "params",
                 workers: Optional[Mapping[str, Any]] = None):
        if schedule not in pipeline_schedule.SCHEDULES:
            raise ValueError(f"Unknown schedule {schedule!r}; use one of "
                             f"{list(pipeline_schedule.SCHEDULES)}.")
        if balance not in BALANCES:
            raise ValueError(f"Unknown balance {balance!r}; use one of {list(BALANCES)}.")
        if split_at is not None and (isinstance(split_at, str) or not split_at):
            raise ValueError(f"split_at={split_at!r} must be a non-empty list of layer names "
                             "(the first layer of stages 2..p), e.g. ['dense_2'].")
        if num_stages is None:
            num_stages = len(split_at) + 1 if split_at else None
        elif not data_lib.is_positive_int(num_stages):
            raise ValueError(f"num_stages={num_stages!r} must be an integer >= 1.")
        if split_at and len(split_at) != num_stages - 1:
            raise ValueError(
                f"split_at names {len(split_at)} layer(s) but num_stages={num_stages} needs "
                f"{num_stages - 1} (the first layer of each stage after the first).")
        if devices is None:
            available = devices_lib.local_devices()
            num_stages = num_stages or len(available)
            if num_stages > len(available):
                raise ValueError(
                    f"num_stages={num_stages} needs {num_stages} devices but only "
                    f"{len(available)} are visible ({available}); use fewer stages.")
            devices = available[:num_stages]
        devices = devices_lib.check_devices(devices)
        num_stages = num_stages or len(devices)
        if num_stages != len(devices):
            raise ValueError(
                f"num_stages={num_stages} but {len(devices)} devices were given; pass one "
                "device per stage.")
        if num_micro_batches is None:
            num_micro_batches = 4 * num_stages
        if not data_lib.is_positive_int(num_micro_batches):
            raise ValueError(f"num_micro_batches={num_micro_batches!r} must be an integer "
                             ">= 1 (micro-batches per global batch).")
        self.num_stages = num_stages
        self.num_micro_batches = int(num_micro_batches)
        self.schedule = schedule
        self.split_at = list(split_at) if split_at else None
        self.balance = balance
        self._topology = self._join_workers(devices, workers)
        # Variables created under scope() or moved by place() (ids -> weak refs).
        self._made: dict[int, weakref.ref] = {}

    @property
    def topology(self) -> Topology:
        return self._topology

    # -- placement ----------------------------------------------------------------

    @contextlib.contextmanager
    def _creating_on(self, device: str):
        """Variables created inside go on `device` and count as this strategy's."""

        def record(next_creator, **kwargs):
            variable = next_creator(**kwargs)
            self._made[id(variable)] = weakref.ref(variable)
            return variable

        with tf.device(device), tf.variable_creator_scope(record):
            yield

    def scope(self):
        # Optimizer step counters and metrics: with the loss and metrics,
        # on the last stage. Layers go on their stage's device (place).
        return self._creating_on(self.devices[-1])

    def holds(self, variable: Any) -> bool:
        value = getattr(variable, "value", variable)
        ref = self._made.get(id(value))
        return ref is not None and ref() is value

    def place(self, model) -> list:
        """Moves each layer's variables (those of the layers nested in it
        too) to its stage's device, in place; the model's own (a seed
        generator) and anything else go with the loss, on the last stage."""
        from keras_distrib import placement  # not at import: it loads Keras

        moved = []
        if isinstance(model, _compat.functional_class()):
            graph = self._cut_graph(model)
            stage_of = _stage_of_layers(graph, self.num_stages, self.split_at)
            for layer in _pipelined_layers(graph):
                moving = placement.unheld(self, layer.variables, model)
                device = self.devices[stage_of[layer.name]]
                placement.remake(moving, self, model, where=lambda d=device: self._creating_on(d))
                moved += moving
        moving = placement.unheld(self, model.variables, model)
        placement.remake(moving, self, model)
        return moved + moving

    def describe(self, model) -> "PipelinePlan":
        """Which layer and variable lives on which device, and bytes per device.

        Read from the variables' actual placement (not from the plan).
        """
        stages = self._stages(model)
        layer_stages = [[] for _ in range(self.num_stages)]
        for layer, stage in stages.layers:
            layer_stages[stage].append(layer.name)
        placement = {v.path: _device_of(v) for v in model.variables}
        optimizer = getattr(model, "optimizer", None)
        return PipelinePlan(
            devices=list(self.devices),
            layers=layer_stages,
            variables=placement,
            bytes_per_device=_bytes_per_device(model.variables),
            optimizer_bytes_per_device=_bytes_per_device(
                optimizer.variables if optimizer is not None else []),
            num_micro_batches=self.num_micro_batches,
            schedule=self.schedule,
            peak_live_activations=pipeline_schedule.peak_live_activations(
                pipeline_schedule.stage_orders(
                    self.schedule, self.num_micro_batches, self.num_stages)),
        )

    # -- input --------------------------------------------------------------------------

    def check_batch_size(self, batch_size: Optional[int], name: str = "batch_size") -> None:
        super().check_batch_size(batch_size, name)
        m = self.num_micro_batches * self.world_size
        if batch_size is not None and batch_size % m:
            lower = batch_size - batch_size % m
            examples = " or ".join(str(b) for b in (lower, lower + m) if b > 0)
            workers = f" x {self.world_size} workers" if self.world_size > 1 else ""
            raise ValueError(
                f"{name}={batch_size} is not divisible by num_micro_batches="
                f"{self.num_micro_batches}{workers} of strategy 'pipeline'; use a multiple of "
                f"{m} (e.g. {examples}).")

    # -- execution ----------------------------------------------------------------------

    def without_xla(self) -> Optional[str]:
        return "XLA compiles the work of one device, and a pipeline step spans every stage's device"

    def make_step_function(self, model, step, keras_make_function: Callable):
        if not step.applies:  # DistributedModel's gradient accumulation
            raise ValueError(
                "strategy='pipeline' does not support backward_passes_per_step > 1; raise "
                "num_micro_batches instead (micro-batches accumulate gradients in a step).")
        if step.kind == "train" and step.custom:
            raise ValueError(
                "strategy='pipeline' runs its own train step and cannot run a custom "
                "train_step; use DistributedModel's (override compute_loss instead).")
        model.compile_replicas_separately(False)
        if step.custom:
            run_step = step.fn  # a custom test step runs as written, on the whole batch
        else:
            stages = self._stages(model)
            run = self._train_step if step.kind == "train" else self._test_step

            def run_step(data):
                return run(model, stages, data)

        run_step = self._as_this_replica(run_step)
        if self.world_size > 1 and model.steps_per_execution > 1:
            # Keras's fused steps trace the step inside tf.cond, where the
            # collectives across workers cannot be.
            return lockstep.stepwise(model, run_step)
        return keras_make_function(run_step)  # without XLA: see `without_xla`

    def make_predict_function(self, model, step, keras_make_predict_function: Callable):
        import keras

        if step.custom:
            return keras_make_predict_function()
        stages = self._stages(model)
        return lockstep.predict_over_steps(model, self._as_this_replica(
            lambda batch: self.gather_rows(
                self._forward(stages, keras.utils.unpack_x_y_sample_weight(batch)[0])[0])))

    def run(self, replica_fn: Callable, batch: Any):
        with self.scope():
            return self._as_this_replica(replica_fn)(batch)

    def _as_this_replica(self, step: Callable) -> Callable:
        """`step`, drawing this worker's random numbers (`replica_seeds`):
        the schedule runs the stages itself, not through `run`."""
        def seeded_step(data):
            with replica_seeds.as_replica(self.rank):
                return step(data)
        return seeded_step

    def _stages(self, model) -> "_Stages":
        """The model's stages as sub-models (made once per model: each
        sub-model adds a node to its layers)."""
        cached = model.__dict__.get("_kd_pipeline_stages")
        if cached is not None and cached.strategy is self:
            return cached
        if not isinstance(model, _compat.functional_class()):
            raise ValueError(
                f"strategy='pipeline' needs a Functional or Sequential model, got subclassed "
                f"{type(model).__name__}; build it with DistributedModel(inputs, outputs) or "
                "DistributedModel.from_model(model).")
        stages = _Stages(self, model, self._cut_graph(model))
        model.__dict__["_kd_pipeline_stages"] = stages
        return stages

    def _cut_graph(self, model):
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
        names = {layer.name for layer in _pipelined_layers(model)}
        wants_inside = any(name not in names for name in self.split_at or ())
        if ((len(names) < self.num_stages or wants_inside)
                and any(_compat.graph_of(layer) is not None for layer in model.layers)):
            graph = _compat.inlined_functional(model)
        model.__dict__["_kd_pipeline_graph"] = types.SimpleNamespace(graph=graph)
        return graph

    def _forward(self, stages: "_Stages", x, training: bool = False):
        """The model's output on `x`, stage by stage, micro-batch by
        micro-batch, and the losses its layers added on the way (weighted
        over the micro-batches as `take_added_losses` does), or None."""
        outputs, added, rows = [], [], _rows(x)
        for x_part in data_lib.split_batch(x, self.num_micro_batches):
            values = None
            for s in range(self.num_stages):
                with tf.device(self.devices[s]):
                    values = stages.forward(s, x_part if s == 0 else values, training)
                    added.append(stages.take_added_losses(s, _share(x_part, rows)))
            outputs.append(values)
        added = [loss for loss in added if loss is not None]
        with tf.device(self.devices[-1]):
            return stages.pack_outputs(_concat(outputs)), (tf.add_n(added) if added else None)

    def _test_step(self, model, stages: "_Stages", data):
        import keras

        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, added = self._forward(stages, x)
        with tf.device(self.devices[-1]):
            # As DistributedModel.test_step, on the whole batch.
            loss = _compat.compute_loss(model, x=x, y=y, y_pred=y_pred,
                                        sample_weight=sample_weight, training=False)
            if added is not None:
                loss = loss + tf.cast(added, loss.dtype)
            _compat.loss_tracker(model).update_state(loss, sample_weight=_rows(x))
            return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _train_step(self, model, stages: "_Stages", data):
        import keras

        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        m, p = self.num_micro_batches, self.num_stages
        rows = _rows(x)
        parts = data_lib.split_batch((x, y, sample_weight), m)
        variables = list(model.trainable_weights)
        gradients: list = [[] for _ in variables]  # per variable, to be summed
        values = [dict() for _ in range(m)]  # (stage, i) -> that stage's inputs
        tapes, upstream, losses, predictions = {}, {}, [None] * m, [None] * m
        added = [[] for _ in range(m)]  # per micro-batch: earlier stages' added losses
        last_pass = [None] * p  # per stage: what its next pass waits for
        output_sums = []  # per micro-batch: its per-output losses times its rows
        orders = pipeline_schedule.stage_orders(self.schedule, m, p)
        for _, s, kind, i in pipeline_schedule.emission_order(orders):
            x_i, y_i, w_i = parts[i]
            # The scope names each pass in the graph (tests find them there).
            with tf.device(self.devices[s]), _after(last_pass[s]), \
                    tf.name_scope(f"stage_{s}_{kind}_{i}"):
                if kind == "F":
                    inputs = x_i if s == 0 else values[i][s]
                    sources = [] if s == 0 else _differentiable(inputs)
                    with tf.GradientTape() as tape:
                        tape.watch(sources)
                        outputs = stages.forward(s, inputs, training=True)
                        if s == p - 1:
                            y_pred = stages.pack_outputs(outputs)
                            # Counts the losses this stage added in this pass.
                            with _compat.captured_output_losses(model) as per_output:
                                loss = _compat.compute_loss(model, x=x_i, y=y_i, y_pred=y_pred,
                                                            sample_weight=w_i, training=True)
                            output_sums.append([tf.cast(v, tf.float32) * tf.cast(
                                _rows(x_i), tf.float32) for v in per_output])
                            # This micro-batch's share of the global mean loss.
                            loss = loss * tf.cast(_rows(x_i), loss.dtype) / tf.cast(
                                rows, loss.dtype)
                            target = model.optimizer.scale_loss(loss)
                            losses[i] = tf.add_n([loss, *(tf.cast(a, loss.dtype)
                                                          for a in added[i])])
                            predictions[i] = outputs
                        else:
                            values[i][s + 1] = outputs
                            target = _differentiable(outputs)
                            # Losses this stage added (activity regularizers):
                            # differentiated in this stage's tape, one more
                            # target with its own output gradient.
                            extra = stages.take_added_losses(s, _share(x_i, rows))
                            if extra is not None:
                                added[i].append(extra)
                                target = [*target, model.optimizer.scale_loss(extra)]
                    tapes[s, i] = (tape, target, sources)
                    done = tf.nest.flatten(outputs) + ([target] if s == p - 1 else [])
                else:
                    tape, target, sources = tapes.pop((s, i))
                    output_gradients = None
                    if s < p - 1:
                        arriving = list(upstream.pop((s + 1, i)))
                        # An added loss's target (after the outputs) gets 1.
                        arriving += [tf.ones_like(t) for t in target[len(arriving):]]
                        output_gradients = [
                            tf.zeros_like(t) if g is None else g
                            for t, g in zip(target, arriving)]
                    found = tape.gradient(target, variables + sources,
                                          output_gradients=output_gradients)
                    upstream[s, i] = found[len(variables):]
                    for k, g in enumerate(found[:len(variables)]):
                        if g is not None:
                            gradients[k].append(g)
                            if self.schedule == "1f1b":
                                # A running sum: one gradient per variable is
                                # kept, as 1F1B bounds memory. GPipe holds every
                                # micro-batch anyway; one sum at the end saves
                                # it m-2 passes over the gradients.
                                gradients[k] = [summed_gradients(gradients[k])]
                    done = [g for g in found if g is not None] or [tf.constant(0)]
                last_pass[s] = done
        gradients = [summed_gradients(g) if g else None for g in gradients]
        # Per-output losses (a model with several outputs): the batch's
        # means, recorded once as one device records them.
        output_losses = [tf.add_n(list(sums)) / tf.cast(rows, tf.float32)
                         for sums in zip(*output_sums)]
        if self.world_size > 1:
            # The sum over micro-batches is this worker's mean-loss gradient;
            # as a sum over its rows it reduces with every worker's (and the
            # row counts, statistics, per-output losses and stop vote) in one
            # all-reduce.
            gradients = model.reduce_with_statistics(
                [scaled_gradient(g, rows) for g in gradients], rows, output_losses, x)
        else:
            model.record_output_losses(output_losses, x, summed=True)
        model.apply_reduced_gradients(gradients)
        with tf.device(self.devices[-1]):
            y_pred = stages.pack_outputs(_concat(predictions))
            _compat.loss_tracker(model).update_state(tf.add_n(losses), sample_weight=rows)
            return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


@dataclasses.dataclass
class PipelinePlan:
    """Where a pipelined model lives, from `Pipeline.describe(model)`.

    Attributes:
        devices: stage `s` runs on `devices[s]`.
        layers: layer names per stage.
        variables: each model variable's path -> the device it is on.
        bytes_per_device: model variables' bytes on each device.
        optimizer_bytes_per_device: the optimizer's variables' bytes (its
            slots sit with their variables).
        num_micro_batches, schedule: the step's options.
        peak_live_activations: per stage, the most micro-batches whose
            activations the schedule keeps at once.
    """

    devices: list
    layers: list
    variables: dict
    bytes_per_device: dict
    optimizer_bytes_per_device: dict
    num_micro_batches: int
    schedule: str
    peak_live_activations: list

    def __str__(self) -> str:
        lines = [f"pipeline: {len(self.devices)} stages, {self.num_micro_batches} "
                 f"micro-batches, schedule {self.schedule!r}"]
        for s, device in enumerate(self.devices):
            lines.append(
                f"  stage {s} on {device}: {self.bytes_per_device.get(device, 0):,} bytes "
                f"(+{self.optimizer_bytes_per_device.get(device, 0):,} optimizer), "
                f"peak live activations {self.peak_live_activations[s]}, layers "
                f"{', '.join(self.layers[s])}")
        return "\n".join(lines)


class _Stages:
    """A functional model cut into stage sub-models.

    `boundary[s]` lists the tensors entering stage `s` (for `s = 0`, the
    model's inputs; for `s = p`, its outputs): those made before stage `s`
    and used by it or later. Stage `s` maps `boundary[s]` to
    `boundary[s + 1]`: its sub-model computes the tensors it makes, and
    the others pass through.
    """

    def __init__(self, strategy: Pipeline, model, graph):
        """`graph`: what the stages are cut from (`Pipeline._cut_graph`:
        `model`, or the same computation with nested models inlined)."""
        import keras

        self.strategy = strategy
        p = strategy.num_stages
        model = graph
        stage_of = _stage_of_layers(model, p, strategy.split_at)
        self.layers = [(layer, stage_of[layer.name]) for layer in _pipelined_layers(model)]
        layers = {id(layer): layer for layer, _ in self.layers}
        made_at = {id(t): -1 for t in model.inputs}
        used_at = {}
        consumed_at: dict = {}  # stage -> ids of the tensors its calls take
        known = list(model.inputs)
        # Every call in this model's graph, inputs first, with its tensors
        # there (a nested model's `input`/`output` are those of its own
        # graph): the layers', and the operations between them (`h + a`),
        # which are computed in the stage of their latest input.
        for operation, (inputs, outputs) in _compat.layer_tensors(model).items():
            layer = layers.get(operation)
            if layer is not None:
                stage = stage_of[layer.name]
                _check_placement(layer, strategy.devices[stage])
            else:
                stage = max([made_at.get(id(t), -1) for t in inputs] + [0])
            for t in inputs:
                if made_at.get(id(t), -1) > stage:
                    raise ValueError(
                        f"Layer {layer.name!r} (stage {stage}) uses a tensor made in a later "
                        "stage; pipeline stages must follow the layer graph (a shared layer "
                        "called at two depths cannot be cut); choose split_at differently.")
                used_at[id(t)] = max(used_at.get(id(t), -1), stage)
                consumed_at.setdefault(stage, set()).add(id(t))
            for t in outputs:
                made_at[id(t)] = stage
                known.append(t)
        outputs = list(model.outputs)
        for t in outputs:
            used_at[id(t)] = p
        self.boundary = [list(model.inputs)]
        for s in range(1, p):
            self.boundary.append([t for t in known
                                  if made_at[id(t)] < s <= used_at.get(id(t), -1)])
        self.boundary.append(outputs)
        self._output_structure = model.output
        self.models, self.inputs, self.made = [], [], []
        for s in range(p):
            mine = [t for t in self.boundary[s + 1] if made_at[id(t)] == s]
            if s == 0:
                # The model's own input structure: Keras maps x onto it.
                inputs, mine = model.input, self.boundary[1]
            else:
                consumed = consumed_at.get(s, set())
                inputs = [t for t in self.boundary[s] if id(t) in consumed]
            if not mine:
                raise ValueError(
                    f"Pipeline stage {s} makes none of the tensors later stages use; "
                    "choose split_at (or num_stages) differently.")
            try:
                stage = keras.Model(inputs, mine, name=f"{model.name}_stage_{s}")
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
            self.inputs.append([self.boundary[s].index(t) for t in _flat(inputs)]
                               if s else None)
            self.made.append([id(t) for t in mine])

    def forward(self, s: int, inputs, training: bool) -> list:
        """Stage `s`'s outputs (`boundary[s + 1]`, as a list) from its inputs
        (the batch's `x` for stage 0, else `boundary[s]` as a list)."""
        if s == 0:
            return _flat(self.models[0](inputs, training=training))
        made = _flat(self.models[s]([inputs[k] for k in self.inputs[s]], training=training))
        by_id = dict(zip(self.made[s], made))
        entering = {id(t): v for t, v in zip(self.boundary[s], inputs)}
        return [by_id[id(t)] if id(t) in by_id else tf.identity(entering[id(t)])
                for t in self.boundary[s + 1]]

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


def _pipelined_layers(model) -> list:
    import keras

    return [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]


def _stage_of_layers(model, num_stages: int, split_at: Optional[list]) -> dict:
    """Layer name -> stage, for the model's layers in graph order."""
    layers = _pipelined_layers(model)
    names = [layer.name for layer in layers]
    if num_stages > len(layers):
        raise ValueError(
            f"Cannot cut model {model.name!r} ({len(layers)} layers) into {num_stages} "
            f"stages; use num_stages <= {len(layers)}.")
    if split_at is None:
        stages = pipeline_schedule.partition([layer.count_params() for layer in layers],
                                             num_stages)
        return dict(zip(names, stages))
    starts = []
    for name in split_at:
        if name not in names:
            shown = names if len(names) <= 12 else names[:6] + ["..."] + names[-5:]
            raise ValueError(f"split_at: {name!r} is not a layer of model {model.name!r}; "
                             f"its layers are {shown}.")
        starts.append(names.index(name))
    if starts != sorted(set(starts)) or starts[0] == 0:
        raise ValueError(
            f"split_at={split_at} must name distinct layers in the model's order, after its "
            f"first layer {names[0]!r} (each starts a stage).")
    return {name: sum(i >= start for start in starts) for i, name in enumerate(names)}


def _check_placement(layer, device: str) -> None:
    for variable in layer.variables:
        placed = _device_of(variable)
        if placed != device:
            raise ValueError(
                f"Layer {layer.name!r} belongs to a stage on {device} but its variable "
                f"{variable.path!r} is on {placed}; build the layers outside "
                "strategy.scope() and let DistributedModel place them.")


def _device_of(variable) -> str:
    spec = tf.DeviceSpec.from_string(getattr(variable, "value", variable).device)
    return f"/device:{spec.device_type}:{spec.device_index}"


def _bytes_per_device(variables) -> dict:
    sizes: dict = {}
    for v in variables:
        nbytes = int(np.prod(v.shape)) * np.dtype(
            getattr(v.dtype, "as_numpy_dtype", v.dtype)).itemsize
        sizes[_device_of(v)] = sizes.get(_device_of(v), 0) + nbytes
    return sizes


def _flat(structure) -> list:
    return tf.nest.flatten(structure)


def _differentiable(tensors: list) -> list:
    return [t for t in tensors if t.dtype.is_floating or t.dtype.is_complex]


def _concat(per_micro_batch: list) -> list:
    """Flat outputs of each micro-batch -> flat outputs of the batch."""
    return [tf.concat(parts, axis=0) for parts in zip(*per_micro_batch)]


def _share(x_part, rows):
    """A micro-batch's rows over the batch's `rows` (float32)."""
    return tf.cast(_rows(x_part), tf.float32) / tf.cast(rows, tf.float32)


def _rows(x):
    return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]


def _after(tensors):
    """Runs what is built inside after `tensors` (graph mode; eager runs in
    program order anyway)."""
    if not tensors or tf.executing_eagerly():
        return contextlib.nullcontext()
    return tf.control_dependencies(tensors)
