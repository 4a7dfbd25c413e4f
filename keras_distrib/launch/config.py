"""What a launch is asked to do: `LaunchConfig`, its check, and `LaunchError`.

Every other module of the launcher reads a `LaunchConfig`; keeping it here,
apart from the absl flags in `cli`, lets planning, backends and supervision
be used (and tested) without the command line. `GRACE_SECONDS`, the default
of `--grace_seconds`, lives here for the same reason.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

# -tt gives the remote command a terminal, so it gets SIGHUP and dies when
# the launcher kills ssh; without it remote ranks would outlive the launcher.
DEFAULT_SSH_COMMAND = "ssh -o BatchMode=yes -tt"

# Seconds a rank gets to exit after SIGTERM before SIGKILL (--grace_seconds):
# enough for the chief to write a backup checkpoint when it is preempted.
GRACE_SECONDS = 30.0
# Seconds ranks may run on after another exited 0 before the launcher says
# so (--straggler_warning): one that waits for the finished rank in a
# collective would otherwise wait silently until its collective timeout.
STRAGGLER_WARNING = 60.0
# Seconds after an attempt's start within which a second failure of the
# same slot leaves it out of an elastic job (--elastic_grace).
ELASTIC_GRACE = 60.0


class LaunchError(Exception):
    """A one-line usage or configuration error; nothing was started."""


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """What to start and where; the parsed form of `keras-distrib launch`.

    Example:

    ```python
    config = LaunchConfig(nproc=2, script="train.py", script_args=("--epochs", "3"))
    exit_code = launch(config)
    ```
    """

    nproc: int
    script: str
    script_args: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()
    port_base: int = 0
    bind: str = "127.0.0.1"
    backend: str = "tf"
    output_dir: Optional[str] = None
    ssh: bool = False
    ssh_command: str = DEFAULT_SSH_COMMAND
    timeout: float = 0.0  # bounds the whole job, restarts included
    tail_lines: int = 40
    max_restarts: int = 0
    grace_seconds: float = GRACE_SECONDS
    straggler_warning: float = STRAGGLER_WARNING  # 0: never
    # GPUs each rank of a host gets (CUDA_VISIBLE_DEVICES by local rank,
    # `keras_distrib.cluster.gpu_share`); 0: every rank sees every GPU.
    gpus_per_worker: int = 1
    # Seconds without a finished training step (after the first) before the
    # flight recorder's screen is shown, the job going on; 0: never.
    stall_warning: float = 0.0
    # Parameter-server mode (--ps M >= 1): a chief runs the script, `nproc`
    # worker tasks and `ps` ps tasks run TensorFlow servers
    # (`keras_distrib.strategies.parameter_server.task_server`), or the script too with
    # `ps_tasks_run_script` (Kubeflow style: the strategy serves there).
    ps: int = 0
    ps_tasks_run_script: bool = False
    # Elastic (`keras_distrib.launch.elastic`): >= 1 lets a restart go on
    # with this many of the -n slots or more; a slot whose rank fails again
    # within `elastic_grace` seconds of its attempt's start is left out.
    min_workers: int = 0
    elastic_grace: float = ELASTIC_GRACE

    @property
    def parameter_server(self) -> bool:
        """Whether this is a parameter-server job (`--ps` >= 1)."""
        return self.ps > 0

    @property
    def num_tasks(self) -> int:
        """Processes in the cluster: the ranks, or chief + workers + ps."""
        return 1 + self.nproc + self.ps if self.parameter_server else self.nproc


def check_config(config: LaunchConfig) -> None:
    """Raises `LaunchError` naming the first bad setting and its fix."""
    if config.ps < 0:
        raise LaunchError(f"--ps={config.ps} must be >= 0 (0: no parameter servers).")
    if config.nproc < 1 and config.parameter_server:
        raise LaunchError(
            f"--workers must be >= 1 with --ps, got {config.nproc}; the chief "
            "only coordinates, the worker tasks run the training steps."
        )
    if config.nproc < 1:
        raise LaunchError(f"-n/--nproc must be >= 1, got {config.nproc}.")
    if config.ps_tasks_run_script and not config.parameter_server:
        raise LaunchError(
            "--ps_tasks_run_script needs --ps M (M >= 1); without parameter "
            "servers every rank runs the script anyway."
        )
    if config.parameter_server and config.backend == "horovod":
        raise LaunchError(
            f"--ps={config.ps} works with --backend=tf only (Horovod has no "
            "parameter servers); drop --ps or use --backend=tf."
        )
    if not os.path.isfile(config.script):
        raise LaunchError(
            f"script {config.script!r} not found (cwd {os.getcwd()}); pass the "
            "path of a Python file as the first argument after the flags."
        )
    if not 0 <= config.port_base <= 65535 - config.num_tasks + 1:
        raise LaunchError(
            f"--port_base={config.port_base} leaves no room for {config.num_tasks} "
            "ports; use 0 (free ports) or a base in 1024..60000."
        )
    if config.timeout < 0:
        raise LaunchError(f"--timeout={config.timeout:g} must be >= 0 (0: no limit).")
    if config.tail_lines < 0:
        raise LaunchError(f"--tail_lines={config.tail_lines} must be >= 0.")
    if config.max_restarts < 0:
        raise LaunchError(f"--max_restarts={config.max_restarts} must be >= 0 (0: no restarts).")
    if config.straggler_warning < 0:
        raise LaunchError(
            f"--straggler_warning={config.straggler_warning:g} must be >= 0 (0: no warning)."
        )
    if config.gpus_per_worker < 0:
        raise LaunchError(
            f"--gpus_per_worker={config.gpus_per_worker} must be >= 0 (0: every "
            "rank sees every GPU of its host)."
        )
    if config.stall_warning < 0:
        raise LaunchError(f"--stall_warning={config.stall_warning:g} must be >= 0 (0: no warning).")
    if config.grace_seconds < 0:
        raise LaunchError(f"--grace_seconds={config.grace_seconds:g} must be >= 0.")
    _check_elastic(config)
    if config.max_restarts and config.backend == "horovod" and not config.min_workers:
        raise LaunchError(
            f"--max_restarts={config.max_restarts} works with --backend=tf only "
            "(horovodrun is one child here, its ranks out of the launcher's "
            "reach); drop --max_restarts, use --backend=tf, or add --min_workers "
            "(elastic: horovodrun again on the hosts that answer)."
        )


def _check_elastic(config: LaunchConfig) -> None:
    """The settings of an elastic launch (--min_workers >= 1)."""
    if not config.min_workers:
        return
    if not 1 <= config.min_workers <= config.nproc:
        raise LaunchError(
            f"--min_workers={config.min_workers} must be between 1 and -n "
            f"({config.nproc}), the most workers."
        )
    if config.parameter_server:
        raise LaunchError(
            "--min_workers works with workers only (no --ps: worker tasks are "
            "restarted alone there); drop --min_workers."
        )
    if config.max_restarts < 1:
        raise LaunchError(
            f"--min_workers={config.min_workers} goes on with the workers left "
            "at a restart: give --max_restarts K (K >= 1)."
        )
    if config.elastic_grace < 0:
        raise LaunchError(f"--elastic_grace={config.elastic_grace:g} must be >= 0.")
