"""This process's collective runtime: started before TensorFlow is used.

TensorFlow allows one collective runtime (the gRPC server that multi-worker
collectives run on) per process, and it must be configured before
TensorFlow creates its eager context, i.e. before the first tensor,
variable or layer weight exists (`enable_collective_ops` after that point
leaves earlier tensors on a device that no longer exists). A script that
builds its model first and names `strategy="multi_worker"` afterwards would
therefore fail. So when this process is a training task of a cluster
configured in the environment (`TF_CONFIG`, as `keras-distrib launch` and
Kubeflow set it, or Slurm), `import keras_distrib` starts the runtime at
once (`bootstrap`), and the strategy created later, with whatever options,
runs on it.

The import waits up to `KERAS_DISTRIB_PEER_TIMEOUT` seconds (default 120)
for every peer to come up and names the first that did not (the error is
raised when the strategy is created). Set `KERAS_DISTRIB_BOOTSTRAP=0` to
opt out (then create the strategy before using TensorFlow; its
`peer_timeout` option applies). The launcher itself never bootstraps.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from typing import Optional

from keras_distrib import cluster as cluster_lib
from keras_distrib.cluster.network import listen_address
from keras_distrib.collectives import flight_recorder
from keras_distrib.collectives.seconds import check_seconds, seconds_from_env

# Seconds the import-time start waits for every peer to come up.
DEFAULT_PEER_TIMEOUT = 120.0
_OPT_OUT = "KERAS_DISTRIB_BOOTSTRAP"
_PEER_TIMEOUT = "KERAS_DISTRIB_PEER_TIMEOUT"

_started: Optional[cluster_lib.ClusterInfo] = None
_failed: Optional[Exception] = None
# (cluster, tf ParameterServerStrategy, ClusterCoordinator) of a chief.
_coordinator: Optional[tuple] = None


def bootstrap() -> None:
    """Starts the runtime now if the environment configures a cluster.

    Called by `import keras_distrib`. Errors are kept and raised when a
    strategy needs the runtime, so a malformed `TF_CONFIG` does not break
    importing the package (only using it).
    """
    global _failed
    if os.environ.get(_OPT_OUT, "1") == "0" or is_launcher():
        return
    try:
        info = cluster_lib.resolve()
    except cluster_lib.ClusterConfigError:
        return  # reported, with the field at fault, when a strategy resolves it
    coordinates = info is not None and _coordinates(info)
    if info is None or not (_runs_collectives(info) or coordinates):
        return
    from keras_distrib import _compat

    if _compat.tensorflow_started():
        return  # too late; `ensure_started` says so when the runtime is needed
    try:
        if coordinates:
            start_coordinator(info, _peer_timeout())
        else:
            start(info, _peer_timeout())
    except Exception as e:  # noqa: BLE001 - re-raised by ensure_started
        _failed = e


def _peer_timeout() -> float:
    return seconds_from_env(_PEER_TIMEOUT, DEFAULT_PEER_TIMEOUT)


def ensure_started(info: cluster_lib.ClusterInfo, peer_timeout: float) -> None:
    """Makes sure the runtime runs for `info` (starting it if still possible).

    Raises:
        ClusterConfigError: it runs for another cluster; or TensorFlow was
            started before keras_distrib could start it (one line, with the
            fix); or the import-time start failed (its error).
    """
    check_seconds("peer_timeout", peer_timeout)
    if _started is not None:
        if _started.workers != info.workers or _started.rank != info.rank:
            raise cluster_lib.ClusterConfigError(
                f"this process already joined the cluster {list(_started.workers)} as "
                f"worker {_started.rank}; one cluster per process, so pass no other "
                "cluster= to the strategy."
            )
        return
    _check_not_too_late("start its multi-worker runtime", "starts it")
    start(info, peer_timeout)


def start(info: cluster_lib.ClusterInfo, peer_timeout: float) -> None:
    """Waits (bounded) for every peer, then starts this process's server.

    Starting the server blocks inside TensorFlow, holding the GIL, until
    every worker has registered, with no deadline we can set. So first each
    worker listens on its own port and waits until every peer's port
    answers: a worker that never comes up is then named in a clear error
    instead of hanging the job. The probe socket is closed right before
    TensorFlow's server takes the port over (peers keep retrying meanwhile).
    """
    global _started
    import tensorflow as tf

    cluster_lib.check_own_port_free(info)
    with _listening_on(info.address):
        try:
            cluster_lib.wait_for_peers(info, timeout=peer_timeout)
        except cluster_lib.PeersMissingError as e:
            flight_recorder.report(f"it did not find its peers: {e}", lost=e.ranks)
            raise
    spec = tf.train.ClusterSpec({"worker": list(info.workers)})
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type="worker", task_id=info.rank, rpc_layer="grpc"
    )
    from keras_distrib import _compat
    from keras_distrib.collectives import heartbeats

    _compat.configure_coordination_service(spec, heartbeats.timeout())
    # Creating a MultiWorkerMirroredStrategy is TensorFlow's own way to
    # configure and start the runtime; strategies made later reuse it.
    tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    _started = info


def ensure_coordinator(info: cluster_lib.ClusterInfo, peer_timeout: float):
    """The parameter-server engine and coordinator of this chief, started if
    still possible (see `start_coordinator`): `(strategy, coordinator)`.

    Raises:
        ClusterConfigError: as `ensure_started`.
    """
    if _coordinator is not None:
        if _coordinator[0] != info:
            raise cluster_lib.ClusterConfigError(
                f"this process already coordinates the cluster {_coordinator[0].cluster_spec()}; "
                "one cluster per process, so pass no other cluster to the strategy."
            )
        return _coordinator[1:]
    _check_not_too_late("connect this chief to its parameter servers", "connects")
    return start_coordinator(info, peer_timeout)[1:]


def _check_not_too_late(what: str, import_does: str) -> None:
    """Raises the import-time start's error, or a one-line error if
    TensorFlow already runs (too late to `what`)."""
    if _failed is not None:
        raise _failed
    from keras_distrib import _compat

    if _compat.tensorflow_started():
        raise cluster_lib.ClusterConfigError(
            f"TensorFlow was used before keras_distrib could {what}; `import keras_distrib` "
            "before any TensorFlow tensor, variable or layer weight is created (with "
            f"TF_CONFIG or Slurm set, the import {import_does}), or create the strategy at "
            "the top of the script."
        )


def start_coordinator(info: cluster_lib.ClusterInfo, peer_timeout: float):
    """Connects this chief to its workers and ps tasks: `(info, strategy, coordinator)`.

    Like the collective runtime, this must happen before TensorFlow's eager
    context exists: connecting renames the local job (`/job:localhost` ->
    `/job:chief`), and variables made before that become unreadable
    ("Client for target /job:localhost/replica:0/task:0 not found").
    The coordinator's threads (one per worker, plus one) need more
    inter-op threads than a 2-core machine's default, or it deadlocks.
    """
    global _coordinator
    import tensorflow as tf

    wanted = max(4, len(info.workers) + 2)
    if tf.config.threading.get_inter_op_parallelism_threads() < wanted:
        tf.config.threading.set_inter_op_parallelism_threads(wanted)
    cluster_lib.wait_for_peers(info, timeout=peer_timeout)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(info.cluster_spec()),
        task_type=cluster_lib.CHIEF,
        task_id=0,
        rpc_layer="grpc",
    )
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    _coordinator = (info, strategy, coordinator)
    return _coordinator


def _coordinates(info) -> bool:
    """The chief of a cluster with parameter servers (it runs the script)."""
    return getattr(info, "has_ps", False) and getattr(info, "role", "") == cluster_lib.CHIEF


def started() -> Optional[cluster_lib.ClusterInfo]:
    """The cluster this process's runtime runs for, or None."""
    return _started


def _runs_collectives(info) -> bool:
    """Training tasks of a cluster without parameter servers (sync training)."""
    return bool(getattr(info, "is_training_task", True)) and not getattr(info, "has_ps", False)


def is_launcher() -> bool:
    """Whether this process is keras_distrib's own command (the launcher, a
    task server): it starts no runtime and picks no GPUs for itself."""
    # `keras-distrib ...` (console script) or `python -m keras_distrib.X`
    # (sys.argv[0] is "-m" while the package is imported for it).
    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    return program == "keras-distrib" or (sys.argv[:1] == ["-m"])


@contextlib.contextmanager
def _listening_on(address: str):
    """Listens on this task's port while it waits for its peers.

    Peers wait until this port answers (`wait_for_peers`). Only the address
    the cluster names for this task is listened on (`listen_address`), so
    the probe is no wider open than it must be; TensorFlow's server,
    started right after, listens on every interface whatever we do (see
    docs/security.md).
    """
    host, port = cluster_lib.parse_address(address)
    ip = listen_address(host)
    if ip:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        server = socket.create_server((ip, port), family=family)
    elif socket.has_dualstack_ipv6():
        # No local address is named (a wildcard, or a name or NAT address
        # this machine does not have): every interface, as TF's server.
        server = socket.create_server(
            ("", port), family=socket.AF_INET6, dualstack_ipv6=True, reuse_port=False
        )
    else:
        server = socket.create_server(("", port))
    with server:
        yield
