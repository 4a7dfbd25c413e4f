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

How a step runs (in `keras_distrib.strategies.pipeline`: `schedule` holds the
orders, `stages` the cut, `train_step` the passes of a training step):

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
Any global batch trains: micro-batches the batch does not divide into
evenly are one row apart, each weighed by its row count.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence

import tensorflow as tf

from keras_distrib import _compat
from keras_distrib.input import data as data_lib
from keras_distrib import devices as devices_lib
from keras_distrib.strategies.pipeline import schedule as pipeline_schedule
from keras_distrib.strategies.pipeline import train_step
from keras_distrib.strategies.pipeline.plan import PipelinePlan, bytes_per_device, device_of
from keras_distrib.strategies.pipeline.stages import (
    Stages,
    batch_rows,
    concat_micro_batches,
    cut_graph,
    pipelined_layers,
    row_share,
    stage_of_layers,
)
from keras_distrib import replica_seeds
from keras_distrib.strategies import lockstep
from keras_distrib.strategies.base import Strategy
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
            the default batch of 32 for 2 stages). A batch it does not
            divide is split into micro-batches one row apart.
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
    description = (
        "Model cut into stages, one per device; micro-batches in a GPipe or 1F1B "
        "schedule (one process)."
    )

    def __init__(
        self,
        devices: Optional[Sequence[str]] = None,
        num_stages: Optional[int] = None,
        num_micro_batches: Optional[int] = None,
        schedule: str = "1f1b",
        split_at: Optional[Sequence[str]] = None,
        balance: str = "params",
        workers: Optional[Mapping[str, Any]] = None,
    ):
        if schedule not in pipeline_schedule.SCHEDULES:
            raise ValueError(
                f"Unknown schedule {schedule!r}; use one of {list(pipeline_schedule.SCHEDULES)}."
            )
        if balance not in BALANCES:
            raise ValueError(f"Unknown balance {balance!r}; use one of {list(BALANCES)}.")
        if split_at is not None and (isinstance(split_at, str) or not split_at):
            raise ValueError(
                f"split_at={split_at!r} must be a non-empty list of layer names "
                "(the first layer of stages 2..p), e.g. ['dense_2']."
            )
        num_stages, devices = _stages_and_devices(devices, num_stages, split_at)
        if num_micro_batches is None:
            num_micro_batches = 4 * num_stages
        if not data_lib.is_positive_int(num_micro_batches):
            raise ValueError(
                f"num_micro_batches={num_micro_batches!r} must be an integer "
                ">= 1 (micro-batches per global batch)."
            )
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
            graph = cut_graph(model, self.num_stages, self.split_at)
            stage_of = stage_of_layers(graph, self.num_stages, self.split_at)
            for layer in pipelined_layers(graph):
                moving = placement.unheld(self, layer.variables, model)
                device = self.devices[stage_of[layer.name]]
                placement.remake(moving, self, model, where=lambda d=device: self._creating_on(d))
                moved += moving
        moving = placement.unheld(self, model.variables, model)
        placement.remake(moving, self, model)
        return moved + moving

    # Not `Strategy.describe`'s ReplicaMemory: the stages' placement, per device.
    def describe(self, model) -> PipelinePlan:  # type: ignore[override]
        """Which layer and variable lives on which device, and bytes per device.

        Read from the variables' actual placement (not from the plan).
        """
        stages = self._stages(model)
        layer_stages: list[list[str]] = [[] for _ in range(self.num_stages)]
        for layer, stage in stages.layers:
            layer_stages[stage].append(layer.name)
        placement = {v.path: device_of(v) for v in model.variables}
        optimizer = getattr(model, "optimizer", None)
        return PipelinePlan(
            devices=list(self.devices),
            layers=layer_stages,
            variables=placement,
            bytes_per_device=bytes_per_device(model.variables),
            optimizer_bytes_per_device=bytes_per_device(
                optimizer.variables if optimizer is not None else []
            ),
            num_micro_batches=self.num_micro_batches,
            schedule=self.schedule,
            peak_live_activations=pipeline_schedule.peak_live_activations(
                pipeline_schedule.stage_orders(
                    self.schedule, self.num_micro_batches, self.num_stages
                )
            ),
        )

    # -- input --------------------------------------------------------------------------

    # -- execution ----------------------------------------------------------------------

    def without_xla(self) -> Optional[str]:
        return "XLA compiles the work of one device, and a pipeline step spans every stage's device"

    def make_step_function(self, model, step, keras_make_function: Callable):
        if not step.applies:  # DistributedModel's gradient accumulation
            raise ValueError(
                "strategy='pipeline' does not support backward_passes_per_step > 1; raise "
                "num_micro_batches instead (micro-batches accumulate gradients in a step)."
            )
        if step.kind == "train" and step.custom:
            raise ValueError(
                "strategy='pipeline' runs its own train step and cannot run a custom "
                "train_step; use DistributedModel's (override compute_loss instead)."
            )
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
        return lockstep.predict_over_steps(
            model,
            self._as_this_replica(
                lambda batch: self.gather_rows(
                    self._forward(stages, keras.utils.unpack_x_y_sample_weight(batch)[0])[0]
                )
            ),
        )

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

    def _stages(self, model) -> Stages:
        """The model's stages as sub-models (made once per model: each
        sub-model adds a node to its layers)."""
        cached = model.__dict__.get("_kd_pipeline_stages")
        if cached is not None and cached.strategy is self:
            return cached
        if not isinstance(model, _compat.functional_class()):
            raise ValueError(
                f"strategy='pipeline' needs a Functional or Sequential model, got subclassed "
                f"{type(model).__name__}; build it with DistributedModel(inputs, outputs) or "
                "DistributedModel.from_model(model)."
            )
        stages = Stages(self, cut_graph(model, self.num_stages, self.split_at))
        model.__dict__["_kd_pipeline_stages"] = stages
        return stages

    def _forward(self, stages: Stages, x, training: bool = False):
        """The model's output on `x`, stage by stage, micro-batch by
        micro-batch, and the losses its layers added on the way (weighted
        over the micro-batches as `take_added_losses` does), or None."""
        outputs, added, rows = [], [], batch_rows(x)
        for x_part in data_lib.split_batch(x, self.num_micro_batches):
            values = None
            for s in range(self.num_stages):
                with tf.device(self.devices[s]):
                    values = stages.forward(s, x_part if s == 0 else values, training)
                    added.append(stages.take_added_losses(s, row_share(x_part, rows)))
            outputs.append(values)
        added = [loss for loss in added if loss is not None]
        with tf.device(self.devices[-1]):
            return (
                stages.pack_outputs(concat_micro_batches(outputs)),
                tf.add_n(added) if added else None,
            )

    def _test_step(self, model, stages: Stages, data):
        import keras

        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, added = self._forward(stages, x)
        with tf.device(self.devices[-1]):
            # As DistributedModel.test_step, on the whole batch.
            loss = _compat.compute_loss(
                model, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
            )
            if added is not None:
                loss = loss + tf.cast(added, loss.dtype)
            _compat.loss_tracker(model).update_state(loss, sample_weight=batch_rows(x))
            return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _train_step(self, model, stages: Stages, data):
        """The scheduled passes over the micro-batches, then one update
        (`keras_distrib.strategies.pipeline.train_step`)."""
        return train_step.run(self, model, stages, data)


def _stages_and_devices(
    devices: Optional[Sequence[str]], num_stages: Optional[int], split_at: Optional[Sequence[str]]
) -> tuple[int, list[str]]:
    """`PipelineStrategy`'s stage count and stage devices, checked against
    each other and `split_at`: a count `split_at` implies, the visible
    devices when `devices` is None (one per stage)."""
    if num_stages is None:
        num_stages = len(split_at) + 1 if split_at else None
    elif not data_lib.is_positive_int(num_stages):
        raise ValueError(f"num_stages={num_stages!r} must be an integer >= 1.")
    if split_at and num_stages is not None and len(split_at) != num_stages - 1:
        raise ValueError(
            f"split_at names {len(split_at)} layer(s) but num_stages={num_stages} needs "
            f"{num_stages - 1} (the first layer of each stage after the first)."
        )
    if devices is None:
        available = devices_lib.local_devices()
        num_stages = num_stages or len(available)
        if num_stages > len(available):
            raise ValueError(
                f"num_stages={num_stages} needs {num_stages} devices but only "
                f"{len(available)} are visible ({available}); use fewer stages."
            )
        devices = available[:num_stages]
    devices = devices_lib.check_devices(devices)
    num_stages = num_stages or len(devices)
    if num_stages != len(devices):
        raise ValueError(
            f"num_stages={num_stages} but {len(devices)} devices were given; pass one "
            "device per stage."
        )
    return num_stages, devices
