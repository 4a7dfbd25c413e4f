"""The attempts of a job, and the policy that restarts them.

`run_attempts` starts one attempt of a `Job` after another: all of its
children, from `Job.specs(restart, shm_dir)` (new ports on each attempt,
`KERAS_DISTRIB_RESTART`). When a child fails (exits non-zero, `PREEMPTED`
included, or is killed by a signal) and `config.max_restarts` allows, the
others are stopped and the job starts again (`should_restart`); a signal
to the launcher or the timeout (which bounds all attempts together) ends
it for good. Nothing of an attempt outlives it.

Each attempt with children on this host gets a private directory (mode
0700, in /dev/shm when there is one: `private_directory`) for the
workers' shared-memory files, removed when the attempt ends, whatever way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import tempfile
import time
from typing import Callable, Iterator, Optional, Sequence, TextIO

from keras_distrib.cluster import launch_contract
from keras_distrib.launch import flight
from keras_distrib.launch.config import LaunchConfig
from keras_distrib.launch.endings import Ending, SuperviseResult, end, watch
from keras_distrib.launch.output import Printer, say
from keras_distrib.launch.processes import Child, ChildSpec, SignalTrap, signal_name, start


@dataclasses.dataclass(frozen=True)
class Job:
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


def run_attempts(job: Job, config: LaunchConfig, printer: Printer,
                 deadline: Optional[float], err: TextIO) -> SuperviseResult:
    """Runs attempts of `job` while the restart policy allows; returns how the last ended.

    Says why a failed attempt is not followed by another when restarts
    are left, and, under --max_restarts, sums the job up in one last line.
    """
    with SignalTrap() as trap:
        restarts = 0
        while True:
            result = run_attempt(job, restarts, config, trap, deadline, printer, err)
            if not should_restart(result, restarts, config, trap, deadline):
                break
            restarts += 1
            say(err, f"restart {restarts}/{config.max_restarts}: {result.failed.outcome()}; "
                     f"starting all {len(job)} ranks again"
                     f"{from_backup(printer, ', from the last backup', unknown='')}.")
        return finish(result, restarts, len(job), config, trap, err)


def from_backup(printer: Printer, which: str, unknown: Optional[str] = None) -> str:
    """`which` and the step of the job's last backup, as its chief reported
    it (`launch_contract.BACKUP_LINE`): `the last backup, step 12 (epoch 2,
    step 4)`; `unknown` (default: `which` alone) when it reported none."""
    if printer.backup_point is None:
        return which if unknown is None else unknown
    return f"{which}, {printer.backup_point}"


def finish(result: SuperviseResult, restarts: int, size: int, config: LaunchConfig,
           trap: SignalTrap, err: TextIO) -> SuperviseResult:
    """The job's last attempt `result` with the restarts used; says why no
    restart followed a failure when restarts were left, and, under
    --max_restarts, sums the job up in one last line."""
    result = dataclasses.replace(result, restarts=restarts)
    if result.ending is Ending.CHILD_FAILED and restarts < config.max_restarts:
        why = (f"got {signal_name(trap.received[0])}" if trap.received
               else f"--timeout={config.timeout:g}s has passed")
        say(err, f"no restart: {why}.")
    if config.max_restarts:
        _summarize(result, size, config, err)
    return result


def run_attempt(job: Job, restart: int, config: LaunchConfig, trap: SignalTrap,
                deadline: Optional[float], printer: Printer, err: TextIO,
                resize: Callable[[], bool] = lambda: False) -> SuperviseResult:
    """Starts, watches and ends one attempt; nothing of it outlives this call.
    `resize`: see `endings.watch`."""
    children: list[Child] = []
    started = time.monotonic()
    with private_directory(job.private_dir) as shm_dir:
        try:
            for spec in job.specs(restart, shm_dir):
                children.append(start(spec, config.tail_lines, printer))

            def warn(message: str) -> None:
                printer.end_line()
                say(err, message)

            def show_accounts(why: str) -> None:
                printer.end_line()
                flight.show(children, printer.accounts, err, why)

            no_progress = flight.NoProgress(printer.accounts, config.stall_warning,
                                            show_accounts, started)
            result = watch(children, trap, deadline, config.straggler_warning, warn, resize,
                           show_accounts, no_progress.check)
            return end(result, children, config, trap, printer, err, started=started)
        finally:
            for child in children:
                child.signal_group(signal.SIGKILL)
            for child in children:
                child.proc.wait()
                child.reader.join(timeout=5)
            printer.end_line()


def should_restart(result: SuperviseResult, restarts: int, config: LaunchConfig,
                   trap: SignalTrap, deadline: Optional[float]) -> bool:
    """The restart policy: a failed child, restarts left, time left, no signal."""
    return (result.ending is Ending.CHILD_FAILED
            and restarts < config.max_restarts
            and not trap.received
            and (deadline is None or time.monotonic() < deadline))


@contextlib.contextmanager
def private_directory(wanted: bool = True) -> Iterator[Optional[str]]:
    """A new directory of mode 0700 for one attempt, removed after it.

    The workers on this host keep their shared-memory files in it
    (`KERAS_DISTRIB_SHM_DIR`): no other user can reach them, and nothing
    a killed attempt left there outlives the attempt. It is in /dev/shm
    when there is one (`launch_contract.default_shm_directory`), so the
    files are memory. Yields None (and makes nothing) when not `wanted`.
    """
    if not wanted:
        yield None
        return
    path = tempfile.mkdtemp(prefix="kd-", dir=launch_contract.default_shm_directory())
    try:
        os.chmod(path, 0o700)  # mkdtemp's 0700 may have been narrowed by the umask
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _summarize(result: SuperviseResult, size: int, config: LaunchConfig, err: TextIO) -> None:
    """The last line under --max_restarts: how the job ended, restarts used."""
    if result.ending is Ending.SUCCEEDED:
        what = f"all {size} ranks succeeded" if size > 1 else "the rank succeeded"
    elif result.ending is Ending.CHILD_FAILED:
        what = result.failed.outcome_and_last_line()
    elif result.ending is Ending.INTERRUPTED:
        what = f"stopped by {signal_name(result.signum)}"
    else:
        what = f"timed out after {config.timeout:g}s"
    plural = "" if config.max_restarts == 1 else "s"
    say(err, f"{what}; {result.restarts} of {config.max_restarts} restart{plural} used; "
             f"exit code {result.exit_code}.")
