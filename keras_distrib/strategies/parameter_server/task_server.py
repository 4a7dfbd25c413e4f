"""The server a `worker` or `ps` task of a parameter-server cluster runs.

With `strategy="parameter_server"` (TensorFlow's `ParameterServerStrategy`
and `ClusterCoordinator`) only the `chief` runs the training script: it is
the coordinator, and it sends the functions to run to the `worker` tasks
and keeps the variables on the `ps` tasks. Those tasks run no user code,
only a TensorFlow gRPC server, which this module starts:

    python -m keras_distrib.strategies.parameter_server.task_server   # the cluster and task from TF_CONFIG

That is what `keras-distrib launch --workers N --ps M train.py` runs on
the worker and ps tasks; with `--ps_tasks_run_script` (Kubeflow style,
every task runs the script) the strategy's constructor calls `serve(info)`
on those tasks instead, and never returns.

A server exits 0, quietly, on SIGTERM (how the launcher, Kubernetes or
Slurm end it) and SIGINT (see `serve`). Importing this module is cheap:
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

import os
import signal
import sys
import threading
import time
from typing import NoReturn

from keras_distrib import cluster as cluster_lib

# The task types that run a server and nothing else.
SERVER_TASK_TYPES = (cluster_lib.WORKER, cluster_lib.PS)

# Seconds between re-installs of the SIGTERM handler while serving (see `serve`).
_HANDLER_REFRESH_SECONDS = 0.5

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
    print(f"keras_distrib: {info.task_type} {info.task_index} serving on {info.address} "
          f"(pid {os.getpid()})", file=sys.stderr, flush=True)
    while True:
        # Python runs signal handlers between bytecodes of the main thread,
        # which `Server.join()` would block forever.
        time.sleep(_HANDLER_REFRESH_SECONDS)
        if main_thread:
            _install_handlers()


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


def main() -> int:
    """`python -m keras_distrib.strategies.parameter_server.task_server`: serves the task `TF_CONFIG` names."""
    try:
        info = cluster_lib.resolve()
    except cluster_lib.ClusterConfigError as e:
        print(f"keras_distrib.strategies.parameter_server.task_server: error: {e}", file=sys.stderr, flush=True)
        return 2
    if info is None:
        print("keras_distrib.strategies.parameter_server.task_server: error: no cluster in the environment; set "
              "TF_CONFIG to this task's cluster and task (type 'worker' or 'ps').",
              file=sys.stderr, flush=True)
        return 2
    try:
        serve(info)
    except ValueError as e:
        print(f"keras_distrib.strategies.parameter_server.task_server: error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
