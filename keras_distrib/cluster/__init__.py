"""Who am I, who are my peers: cluster discovery for distributed training.

A cluster is a set of tasks by role, as `TF_CONFIG` describes it: training
tasks (an optional dedicated `chief`, then `worker`s; their order is the
rank order, chief first), and optionally parameter servers (`ps`) and
`evaluator`s. `ClusterInfo` holds them and this process's task type and
index. The cluster comes from, in this order:

1. addresses passed by the user, a list of workers or a dict of roles
   (`from_explicit`),
2. the `TF_CONFIG` environment variable, as Kubeflow's TFJob and
   `keras-distrib launch` set it (`from_tf_config`),
3. a Slurm job step started with `srun`, all tasks workers (`from_slurm`;
   with `KERAS_DISTRIB_NUM_PS=M`, task 0 the chief and the last M ps tasks),
4. a job started by Open MPI's `mpirun`, all processes workers, which find
   each other through mpi4py (`from_openmpi`),
5. a pod of a Kubernetes Indexed Job (or JobSet) whose manifest sets
   `KERAS_DISTRIB_WORLD_SIZE`: rank `JOB_COMPLETION_INDEX`, peers by the
   pods' stable DNS names (`from_indexed_job`),

and `resolve()` tries them in that order. Every malformed input fails with a
`ClusterConfigError` (a `ValueError`) whose one-line message names the field
or peer at fault and the fix. Discovery accepts every role; a strategy that
trains on workers only calls `require_training_workers(info, name)`.

One module per concern: `errors`, `roles` (task type names), `addresses`
(`parse_address` and the shared checks), `info` (`ClusterInfo`,
`require_training_workers`), the sources `explicit`, `tf_config`, `slurm`,
`openmpi` and `kubernetes`, `resolve`, `gpu_share` (the GPUs each process of
a host sees), `network` (port and peer checks), `process_state` (what became
of a process of this machine), and `launch_contract` (the environment
variables and exit codes `keras-distrib launch` and its workers agree on).

This package is pure Python on purpose: the launcher and the tests import it
without paying for TensorFlow's import. Only `from_slurm` imports TensorFlow,
lazily, to reuse its Slurm host-list expansion; only `from_openmpi` imports
mpi4py, lazily, under `mpirun`.

Example:

```python
from keras_distrib import cluster

info = cluster.resolve()  # None when this process is not part of a cluster
if info is not None:
    cluster.require_training_workers(info, "multi_worker")
    cluster.check_own_port_free(info)
    cluster.wait_for_peers(info, timeout=60)
    print(info.rank, info.world_size, info.peers)
```
"""

from __future__ import annotations

from .addresses import parse_address
from .errors import ClusterConfigError, PeersMissingError
from .explicit import from_explicit
from . import gpu_share  # noqa: F401  (the GPUs each process of a host sees)
from . import launch_contract  # noqa: F401  (what the launcher and its workers agree on)
from . import process_state  # noqa: F401  (what became of a process of this machine)
from .info import ClusterInfo, require_training_workers
from .kubernetes import from_indexed_job
from .openmpi import from_openmpi
from .network import check_own_port_free, free_ports, is_local_host, wait_for_peers
from .resolve import resolve
from .roles import CHIEF, EVALUATOR, PS, TASK_TYPES, TRAINING_TASK_TYPES, WORKER
from .slurm import DEFAULT_SLURM_PORT_BASE, from_slurm
from .tf_config import from_tf_config

__all__ = [
    "CHIEF",
    "ClusterConfigError",
    "from_indexed_job",
    "PeersMissingError",
    "ClusterInfo",
    "DEFAULT_SLURM_PORT_BASE",
    "EVALUATOR",
    "PS",
    "TASK_TYPES",
    "TRAINING_TASK_TYPES",
    "WORKER",
    "check_own_port_free",
    "free_ports",
    "from_explicit",
    "from_openmpi",
    "from_slurm",
    "from_tf_config",
    "is_local_host",
    "parse_address",
    "require_training_workers",
    "resolve",
    "wait_for_peers",
]
