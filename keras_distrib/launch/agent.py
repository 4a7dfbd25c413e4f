"""The one loop that runs a job, whatever its kind: attempts, each started,
monitored and stopped, and after each the kind's decision.

The shape is torch elastic's `SimpleElasticAgent` (start the workers,
monitor them, stop or restart them). `run(kind, config, printer,
deadline, err)`, within the kind's `session` and the launcher's signal
trap, asks the job's kind (a `JobKind`) for its attempts:

    attempt = kind.first_attempt(agent)
    while it is an `Attempt` (else it is how the job ended):
        kind.start(attempt, its specs, agent)       its children, in its private directory
        result = kind.monitor(attempt, agent)       waits until it ends
        result = kind.stop(attempt, result, agent)  stops what still runs, says how it ended
        attempt = kind.next_attempt(attempt, result, agent)
    return attempt

Nothing of an attempt outlives it, whatever happens (a child that cannot
start included): the agent kills its children's process groups, waits
for them and removes its private directory (`private_directory`).

The kinds, each in its own module:

    restarts.Job                      all ranks again after a failure, while
                                      --max_restarts allows
    parameter_server.ParameterServerJob  one attempt until the chief exits;
                                      worker tasks restarted alone within it
    elastic.ElasticJob                attempts on the slots that answer
                                      (--min_workers), hosts lost and taken back
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import os
import shutil
import signal
import tempfile
import time
from typing import Callable, ContextManager, Iterator, Optional, Sequence, TextIO, Union

from keras_distrib.cluster import launch_contract
from keras_distrib.launch import flight
from keras_distrib.launch.config import LaunchConfig
from keras_distrib.launch.endings import SuperviseResult, end, watch
from keras_distrib.launch.output import Printer, say
from keras_distrib.launch.processes import Child, ChildSpec, SignalTrap, start


@dataclasses.dataclass
class Attempt:
    """One attempt of a job: what it starts, and the children it started.

    `specs(shm_dir)` gives its children, `shm_dir` being its private
    directory when `private_dir` asks for one (else None).
    """

    number: int  # the attempts of the job before it (`KERAS_DISTRIB_RESTART`)
    specs: Callable[[Optional[str]], Sequence[ChildSpec]]
    private_dir: bool = False
    restarts: int = 0  # the restarts of the job before it
    # Asked while it runs: whether to stop it, to resize the job (`endings.watch`).
    resize: Callable[[], bool] = lambda: False
    # Its children, in the order of `specs`, as they start.
    children: list[Child] = dataclasses.field(default_factory=list)
    # Children it replaced while it ran, to be waited for when it ends.
    replaced: list[Child] = dataclasses.field(default_factory=list)
    started: float = 0.0  # `time.monotonic()` when it started


class JobKind(abc.ABC):
    """The hooks through which `run` runs a job (see the module docstring).

    `first_attempt` and `next_attempt` decide; the others have defaults:
    `start` starts the children in order, `monitor` waits until one
    fails, all succeed, the launcher is signalled or the timeout passes
    (`Agent.watch`), and `stop` stops what still runs and says why
    (`endings.end`).
    """

    unit = "rank"  # how the launcher's lines name the children

    def session(self) -> ContextManager[object]:
        """Held while the job runs, around the launcher's signal trap."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def first_attempt(self, agent: "Agent") -> Union[Attempt, SuperviseResult]:
        """The first attempt, or how the job ended before it."""

    def start(self, attempt: Attempt, specs: Sequence[ChildSpec], agent: "Agent") -> None:
        """Starts the attempt's children (`specs`) into `attempt.children`."""
        for spec in specs:
            attempt.children.append(agent.start_child(spec))

    def monitor(self, attempt: Attempt, agent: "Agent") -> SuperviseResult:
        """Waits until the attempt ends; stops nothing."""
        return agent.watch(attempt)

    def stop(self, attempt: Attempt, result: SuperviseResult, agent: "Agent") -> SuperviseResult:
        """Stops the children still running and says how the attempt ended."""
        return end(
            result,
            attempt.children,
            agent.config,
            agent.trap,
            agent.printer,
            agent.err,
            unit=self.unit,
            started=attempt.started,
        )

    @abc.abstractmethod
    def next_attempt(
        self, attempt: Attempt, result: SuperviseResult, agent: "Agent"
    ) -> Union[Attempt, SuperviseResult]:
        """After `attempt` ended with `result`: the next attempt, or how the job ended."""


@dataclasses.dataclass
class Agent:
    """What the hooks of a running job share: the launch's settings, the
    output, the launcher's signal trap and the deadline (None: none)."""

    config: LaunchConfig
    printer: Printer
    err: TextIO
    trap: SignalTrap
    deadline: Optional[float]

    def run_attempt(self, kind: JobKind, attempt: Attempt) -> SuperviseResult:
        """Starts, monitors and stops one attempt; nothing of it outlives this call."""
        attempt.started = time.monotonic()
        with private_directory(attempt.private_dir) as shm_dir:
            try:
                kind.start(attempt, attempt.specs(shm_dir), self)
                result = kind.monitor(attempt, self)
                return kind.stop(attempt, result, self)
            finally:
                for child in attempt.children:
                    child.signal_group(signal.SIGKILL)
                for child in attempt.children + attempt.replaced:
                    child.proc.wait()
                    child.reader.join(timeout=5)
                self.printer.end_line()

    def start_child(self, spec: ChildSpec) -> Child:
        """Starts `spec`'s child; a `LaunchError` when its program cannot be run."""
        return start(spec, self.config.tail_lines, self.printer)

    def watch(self, attempt: Attempt) -> SuperviseResult:
        """`endings.watch` over the attempt's children, with the launcher's
        warnings: a straggler, a stall of the training, SIGUSR1's screen."""
        children, printer, config = attempt.children, self.printer, self.config

        def warn(message: str) -> None:
            printer.end_line()
            say(self.err, message)

        def show_accounts(why: str) -> None:
            printer.end_line()
            flight.show(children, printer.accounts, self.err, why)

        no_progress = flight.NoProgress(
            printer.accounts, config.stall_warning, show_accounts, attempt.started
        )
        return watch(
            children,
            self.trap,
            self.deadline,
            config.straggler_warning,
            warn,
            attempt.resize,
            show_accounts,
            no_progress.check,
        )


def run(
    kind: JobKind, config: LaunchConfig, printer: Printer, deadline: Optional[float], err: TextIO
) -> SuperviseResult:
    """Runs the job's attempts, as its kind decides; returns how the job ended."""
    with kind.session(), SignalTrap() as trap:
        agent = Agent(config, printer, err, trap, deadline)
        step = kind.first_attempt(agent)
        while isinstance(step, Attempt):
            result = agent.run_attempt(kind, step)
            step = kind.next_attempt(step, result, agent)
        return step


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
