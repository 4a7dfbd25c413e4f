"""The coordination service's heartbeats: their timeout, and the peer a
failed heartbeat names.

Between hosts, a lost peer (its host down, its link cut, its process gone)
is found by TensorFlow's coordination service, not by us: every task sends
the service's leader (worker 0) a heartbeat, and a task silent for the
heartbeat timeout is declared unhealthy, which aborts every task's
collectives. TensorFlow's default is 10 s and its public API has no
setting; `KERAS_DISTRIB_HEARTBEAT_TIMEOUT` (seconds) sets it for every
process of a job (read when the runtime starts, at `import keras_distrib`).
A link that comes back within it costs nothing; a longer outage stops the
job, which `keras-distrib launch --max_restarts` can restart.

What the failing step raises is a TensorFlow traceback of 40 lines ending
in "The following tasks are unhealthy (stopped sending heartbeats):
/job:worker/replica:0/task:1" on the leader, or in "Deadline Exceeded
RPC: /tensorflow.CoordinationService/Heartbeat" on a task that lost the
leader. `lost_peer` turns either into one line naming the peer: its rank,
its address and the timeout that fired.
"""

from __future__ import annotations

import re
from typing import Optional

from keras_distrib import cluster as cluster_lib
from keras_distrib.collectives.seconds import seconds_from_env

ENV = "KERAS_DISTRIB_HEARTBEAT_TIMEOUT"
# TensorFlow's own (kDefaultHeartbeatTimeout in the coordination service).
DEFAULT_TIMEOUT = 10.0

_UNHEALTHY = re.compile(r"stopped sending heartbeats\):\s*((?:/job:\w+/replica:\d+/task:\d+\s*)+)")
_TASK = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")
_HEARTBEAT_RPC = "CoordinationService/Heartbeat"


def timeout() -> float:
    """`KERAS_DISTRIB_HEARTBEAT_TIMEOUT` in seconds (`DEFAULT_TIMEOUT` unset).

    Raises:
        ClusterConfigError: not a number of seconds > 0 (one line).
    """
    return seconds_from_env(ENV, DEFAULT_TIMEOUT, f" (TensorFlow's default: {DEFAULT_TIMEOUT:g})")


def lost_peer(error: BaseException, info: cluster_lib.ClusterInfo) -> Optional[str]:
    """One line naming the peer a heartbeat failure in `error` is about, or
    None when `error` is not one.

    Example:

    ```python
    lost_peer(error, info)
    # "worker 1 at 10.0.0.2:23457 is unreachable: it sent no heartbeat for
    #  KERAS_DISTRIB_HEARTBEAT_TIMEOUT=10s (...)"
    ```
    """
    text = str(error)
    seconds = f"{ENV}={timeout():g}s"
    cause = (
        "its host is down, the network to it is cut, or its process is gone; "
        f"raise {ENV} to ride out longer network outages"
    )
    unhealthy = _UNHEALTHY.search(text)
    if unhealthy:
        peers = [_describe(job, int(task), info) for job, task in _TASK.findall(unhealthy[1])]
        verb = "is" if len(peers) == 1 else "are"
        return (
            f"{', '.join(peers)} {verb} unreachable: no heartbeat reached the "
            f"coordination service for {seconds} ({cause})."
        )
    if _HEARTBEAT_RPC in text:
        leader = _describe("worker", 0, info)
        return (
            f"{leader}, the coordination service's leader, is unreachable: this "
            f"worker's heartbeat got no answer within {seconds} ({cause})."
        )
    return None


def lost_ranks(error: BaseException) -> list[int]:
    """The ranks (worker tasks) a heartbeat failure in `error` names: the
    unhealthy tasks on the leader, the leader (0) on a task that lost it;
    [] when `error` is not one."""
    text = str(error)
    unhealthy = _UNHEALTHY.search(text)
    if unhealthy:
        return [int(task) for job, task in _TASK.findall(unhealthy[1]) if job == "worker"]
    return [0] if _HEARTBEAT_RPC in text else []


def _describe(job: str, task: int, info: cluster_lib.ClusterInfo) -> str:
    """`worker 1 at host:port` (the address from the cluster, if it has it)."""
    addresses = list(info.workers) if job == "worker" else []
    where = f" at {addresses[task]}" if task < len(addresses) else ""
    return f"{job} {task}{where}"
