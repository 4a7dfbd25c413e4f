"""The launcher's children as processes: starting, signalling, stopping them.

Each child (`Child`, from a `ChildSpec`) runs in its own session and
process group, tied to the launcher so that it cannot outlive it (Linux),
with one thread feeding its output to the `keras_distrib.launch.output`
printer and keeping its last lines.

Stopping (`stop`) means SIGTERM to each child's process group, then SIGCONT
(a stopped child can only act on SIGTERM once it runs), up to the grace
period to exit (the chief may be writing a backup), then SIGKILL.
`SignalTrap` records SIGINT, SIGTERM and SIGHUP to the launcher instead of
dying of them, so the children can be stopped first. `describe_stopped`
names a child stopped by SIGSTOP (`T` in /proc/PID/stat), the likely
cause when another one fails.
"""

from __future__ import annotations

import codecs
import collections
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from typing import Any, Callable, Optional, Sequence, Union

from keras_distrib.cluster.launch_contract import PREEMPTED
from keras_distrib.cluster.process_state import state_letter
from keras_distrib.launch.config import LaunchError
from keras_distrib.launch.output import Printer, RankDemux, Stream


@dataclasses.dataclass(frozen=True)
class ChildSpec:
    """One process to start: its label in output, its argv and extra env."""

    label: str
    argv: list[str]
    env: dict[str, str]
    # A regular expression with a group `rank`: the prefix this child puts
    # on its ranks' output pieces (each ending in \r or \n), as horovodrun
    # does. Such pieces are shown as `[rank N] ` lines; the rest as `[label] `.
    rank_prefix: Optional[str] = None
    # How many ranks such a child runs.
    ranks: int = 1


def signal_name(signum: int) -> str:
    """`SIGTERM` for 15; the number itself for a signal without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:  # a real-time signal has no name
        return str(signum)


# Run in front of every rank's command: asks the kernel to SIGKILL the rank
# when the launcher dies, even by SIGKILL (when none of our clean-up runs),
# then becomes the rank's command (the request survives exec).
_DIE_WITH_LAUNCHER = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(137)  # the launcher died before the request was made\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def _tied_to_launcher(argv: Sequence[str]) -> list[str]:
    """`argv`, started so that it cannot outlive this process (Linux)."""
    if not sys.platform.startswith("linux") or shutil.which(argv[0]) is None:
        return list(argv)  # a missing program still fails in Popen, clearly
    return [sys.executable, "-c", _DIE_WITH_LAUNCHER, str(os.getpid()), *argv]


class Child:
    """One started process, its own process group, and the thread reading it."""

    def __init__(self, spec: ChildSpec, tail_lines: int, printer: Printer):
        self.label = spec.label
        self._ranks = spec.ranks
        self._final: Optional[int] = None
        self.tail: collections.deque[str] = collections.deque(maxlen=max(tail_lines, 1))
        # Own session: a signal to the group reaches the rank and anything it
        # spawned, and a terminal's Ctrl-C reaches only the launcher, which
        # forwards it once (no double interrupt).
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            _tied_to_launcher(spec.argv),
            env={**os.environ, **spec.env},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        own = Stream(f"[{self.label}] ", printer, self.tail)
        self._sink = (
            own
            if spec.rank_prefix is None
            else RankDemux(spec.rank_prefix, own, printer, self.tail)
        )
        self.reader = threading.Thread(target=self._pump, name=f"pump {self.label}", daemon=True)
        self.reader.start()

    def _pump(self) -> None:
        # os.read, not readline: a progress bar's redraws end in no newline
        # and must show as they come.
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        stdout = self.proc.stdout
        assert stdout is not None  # started with stdout=PIPE
        fd = stdout.fileno()
        try:
            while data := os.read(fd, 65536):
                self._sink.feed(decoder.decode(data))
            self._sink.feed(decoder.decode(b"", final=True))
            self._sink.close()
        finally:
            stdout.close()

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    @property
    def exit_code(self) -> Optional[int]:
        """The child's return code (None while it runs), except PREEMPTED
        for a child running ranks (horovodrun) once it exited and every rank
        said it was preempted (`launch_contract.PREEMPTED_LINE`): horovodrun
        turns its ranks' 75 into 1, or even 0."""
        code = self.proc.poll()
        if code is None or not isinstance(self._sink, RankDemux):
            return code
        if self._final is None:
            self.reader.join(timeout=5)  # the ranks' last lines
            self._final = PREEMPTED if len(self._sink.preempted) == self._ranks else code
        return self._final

    @property
    def first_failed_rank(self) -> Optional[int]:
        """For a child running ranks (horovodrun) that exited: the rank it
        saw fail first, if it said so; else None."""
        if not isinstance(self._sink, RankDemux) or self.exit_code is None:
            return None
        return self._sink.first_failed

    def ask_report(self, why: str) -> None:
        """Asks the child for its flight-recorder account (`launch.flight`),
        on its standard input; a child that stopped reading is not waited for."""
        line = "report " + " ".join(why.split()) + "\n"
        stdin = self.proc.stdin
        assert stdin is not None  # started with stdin=PIPE
        try:
            os.set_blocking(stdin.fileno(), False)
            os.write(stdin.fileno(), line.encode())
        except (OSError, ValueError):
            pass  # exited, or its pipe is full: it shows as not answering

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone already


# What signal.signal returns and takes: a handler, SIG_DFL or SIG_IGN, or None.
_Handler = Union[Callable[[int, Optional[types.FrameType]], Any], int, signal.Handlers, None]


class SignalTrap:
    """Records SIGINT/SIGTERM/SIGHUP instead of dying, so children can be
    stopped; and SIGUSR1, a request for the ranks' flight-recorder screen
    (`accounts_wanted`), on which the job goes on."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: list[int] = []
        self._accounts_wanted = 0
        self._previous: dict[int, _Handler] = {}

    def __enter__(self) -> "SignalTrap":
        # Handlers can only be set from the main thread; elsewhere (a caller's
        # worker thread) the caller owns signals.
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._record)
            self._previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._want_accounts)
        return self

    def _record(self, signum, frame) -> None:
        del frame
        self.received.append(signum)

    def _want_accounts(self, signum, frame) -> None:
        del signum, frame
        self._accounts_wanted += 1

    def accounts_wanted(self) -> bool:
        """Whether SIGUSR1 came since the last call."""
        wanted, self._accounts_wanted = self._accounts_wanted > 0, 0
        return wanted

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def start(spec: ChildSpec, tail_lines: int, printer: Printer) -> Child:
    """Starts `spec`'s child; a `LaunchError` when its program cannot be run."""
    try:
        return Child(spec, tail_lines, printer)
    except OSError as e:
        raise LaunchError(
            f"cannot start {spec.label} ({spec.argv[0]}): {e.strerror or e}."
        ) from None


def stop(children: Sequence[Child], trap: SignalTrap, grace: float) -> None:
    """SIGTERM to every live group, SIGKILL after `grace` seconds; waits for all.

    SIGCONT follows SIGTERM: a stopped (SIGSTOP) child acts on SIGTERM only
    once it runs again. A second signal to the launcher ends the wait.
    """
    already = len(trap.received)
    for child in children:
        if child.running:
            child.signal_group(signal.SIGTERM)
            child.signal_group(signal.SIGCONT)
    deadline = time.monotonic() + grace
    while any(c.running for c in children) and time.monotonic() < deadline:
        if len(trap.received) > already:  # a second Ctrl-C: no more waiting
            break
        time.sleep(0.05)
    for child in children:
        child.signal_group(signal.SIGKILL)
    for child in children:
        child.proc.wait()


def describe_stopped(child: Child) -> Optional[str]:
    """`rank 1 (pid 123) was stopped (SIGSTOP)` when it is; else None.

    A stopped rank cannot answer its peers, which then fail (timeouts,
    lost connections): it, not they, is what to look at.
    """
    state = state_letter(child.proc.pid) if child.running else None
    how = {"T": "SIGSTOP", "t": "held by a debugger"}.get(state or "")
    return f"{child.label} (pid {child.proc.pid}) was stopped ({how})" if how else None
