"""The cluster of a Kubernetes Indexed Job (or JobSet), without TF_CONFIG.

Kubeflow's TFJob is gone (Kubeflow Trainer v2 dropped it,
kubeflow/trainer#2699), so nothing writes `TF_CONFIG` into the pods. A plain
Kubernetes Indexed `Job` whose pods name a headless `Service` as their
`subdomain` (configs/k8s/) gives each pod what a cluster needs:

* its index, `JOB_COMPLETION_INDEX` (0..N-1): its rank;
* a stable host name, `<job>-<index>` (a JobSet's pods:
  `<jobset>-<replicated job>-<job index>-<index>`), and a DNS name
  `<host name>.<subdomain>`, which every pod of the namespace resolves, so
  worker r is `<job>-<r>.<subdomain>:<port>`;
* N, which Kubernetes does not put in the environment: the manifest sets
  `KERAS_DISTRIB_WORLD_SIZE` to the Job's `completions`.

The subdomain is read from the pod's own fully qualified name
(`<host>.<subdomain>.<namespace>.svc...`, which Kubernetes writes into the
pod's /etc/hosts). Every worker listens on `KERAS_DISTRIB_PORT` (default
8888, as under Slurm). All pods are workers, rank 0 the chief.
"""

from __future__ import annotations

import os
import socket
from typing import Callable, Mapping, Optional

from .addresses import check_index, whole_number
from .errors import ClusterConfigError
from .info import ClusterInfo

__all__ = ["DEFAULT_PORT", "from_indexed_job"]

DEFAULT_PORT = 8888
INDEX_ENV = "JOB_COMPLETION_INDEX"
SIZE_ENV = "KERAS_DISTRIB_WORLD_SIZE"
PORT_ENV = "KERAS_DISTRIB_PORT"


def from_indexed_job(
    environ: Mapping[str, str] = os.environ,
    hostname: Callable[[], str] = socket.gethostname,
    fqdn: Callable[[], str] = socket.getfqdn,
) -> Optional[ClusterInfo]:
    """Reads the cluster of an Indexed Job's pod; None outside one (no
    `JOB_COMPLETION_INDEX`, or no `KERAS_DISTRIB_WORLD_SIZE`: an Indexed
    Job whose manifest does not ask for a cluster, a sweep of single runs).

    Raises:
        ClusterConfigError: `KERAS_DISTRIB_WORLD_SIZE` or the port missing
            or malformed, an index out of range, a host name that does not
            end in `-<index>`, or a pod without a subdomain (one line each,
            with the fix).

    Example:

    ```python
    # pod train-1 of Indexed Job "train", subdomain "train-workers", 2 completions:
    from_indexed_job().workers  # ('train-0.train-workers:8888', 'train-1.train-workers:8888')
    ```
    """
    if INDEX_ENV not in environ or SIZE_ENV not in environ:
        return None
    index = whole_number(environ, INDEX_ENV, " (the pod's index, which an Indexed Job sets).")
    size = whole_number(
        environ, SIZE_ENV, " (set it in the pod template to the Job's completions)."
    )
    if size < 1:
        raise ClusterConfigError(f"{SIZE_ENV}={size} must be >= 1 (the Job's completions).")
    check_index(index, size, INDEX_ENV, "pods (KERAS_DISTRIB_WORLD_SIZE)")
    port = whole_number(environ, PORT_ENV, " (the workers' port).", DEFAULT_PORT)
    if not 1 <= port <= 65535:
        raise ClusterConfigError(f"{PORT_ENV}={port} must be a port in 1..65535.")
    host = hostname().split(".", 1)[0]
    suffix = f"-{index}"
    if not host.endswith(suffix):
        raise ClusterConfigError(
            f"the pod's host name {host!r} does not end in {suffix!r} ({INDEX_ENV}={index}); "
            "an Indexed Job's pods are named <job>-<index>: use completionMode: Indexed "
            "and leave the pod's hostname unset."
        )
    stem = host[: -len(suffix)]
    labels = fqdn().split(".")
    if len(labels) < 2 or labels[0] != host:
        raise ClusterConfigError(
            f"the pod {host!r} has no subdomain (its full name is {fqdn()!r}); set the pod "
            "template's subdomain to a headless Service selecting the Job's pods "
            "(configs/k8s/job.yaml)."
        )
    subdomain = labels[1]
    workers = tuple(f"{stem}-{r}.{subdomain}:{port}" for r in range(size))
    return ClusterInfo(workers, index)
