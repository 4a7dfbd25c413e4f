"""The `keras-distrib` launcher: start the workers of a multi-worker job.

The command's user documentation is `keras_distrib.launch.cli`'s docstring
(what `keras-distrib launch --help` prints). One concern per module:

    cli         the command line: absl flags, `main`, `run`, and
                `launch(config)`, which ties the modules below together
    arguments   the command line read: argv split between the launcher and
                the script, the parsed flags as a `LaunchConfig`
    config      `LaunchConfig`, `check_config`, `LaunchError`
    plan        who runs where: hosts, ports, TF_CONFIG, dry run, --output_dir;
                the roles of a parameter-server job (--ps)
    backends    how a rank or job is started: local, ssh, horovodrun; the
                `Job` (or `ParameterServerJob`) that `supervise` runs
    supervise   `supervise(job, config, out, err)`: runs a job, from the
                modules below, and re-exports their public names
    agent       the one loop every job runs in: each attempt started,
                monitored and stopped, then the job's kind (`JobKind`: `Job`,
                `ParameterServerJob`, `ElasticJob`) decides what follows;
                each attempt's private directory
    output      the children's output prefixed (`[label] `, `[rank N] `),
                progress bars redrawn in place; the launcher's own lines
    processes   `ChildSpec`; starting a child in its own process group,
                trapping signals, stopping the children
    endings     how an attempt ended and the exit code; stopping the rest,
                the failed child's tail
    restarts    `Job`: all its ranks again after a failure, the restart
                policy (--max_restarts)
    parameter_server  `ParameterServerJob` (--ps): until the chief exits,
                worker tasks restarted alone, lost ps tasks
    elastic     `ElasticJob` (--min_workers): attempts on the slots that
                answer, hosts lost and taken back

What the launcher and its workers agree on (exit code `PREEMPTED`, the
`KERAS_DISTRIB_RESTART` and `KERAS_DISTRIB_SHM_DIR` variables) is in
`keras_distrib.cluster.launch_contract`.

This package never imports TensorFlow or Keras (only `keras_distrib.cluster`,
`keras_distrib.cluster.launch_contract`, the standard library and absl; and, once
ranks run on this machine, the NumPy-only `keras_distrib.collectives.host_allreduce`
for its shared-memory directory), so the launcher starts in a fraction of a
second; tests/unit/test_launch_options.py checks that.

The functions `plan` and `supervise` re-exported here share their names
with the modules that define them, so `keras_distrib.launch.plan` is the
function; reach the modules with `from keras_distrib.launch.plan import ...`
or `importlib.import_module("keras_distrib.launch.plan")`.

Example:

```python
from keras_distrib import launch

code = launch.launch(launch.LaunchConfig(nproc=2, script="train.py", max_restarts=3))
```
"""

from keras_distrib.launch.config import (
    DEFAULT_SSH_COMMAND,
    GRACE_SECONDS,
    LaunchConfig,
    LaunchError,
    check_config,
)
from keras_distrib.launch.plan import (
    DEFAULT_REMOTE_PORT_BASE,
    RankPlan,
    parse_hosts,
    plan,
    print_dry_run,
    shell_command,
    task_argv,
    write_output_dir,
)
from keras_distrib.launch.supervise import (
    EXIT_TIMEOUT,
    PREEMPTED,
    ChildExit,
    ChildSpec,
    Ending,
    Job,
    ParameterServerJob,
    SuperviseResult,
    exit_code,
    private_directory,
    supervise,
)
from keras_distrib.launch.arguments import USAGE, config_from_flags, split_argv
from keras_distrib.launch.cli import EXIT_USAGE, SUBCOMMANDS, launch, main, parse_flags, run, usage

__all__ = [
    "ChildExit",
    "ChildSpec",
    "DEFAULT_REMOTE_PORT_BASE",
    "DEFAULT_SSH_COMMAND",
    "EXIT_TIMEOUT",
    "EXIT_USAGE",
    "Ending",
    "GRACE_SECONDS",
    "Job",
    "LaunchConfig",
    "LaunchError",
    "PREEMPTED",
    "ParameterServerJob",
    "RankPlan",
    "SUBCOMMANDS",
    "SuperviseResult",
    "USAGE",
    "check_config",
    "config_from_flags",
    "exit_code",
    "launch",
    "main",
    "parse_flags",
    "parse_hosts",
    "plan",
    "print_dry_run",
    "private_directory",
    "run",
    "shell_command",
    "split_argv",
    "supervise",
    "task_argv",
    "usage",
    "write_output_dir",
]
