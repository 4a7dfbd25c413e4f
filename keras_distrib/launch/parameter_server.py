"""A parameter-server job under the launcher: one attempt, worker tasks restarted alone.

A `ParameterServerJob` (a chief, worker and ps tasks) runs as one attempt
of the launcher's agent (`keras_distrib.launch.agent`, whose hooks it
implements): the job ends when the chief exits, with its exit code, and
then the servers are stopped. A worker task that exits meanwhile is
started again at once, alone, with the same argv and environment (the same
port): it is stateless, and TensorFlow's coordinator re-queues its work
and reconnects when it is back; at most `--max_restarts` times over all
workers (`DEFAULT_WORKER_RESTARTS` when that is 0). A ps task that exits
is not (its variables are gone): the chief is expected to fail, and if it
still runs `PS_LOSS_GRACE_SECONDS` later the launcher stops everything and
exits with 1. Those events are one `[launcher] ...` line each on `err`.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from typing import Optional, Sequence

from keras_distrib.launch import processes
from keras_distrib.launch.agent import Agent, Attempt, JobKind
from keras_distrib.launch.endings import EXIT_TIMEOUT, ChildExit, Ending, SuperviseResult
from keras_distrib.launch.output import note
from keras_distrib.launch.processes import ChildSpec


@dataclasses.dataclass(frozen=True)
class ParameterServerJob(JobKind):
    """The tasks of a parameter-server job, each one child, by role.

    The chief runs the script; the worker and ps tasks run TensorFlow
    servers (or the script, which then serves). `supervise` watches such
    a job as the module docstring says: no whole-job restarts, worker
    tasks restarted alone. Labels are `chief`, `worker I`, `ps I`.

    Example:

    ```python
    job = ParameterServerJob(ChildSpec("chief", chief_argv, env0),
                             (ChildSpec("worker 0", server_argv, env1),),
                             (ChildSpec("ps 0", server_argv, env2),))
    ```
    """

    chief: ChildSpec
    workers: tuple[ChildSpec, ...]
    ps: tuple[ChildSpec, ...]

    unit = "task"

    def __len__(self) -> int:
        return 1 + len(self.workers) + len(self.ps)

    @property
    def specs(self) -> list[ChildSpec]:
        """Every task's spec: the chief, the workers, the ps tasks."""
        return [self.chief, *self.workers, *self.ps]

    def first_attempt(self, agent: Agent) -> Attempt:
        """The job's one attempt."""
        return Attempt(0, lambda shm_dir: self.specs)

    def start(self, attempt: Attempt, specs: Sequence[ChildSpec], agent: Agent) -> None:
        """The servers first: the chief connects to them as soon as it can."""
        attempt.children = []
        for spec in specs[1:]:
            attempt.children.append(agent.start_child(spec))
        attempt.children.insert(0, agent.start_child(specs[0]))

    def monitor(self, attempt: Attempt, agent: Agent) -> SuperviseResult:
        return _watch_parameter_server(self, attempt, agent)

    def stop(self, attempt: Attempt, result: SuperviseResult, agent: Agent) -> SuperviseResult:
        if result.ending is Ending.SUCCEEDED:  # the servers' work is done
            processes.stop(attempt.children, agent.trap, agent.config.grace_seconds)
        return super().stop(attempt, result, agent)

    def next_attempt(
        self, attempt: Attempt, result: SuperviseResult, agent: Agent
    ) -> SuperviseResult:
        """How the job ended: it has one attempt."""
        return result


# Restarts of worker tasks in a parameter-server job when --max_restarts
# is 0: a worker lost now and then (preempted VMs) is routine there, but a
# worker that fails at every start should end the job some time.
DEFAULT_WORKER_RESTARTS = 100

# Seconds the chief of a parameter-server job gets to exit by itself after a
# ps task was lost (its coordinator then fails within seconds) before the
# launcher stops the job with exit code 1.
PS_LOSS_GRACE_SECONDS = 60.0


def _watch_parameter_server(
    job: ParameterServerJob, attempt: Attempt, agent: Agent
) -> SuperviseResult:
    """Waits until the chief exits (or a signal, the timeout, a lost cause);
    meanwhile starts exited worker tasks again and notes lost ps tasks."""
    children = attempt.children
    trap, deadline, printer, err = agent.trap, agent.deadline, agent.printer, agent.err
    restarts = 0
    lost_ps: list[tuple[float, ChildExit]] = []  # (when it was seen, how it ended)
    while True:
        if trap.received:
            signum = trap.received[0]
            return SuperviseResult(
                Ending.INTERRUPTED, 128 + signum, signum=signum, restarts=restarts
            )
        chief = children[0]
        if chief.proc.poll() is not None:
            if chief.proc.returncode == 0:
                return SuperviseResult(Ending.SUCCEEDED, 0, restarts=restarts)
            how = ChildExit(0, chief.label, chief.proc.returncode)
            return SuperviseResult(
                Ending.CHILD_FAILED, how.exit_code, failed=how, restarts=restarts
            )
        if deadline is not None and time.monotonic() >= deadline:
            return SuperviseResult(Ending.TIMED_OUT, EXIT_TIMEOUT, restarts=restarts)
        restarts, ended = _restart_exited_workers(job, attempt, agent, restarts)
        if ended is not None:
            return ended
        _note_lost_ps(job, attempt, agent, lost_ps)
        if lost_ps and time.monotonic() - lost_ps[0][0] >= PS_LOSS_GRACE_SECONDS:
            how = lost_ps[0][1]
            note(
                printer,
                err,
                f"the chief still runs {PS_LOSS_GRACE_SECONDS:g}s after "
                f"{how.label} was lost; stopping the job (exit code 1).",
            )
            return SuperviseResult(Ending.CHILD_FAILED, 1, failed=how, restarts=restarts)
        time.sleep(0.05)


def _restart_exited_workers(
    job: ParameterServerJob, attempt: Attempt, agent: Agent, restarts: int
) -> tuple[int, Optional[SuperviseResult]]:
    """Starts each worker task that exited again, alone, with its spec.

    `restarts`: the restarts used so far; returns them, then the job's end
    (the exited worker's failure) when a worker exited with none left, else
    None.
    """
    specs, children, config = job.specs, attempt.children, agent.config
    printer, err = agent.printer, agent.err
    limit = config.max_restarts or DEFAULT_WORKER_RESTARTS
    for i in range(1, 1 + len(job.workers)):
        child = children[i]
        if child.proc.poll() is None:
            continue
        how = ChildExit(i, child.label, child.proc.returncode)
        if restarts >= limit:
            flag = (
                f"--max_restarts={config.max_restarts}"
                if config.max_restarts
                else f"{DEFAULT_WORKER_RESTARTS} when --max_restarts is 0"
            )
            note(
                printer,
                err,
                f"{child.label} exited ({_short(how)}); no restarts "
                f"left ({restarts} used, at most {flag}); stopping the job.",
            )
            return restarts, SuperviseResult(
                Ending.CHILD_FAILED, how.exit_code, failed=how, restarts=restarts
            )
        restarts += 1
        note(
            printer,
            err,
            f"{child.label} exited ({_short(how)}); restarting it (restart {restarts})",
        )
        child.signal_group(signal.SIGKILL)  # whatever it started in its group
        attempt.replaced.append(child)
        children[i] = agent.start_child(specs[i])
    return restarts, None


def _note_lost_ps(
    job: ParameterServerJob, attempt: Attempt, agent: Agent, lost_ps: list[tuple[float, ChildExit]]
) -> None:
    """Adds each ps task that exited since the last look to `lost_ps` (when
    it was seen, how it ended), with one line: it is not restarted."""
    children = attempt.children
    for i in range(1 + len(job.workers), len(job.specs)):
        child = children[i]
        if child.proc.poll() is None or any(h.index == i for _, h in lost_ps):
            continue
        how = ChildExit(i, child.label, child.proc.returncode)
        lost_ps.append((time.monotonic(), how))
        note(
            agent.printer,
            agent.err,
            f"{child.label} exited ({_short(how)}); not restarting it "
            "(its variables are lost); the chief should fail, else it is "
            f"stopped in {PS_LOSS_GRACE_SECONDS:g}s.",
        )


def _short(how: ChildExit) -> str:
    """`signal 9` or `exit code 3`, for the one-line `[launcher]` notes."""
    if how.returncode < 0:
        return f"signal {-how.returncode}"
    return f"exit code {how.returncode}"
