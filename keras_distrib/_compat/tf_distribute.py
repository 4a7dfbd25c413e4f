"""tf.distribute internals: strategy scopes and variable creators, merge
calls, collective keys and the collective runtime, Slurm host lists,
parameter-server and strategy options, and the dataset behind a
DistributedDataset (tf.distribute's variables: `tf_variables`). Verified on
TensorFlow 2.21.0."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import tensorflow as tf

_DISTRIBUTE = "tensorflow.python.distribute"
_MIRRORED = f"{_DISTRIBUTE}.mirrored_strategy:MirroredExtended"
_COLLECTIVE = f"{_DISTRIBUTE}.collective_all_reduce_strategy"
_SLURM = f"{_DISTRIBUTE}.cluster_resolver.slurm_cluster_resolver"

# Private names the shims below use (checked at import, see `versions`).
PRIVATE = (
    # updates_in_cross_replica_context
    f"{_MIRRORED}._use_merge_call",
    f"{_DISTRIBUTE}.merge_call_interim:maybe_merge_call",
    # without_default_strategy_creator, outside_strategy_scopes
    "tensorflow.python.framework.ops:Graph._variable_creator_stack",
    "tensorflow.python.framework.ops:Graph._distribution_strategy_stack",
    f"{_DISTRIBUTE}.distribute_lib:_DefaultDistributionContext",
    # configure_coordination_service
    "tensorflow.python.eager.context:Context.configure_coordination_service",
    "tensorflow.python.eager.context:Context.coordination_service",
    f"{_DISTRIBUTE}.multi_worker_util:coordination_leader",
    "tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2:CoordinatedJob",
    # tensorflow_started, abort_collective_ops
    "tensorflow.python.eager.context:context",
    "tensorflow.python.eager.context:Context._context_handle",
    "tensorflow.python.eager.context:Context.abort_collective_ops",
    # set_collective_key_base, rekey_collectives, cross_device_ops
    f"{_DISTRIBUTE}.mirrored_strategy:MirroredStrategy._collective_key_base",
    f"{_COLLECTIVE}:CollectiveAllReduceStrategy._collective_key_base",
    f"{_MIRRORED}._collective_key_base",
    f"{_MIRRORED}._cross_device_ops",
    f"{_MIRRORED}._collective_ops",
    f"{_MIRRORED}._make_collective_ops_with_fallbacks",
    # gather
    f"{_DISTRIBUTE}.device_util:current",
    f"{_MIRRORED}._default_device",
    f"{_MIRRORED}._gather_to",
    f"{_MIRRORED}._local_results",
    # reuse_collective_server, communication_options
    f"{_COLLECTIVE}:CollectiveAllReduceExtended._std_server_started",
    f"{_COLLECTIVE}:CollectiveAllReduceExtended._enable_check_health",
    f"{_COLLECTIVE}:CollectiveAllReduceExtended._communication_options",
    # slurm_hosts_and_tasks, slurm_worker_addresses
    f"{_SLURM}:expand_hostlist",
    f"{_SLURM}:expand_tasks_per_node",
    f"{_SLURM}:SlurmClusterResolver._resolve_own_rank",
    # set_variable_partitioner, variable_partitioner
    f"{_DISTRIBUTE}.parameter_server_strategy_v2:ParameterServerStrategyV2Extended"
    "._variable_partitioner",
    # undistributed
    f"{_DISTRIBUTE}.input_lib:DistributedDataset._original_dataset",
    f"{_DISTRIBUTE}.input_lib:DistributedDatasetsFromFunction._dataset_fn",
)


@contextlib.contextmanager
def updates_in_cross_replica_context(engine):
    """Lets Keras's optimizer update variables from `engine`'s cross-replica context.

    Keras 3's TF optimizer reaches the cross-replica context through
    `tf.__internal__.distribute.interim.maybe_merge_call`, which, for a
    strategy that uses merge calls, asks the *replica* context for one: in
    the cross-replica context there is none ("'NoneType' object has no
    attribute 'merge_call'"). With `extended._use_merge_call()` False it
    calls the update directly, which is what the cross-replica context
    needs (TensorFlow's own strategy tests set it so:
    tensorflow/python/distribute/strategy_combinations.py). Trace time only.
    """
    extended = engine.extended
    had_own = "_use_merge_call" in vars(extended)
    previous = vars(extended).get("_use_merge_call")
    extended._use_merge_call = lambda: False
    try:
        yield
    finally:
        if had_own:
            extended._use_merge_call = previous
        else:
            del extended._use_merge_call


@contextlib.contextmanager
def without_default_strategy_creator() -> Iterator[None]:
    """Variables made inside skip the default tf.distribute strategy's
    variable creator.

    Keras runs each step inside the default strategy's `run`
    (`TensorFlowTrainer._make_function`, and `keras_distrib.training.step_call` as
    Keras does), whose scope installs a creator that refuses any other
    strategy (`_DefaultDistributionContext`, tensorflow/python/distribute/
    distribute_lib.py: "Mixing different tf.distribute.Strategy objects");
    `tf.init_scope` carries it out of the step. No public API removes a
    creator: the graph's creator stack (`Graph._variable_creator_stack`)
    is set without it while the variables are made, then restored.
    """
    graph = tf.compat.v1.get_default_graph()
    stack = graph._variable_creator_stack
    graph._variable_creator_stack = [
        entry
        for entry in stack
        if not getattr(entry[-1], "__qualname__", "").startswith("_DefaultDistributionContext.")
    ]
    try:
        yield
    finally:
        graph._variable_creator_stack = stack


@contextlib.contextmanager
def outside_strategy_scopes() -> Iterator[None]:
    """Runs the body as if no tf.distribute strategy scope were entered.

    Code written for tf.distribute calls `fit`, `evaluate`, `predict` and
    `compile` inside `with strategy.scope():`. Keras then reads that
    strategy (`Trainer.distribute_strategy` falls back to
    `tf.distribute.get_strategy()`) and runs its own distribution code,
    which fails ("'PerReplica' object has no attribute 'shape'",
    keras-team/keras#20585); our model does the distribution itself and
    enters its strategy's scope where it makes variables. A scope is the
    graph's strategy stack (`Graph._distribution_strategy_stack`) and the
    variable creators it pushed (`Graph._variable_creator_stack`); both
    are set aside for the body and put back after it (TensorFlow has no
    public way to leave a scope from inside it).
    """
    graph = tf.compat.v1.get_default_graph()
    modes, creators = graph._distribution_strategy_stack, graph._variable_creator_stack
    graph._distribution_strategy_stack, graph._variable_creator_stack = [], []
    try:
        yield
    finally:
        graph._distribution_strategy_stack, graph._variable_creator_stack = modes, creators


# -- TensorFlow runtime -------------------------------------------------------------


def tensorflow_started() -> bool:
    """Whether TensorFlow's eager context exists (devices are fixed from then).

    A collective runtime (multi-worker server) can only be configured before
    this; `tf.config` has no public query for it.
    """
    from tensorflow.python.eager import context

    return context.context()._context_handle is not None


def configure_coordination_service(
    cluster_spec: tf.train.ClusterSpec, heartbeat_timeout: float
) -> None:
    """Configures the coordination service as `MultiWorkerMirroredStrategy`
    would (its leader, the jobs it coordinates), with `heartbeat_timeout`
    seconds instead of TensorFlow's default (10 s): a task whose heartbeats
    stop for that long is declared unhealthy and every task's collectives
    fail. The strategy keeps a configuration that exists (it configures one
    only when `context.coordination_service` is None). Before TensorFlow
    starts; the public API has no heartbeat setting."""
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    jobs = [
        coordination_config_pb2.CoordinatedJob(name=job, num_tasks=cluster_spec.num_tasks(job))
        for job in ("chief", "worker")
        if job in cluster_spec.jobs
    ]
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(cluster_spec),
        heartbeat_timeout_in_ms=int(heartbeat_timeout * 1000),
        coordinated_jobs=jobs,
    )


def set_collective_key_base(tf_strategy: Any, base: int) -> None:
    """Gives a tf.distribute strategy its own collective key range.

    Every Mirrored/MultiWorkerMirrored strategy starts its group keys at 1, so
    two in one process share collective instances and TF aborts with "Shape
    mismatch in the collective instance". Must be set before its `__init__`.
    """
    tf_strategy._collective_key_base = base


def rekey_collectives(tf_strategy: Any, base: int) -> None:
    """Gives a `MirroredStrategy` made by the user (with the default key
    range, see `set_collective_key_base`) its own collective key range, by
    making its collective ops again as its constructor did
    (`MirroredExtended._make_collective_ops_with_fallbacks`, which reads
    `_collective_key_base`); its cross-device ops become them unless the
    user chose others. Two such strategies in one process would otherwise
    share instance keys: "Shape mismatch in the collective instance 100"."""
    extended = tf_strategy.extended
    if getattr(extended, "_collective_key_base", None) != 0:
        return  # already its own range
    chosen = extended._cross_device_ops is not extended._collective_ops
    extended._collective_key_base = base
    extended._collective_ops = extended._make_collective_ops_with_fallbacks()
    if not chosen:
        extended._cross_device_ops = extended._collective_ops


def abort_collective_ops(message: str) -> None:
    """Fails every collective of this process, running or to come, with
    DEADLINE_EXCEEDED and `message` (what TensorFlow's own health check
    does on a lost peer; the eager context has no public call for it)."""
    from tensorflow.python.eager import context

    context.context().abort_collective_ops(tf.errors.DEADLINE_EXCEEDED, message)


def gather(tf_strategy: Any, value: Any, axis: int, options: Any) -> Any:
    """`tf_strategy.gather(value, axis)` with collective `options` (the
    public call takes none; this is its body, with them)."""
    from tensorflow.python.distribute import device_util

    extended = tf_strategy.extended
    destination = device_util.current() or extended._default_device or "/device:CPU:0"
    return extended._local_results(extended._gather_to(value, destination, axis, options))[0]


@contextlib.contextmanager
def reuse_collective_server() -> Iterator[None]:
    """MultiWorkerMirroredStrategy objects built inside reuse the running server.

    `keras_distrib.collectives.runtime` starts this process's collective server once;
    a strategy built later must not start a second one (TensorFlow checks
    `_std_server_started` on the strategy's extended object), and, as when
    TensorFlow starts the server itself with its coordination service, must
    not start its Python health-check thread (`_enable_check_health`).
    """
    from tensorflow.python.distribute import collective_all_reduce_strategy as car

    extended = car.CollectiveAllReduceExtended
    saved = extended._enable_check_health
    extended._std_server_started = True
    extended._enable_check_health = False
    try:
        yield
    finally:
        del extended._std_server_started
        extended._enable_check_health = saved


# -- Slurm -------------------------------------------------------------------------
# TensorFlow's SlurmClusterResolver expands Slurm's compressed host lists and
# task counts ("n[1-3]", "2(x3)") as Slurm documents them; the expansion
# helpers are module functions with no public export.


def slurm_hosts_and_tasks(nodelist: str, tasks_per_node: str) -> tuple[list, list]:
    """(`SLURM_STEP_NODELIST` expanded, `SLURM_STEP_TASKS_PER_NODE` expanded)."""
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as slurm

    return slurm.expand_hostlist(nodelist), slurm.expand_tasks_per_node(tasks_per_node)


def slurm_worker_addresses(rank: int, num_tasks: int, task_config: dict, port_base: int) -> list:
    """Worker addresses as TensorFlow's SlurmClusterResolver assigns them.

    The stock resolver reads `SLURM_PROCID` from `os.environ`
    (`_resolve_own_rank`); ours reads the environment it was given.
    """
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as slurm

    class _Resolver(slurm.SlurmClusterResolver):
        def _resolve_own_rank(self):
            return rank

    resolver = _Resolver(
        jobs={"worker": num_tasks},
        port_base=port_base,
        tasks_per_node=task_config,
        # One fake "GPU" per task keeps the resolver from calling nvidia-smi
        # and from assigning devices; which devices a worker uses is the
        # strategy's business, and auto_set_gpu=False leaves the env alone.
        gpus_per_node=max(task_config.values()),
        gpus_per_task=1,
        auto_set_gpu=False,
    )
    return resolver.cluster_spec().job_tasks("worker")


# -- tf.distribute parameter servers -------------------------------------------------


def set_variable_partitioner(strategy: Any, partitioner: Any) -> None:
    """Sets the partitioner of a `tf.distribute.ParameterServerStrategy` made
    earlier (its extended's `_variable_partitioner`, which the constructor
    sets and variable creation reads; verified TF 2.21).

    The chief must connect to its cluster before TensorFlow makes any
    tensor (see `keras_distrib.collectives.runtime.start_coordinator`), which is before
    the user's script names its partitioner; TensorFlow offers no setter.
    """
    strategy.extended._variable_partitioner = partitioner


def cross_device_ops(strategy: Any) -> Any:
    """A `MirroredStrategy`'s cross-device ops object (its extended's
    `_cross_device_ops`; None: TensorFlow's choice, made at first use)."""
    return getattr(strategy.extended, "_cross_device_ops", None)


def variable_partitioner(strategy: Any) -> Any:
    """A `ParameterServerStrategy`'s partitioner (see `set_variable_partitioner`)."""
    return getattr(strategy.extended, "_variable_partitioner", None)


def communication_options(strategy: Any) -> Any:
    """A `MultiWorkerMirroredStrategy`'s `CommunicationOptions` (its
    extended's `_communication_options`, set by the constructor; no public
    getter, verified TF 2.21)."""
    return strategy.extended._communication_options


# -- distributed datasets -------------------------------------------------------------


def undistributed(data: Any) -> Any:
    """The `tf.data.Dataset` of global batches behind a tf.distribute
    distributed dataset, or `data` itself.

    `strategy.experimental_distribute_dataset(ds)` keeps `ds` (its
    `_original_dataset`, before TensorFlow splits each batch over the
    replicas); `strategy.distribute_datasets_from_function(fn)` keeps `fn`
    (`_dataset_fn`), which called with a one-pipeline, one-replica
    `tf.distribute.InputContext` gives global batches
    (`ctx.get_per_replica_batch_size(global_batch)` is then the global
    batch). Our strategies split batches themselves; TensorFlow's
    `DistributedDataset` has no public accessor for either (verified TF
    2.21, tensorflow/python/distribute/input_lib.py).
    """
    from tensorflow.python.distribute import input_lib

    if isinstance(data, input_lib.DistributedDataset) and hasattr(data, "_original_dataset"):
        return data._original_dataset
    if isinstance(data, input_lib.DistributedDatasetsFromFunction) and hasattr(data, "_dataset_fn"):
        return data._dataset_fn(
            tf.distribute.InputContext(
                num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1
            )
        )
    return data
