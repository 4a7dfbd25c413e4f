"""Starting and watching the children of a launch, and restarting them.

`supervise(job, config, out, err)` starts one process per `ChildSpec` of
the job's attempt, prints each line it writes as `[label] line`, waits
until the attempt ends and then makes sure nothing of it is left running.
When a child fails (exits non-zero, `PREEMPTED` included, or is killed by
a signal) and `config.max_restarts` allows, all the others are stopped and
the job starts again, as a new attempt (`Job.specs(restart, shm_dir)`: new
ports, `KERAS_DISTRIB_RESTART`). How the job ended (all succeeded, which
child failed and how, the launcher was interrupted, the timeout hit) comes
back as a `SuperviseResult`; its `exit_code` is the launcher's.

The job object is its own kind (`agent.JobKind`): the hooks through which
the one loop of `keras_distrib.launch.agent` starts, monitors and stops
each attempt and decides what follows it.

One concern per module; this one holds `supervise` and re-exports the
names the launcher's other modules and its users take from here:

    agent             the loop: attempts started, monitored and stopped, the
                      job's kind deciding what follows each; each attempt's
                      private directory
    output            the children's output as `[label] ` lines, progress bars
                      redrawn in place, horovodrun's ranks demultiplexed,
                      TensorFlow's start-up noise left out; the launcher's own lines
    processes         `ChildSpec`, starting a child in its own process group,
                      signals to the launcher trapped, stopping the children
                      (SIGTERM, SIGCONT, the grace period, SIGKILL)
    endings           how an attempt ended (`Ending`, `ChildExit`,
                      `SuperviseResult`, exit codes), stopping the rest, saying why
    restarts          `Job`, a fixed job: all its ranks again after a failure,
                      under the restart policy (--max_restarts)
    parameter_server  `ParameterServerJob`: one attempt until the chief exits,
                      worker tasks restarted alone, lost ps tasks
    elastic           `ElasticJob` (--min_workers): attempts on the slots that
                      can train, hosts lost and taken back (`reachability`: the
                      probe of a host; `blame`: whom a failed attempt is charged to)
    flight            the ranks' flight-recorder accounts as one screen (on a
                      stall, at --timeout, on SIGUSR1)
"""

from __future__ import annotations

import os
import time
from typing import Sequence, TextIO, Union

from keras_distrib.cluster.launch_contract import PREEMPTED
from keras_distrib.launch import agent
from keras_distrib.launch.agent import JobKind, private_directory
from keras_distrib.launch.config import LaunchConfig
from keras_distrib.launch.endings import EXIT_TIMEOUT, ChildExit, Ending, SuperviseResult, exit_code
from keras_distrib.launch.elastic import ElasticJob
from keras_distrib.launch.output import TF_LOG_NOISE, Printer, is_tf_log_noise
from keras_distrib.launch.parameter_server import DEFAULT_WORKER_RESTARTS, ParameterServerJob
from keras_distrib.launch.processes import ChildSpec
from keras_distrib.launch.restarts import Job

__all__ = [
    "ChildExit",
    "ChildSpec",
    "DEFAULT_WORKER_RESTARTS",
    "EXIT_TIMEOUT",
    "ElasticJob",
    "Ending",
    "Job",
    "JobKind",
    "PREEMPTED",
    "ParameterServerJob",
    "SuperviseResult",
    "TF_LOG_NOISE",
    "exit_code",
    "is_tf_log_noise",
    "private_directory",
    "supervise",
]


def supervise(
    job: Union[JobKind, Sequence[ChildSpec]], config: LaunchConfig, out: TextIO, err: TextIO
) -> SuperviseResult:
    """Runs the job's attempts, streams their lines, and returns how the job ended.

    `job`: a `Job`, `ParameterServerJob` or `ElasticJob` (its kind decides
    what follows each attempt), or a list of `ChildSpec`s (a `Job`, the
    same on every attempt). A failed attempt of a `Job` is followed by
    another while `config.max_restarts` allows, the launcher was not
    signalled and `config.timeout` (which bounds all attempts together)
    has not passed. A `ParameterServerJob` runs once, until its chief
    exits (see `keras_distrib.launch.parameter_server`); an `ElasticJob`
    goes on with the slots that answer (`keras_distrib.launch.elastic`).

    The result's `exit_code` is 0 when all succeed; the last failed
    child's code (128+signal when killed; `PREEMPTED` when it was
    preempted); after SIGINT/SIGTERM/SIGHUP to the launcher, `PREEMPTED`
    when every child exited with it or 0, else 128+signal; 124 on timeout.
    Every child's process group is killed and the attempt's private
    directory removed on the way out of each attempt, whatever happens.

    Raises:
        LaunchError: a child could not be started (those already started
            are killed).
    """
    # The banners TF_CPP_MIN_LOG_LEVEL=2 does not silence are left out too,
    # unless the user set the level (then they see what they asked for).
    printer = Printer(out, hide_tf_noise="TF_CPP_MIN_LOG_LEVEL" not in os.environ)
    deadline = time.monotonic() + config.timeout if config.timeout > 0 else None
    kind = job if isinstance(job, JobKind) else Job.of(job)
    return agent.run(kind, config, printer, deadline, err)
