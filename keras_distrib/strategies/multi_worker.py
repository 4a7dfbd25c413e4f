"""`"multi_worker"`: synchronous data parallelism across processes and hosts."""

from __future__ import annotations

import dataclasses
import itertools
import re
import secrets
import sys
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib import cluster as cluster_lib
from keras_distrib.collectives import flight_recorder, heartbeats, host_allreduce
from keras_distrib.collectives import registry as transports
from keras_distrib.collectives import engine_choice, overlap, runtime, seconds
from keras_distrib.cluster import launch_contract
from keras_distrib.collectives.watchdog import CollectiveWatchdog
from keras_distrib.strategies import multi_worker_engines as engines
from keras_distrib.strategies.replica_memory import ReplicaMemory
from keras_distrib.strategies.tf_distribute import TFDistributeStrategy
from keras_distrib.arithmetic import optimizer_sharding as sharding_option

_IMPLEMENTATIONS = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}
# Not TensorFlow's: the steps' collectives go through shared memory between
# the workers of one host (the transport of that name,
# keras_distrib/collectives/shared_memory.py).
_SHARED_MEMORY = "shm"
# Not TensorFlow's either: a ring all-reduce over plain TCP between the
# workers' hosts (keras_distrib/collectives/tcp_collectives.py).
_TCP = "tcp"
# And shared memory within each host, a TCP ring between hosts
# (keras_distrib/collectives/hierarchical_collectives.py).
_HIERARCHICAL = "hierarchical"
# Horovod's Gloo between the workers, joined at a rendezvous store the
# chief runs (keras_distrib/collectives/gloo_collectives.py).
_GLOO = "gloo"
_OURS = (_SHARED_MEMORY, _TCP, _HIERARCHICAL, _GLOO)
# What our engines raise, in the text of the TensorFlow error around a
# step whose numpy_function raised it.
_ENGINE_ERROR = re.compile(r"PeerLostError: ([^\n]+)")
_KEY_RANGES = itertools.count(start=500_000, step=1_000)
# Seconds a collective may wait for a worker that never joins it: long
# enough for the chief to write a large checkpoint while the others wait in
# the next step, finite so that a stuck job ends on its own.
DEFAULT_COLLECTIVE_TIMEOUT = 300.0


class _KeyedMultiWorkerStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    # See mirrored.py: collective keys must not collide with other strategies
    # in the same process.
    def __init__(self, **kwargs):
        _compat.set_collective_key_base(self, next(_KEY_RANGES))
        super().__init__(**kwargs)


class MultiWorker(TFDistributeStrategy):
    """Synchronous all-reduce across worker processes (and their devices).

    Runs on TensorFlow's collective runtime: a gRPC ring between CPUs, NCCL
    between GPUs. When every worker is on this host and has no GPU, the
    gradient all-reduce of the training step goes through shared memory
    instead (`implementation="shm"`, what `"auto"` picks there): TF's gRPC
    collectives are slow even between local processes (docs/design.md,
    section 1.2, row 4). Across hosts, `implementation="tcp"` reduces over a
    ring of plain TCP connections of its own, which carries about twice
    what TF's gRPC ring does over the same link (row 16), and with several
    workers per host `implementation="hierarchical"` sums within each host
    through shared memory and between hosts over that ring, one leader per
    host; `implementation="gloo"` runs Horovod's Gloo collectives between
    the workers; `"auto"` across hosts times these against TensorFlow's and
    keeps the fastest. Every worker runs the same script; `keras-distrib
    launch` starts them and sets `TF_CONFIG`. Variables start equal on all
    workers (broadcast from worker 0 when they are created).

    TensorFlow's collective runtime must start before TensorFlow is first
    used; when `TF_CONFIG` or Slurm describes the cluster, `import
    keras_distrib` starts it (`keras_distrib.collectives.runtime`), so this strategy can
    be named as a string wherever the model is built.

    Args:
        cluster: Worker addresses (`["host:port", ...]` or
            `{"worker": [...]}`); default: `TF_CONFIG`, then Slurm.
        task_index: This process's rank in `cluster` (with `cluster` only).
        implementation: `"auto"` (`"shm"` when all workers are on this host
            and no GPU is visible; across hosts with one device per
            worker, the fastest of TensorFlow's collectives, `"tcp"`,
            `"hierarchical"` and, where every worker can load Horovod,
            `"gloo"`, timed by every worker at start, see
            `keras_distrib.collectives.engine_choice`; else TensorFlow's
            choice), `"ring"`,
            `"nccl"`, `"shm"` (the training step's collectives and the
            eager sums between steps through shared memory; needs every
            worker on this host, Linux), `"tcp"` (the same through a
            ring of TCP connections between the workers, on any hosts:
            each listens on its address in the cluster at a free port,
            and a connection must present a secret the chief draws; see
            `keras_distrib.collectives.tcp_ring`), or `"hierarchical"`
            (shared memory within each host, the TCP ring between one
            leader per host; `keras_distrib.collectives.hierarchical`), or
            `"gloo"` (Horovod's Gloo collectives, without `horovodrun`: the
            workers meet at a rendezvous store the chief runs at a free
            port; needs Horovod on every worker;
            `keras_distrib.collectives.gloo_collectives`).
            These need one device per worker. The initial broadcast of
            variables, metric reads and `predict`'s gathers always use
            TensorFlow's collectives.
        bytes_per_pack: Pack gradients into all-reduces of about this many
            bytes (0 or None, the default: TensorFlow's default, one pack). Many small gradients
            travel in few collectives, which matters on latency-bound links,
            and a larger one is cut into pieces of this size (TensorFlow's
            ring moves a large tensor at a fraction of a link's rate; see
            `keras_distrib.collectives.pieces`). On our engines (`"shm"`,
            `"tcp"`, `"hierarchical"`), packs of about this many bytes, the
            last layers' first, each reduced as soon as the backward pass
            has made it, while it makes the others; a large gradient is
            not cut (see `keras_distrib.collectives.numpy_engine`). There
            None packs them by 1 MiB where this host has a core its
            workers' computation leaves free and TensorFlow more than one
            inter-op thread, else in one pack after the
            backward pass (`keras_distrib.collectives.overlap`;
            `describe` says which, and why).
        collective_timeout: Seconds after which a collective that some
            worker never joins fails, naming the late workers (default
            `DEFAULT_COLLECTIVE_TIMEOUT`, 300; None: wait forever). On
            shared memory a peer that exits is detected within a second
            and one stopped by SIGSTOP within seconds, whatever this is;
            on `"tcp"` one that exits (its connections close) within a
            second, and one that moves no data after this many seconds;
            on `"gloo"` (Gloo's own timeout) one that exits at once, one
            whose host answers nothing after the heartbeat timeout, one
            that is stopped after this many seconds.
            The TensorFlow collectives of the training and predict steps
            are timed by one watchdog thread
            (`keras_distrib.collectives.watchdog`), not by TensorFlow's
            thread per collective, which would pile up (its error says the
            step timed out, not which worker).
        peer_timeout: Seconds to wait for all workers to join at start-up
            (and on `"tcp"`, for the ring's connections); a worker that
            never answers is named in the error.
        optimizer_sharding: None (every worker keeps the optimizer's slots
            for every variable), `"optimizer"` (ZeRO stage 1: each keeps
            them for 1/N of each variable) or `"gradients"` (stage 2: and
            receives only that part's reduced gradients); see
            `keras_distrib.arithmetic.optimizer_shards`. Needs one device per
            worker.

    Example:

    ```python
    # keras-distrib launch -n 2 train.py   (sets TF_CONFIG for each worker)
    model = keras_distrib.DistributedModel(inputs, outputs, strategy="multi_worker")
    ```
    """

    name = "multi_worker"
    aliases = ("multi_worker_mirrored", "multiworker")
    # Per-batch logs are this worker's values: exact global ones would cost
    # a cross-worker collective per metric variable and step (epoch logs
    # and evaluate results are exact).
    capabilities = dataclasses.replace(
        TFDistributeStrategy.capabilities, one_per_process=True, exact_batch_logs=False
    )
    description = "Sync all-reduce across worker processes/hosts (gRPC ring on CPU, NCCL on GPU)."

    def __init__(
        self,
        cluster: Union[Sequence[str], Mapping[str, Sequence[str]], None] = None,
        task_index: Optional[int] = None,
        implementation: str = "auto",
        bytes_per_pack: Optional[int] = None,
        collective_timeout: Optional[float] = DEFAULT_COLLECTIVE_TIMEOUT,
        peer_timeout: float = 120.0,
        optimizer_sharding: Optional[str] = None,
    ):
        # Options first: a bad one is named even where no cluster is found.
        options = _communication_options(implementation, bytes_per_pack, collective_timeout)
        sharding_option.check(self.name, optimizer_sharding)
        seconds.check_seconds("peer_timeout", peer_timeout)
        info = _training_cluster(cluster, task_index, self.name)
        shared_memory = _wants_shared_memory(implementation, info)
        runtime.ensure_started(info, peer_timeout)
        self._info = info
        self.bytes_per_pack = bytes_per_pack
        # How our engines take the step's gradients (TensorFlow's: `options`).
        self.packing = _packing(bytes_per_pack, info)
        engine = _engine(info, options)
        # The steps' collectives on TensorFlow (gradients off shared memory,
        # predict's gathers): our one watchdog thread, not a TensorFlow
        # thread per collective (see keras_distrib.collectives.watchdog).
        self._watchdog = (
            None if collective_timeout is None else CollectiveWatchdog(collective_timeout)
        )
        super().__init__(
            engine,
            num_processes=info.world_size,
            process_index=info.rank,
            local_rank=_local_rank(info),
            multi_worker=True,
            watchdog=self._watchdog,
            bytes_per_pack=bytes_per_pack or 0,
        )
        self.implementation = implementation
        # Which engine reduces the step's gradients, and why (`describe`).
        self.engine_choice = engine_choice.Choice(
            engine_choice.TENSORFLOW, f"implementation={implementation!r}"
        )
        self.optimizer_sharding = sharding_option.check(
            self.name, optimizer_sharding, one_replica_per_process=self.num_local_replicas == 1
        )
        self._own_engine(implementation, shared_memory, collective_timeout, peer_timeout)

    def _own_engine(
        self,
        implementation: str,
        shared_memory: bool,
        timeout: Optional[float],
        connect_timeout: float,
    ) -> None:
        """Our transport in place of TensorFlow's, where `implementation`
        asks for one or `"auto"` picks one."""
        info = self._info
        if shared_memory and self._one_device_per_worker(implementation):
            self.implementation = _SHARED_MEMORY
            self.engine_choice = engine_choice.Choice(
                _SHARED_MEMORY, f"implementation={implementation!r}, every worker on this host"
            )
            self.transport = transports.create(
                _SHARED_MEMORY,
                rows=self.transport,
                rank=info.rank,
                world_size=info.world_size,
                job_id=self._secret_job_id(),
                timeout=timeout,
                connect_timeout=connect_timeout,
                bytes_per_pack=self.packing.bytes_per_pack,
            )
        elif implementation in (_TCP, _HIERARCHICAL, _GLOO) and info.world_size > 1:
            self._one_device_per_worker(implementation)
            made, _, _ = engines.network_transports(
                self, [implementation], timeout, connect_timeout
            )
            self.transport = made[implementation]
            self.engine_choice = engine_choice.Choice(
                implementation, f"implementation={implementation!r}"
            )
        elif implementation == "auto" and info.world_size > 1 and not shared_memory:
            if _spans_hosts(info) and self.num_local_replicas == 1:
                self._choose_engine(timeout, connect_timeout)

    def _choose_engine(self, timeout: Optional[float], connect_timeout: float) -> None:
        """`"auto"` across hosts: the fastest engine, measured
        (`multi_worker_engines.choose_engine`); the chief says which, and why."""
        self.transport, self.engine_choice = engines.choose_engine(self, timeout, connect_timeout)
        if self.engine_choice.name != engine_choice.TENSORFLOW:
            self.implementation = self.engine_choice.name
        if self.is_chief:
            print(
                f"{launch_contract.LINE_START}multi_worker: all-reduce by {self.engine_choice}",
                file=sys.stderr,
                flush=True,
            )

    def _one_device_per_worker(self, implementation: str) -> bool:
        """Whether our own engines can serve this worker: one call per
        process is what they expect (a one-line error when the user asked
        for one with several devices)."""
        if self.num_local_replicas == 1:
            return True
        if implementation in _OURS:
            raise cluster_lib.ClusterConfigError(
                f"implementation={implementation!r} needs one device per worker, but this "
                f"worker has {self.num_local_replicas}; use implementation='auto'."
            )
        return False

    @property
    def cluster(self) -> cluster_lib.ClusterInfo:
        return self._info

    def _secret_job_id(self) -> str:
        """128 random bits drawn by the chief, shared over TensorFlow's
        collectives: the name of the job's shared-memory directory, never
        written anywhere another user could read it first."""
        words = np.zeros(4, np.int64)
        if self.is_chief:
            words[:] = np.frombuffer(secrets.token_bytes(16), np.uint32)
        (shared,) = self.sync_sum([words])
        return "".join(f"{int(w):08x}" for w in shared)

    def describe(self, model: Any) -> ReplicaMemory:
        collectives = str(self.engine_choice)
        if self.engine_choice.name != engine_choice.TENSORFLOW:
            collectives += f", {self.packing}"
        return dataclasses.replace(super().describe(model), collectives=collectives)

    def failure(self, error: Exception) -> Optional[Exception]:
        if self._watchdog is not None and self._watchdog.fired is not None:
            return host_allreduce.PeerLostError(f"multi_worker: {self._watchdog.fired}.")
        lost = heartbeats.lost_peer(error, self._info)
        if lost is not None:
            flight_recorder.report(f"it lost a peer: {lost}", lost=heartbeats.lost_ranks(error))
            return host_allreduce.PeerLostError(f"multi_worker: {lost}")
        explained = self.transport.explain(error)
        if explained is not None:
            flight_recorder.report(f"it lost a peer: {explained}")
            return host_allreduce.PeerLostError(f"multi_worker: {explained}")
        ours = _ENGINE_ERROR.search(str(error))
        if ours is not None and not isinstance(error, host_allreduce.PeerLostError):
            # Our engine's one line, out of TensorFlow's error around the
            # step's numpy_function (as the eager sums between steps raise it).
            return host_allreduce.PeerLostError(f"multi_worker: {ours[1]}")
        return None


def _communication_options(implementation, bytes_per_pack, collective_timeout):
    if implementation not in _IMPLEMENTATIONS and implementation not in _OURS:
        raise ValueError(
            f"Unknown implementation={implementation!r}; use one of "
            f"{sorted([*_IMPLEMENTATIONS, *_OURS])}."
        )
    if bytes_per_pack is not None and (
        isinstance(bytes_per_pack, bool)
        or not isinstance(bytes_per_pack, int)
        or bytes_per_pack < 0
    ):
        raise ValueError(
            f"bytes_per_pack={bytes_per_pack!r} must be an int >= 0 (0 = one pack) or None."
        )
    seconds.check_seconds("collective_timeout", collective_timeout, none_ok=True)
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=bytes_per_pack or 0,
        timeout_seconds=collective_timeout,
        implementation=_IMPLEMENTATIONS.get(implementation, _IMPLEMENTATIONS["auto"]),
    )


def _training_cluster(cluster, task_index: Optional[int], name: str) -> cluster_lib.ClusterInfo:
    """The cluster `cluster` and `task_index` name (or the environment
    does), which must have workers that train; a one-line error else."""
    info = cluster_lib.resolve(cluster, task_index)
    if info is None:
        raise cluster_lib.ClusterConfigError(
            "strategy 'multi_worker' found no cluster; start the workers "
            "with `keras-distrib launch -n N script.py`, set TF_CONFIG, run "
            "under Slurm, or pass cluster=[...] and task_index=..."
        )
    cluster_lib.require_training_workers(info, name)
    return info


def _engine(info: cluster_lib.ClusterInfo, options) -> "_KeyedMultiWorkerStrategy":
    """TensorFlow's multi-worker engine for this worker of `info`, on the
    collective server the runtime already started."""
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": list(info.workers)}),
        task_type="worker",
        task_id=info.rank,
        rpc_layer="grpc",
    )
    with _compat.reuse_collective_server():
        return _KeyedMultiWorkerStrategy(cluster_resolver=resolver, communication_options=options)


def _wants_shared_memory(implementation: str, info: cluster_lib.ClusterInfo) -> bool:
    """Whether the step's all-reduce goes through shared memory (see above)."""
    if implementation not in ("auto", _SHARED_MEMORY) or info.world_size == 1:
        return False
    remote = [
        f"worker {rank} at {address}"
        for rank, address in enumerate(info.workers)
        if not cluster_lib.is_local_host(cluster_lib.parse_address(address)[0])
    ]
    if implementation == "auto":
        return (
            not remote and host_allreduce.supported() and not tf.config.list_physical_devices("GPU")
        )
    if remote:
        raise cluster_lib.ClusterConfigError(
            f"implementation='shm' needs every worker on this host, but {remote[0]} is "
            "not; use implementation='auto' or 'ring' across hosts."
        )
    if not host_allreduce.supported():
        raise cluster_lib.ClusterConfigError(
            "implementation='shm' needs Linux (named pipes and /dev/shm); use 'auto' or 'ring'."
        )
    return True


def _packing(bytes_per_pack: Optional[int], info: cluster_lib.ClusterInfo) -> overlap.Packing:
    """How our engines take this worker's gradients (`overlap.packing`):
    its host's cores, the workers on it, and what each computes on."""
    hosts = info.worker_hosts
    accelerator = bool(
        tf.config.list_physical_devices("GPU") or tf.config.list_physical_devices("TPU")
    )
    return overlap.packing(
        bytes_per_pack,
        cores=overlap.host_cores(),
        workers_on_host=hosts.count(hosts[info.rank]),
        accelerator=accelerator,
        intra_op_threads=overlap.intra_op_threads(
            tf.config.threading.get_intra_op_parallelism_threads()
        ),
        inter_op_threads=overlap.inter_op_threads(
            tf.config.threading.get_inter_op_parallelism_threads()
        ),
    )


def _spans_hosts(info: cluster_lib.ClusterInfo) -> bool:
    """Whether some worker of `info` is on another host than this one."""
    return any(not cluster_lib.is_local_host(host) for host in info.worker_hosts)


def _local_rank(info: cluster_lib.ClusterInfo) -> int:
    """This worker's index among the workers on its host."""
    hosts = info.worker_hosts
    return hosts[: info.rank].count(hosts[info.rank])
