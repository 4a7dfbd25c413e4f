"""A parameter-server job under the launcher: one attempt, worker tasks restarted alone.

A `ParameterServerJob` (a chief, worker and ps tasks) is supervised in one
attempt (`supervise_parameter_server`): the job ends when the chief exits,
with its exit code, and then the servers are stopped. A worker task that
exits meanwhile is started again at once, alone, with the same argv and
environment (the same port): it is stateless, and TensorFlow's
coordinator re-queues its work and reconnects when it is back; at most
`--max_restarts` times over all workers (`DEFAULT_WORKER_RESTARTS` when
that is 0). A ps task that exits is not (its variables are gone): the
chief is expected to fail, and if it still runs `PS_LOSS_GRACE_SECONDS`
later the launcher stops everything and exits with 1. Those events are
one `[launcher] ...` line each on `err`.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from typing import Optional, TextIO

from keras_distrib.launch.config import LaunchConfig
from keras_distrib.launch.endings import EXIT_TIMEOUT, ChildExit, Ending, SuperviseResult, end
from keras_distrib.launch.output import Printer, note
from keras_distrib.launch.processes import Child, ChildSpec, SignalTrap, start, stop


@dataclasses.dataclass(frozen=True)
class ParameterServerJob:
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

    def __len__(self) -> int:
        return 1 + len(self.workers) + len(self.ps)

    @property
    def specs(self) -> list[ChildSpec]:
        """Every task's spec: the chief, the workers, the ps tasks."""
        return [self.chief, *self.workers, *self.ps]


# Restarts of worker tasks in a parameter-server job when --max_restarts
# is 0: a worker lost now and then (preempted VMs) is routine there, but a
# worker that fails at every start should end the job some time.
DEFAULT_WORKER_RESTARTS = 100

# Seconds the chief of a parameter-server job gets to exit by itself after a
# ps task was lost (its coordinator then fails within seconds) before the
# launcher stops the job with exit code 1.
PS_LOSS_GRACE_SECONDS = 60.0


def supervise_parameter_server(job: ParameterServerJob, config: LaunchConfig,
                               printer: Printer, deadline: Optional[float],
                               err: TextIO) -> SuperviseResult:
    """Runs a parameter-server job until its chief exits (module docstring).

    Nothing of it outlives this call, replaced worker tasks included.
    """
    specs = job.specs
    children: list[Optional[Child]] = [None] * len(specs)
    replaced: list[Child] = []  # worker tasks that exited and were started again
    with SignalTrap() as trap:
        try:
            # The servers first: the chief connects to them as soon as it can.
            for i in [*range(1, len(specs)), 0]:
                children[i] = start(specs[i], config.tail_lines, printer)
            result = _watch_parameter_server(job, children, replaced, config, trap,
                                             deadline, printer, err)
            if result.ending is Ending.SUCCEEDED:  # the servers' work is done
                stop(children, trap, config.grace_seconds)
            return end(result, children, config, trap, printer, err, unit="task")
        finally:
            running = [c for c in children if c is not None]
            for child in running:
                child.signal_group(signal.SIGKILL)
            for child in running + replaced:
                child.proc.wait()
                child.reader.join(timeout=5)
            printer.end_line()


def _watch_parameter_server(job: ParameterServerJob, children: list[Child],
                            replaced: list[Child], config: LaunchConfig,
                            trap: SignalTrap, deadline: Optional[float],
                            printer: Printer, err: TextIO) -> SuperviseResult:
    """Waits until the chief exits (or a signal, the timeout, a lost cause);
    meanwhile starts exited worker tasks again and notes lost ps tasks."""
    specs = job.specs
    workers = range(1, 1 + len(job.workers))
    ps_tasks = range(1 + len(job.workers), len(specs))
    limit = config.max_restarts or DEFAULT_WORKER_RESTARTS
    restarts = 0
    lost_ps: list[tuple[float, ChildExit]] = []  # (when it was seen, how it ended)
    while True:
        if trap.received:
            signum = trap.received[0]
            return SuperviseResult(Ending.INTERRUPTED, 128 + signum, signum=signum,
                                   restarts=restarts)
        chief = children[0]
        if chief.proc.poll() is not None:
            if chief.proc.returncode == 0:
                return SuperviseResult(Ending.SUCCEEDED, 0, restarts=restarts)
            how = ChildExit(0, chief.label, chief.proc.returncode)
            return SuperviseResult(Ending.CHILD_FAILED, how.exit_code, failed=how,
                                   restarts=restarts)
        if deadline is not None and time.monotonic() >= deadline:
            return SuperviseResult(Ending.TIMED_OUT, EXIT_TIMEOUT, restarts=restarts)
        for i in workers:
            child = children[i]
            if child.proc.poll() is None:
                continue
            how = ChildExit(i, child.label, child.proc.returncode)
            if restarts >= limit:
                flag = (f"--max_restarts={config.max_restarts}" if config.max_restarts
                        else f"{DEFAULT_WORKER_RESTARTS} when --max_restarts is 0")
                note(printer, err, f"{child.label} exited ({_short(how)}); no restarts "
                                   f"left ({restarts} used, at most {flag}); stopping the job.")
                return SuperviseResult(Ending.CHILD_FAILED, how.exit_code, failed=how,
                                       restarts=restarts)
            restarts += 1
            note(printer, err, f"{child.label} exited ({_short(how)}); "
                               f"restarting it (restart {restarts})")
            child.signal_group(signal.SIGKILL)  # whatever it started in its group
            replaced.append(child)
            children[i] = start(specs[i], config.tail_lines, printer)
        for i in ps_tasks:
            child = children[i]
            if child.proc.poll() is None or any(h.index == i for _, h in lost_ps):
                continue
            how = ChildExit(i, child.label, child.proc.returncode)
            lost_ps.append((time.monotonic(), how))
            note(printer, err, f"{child.label} exited ({_short(how)}); not restarting it "
                               "(its variables are lost); the chief should fail, else it is "
                               f"stopped in {PS_LOSS_GRACE_SECONDS:g}s.")
        if lost_ps and time.monotonic() - lost_ps[0][0] >= PS_LOSS_GRACE_SECONDS:
            how = lost_ps[0][1]
            note(printer, err, f"the chief still runs {PS_LOSS_GRACE_SECONDS:g}s after "
                               f"{how.label} was lost; stopping the job (exit code 1).")
            return SuperviseResult(Ending.CHILD_FAILED, 1, failed=how, restarts=restarts)
        time.sleep(0.05)


def _short(how: ChildExit) -> str:
    """`signal 9` or `exit code 3`, for the one-line `[launcher]` notes."""
    if how.returncode < 0:
        return f"signal {-how.returncode}"
    return f"exit code {how.returncode}"
