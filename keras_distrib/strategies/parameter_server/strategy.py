"""`"parameter_server"`: asynchronous training against parameter servers.

Keras 3 dropped parameter-server training from `fit`
(keras-team/keras#18624); TensorFlow 2.21 still ships the engine,
`tf.distribute.ParameterServerStrategy` with a
`tf.distribute.coordinator.ClusterCoordinator`, and this strategy drives
Keras's `fit` with it:

* the cluster has a `chief` (runs the user's script: the coordinator),
  `worker`s and `ps` tasks (plain TensorFlow servers; see
  `keras_distrib.strategies.parameter_server.task_server` and
  `keras-distrib launch --workers N --ps M`);
* variables live on the ps tasks (round robin, or split over them by
  `variable_partitioner`);
* `fit` schedules each `steps_per_execution` steps as one closure that a
  free worker runs (`keras_distrib.strategies.parameter_server.scheduled_training`),
  reading its input as `keras_distrib.strategies.parameter_server.per_worker_input`
  describes; workers apply their
  updates without waiting for each other;
* `evaluate`, `predict` and `fit`'s validation run on the chief, reading
  the variables from the ps tasks: exact, in order.

Fault tolerance is TensorFlow's: a closure whose worker fails is run again
on another worker (or on the same one when it is back), so a step can be
applied twice (at least once, never lost); a lost ps task ends training
with a one-line error naming it (`ParameterServerLostError`), and a re-run
with `keras_distrib.callbacks.BackupAndRestore` resumes from the last
backup.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib import cluster as cluster_lib
from keras_distrib.strategies.parameter_server import per_worker_input
from keras_distrib.collectives import registry as transports
from keras_distrib.collectives import runtime
from keras_distrib.strategies.parameter_server import sharded_variables
from keras_distrib.strategies.parameter_server.scheduled_training import ScheduledTraining
from keras_distrib.strategies.base import Capabilities, Strategy
from keras_distrib.arithmetic.optimizer_tree import keras_class_among, optimizers_in
from keras_distrib.topology import Topology


class ParameterServerLostError(RuntimeError):
    """A parameter-server task failed: its variables are gone."""


class ParameterServer(Strategy):
    """Asynchronous data parallelism: workers update variables held by ps tasks.

    Run the script on the chief of a cluster with `ps` tasks, e.g.
    `keras-distrib launch --workers 2 --ps 1 train.py`. Created on a `worker`
    or `ps` task (a script run on every task, Kubeflow style), the
    constructor serves that task and never returns.

    Each optimizer step uses `batch_size` samples (the step's batch; no
    replica splits it), so the learning rate of a one-device run carries
    over. `num_replicas` is 1 (no replicas train in sync); `num_workers` is
    how many workers run steps.

    Args:
        variable_partitioner: a
            `tf.distribute.experimental.partitioners.Partitioner` that splits
            large variables (embeddings) over the ps tasks, as TensorFlow's
            `ParameterServerStrategy` takes it; default: variables whole.
        lag: closures in flight before `fit` waits for the oldest (default
            2 per worker): bounds the queue and how far the per-batch logs
            trail.

    Example:

    ```python
    model = keras_distrib.DistributedModel(inputs, outputs, strategy="parameter_server")
    strategy = keras_distrib.strategies.get(
        "parameter_server",
        variable_partitioner=tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=256 << 10, max_shards=2))
    ```
    """

    name = "parameter_server"
    aliases = ("ps", "parameter_servers", "async")
    description = (
        "Asynchronous: variables on ps tasks, steps scheduled on workers by the "
        "chief (tf.distribute.ParameterServerStrategy)."
    )
    capabilities = Capabilities(one_per_process=True, asynchronous=True)

    def __init__(self, variable_partitioner=None, lag: Optional[int] = None):
        info = _check_cluster(cluster_lib.resolve())
        if info.role in (cluster_lib.WORKER, cluster_lib.PS):
            from keras_distrib.strategies.parameter_server import task_server

            task_server.serve(info)  # never returns
        self.info = info
        self.num_workers = len(info.workers) - 1
        self.num_ps = info.num_ps
        self.lag = int(lag) if lag else 2 * self.num_workers
        self._engine, self.coordinator = runtime.ensure_coordinator(
            info, runtime.DEFAULT_PEER_TIMEOUT
        )
        _compat.set_variable_partitioner(self._engine, variable_partitioner)
        self._topology = Topology(
            num_replicas=1,
            num_local_replicas=1,
            first_local_replica=0,
            devices=("/job:chief/replica:0/task:0/device:CPU:0",),
            role="chief",
            num_data_shards=self.num_workers,
        )
        self._training: Optional[ScheduledTraining] = None
        self._plan: Optional[per_worker_input.Plan] = None
        # One replica here (the steps run on the workers): nothing to reduce.
        self.transport = transports.create("one_process")

    @property
    def topology(self) -> Topology:
        return self._topology

    @property
    def tf_strategy(self) -> tf.distribute.Strategy:
        """The `tf.distribute.ParameterServerStrategy` that places variables."""
        return self._engine

    def __repr__(self) -> str:
        return (
            f"<ParameterServer workers={self.num_workers} ps={self.num_ps} "
            f"chief={self.info.workers[0]}>"
        )

    # -- placement ------------------------------------------------------------------

    def scope(self):
        return self._engine.scope()

    def holds(self, variable: Any) -> bool:
        value = getattr(variable, "value", variable)
        return _compat.variable_strategy(value) is self._engine

    # -- input ----------------------------------------------------------------------

    def distribute_fit_input(self, fit):
        """Keras's loop gets one ticket per step (`Dataset.range(steps_per_epoch)`);
        the data itself goes to the workers (see `per_worker_input`)."""
        self._plan = plan = per_worker_input.plan(fit)
        tickets = tf.data.Dataset.range(plan.steps_per_epoch)
        return fit.replace(
            x=tickets,
            y=None,
            sample_weight=None,
            batch_size=None,
            validation_split=0.0,
            validation_data=plan.validation_data,
            steps_per_epoch=plan.steps_per_epoch,
            shuffle=False,
            build_batch=plan.build_batch,
        )

    def distribute_input(self, x, y=None, sample_weight=None, batch_size=None):
        return x, y, sample_weight, batch_size  # the chief reads it all

    def check_callbacks(self, callbacks) -> None:
        """Epoch-level callbacks see exact logs and every scheduled step
        applied; per-batch ones run on the chief as it schedules, with logs
        `lag` closures behind. A profiler there would trace no step."""
        for callback in callbacks:
            if isinstance(callback, keras.callbacks.TensorBoard) and _compat.tensorboard_profiles(
                callback
            ):
                raise ValueError(
                    "TensorBoard(profile_batch=...) profiles the chief, but under "
                    "strategy='parameter_server' the steps run on the workers; pass "
                    "profile_batch=0 (and profile a worker with tf.profiler.experimental.client)."
                )

    def adopt_optimizer(self, optimizer) -> None:
        """A one-line error for Muon with weight decay.

        Muon decays the weights with Keras-level assignments
        (`variable.assign(...)` in its own `_apply_weight_decay`), which
        inside a closure's `StatelessScope` become the scope's values: the
        update then read a weight as a tensor and failed inside TensorFlow
        ("You can not update `var` <tf.Tensor 'while/muon/Sub:0' ...>. It
        must be a Variable."). Muon without weight decay trains here.
        """
        for opt in optimizers_in(optimizer):
            if keras_class_among(opt, ("Muon",)) and (
                opt.weight_decay or getattr(opt, "adam_weight_decay", None)
            ):
                raise ValueError(
                    "strategy='parameter_server' cannot apply Muon's weight decay (Muon "
                    "assigns the weights through Keras variables, which a parameter-server "
                    "step does not apply); pass Muon(weight_decay=None, adam_weight_decay=None), "
                    "or use AdamW."
                )

    # -- execution --------------------------------------------------------------------

    def make_step_function(self, model, step, keras_make_function: Callable):
        if getattr(model.optimizer, "backward_passes_per_step", 1) > 1:
            raise ValueError(
                "backward_passes_per_step > 1 does not apply to "
                "strategy='parameter_server' (each worker step is applied on "
                "its own); use a larger batch_size instead."
            )
        if step.kind != "train":
            return keras_make_function(step.fn)  # evaluation, on the chief
        if self._plan is None:
            raise ValueError(
                "strategy='parameter_server' trains through model.fit only "
                "(no train_on_batch): the workers need fit's input plan."
            )
        if model.optimizer is not None:
            with self.scope():
                # Slots and updates of variables split over the ps tasks
                # (a no-op for whole variables).
                sharded_variables.install(model.optimizer)
                if not model.optimizer.built:
                    model.optimizer.build(model.trainable_variables)
        self._training = ScheduledTraining(
            model, self._engine, self.coordinator, self._plan, step.fn, self.lag, self.lost
        )
        return self._training

    def make_predict_function(self, model, step, keras_make_predict_function: Callable):
        return keras_make_predict_function()

    def run(self, replica_fn: Callable, batch: Any):
        return replica_fn(batch)

    def gradients(self, tape: tf.GradientTape, target: Any, variables: Sequence[Any]) -> list:
        """Variables split over the ps tasks: each one's gradient joined
        from its parts' (`sharded_variables.gradients`)."""
        return sharded_variables.gradients(tape, target, variables)

    def settle(self, model) -> None:
        if self._training is not None:
            self._training.settle()

    def reset_metrics(self, model, reset) -> None:
        reset()
        if self._training is not None:
            self._training.metrics_reset()

    def without_xla(self) -> Optional[str]:
        """XLA cannot read a variable kept on another task: `evaluate` and
        `predict` on the chief failed with "Trying to access resource ...
        located in device /job:ps/... from device /job:chief/..."
        (TensorFlow's XLA known issue "tf.Variable on a different device")."""
        return (
            "XLA cannot read the variables kept on the ps tasks (TensorFlow's XLA known "
            "issue 'tf.Variable on a different device')"
        )

    def failure(self, error: Exception) -> Optional[Exception]:
        # A ps may die while a callback reads or writes its variables
        # (checkpoints, early stopping), outside the scheduled steps. Errors
        # of the program itself (an InvalidArgumentError naming a variable on
        # the ps, say) are not a lost ps: TensorFlow's message stays.
        if not _looks_like_a_lost_task(error):
            return None
        lost = self.lost(error)
        return lost if isinstance(lost, ParameterServerLostError) else None

    def lost(self, error: Exception) -> Exception:
        """A one-line error for a failure the coordinator gave up on."""
        text = str(error)
        for index, address in enumerate(self.info.ps):
            if f"/job:ps/replica:0/task:{index}" in text or address in text:
                return ParameterServerLostError(
                    f"parameter server ps {index} ({address}) failed; its variables are "
                    "lost: restart the job (with keras_distrib.callbacks.BackupAndRestore "
                    "training resumes from the last backup)."
                )
        return RuntimeError(
            f"parameter-server training failed: {failure_summary(text, self.info)}; restart "
            "the job (with keras_distrib.callbacks.BackupAndRestore training resumes from "
            "the last backup)."
        )

    @property
    def steps_applied(self) -> int:
        """Optimizer steps of the last `fit` whose results reached the chief
        (a re-run closure's steps count again)."""
        return 0 if self._training is None else self._training.steps_applied

    @property
    def lost_results(self) -> int:
        """Closures of the last `fit` that finished on a worker that died before
        the chief fetched their metric states: their steps are applied, their
        share of the epoch's logs is missing."""
        return 0 if self._training is None else self._training.lost_results

    # -- between steps: one process -------------------------------------------------------

    def local_replica_values(self, variable: Any) -> list[np.ndarray]:
        return [np.asarray(variable)]


# TensorFlow's remote errors: "2 root error(s) found.", then "(0) INTERNAL:
# {{function_node ...}} the message", and "... from remote target
# /job:worker/replica:0/task:1/device:CPU:0 ..." naming the task that failed.
_ROOT_COUNT = re.compile(r"\d+ root error\(s\) found\.?")
_ROOT_INDEX = re.compile(r"^\(\d+\)\s+")
_FUNCTION_NODE = re.compile(r"\{\{[^}]*\}\}\s*")
_REMOTE_TASK = re.compile(r"remote target /job:(\w+)/replica:\d+/task:(\d+)")


def _looks_like_a_lost_task(error: Exception) -> bool:
    """Whether TensorFlow's `error` is what a lost peer task gives, as its
    coordinator judges a ps failure (`_is_ps_failure` in
    tensorflow/python/distribute/coordinator/cluster_coordinator.py):
    unreachable or aborted, or a restarted task's unknown device or handle."""
    if isinstance(
        error,
        (
            tf.errors.UnavailableError,
            tf.errors.AbortedError,
            tf.errors.DeadlineExceededError,
            tf.errors.CancelledError,
        ),
    ):
        return True
    text = str(error)
    return isinstance(error, tf.errors.InvalidArgumentError) and (
        "unknown device" in text.lower()
        or "Unable to find the relevant tensor remote_handle" in text
    )


def failure_summary(text: str, info) -> str:
    """One line for a failure TensorFlow reported in many: the first root
    error, without TensorFlow's tags, and the task that reported it (its
    address from `info`, a `ClusterInfo`), if the text names one.

    Example: `"INTERNAL: Unable to parse request (reported by worker 1,
    localhost:2223)"`.
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = [line for line in lines if not _ROOT_COUNT.fullmatch(line)]
    first = _FUNCTION_NODE.sub("", _ROOT_INDEX.sub("", lines[0])) if lines else "unknown error"
    remote = _REMOTE_TASK.search(text)
    if remote is not None:
        job, index = remote.group(1), int(remote.group(2))
        addresses = info.cluster_spec().get(job, ())
        where = f", {addresses[index]}" if index < len(addresses) else ""
        first += f" (reported by {job} {index}{where})"
    return first


def _check_cluster(info: Optional[cluster_lib.ClusterInfo]) -> cluster_lib.ClusterInfo:
    """`info`, once it is a cluster this strategy can train on."""
    example = "e.g. keras-distrib launch --workers 2 --ps 1 train.py"
    if info is None:
        raise ValueError(
            "strategy='parameter_server' needs a cluster with 'chief', 'worker' "
            f"and 'ps' tasks (TF_CONFIG), and none is configured; {example}."
        )
    if not info.has_ps:
        raise ValueError(
            "strategy='parameter_server' needs 'ps' tasks in the cluster, and "
            f"it has none; add some ({example}) or use strategy='multi_worker'."
        )
    if not info.has_chief:
        raise ValueError(
            "strategy='parameter_server' needs a 'chief' task to run the script "
            f"and coordinate the workers; add one ({example})."
        )
    if len(info.workers) < 2:
        raise ValueError(
            "strategy='parameter_server' needs at least one 'worker' task to "
            f"run the steps; add some ({example})."
        )
    if info.role == cluster_lib.EVALUATOR:
        raise ValueError(
            "strategy='parameter_server' has no work for an 'evaluator' task; "
            "run it without this strategy."
        )
    return info
