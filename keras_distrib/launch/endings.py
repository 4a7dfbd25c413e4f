"""How an attempt ends: watching for it, stopping the rest, saying why.

`watch` waits until the children of an attempt succeed, one of them fails
(exits non-zero, `PREEMPTED` included, or is killed by a signal), the
launcher is signalled or the timeout passes; it stops nothing and prints
nothing. `end` then stops the children still running and says why: for a
failed child, the tail of its output and any child stopped (SIGSTOP) at
the time, the likely cause. How it ended comes back as a `SuperviseResult`,
whose `exit_code` is the launcher's: after SIGINT, SIGTERM or SIGHUP it is
`PREEMPTED` when every child then exited with `PREEMPTED` or 0.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Callable, Optional, Sequence, TextIO

from keras_distrib.cluster.launch_contract import PREEMPTED
from keras_distrib.launch import flight
from keras_distrib.launch.config import LaunchConfig
from keras_distrib.launch.output import Printer, say
from keras_distrib.launch.processes import Child, SignalTrap, describe_stopped, signal_name, stop

EXIT_TIMEOUT = 124


class Ending(enum.Enum):
    """Why supervision stopped."""

    SUCCEEDED = "succeeded"  # every child exited with 0
    CHILD_FAILED = "child failed"  # a child exited non-zero or was killed
    INTERRUPTED = "interrupted"  # the launcher got SIGINT, SIGTERM or SIGHUP
    TIMED_OUT = "timed out"  # --timeout passed
    # Elastic (--min_workers): a lost host answers again; the job was asked
    # to save and stop, to start again with it (`keras_distrib.launch.elastic`).
    RESIZING = "resizing"


@dataclasses.dataclass(frozen=True)
class ChildExit:
    """How one child ended."""

    index: int  # its position in its attempt's specs
    label: str
    returncode: int  # as Popen reports it: -N when killed by signal N
    tail: tuple[str, ...] = ()  # its last lines of output, up to --tail_lines
    # For a child running ranks (horovodrun): the rank it saw fail first.
    first_rank: Optional[int] = None

    @property
    def exit_code(self) -> int:
        return exit_code(self.returncode)

    @property
    def preempted(self) -> bool:
        """It exited with `PREEMPTED`: asked to stop, not broken."""
        return self.returncode == PREEMPTED

    def describe(self) -> str:
        """`exit code 3`, or `signal SIGKILL (exit code 137)`."""
        if self.returncode < 0:
            return f"signal {signal_name(-self.returncode)} (exit code {self.exit_code})"
        return f"exit code {self.exit_code}"

    def outcome(self) -> str:
        """`rank 1 failed with exit code 3`, `rank 1 was preempted (exit
        code 75)`, or `horovodrun failed with exit code 1 (its rank 1 first)`."""
        if self.preempted:
            return f"{self.label} was preempted (exit code {PREEMPTED})"
        first = "" if self.first_rank is None else f" (its rank {self.first_rank} first)"
        return f"{self.label} failed with {self.describe()}{first}"

    def outcome_and_last_line(self) -> str:
        """`outcome()`, then the child's own last line when it wrote one:
        `rank 0 failed with exit code 1: ValueError: The backup ...`."""
        said = self.tail[-1].strip() if self.tail else ""
        return f"{self.outcome()}: {said}" if said else self.outcome()


@dataclasses.dataclass(frozen=True)
class SuperviseResult:
    """How a supervised job ended, and the launcher's exit code for it."""

    ending: Ending
    exit_code: int
    failed: Optional[ChildExit] = None  # for CHILD_FAILED: the first failed child
    signum: Optional[int] = None  # for INTERRUPTED: the signal the launcher got
    restarts: int = 0  # restarts used before the attempt that ended the job
    # For CHILD_FAILED: `rank 1 (pid 123) was stopped (SIGSTOP)` for each
    # child stopped when the failure was seen, the likely cause.
    stopped: tuple[str, ...] = ()
    # For CHILD_FAILED: when the failure was seen (`time.monotonic()`), before
    # anything was stopped: what ranks said after it is no diagnosis.
    seen: float = 0.0


def exit_code(returncode: int) -> int:
    """A shell-style exit code: the code itself, or 128+signal when killed."""
    return 128 - returncode if returncode < 0 else returncode


def watch(
    children: Sequence[Child],
    trap: SignalTrap,
    deadline: Optional[float],
    straggler_warning: float = 0.0,
    warn: Callable[[str], None] = lambda message: None,
    resize: Callable[[], bool] = lambda: False,
    show_accounts: Callable[[str], None] = lambda why: None,
    stalled: Callable[[], None] = lambda: None,
) -> SuperviseResult:
    """Waits until the attempt ends one way or another; stops nothing.

    Says nothing either, but for one `warn(line)` when children still run
    `straggler_warning` seconds (> 0) after one exited 0, and the ranks'
    flight-recorder screen (`show_accounts(why)`) on SIGUSR1; `stalled()`
    checks for a stall of the training on each round (`flight.NoProgress`).
    Ends `RESIZING` when `resize()` says so (elastic launches).
    """
    straggling = _Stragglers(children, straggler_warning, warn)
    while True:
        if trap.accounts_wanted():
            show_accounts("the launcher got SIGUSR1; the job goes on")
        if trap.received:
            signum = trap.received[0]
            return SuperviseResult(Ending.INTERRUPTED, 128 + signum, signum=signum)
        failed = next((i for i, c in enumerate(children) if c.exit_code not in (None, 0)), None)
        if failed is not None:
            child = children[failed]
            code = child.exit_code
            assert code is not None  # it exited: it is the one failed
            how = ChildExit(failed, child.label, code, first_rank=child.first_failed_rank)
            return SuperviseResult(
                Ending.CHILD_FAILED, how.exit_code, failed=how, seen=time.monotonic()
            )
        if all(c.exit_code == 0 for c in children):
            return SuperviseResult(Ending.SUCCEEDED, 0)
        if resize():  # after the checks above: a job that finished is not resized
            return SuperviseResult(Ending.RESIZING, PREEMPTED)
        if deadline is not None and time.monotonic() >= deadline:
            return SuperviseResult(Ending.TIMED_OUT, EXIT_TIMEOUT)
        straggling.check()
        stalled()
        time.sleep(0.05)


class _Stragglers:
    """Warns once when children run on `seconds` after the first to exit 0."""

    def __init__(self, children: Sequence[Child], seconds: float, warn: Callable[[str], None]):
        self.children, self.seconds, self.warn = children, seconds, warn
        self.first_done: Optional[tuple[float, str]] = None  # (when, label)
        self.warned = not seconds

    def check(self) -> None:
        if self.warned:
            return
        if self.first_done is None:
            done = next((c for c in self.children if c.proc.returncode == 0), None)
            if done is not None:
                self.first_done = (time.monotonic(), done.label)
            return
        since, label = self.first_done
        if time.monotonic() - since < self.seconds:
            return
        running = [c.label for c in self.children if c.proc.returncode is None]
        verb = "runs" if len(running) == 1 else "run"
        self.warn(
            f"{', '.join(running)} still {verb} {self.seconds:g}s after {label} exited "
            f"with 0; a rank waiting for {label} in a collective waits until its "
            "collective timeout, so every rank must run the same steps (the launcher "
            "keeps waiting; --straggler_warning sets this delay)."
        )
        self.warned = True


def end(
    result: SuperviseResult,
    children: Sequence[Child],
    config: LaunchConfig,
    trap: SignalTrap,
    printer: Printer,
    err: TextIO,
    unit: str = "rank",
    started: float = 0.0,
) -> SuperviseResult:
    """Stops the children still running, and says why.

    Shows the ranks' flight-recorder screen (`launch.flight`) at a timeout,
    and at a failure when a rank reported a stall since `started` (the
    attempt's start, `time.monotonic()`).

    Returns `result`, for a failed child with the tail of its output and
    the stopped children filled in; after a signal, with `PREEMPTED` as
    its exit code when every child exited with it or 0. `unit` names the
    children in messages (`rank`, or `task` in a parameter-server job).
    """
    if result.ending is Ending.INTERRUPTED:
        result = _end_interrupted(result, children, config, trap, printer, err, unit)
    elif result.ending is Ending.RESIZING:  # the job saves where it is and stops
        # Finished means exited 0 before the SIGTERM: after it, horovodrun's
        # exit code can be 0 though its rank exited 75 (its safe_shell_exec
        # waits for the rank's shell in two threads, and the one that loses
        # the race reads 0), so no exit code after the signal is taken as one.
        finished = all(c.exit_code == 0 for c in children)
        stop(children, trap, config.grace_seconds)
        if finished:
            result = SuperviseResult(Ending.SUCCEEDED, 0)
    elif result.ending is Ending.TIMED_OUT:
        printer.end_line()
        say(err, f"timed out after {config.timeout:g}s (--timeout); stopping all {unit}s.")
        flight.show(children, printer.accounts, err, f"--timeout={config.timeout:g}s passed")
        stop(children, trap, config.grace_seconds)
    elif result.ending is Ending.CHILD_FAILED:
        result = _end_failed(result, children, config, trap, printer, err, started)
    return result


def _end_interrupted(
    result: SuperviseResult,
    children: Sequence[Child],
    config: LaunchConfig,
    trap: SignalTrap,
    printer: Printer,
    err: TextIO,
    unit: str,
) -> SuperviseResult:
    """`end` after a signal to the launcher: says so, stops the children,
    and returns `result` with `PREEMPTED` as its exit code when every child
    then exited with it or 0."""
    assert result.signum is not None  # an INTERRUPTED result names its signal
    printer.end_line()  # a progress bar must not swallow the message
    say(err, f"got {signal_name(result.signum)}; stopping all {unit}s.")
    stop(children, trap, config.grace_seconds)
    if children and all(c.exit_code in (0, PREEMPTED) for c in children):
        say(err, f"every {unit} exited with {PREEMPTED} (preempted) or 0; exit code {PREEMPTED}.")
        result = dataclasses.replace(result, exit_code=PREEMPTED)
    return result


def _end_failed(
    result: SuperviseResult,
    children: Sequence[Child],
    config: LaunchConfig,
    trap: SignalTrap,
    printer: Printer,
    err: TextIO,
    started: float,
) -> SuperviseResult:
    """`end` after a child failed: notes the children stopped (SIGSTOP) at
    the time, shows the flight-recorder screen when a rank reported a stall
    since `started`, stops the children, reports the failed child's tail;
    returns `result` with that tail and the stopped children filled in."""
    assert result.failed is not None  # a CHILD_FAILED result names its child
    stopped = tuple(filter(None, (describe_stopped(c) for c in children)))
    if printer.accounts.since(started):  # a rank stalled: where is everyone?
        printer.end_line()
        flight.show(
            children,
            printer.accounts,
            err,
            f"{children[result.failed.index].label} failed after a stall",
            since=started,
        )
    stop(children, trap, config.grace_seconds)
    child = children[result.failed.index]
    child.reader.join(timeout=5)  # the last lines are the interesting ones
    tail = tuple(child.tail)[-config.tail_lines :] if config.tail_lines else ()
    result = dataclasses.replace(
        result, failed=dataclasses.replace(result.failed, tail=tail), stopped=stopped
    )
    printer.end_line()
    _report_failure(result, err)
    return result


def _report_failure(result: SuperviseResult, err: TextIO) -> None:
    """The failed child, its last lines, and any stopped child as the likely cause."""
    failed = result.failed
    assert failed is not None
    lines = [f"keras-distrib: {failed.outcome()}; last output:"]
    lines += [f"    {line}" for line in failed.tail] or ["    (no output)"]
    for stopped in result.stopped:
        lines.append(
            f"keras-distrib: {failed.outcome()} while {stopped}; "
            "the stopped rank is the likely cause."
        )
    err.write("\n".join(lines) + "\n")
    err.flush()
