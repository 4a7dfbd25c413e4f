"""A fixed job (`Job`) and the policy that restarts it.

Every attempt of a `Job` runs all of its children, from `Job.specs(restart,
shm_dir)` (new ports on each attempt, `KERAS_DISTRIB_RESTART`). When a
child fails (exits non-zero, `PREEMPTED` included, or is killed by a
signal) and `config.max_restarts` allows, the others are stopped and the
job starts again (`should_restart`); a signal to the launcher or the
timeout (which bounds all attempts together) ends it for good. The
attempts themselves are run by `keras_distrib.launch.agent`, whose hooks
`Job` implements; `should_restart`, `finish` and `from_backup` serve the
elastic jobs too.

Each attempt with children on this host gets a private directory (mode
0700, in /dev/shm when there is one: `agent.private_directory`) for the
workers' shared-memory files, removed when the attempt ends, whatever way.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Optional, Sequence, TextIO, Union

from keras_distrib.launch.agent import Agent, Attempt, JobKind
from keras_distrib.launch.config import LaunchConfig
from keras_distrib.launch.endings import Ending, SuperviseResult
from keras_distrib.launch.output import Printer, say
from keras_distrib.launch.processes import ChildSpec, SignalTrap, signal_name


@dataclasses.dataclass(frozen=True)
class Job(JobKind):
    """What `supervise` starts on every attempt of a job.

    `specs(restart, shm_dir)` gives the children of one attempt: `restart`
    counts the restarts before it (0: the first run), `shm_dir` is the
    attempt's private directory when `private_dir` asks for one (else
    None), for the children on this host. It is called again on each
    restart, so that an attempt can get new ports. `len(job)` is the
    number of children per attempt, as for a list of specs.

    Example:

    ```python
    job = Job(2, lambda restart, shm_dir: [ChildSpec(f"rank {r}", argv, {}) for r in range(2)])
    ```
    """

    size: int
    specs: Callable[[int, Optional[str]], Sequence[ChildSpec]]
    private_dir: bool = False

    def __len__(self) -> int:
        return self.size

    @classmethod
    def of(cls, specs: Sequence[ChildSpec]) -> "Job":
        """The same children on every attempt, without a private directory."""
        specs = list(specs)
        return cls(len(specs), lambda restart, shm_dir: specs)

    def attempt(self, restart: int) -> Attempt:
        """The attempt after `restart` restarts."""
        return Attempt(
            restart, functools.partial(self.specs, restart), self.private_dir, restarts=restart
        )

    def first_attempt(self, agent: Agent) -> Attempt:
        return self.attempt(0)

    def next_attempt(
        self, attempt: Attempt, result: SuperviseResult, agent: Agent
    ) -> Union[Attempt, SuperviseResult]:
        """All children again while the restart policy allows; says why a
        failed attempt is not followed by another when restarts are left,
        and, under --max_restarts, sums the job up in one last line."""
        restarts = attempt.restarts
        if not should_restart(result, restarts, agent):
            return finish(result, restarts, len(self), agent)
        restarts += 1
        assert result.failed is not None  # should_restart: a CHILD_FAILED result
        say(
            agent.err,
            f"restart {restarts}/{agent.config.max_restarts}: "
            f"{result.failed.outcome()}; starting all {len(self)} ranks again"
            f"{from_backup(agent.printer, ', from the last backup', unknown='')}.",
        )
        return self.attempt(restarts)


def run_attempt(
    job: Job,
    restart: int,
    config: LaunchConfig,
    trap: SignalTrap,
    deadline: Optional[float],
    printer: Printer,
    err: TextIO,
    resize: Callable[[], bool] = lambda: False,
) -> SuperviseResult:
    """One attempt of `job`, outside a run of its attempts
    (`agent.Agent.run_attempt`); nothing of it outlives this call.
    `resize`: see `endings.watch`."""
    attempt = job.attempt(restart)
    attempt.resize = resize
    return Agent(config, printer, err, trap, deadline).run_attempt(job, attempt)


def from_backup(printer: Printer, which: str, unknown: Optional[str] = None) -> str:
    """`which` and the step of the job's last backup, as its chief reported
    it (`launch_contract.BACKUP_LINE`): `the last backup, step 12 (epoch 2,
    step 4)`; `unknown` (default: `which` alone) when it reported none."""
    if printer.backup_point is None:
        return which if unknown is None else unknown
    return f"{which}, {printer.backup_point}"


def finish(result: SuperviseResult, restarts: int, size: int, agent: Agent) -> SuperviseResult:
    """The job's last attempt `result` with the restarts used; says why no
    restart followed a failure when restarts were left, and, under
    --max_restarts, sums the job up in one last line."""
    config, err = agent.config, agent.err
    result = dataclasses.replace(result, restarts=restarts)
    if result.ending is Ending.CHILD_FAILED and restarts < config.max_restarts:
        why = (
            f"got {signal_name(agent.trap.received[0])}"
            if agent.trap.received
            else f"--timeout={config.timeout:g}s has passed"
        )
        say(err, f"no restart: {why}.")
    if config.max_restarts:
        _summarize(result, size, config, err)
    return result


def should_restart(result: SuperviseResult, restarts: int, agent: Agent) -> bool:
    """The restart policy: a failed child, restarts left, time left, no signal."""
    return (
        result.ending is Ending.CHILD_FAILED
        and restarts < agent.config.max_restarts
        and not agent.trap.received
        and (agent.deadline is None or time.monotonic() < agent.deadline)
    )


def _summarize(result: SuperviseResult, size: int, config: LaunchConfig, err: TextIO) -> None:
    """The last line under --max_restarts: how the job ended, restarts used."""
    if result.ending is Ending.SUCCEEDED:
        what = f"all {size} ranks succeeded" if size > 1 else "the rank succeeded"
    elif result.ending is Ending.CHILD_FAILED:
        assert result.failed is not None  # a CHILD_FAILED result names its child
        what = result.failed.outcome_and_last_line()
    elif result.ending is Ending.INTERRUPTED:
        assert result.signum is not None  # an INTERRUPTED result names its signal
        what = f"stopped by {signal_name(result.signum)}"
    else:
        what = f"timed out after {config.timeout:g}s"
    plural = "" if config.max_restarts == 1 else "s"
    say(
        err,
        f"{what}; {result.restarts} of {config.max_restarts} restart{plural} used; "
        f"exit code {result.exit_code}.",
    )
