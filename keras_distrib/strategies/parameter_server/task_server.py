"""The server a `worker` or `ps` task of a parameter-server cluster runs.

With `strategy="parameter_server"` (TensorFlow's `ParameterServerStrategy`
and `ClusterCoordinator`) only the `chief` runs the training script: it is
the coordinator, and it sends the functions to run to the `worker` tasks
and keeps the variables on the `ps` tasks. Those tasks run no user code,
only a TensorFlow gRPC server, which this module starts:

    # the cluster and task from TF_CONFIG
    python -m keras_distrib.strategies.parameter_server.task_server

That is what `keras-distrib launch --workers N --ps M train.py` runs on
the worker and ps tasks; with `--ps_tasks_run_script` (Kubeflow style,
every task runs the script) the strategy's constructor calls `serve(info)`
on those tasks instead, and never returns.

A server exits 0, quietly, on SIGTERM (how the launcher, Kubernetes or
Slurm end it) and SIGINT (see `serve`). It also ends, exit 0 with one line,
once its chief is gone: the chief's port refused connections for
`CHIEF_GONE_SECONDS` in a row after it had answered. Under `srun` (every
task runs the script, `KERAS_DISTRIB_NUM_PS`) nobody else would end the
servers, and the job step would outlive its training; the exit code of the
step is then the chief's. Importing this module is cheap:
TensorFlow is imported when a server starts.

Example:

```python
from keras_distrib import cluster
from keras_distrib.strategies.parameter_server import task_server

info = cluster.resolve()
if info is not None and info.task_type in ("worker", "ps"):
    task_server.serve(info)  # never returns
```
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import sys
import threading
import time
from typing import NoReturn, Optional

from keras_distrib import cluster as cluster_lib

# The task types that run a server and nothing else.
SERVER_TASK_TYPES = (cluster_lib.WORKER, cluster_lib.PS)

# Seconds between re-installs of the SIGTERM handler while serving (see `serve`).
_HANDLER_REFRESH_SECONDS = 0.5

# How long the chief's port must refuse connections, after it had answered,
# before a server takes the chief for gone: longer than a launcher needs to
# see the chief's exit and stop the servers itself.
CHIEF_GONE_SECONDS = 10.0

# This process's server, once `serve` started it.
_server = None


def server_config():
    """The `tf.compat.v1.ConfigProto` every task server runs with.

    The inter-op thread pool gets at least 4 threads: the default, one
    per core, deadlocks parameter-server clusters on 2-core machines.
    """
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = max(4, os.cpu_count() or 1)
    return config


def serve(info: cluster_lib.ClusterInfo) -> NoReturn:
    """Runs this task's TensorFlow server until the process is signalled.

    Starts `tf.distribute.Server` for `info`'s task on its address, says so
    in one line on stderr (`keras_distrib: ps 0 serving on host:port (pid
    N)`) and waits forever: the chief's coordinator sends the work.

    SIGTERM ends the process at once with exit code 0 (SIGINT: 130),
    without a traceback: nothing here has state worth saving (a ps's
    variables are lost either way), and `os._exit` skips TensorFlow's
    teardown of a running server. The wait is in Python, not in
    `Server.join()`, which would keep Python's signal handlers from ever
    running. TensorFlow's coordination service installs a SIGTERM handler
    of its own that only records the signal (see `keras_distrib.preemption`);
    a bare server of TF 2.21 serving a `ClusterCoordinator` was seen to
    install none, but ours is installed again every half second all the
    same, so that it stays the one in force. On a thread other than the
    main one no handler can be installed; the signals then do what the
    process's handlers do.

    Raises:
        ValueError: `info` is not a `worker` or `ps` task (one line).

    Example:

    ```python
    serve(cluster.from_tf_config())  # in the process of a ps task
    ```
    """
    if info.task_type not in SERVER_TASK_TYPES:
        raise ValueError(
            f"task_server.serve: this process is the {info.task_type!r} task, not a "
            "'worker' or 'ps' task; only those run a bare server (the chief runs the "
            "training script, an evaluator its own loop)."
        )
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:  # before TensorFlow's import, which takes seconds
        _install_handlers()
    import tensorflow as tf

    global _server
    _server = tf.distribute.Server(  # referenced for as long as it serves
        tf.train.ClusterSpec(info.cluster_spec()),
        job_name=info.task_type,
        task_index=info.task_index,
        protocol="grpc",
        config=server_config(),
        start=True,
    )
    print(
        f"keras_distrib: {info.task_type} {info.task_index} serving on {info.address} "
        f"(pid {os.getpid()})",
        file=sys.stderr,
        flush=True,
    )
    _wait_for_the_chief_to_go(info, main_thread)


def _wait_for_the_chief_to_go(info: cluster_lib.ClusterInfo, main_thread: bool) -> NoReturn:
    """Serves until the chief is gone (`_ChiefWatch`), then exits 0."""
    chief = _ChiefWatch(info.workers[0])
    while True:
        # Python runs signal handlers between bytecodes of the main thread,
        # which `Server.join()` would block forever.
        time.sleep(_HANDLER_REFRESH_SECONDS)
        if main_thread:
            _install_handlers()
        if chief.gone():
            print(
                f"keras_distrib: {info.task_type} {info.task_index}: the chief at "
                f"{info.workers[0]} is gone (its port refuses connections); this server ends.",
                file=sys.stderr,
                flush=True,
            )
            _exit_quietly(signal.SIGTERM, None)


class _ChiefWatch:
    """Whether the chief's port has refused connections for
    `CHIEF_GONE_SECONDS` in a row since it last answered. A chief not
    yet up (still importing TensorFlow) is not gone, and neither is one
    that cannot be reached at all (a timeout, an unreachable network:
    that is the launcher's or the scheduler's to judge)."""

    def __init__(self, address: str):
        self.address = cluster_lib.parse_address(address, "chief")
        self.answered = False
        self.refused_since: Optional[float] = None

    def gone(self) -> bool:
        try:
            with socket.create_connection(self.address, timeout=1.0):
                pass
        except OSError as e:
            if self.answered and e.errno == errno.ECONNREFUSED:
                now = time.monotonic()
                self.refused_since = self.refused_since or now
                return now - self.refused_since >= CHIEF_GONE_SECONDS
            return False
        self.answered, self.refused_since = True, None
        return False


def _install_handlers() -> None:
    signal.signal(signal.SIGTERM, _exit_quietly)
    signal.signal(signal.SIGINT, _exit_quietly)


def _exit_quietly(signum, frame) -> None:
    del frame
    # os._exit: TensorFlow's teardown of a running server can block.
    try:
        sys.stderr.flush()
    finally:
        os._exit(0 if signum == signal.SIGTERM else 128 + signum)


def _error(message: str) -> None:
    print(
        f"keras_distrib.strategies.parameter_server.task_server: error: {message}",
        file=sys.stderr,
        flush=True,
    )


def main() -> int:
    """`python -m keras_distrib.strategies.parameter_server.task_server`:
    serves the task `TF_CONFIG` names."""
    try:
        info = cluster_lib.resolve()
    except cluster_lib.ClusterConfigError as e:
        _error(str(e))
        return 2
    if info is None:
        _error(
            "no cluster in the environment; set TF_CONFIG to this task's cluster and "
            "task (type 'worker' or 'ps')."
        )
        return 2
    try:
        serve(info)
    except ValueError as e:
        _error(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
