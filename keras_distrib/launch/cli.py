"""The `keras-distrib` command: start the workers of a multi-worker job.

Usage:

    keras-distrib launch -n 2 train.py --epochs 3
    python -m keras_distrib.launch launch -n 4 --hosts node1:2,node2:2 train.py
    keras-distrib launch --workers 2 --ps 1 train.py --epochs 3

On one machine, `launch` starts N copies of `python train.py ...`, each
with its own `TF_CONFIG` (all addresses on `--bind`, 127.0.0.1 by default,
free ports), and prints every line they write as `[rank N] line`. A line
redrawn with carriage returns, like Keras's progress bar (printed by rank
0 only), shows as one updating `[rank 0]` line. When a rank fails the
others are stopped and the launcher exits with that rank's exit code,
after the tail of its output (TensorFlow's start-up log lines left out;
a rank stopped with SIGSTOP at that moment is named as the likely cause).
Ctrl-C, SIGTERM or SIGHUP stops them all. Stopping a rank is SIGTERM (and
SIGCONT), then SIGKILL after --grace_seconds. Nothing is left running.
More ranks on this machine than it has CPU cores start anyway, after a
one-line warning.

With `--max_restarts N`, a failed or preempted rank makes the launcher
stop the others and start all ranks again, on new ports, up to N times
(one `restart K/N` line each; the last line says how many were used and,
after a failure, the failed rank's own last line). A
signal to the launcher never restarts. `--timeout` bounds all of it.
With `--min_workers M` as well (elastic), a restart goes on with the hosts
that still answer and leaves out a slot whose rank fails again at once,
as long as M slots are left; a lost host that answers again is taken back
at the job's next backup (one `[launcher] N -> M workers` line each).

Exit codes:

    0         every rank succeeded (with --ps: the chief did)
    CODE      a rank failed with CODE (128+signal when it was killed), no
              restarts left; with --ps: the chief's CODE, or a worker
              task's when its restarts ran out
    1         with --ps: a ps task was lost and the chief still ran 60 s
              later; with --min_workers: fewer slots were left
    75        preempted: a rank exited with 75 and no restarts were left,
              or the launcher got SIGTERM/SIGINT/SIGHUP and every rank then
              exited with 75 or 0 (else 128+signal); horovodrun counts as
              75 when each of its ranks printed that it was preempted
    124       --timeout passed
    2         bad flags or configuration; nothing was started

With `--private_network` (one host), the launcher and its ranks run in a
network namespace of their own that has only loopback: nothing a rank
opens is reachable from another machine.

With `--hosts` naming other machines, nothing is started: the launcher
prints (and with `--output_dir` writes) each rank's `TF_CONFIG` and the
command to run on its host; `--ssh` starts them over ssh instead.

Parameter servers (`--ps M`, M >= 1, for `strategy="parameter_server"`):
the cluster is one `chief`, `--workers N` `worker` tasks and M `ps` tasks,
each with its `TF_CONFIG` `{"cluster": {"chief": [...], "worker": [...],
"ps": [...]}, "task": {"type": ROLE, "index": I}}` (free ports on `--bind`;
with `--hosts`, tasks fill the host slots chief first, then workers, then
ps). Only the chief runs `python train.py ...`: it is the coordinator and
sends the work to the others, which run
`python -m keras_distrib.strategies.parameter_server.task_server` (a bare
TensorFlow server, same interpreter). With `--ps_tasks_run_script` every
task runs the script (Kubeflow style) and the strategy serves on the worker
and ps tasks. Lines are prefixed `[chief] `, `[worker I] `, `[ps I] `.
Without `--ps`, `--workers N` is `-n N`; `--backend horovod` has no `--ps`.

The job ends when the chief exits, with its exit code; then the servers
are stopped. A worker task that exits meanwhile is started again alone,
on the same port with the same `TF_CONFIG` (TensorFlow's coordinator
re-queues its work and reconnects), with one line `[launcher] worker 1
exited (signal 9); restarting it (restart 1)`, up to `--max_restarts`
times over all workers (100 when 0); then the job fails with that
worker's exit code. A ps task that exits is not restarted (its variables
are lost): a `[launcher]` line names it, the chief is expected to fail,
and if it still runs 60 s later the launcher stops all and exits with 1.
Signals, `--timeout` and `--grace_seconds` work as for ranks.

Every child gets these environment variables:

    TF_CONFIG                 {"cluster": {"worker": [...]},
                               "task": {"type": "worker", "index": RANK}}
                              (with --ps: the chief, worker and ps tasks, as above)
    KERAS_DISTRIB_RANK        its rank, 0..N-1 (with --ps: the chief 0, worker
                              I I+1; ps tasks get none)
    KERAS_DISTRIB_WORLD_SIZE  N (with --ps: 1 + --workers; ps tasks get none)
    KERAS_DISTRIB_LOCAL_RANK  its index among the ranks (tasks) on its host
    KERAS_DISTRIB_LOCAL_WORLD_SIZE  the ranks (tasks) on its host
    CUDA_VISIBLE_DEVICES      with several ranks on its host: its own GPUs,
                              --gpus_per_worker of them by local rank (a share
                              of the launcher's CUDA_VISIBLE_DEVICES when set)
    KERAS_DISTRIB_RESTART     how many times the job was restarted before
                              this run (0 on the first; always 0 with --ps);
                              with it set, BackupAndRestore's chief reports
                              each backup in a line the launcher reads and
                              does not print (`keras_distrib: backup saved
                              at step ...`), to name the step a restart
                              goes on from
    KERAS_DISTRIB_SHM_DIR     ranks on this machine only (not with --ps): a private
                              directory (mode 0700, in /dev/shm) for
                              shared-memory files, new for each run and
                              removed when it ends
    PYTHONUNBUFFERED          1, so lines arrive as they are printed
    TF_CPP_MIN_LOG_LEVEL      2, which hides TensorFlow's C++ INFO and WARNING
                              logs (the launcher also drops the banners
                              this leaves, oneDNN and absl), unless the
                              launcher's environment sets it:
                              `TF_CPP_MIN_LOG_LEVEL=0 keras-distrib launch ...`
                              shows them all again

With `--backend horovod` the one child is horovodrun; its own `[N]<stdout>:`
prefixes are replaced by `[rank N] `.

Everything after the script path goes to the script untouched.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence, TextIO

from absl import app
from absl import flags

from keras_distrib import cluster as cluster_lib
from keras_distrib.launch import backends, private_network
from keras_distrib.launch.arguments import USAGE, config_from_flags, split_argv
from keras_distrib.launch.config import (
    DEFAULT_SSH_COMMAND,
    ELASTIC_GRACE,
    GRACE_SECONDS,
    STRAGGLER_WARNING,
    LaunchConfig,
    LaunchError,
    check_config,
)
from keras_distrib.launch.plan import (
    DEFAULT_REMOTE_PORT_BASE,
    check_local_ports,
    plan,
    print_dry_run,
    write_output_dir,
)
from keras_distrib.launch.parameter_server import DEFAULT_WORKER_RESTARTS
from keras_distrib.launch.supervise import ElasticJob, JobKind, supervise

SUBCOMMANDS = ("launch",)
EXIT_USAGE = 2
# absl's own help flags print only main-module flags, which is nothing for
# the console script; these print our usage instead.
_HELP_TOKENS = ("-h", "--help", "-help", "--helpshort", "-?")

FLAGS = flags.FLAGS
flags.DEFINE_integer(
    "nproc",
    None,
    "Number of worker processes (ranks), >= 1. With --ps: the number of worker tasks.",
    short_name="n",
)
flags.DEFINE_integer(
    "workers",
    None,
    "Number of worker tasks; the same as -n (give one of them, or both with the same value).",
)
flags.DEFINE_integer(
    "ps",
    0,
    "Number of parameter-server tasks; >= 1 makes a "
    "parameter-server job: a chief runs the script, the "
    "--workers worker tasks and these ps tasks run "
    "`python -m keras_distrib.strategies.parameter_server.task_server`.",
    lower_bound=0,
)
flags.DEFINE_bool(
    "ps_tasks_run_script",
    False,
    "With --ps: every task (chief, "
    "workers, ps) runs the script, as under Kubeflow; the "
    "strategy then serves on the worker and ps tasks.",
)
flags.DEFINE_list(
    "hosts",
    [],
    "Comma list of host or host:slots. Without slots "
    "-n is split evenly; with slots ranks fill hosts in order. "
    "Default: all ranks on this machine.",
)
flags.DEFINE_integer(
    "port_base",
    0,
    "First port; rank r uses port_base + its "
    "index on its host. 0: free ports on this machine, "
    f"{DEFAULT_REMOTE_PORT_BASE} on remote hosts.",
)
flags.DEFINE_string(
    "bind",
    "127.0.0.1",
    "Address of this machine written into "
    "TF_CONFIG for local ranks. Note that TensorFlow's gRPC "
    "server listens on all interfaces whatever this says.",
)
flags.DEFINE_enum(
    "backend",
    "tf",
    ["tf", "horovod"],
    "tf: TF_CONFIG workers; horovod: delegate to horovodrun (needs Horovod installed).",
)
flags.DEFINE_string(
    "output_dir",
    None,
    "Write each rank's TF_CONFIG "
    "(rank-R.tf_config.json) and each host's commands "
    "(host-H.sh) here.",
)
flags.DEFINE_bool("ssh", False, "Start ranks on remote hosts with ssh.")
flags.DEFINE_string(
    "ssh_command",
    DEFAULT_SSH_COMMAND,
    "ssh program and options used with --ssh; the host and command are appended.",
)
flags.DEFINE_float(
    "timeout",
    0,
    "Stop all ranks after this many seconds, restarts included (exit code 124); 0: no limit.",
)
flags.DEFINE_integer(
    "tail_lines", 40, "Lines of a failed rank's output repeated in the failure summary."
)
flags.DEFINE_integer(
    "max_restarts",
    0,
    "When a rank fails or is preempted, "
    "stop the others and start all ranks again (new ports, "
    "KERAS_DISTRIB_RESTART counting up), at most this many "
    "times (with --backend=horovod: with --min_workers). With --ps: how many "
    "times, over all worker tasks, an exited worker task is "
    f"started again alone (0: up to {DEFAULT_WORKER_RESTARTS}).",
    lower_bound=0,
)
flags.DEFINE_integer(
    "min_workers",
    0,
    "Elastic: at a restart, go on with the slots "
    "(hosts, or processes on this machine) that still answer, as long as at "
    "least this many are left (-n is the most); a lost host that answers "
    "again is taken back at the job's next backup. Needs --max_restarts. "
    "0: every restart starts all -n ranks.",
    lower_bound=0,
)
flags.DEFINE_float(
    "elastic_grace",
    ELASTIC_GRACE,
    "With --min_workers: a slot whose rank "
    "fails again within this many seconds of its attempt's start is left "
    "out.",
    lower_bound=0,
)
flags.DEFINE_float(
    "grace_seconds",
    GRACE_SECONDS,
    "Seconds a rank gets to "
    "exit after SIGTERM (time for the chief to write a backup) "
    "before SIGKILL.",
    lower_bound=0,
)
flags.DEFINE_integer(
    "gpus_per_worker",
    1,
    "GPUs each rank of a host gets: rank r of "
    "its host sees GPUs r*K..r*K+K-1 (CUDA_VISIBLE_DEVICES; a share of "
    "this machine's CUDA_VISIBLE_DEVICES when it is set). 0: every rank sees "
    "every GPU. One rank per host keeps all its GPUs.",
)
flags.DEFINE_float(
    "stall_warning",
    0.0,
    "When no rank has finished a training step for "
    "this many seconds (once training began), print every rank's step, the "
    "collective it waits in and its stacks (the flight recorder's screen); "
    "the job goes on. 0: never.",
)
flags.DEFINE_bool(
    "private_network",
    False,
    "One-host jobs: run the launcher and its "
    "ranks in a network namespace of their own with loopback only, so that "
    "nothing a rank opens (TensorFlow's servers listen on all interfaces) is "
    "reachable from another machine. Needs root or unprivileged user "
    "namespaces; the ranks then have no network beyond loopback.",
)
flags.DEFINE_float(
    "straggler_warning",
    STRAGGLER_WARNING,
    "When a rank exits 0 and others "
    "still run this many seconds later, say which (a rank waiting for the "
    "finished one in a collective waits until its collective timeout); "
    "the launcher keeps waiting. 0: never.",
)


# --------------------------------------------------------------------------
# Command line (read in `keras_distrib.launch.arguments`)


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl `flags_parser`: parses the launcher's flags, keeps the script's.

    Returns `[prog, subcommand, script, *script_args]` (shorter when parts
    are missing). A bad flag prints one line and exits with status 2.
    """
    head, tail = split_argv(argv)
    if any(token in _HELP_TOKENS for token in head[1:]):
        print(usage())
        sys.exit(0)
    try:
        rest = FLAGS(head)
    except flags.Error as e:
        _print_error(f"{e}; see `keras-distrib launch --help`.")
        sys.exit(EXIT_USAGE)
    return list(rest) + tail


def usage() -> str:
    """This module's docstring and its flags, for `--help`."""
    module = sys.modules[__name__]
    return f"{__doc__.strip()}\n\nFlags of `launch`:\n{FLAGS.module_help(module)}"


# --------------------------------------------------------------------------
# Entry points


def launch(config: LaunchConfig, out: Optional[TextIO] = None, err: Optional[TextIO] = None) -> int:
    """Runs (or, for remote hosts without --ssh, prints) the job; returns the exit code.

    Raises:
        LaunchError: bad configuration; nothing was started.

    Example:

    ```python
    code = launch(LaunchConfig(nproc=2, script="train.py"))
    ```
    """
    out, err = out or sys.stdout, err or sys.stderr
    check_config(config)
    if config.backend == "horovod":
        job: JobKind = backends.horovod_job(config)  # fails now when Horovod is missing
        if config.min_workers:
            return supervise(ElasticJob(config), config, out, err).exit_code
        if not config.hosts:
            warn_if_oversubscribed(config.nproc, err)
        return supervise(job, config, out, err).exit_code
    plans = plan(config)
    if config.output_dir:
        write_output_dir(plans, config)
    remote = [p for p in plans if not p.local]
    if remote and not config.ssh:
        print_dry_run(plans, config, out)
        return 0
    check_local_ports(plans, config)
    if config.min_workers:
        warn_if_oversubscribed(sum(p.local for p in plans), err)
        return supervise(ElasticJob(config), config, out, err).exit_code
    if config.parameter_server:
        # The ps tasks mostly wait on the network; the chief and workers compute.
        training = sum(p.local and p.info.is_training_task for p in plans)
        warn_if_oversubscribed(training, err, unit="training task")
        job = backends.parameter_server_job(plans, config)
    else:
        warn_if_oversubscribed(sum(p.local for p in plans), err)
        job = backends.rank_job(plans, config)
    return supervise(job, config, out, err).exit_code


def warn_if_oversubscribed(local_ranks: int, err: TextIO, unit: str = "rank") -> None:
    """One line on `err` when this machine gets more ranks than CPU cores.

    Not an error (it works, slowly): each rank runs a whole TensorFlow
    runtime, and ranks sharing cores mostly wait for each other.
    """
    cores = os.cpu_count()
    if cores and local_ranks > cores:
        flag = "--workers" if unit != "rank" else "-n"
        err.write(
            f"keras-distrib: warning: {local_ranks} {unit}s on this machine, which has "
            f"{cores} CPU cores; they will compete for the cores and train slowly "
            f"(lower {flag}, or spread the {unit}s with --hosts).\n"
        )
        err.flush()


def main(argv: Sequence[str]) -> int:
    """Dispatches `argv = [prog, subcommand, script, *args]` (flags already parsed).

    Example:

    ```python
    app.run(main, flags_parser=parse_flags)
    ```
    """
    if len(argv) < 2:
        _print_error(f"missing subcommand; usage: {USAGE}")
        return EXIT_USAGE
    if argv[1] not in SUBCOMMANDS:
        _print_error(
            f"unknown subcommand {argv[1]!r}; valid subcommands: {', '.join(SUBCOMMANDS)}."
        )
        return EXIT_USAGE
    try:
        config = config_from_flags(argv[2:])
        if FLAGS.private_network:
            private_network.check(config)
            if not private_network.inside():
                private_network.enter(sys.argv)  # this launcher again, in the namespace
            private_network.loopback_up()
        return launch(config)
    except (LaunchError, cluster_lib.ClusterConfigError) as e:
        _print_error(str(e))
        return EXIT_USAGE


def run() -> None:
    """Console entry point of `keras-distrib`."""
    app.run(main, flags_parser=parse_flags)


def _print_error(message: str) -> None:
    print(f"keras-distrib: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
