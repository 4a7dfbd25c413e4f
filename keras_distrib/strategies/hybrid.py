"""Hybrid data x model parallelism: a model-parallel strategy across workers.

Under a configured cluster (`keras-distrib launch`'s `TF_CONFIG`, Slurm, or
the strategy's `workers={...}` options), `tensor_parallel` and `pipeline`
become data-parallel across worker processes, the way Megatron and
DeepSpeed combine them:

* each worker holds one whole model replica, split over its own local
  devices as with one process (`num_replicas` = `world_size`, one replica
  per worker; `rank`, `is_chief` as with `multi_worker`);
* each worker reads its shard of every global batch
  (`keras_distrib.input.sharding`, as `multi_worker`: every sample of an epoch
  seen once, `batch_size` global);
* each gradient, a shard's included, is summed with the same gradient of
  every other worker. Every worker splits the model the same way, so the
  i-th gradient of one worker belongs to the same shard, on the same local
  device, as the i-th of every other: one all-reduce of the gradient list
  reduces each shard with the workers holding that shard. The collective is
  `multi_worker`'s transport (shared memory between the processes of one
  host, TensorFlow's gRPC ring or NCCL otherwise), called across processes
  (`keras_distrib.collectives.across_processes`), once per step for the
  whole replica, with the sample counts, BatchNormalization statistics and
  the preemption vote riding along (`DistributedModel.reduce_gradients`);
* variables start from worker 0's values (broadcast after every build);
* epoch logs and `evaluate` sum each metric variable over the workers before
  the result is read (exact, as `tf.distribute` does for metric variables);
  per-batch logs are the worker's own, as with `multi_worker`;
* `predict` gathers every worker's rows, in global order, on every worker.

TensorFlow's collective runtime must start before TensorFlow is used: under
the launcher `import keras_distrib` starts it. Logical CPUs
(`tf.config.set_logical_device_configuration`) must therefore be set up
before that import (see `examples/` and `tests/workers/hybrid_train.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Optional, Sequence, cast

import numpy as np
import tensorflow as tf

from keras_distrib import cluster as cluster_lib
from keras_distrib.collectives import registry as transports
from keras_distrib.collectives.across_processes import AcrossProcesses
from keras_distrib.topology import Topology

if TYPE_CHECKING:
    from keras_distrib.collectives.transport import Transport
    from keras_distrib.strategies.multi_worker import MultiWorker


class WorkerReplicas:
    """Mixin of a model-parallel strategy: one replica per worker process.

    Without a cluster there is one process and one replica, and every
    collective is the identity.
    """

    # The `multi_worker` strategy whose transport carries the collectives.
    _workers: Optional[MultiWorker] = None

    if TYPE_CHECKING:  # the strategy's (`Strategy`)
        name: ClassVar[str]
        transport: Transport

        def broadcast_model_state(self, model: Any) -> None: ...

    def _join_workers(
        self, devices: Sequence[str], workers: Optional[Mapping[str, Any]]
    ) -> Topology:
        """This process's topology, joining the cluster when one is configured.

        `workers`: options for the collectives across workers (those of
        `multi_worker`: `implementation`, `collective_timeout`, ...).
        """
        if workers is not None and not isinstance(workers, Mapping):
            raise ValueError(
                f"workers={workers!r} must be a dict of multi_worker options, e.g. "
                "{'implementation': 'ring'}."
            )
        if cluster_lib.resolve() is None:
            if workers:
                raise cluster_lib.ClusterConfigError(
                    f"strategy {self.name!r} got workers={dict(workers)!r} but found no "
                    "cluster; start it with `keras-distrib launch -n N script.py` or set "
                    "TF_CONFIG."
                )
            self.transport = transports.create("one_process")
            return Topology(
                num_replicas=1,
                num_local_replicas=1,
                first_local_replica=0,
                devices=tuple(devices),
                role="chief",
            )
        from keras_distrib.strategies import registry

        self._workers = cast("MultiWorker", registry.create("multi_worker", **dict(workers or {})))
        rank, size = self._workers.rank, self._workers.world_size
        self.transport = AcrossProcesses(self._workers.transport, rank, size)
        return Topology(
            num_replicas=size,
            num_local_replicas=1,
            first_local_replica=rank,
            devices=tuple(devices),
            num_processes=size,
            process_index=rank,
            local_rank=self._workers.local_rank,
            role="chief" if rank == 0 else "worker",
            num_data_shards=size,
            data_shard_index=rank,
        )

    @property
    def implementation(self) -> Optional[str]:
        """The collective path across workers (`"shm"`, `"ring"`, ...), or None
        with one process."""
        return None if self._workers is None else self._workers.implementation

    # -- the step -----------------------------------------------------------------

    def failure(self, error: Exception) -> Optional[Exception]:
        return None if self._workers is None else self._workers.failure(error)

    def gather_rows(self, structure: Any) -> Any:
        """Every worker's rows of each tensor in `structure`, in rank order
        (= global batch order, see `keras_distrib.input.sharding`), on every
        worker (the transport's `gather_rows`)."""
        return self.transport.gather_rows(structure)

    # -- metrics ------------------------------------------------------------------------

    def read_metrics(self, model, read):
        if self._workers is None or not tf.executing_eagerly():
            return super().read_metrics(model, read)
        return self.read_summed_metrics(model, read)

    # -- between steps ----------------------------------------------------------------

    def local_replica_values(self, variable: Any) -> list[np.ndarray]:
        return [np.asarray(variable)]

    def sync_initial_state(self, model) -> None:
        if self._workers is not None:
            self.broadcast_model_state(model)
