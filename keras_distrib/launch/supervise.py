"""Starting and watching the children of a launch.

`supervise(specs, config, out, err)` starts one process per `ChildSpec`,
prints each line it writes as `[label] line`, waits until the job ends and
then makes sure nothing is left running. How the job ended (all succeeded,
which child failed and how, the launcher was interrupted, the timeout hit)
comes back as a `SuperviseResult`; its `exit_code` is the launcher's.

Watching (`_watch`: what happened?) and ending (`_end`: stop the others,
say why) are separate steps, so that a policy such as restarting a failed
child can sit between them.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Optional, Sequence, TextIO

from keras_distrib.launch.config import LaunchConfig, LaunchError

# Seconds a rank gets to exit after SIGTERM/SIGINT before SIGKILL: enough for
# Keras to finish writing a checkpoint, short enough that Ctrl-C feels live.
GRACE_SECONDS = 10.0
EXIT_TIMEOUT = 124


@dataclasses.dataclass(frozen=True)
class ChildSpec:
    """One process to start: its label in output, its argv and extra env."""

    label: str
    argv: list[str]
    env: dict[str, str]


class Ending(enum.Enum):
    """Why supervision stopped."""

    SUCCEEDED = "succeeded"  # every child exited with 0
    CHILD_FAILED = "child failed"  # a child exited non-zero or was killed
    INTERRUPTED = "interrupted"  # the launcher got SIGINT, SIGTERM or SIGHUP
    TIMED_OUT = "timed out"  # --timeout passed


@dataclasses.dataclass(frozen=True)
class ChildExit:
    """How one child ended."""

    index: int  # its position in the specs given to `supervise`
    label: str
    returncode: int  # as Popen reports it: -N when killed by signal N
    tail: tuple[str, ...] = ()  # its last lines of output, up to --tail_lines

    @property
    def exit_code(self) -> int:
        return exit_code(self.returncode)

    def describe(self) -> str:
        """`exit code 3`, or `signal SIGKILL (exit code 137)`."""
        if self.returncode < 0:
            return f"signal {signal.Signals(-self.returncode).name} (exit code {self.exit_code})"
        return f"exit code {self.exit_code}"


@dataclasses.dataclass(frozen=True)
class SuperviseResult:
    """How a supervised job ended, and the launcher's exit code for it."""

    ending: Ending
    exit_code: int
    failed: Optional[ChildExit] = None  # for CHILD_FAILED: the first failed child
    signum: Optional[int] = None  # for INTERRUPTED: the signal the launcher got


def exit_code(returncode: int) -> int:
    """A shell-style exit code: the code itself, or 128+signal when killed."""
    return 128 - returncode if returncode < 0 else returncode


class _LinePrinter:
    """Writes whole lines from many threads without interleaving them."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self._lock:
            try:
                self._stream.write(line + "\n")
                self._stream.flush()
            except (OSError, ValueError, UnicodeError):
                # A closed or narrow stdout must not stop the pipe from being
                # drained, or the child would block on a full pipe.
                pass


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


class _Child:
    """One started process, its own process group, and the thread reading it."""

    def __init__(self, spec: ChildSpec, tail_lines: int, printer: Callable[[str], None]):
        self.label = spec.label
        self.tail: collections.deque[str] = collections.deque(maxlen=max(tail_lines, 1))
        # Own session: a signal to the group reaches the rank and anything it
        # spawned, and a terminal's Ctrl-C reaches only the launcher, which
        # forwards it once (no double interrupt).
        self.proc = subprocess.Popen(
            _tied_to_launcher(spec.argv), env={**os.environ, **spec.env},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True)
        self._printer = printer
        self.reader = threading.Thread(target=self._pump, name=f"pump {self.label}", daemon=True)
        self.reader.start()

    def _pump(self) -> None:
        prefix = f"[{self.label}] "
        for raw in iter(self.proc.stdout.readline, b""):
            # \r: ssh -tt sends CRLF line ends.
            line = raw.rstrip(b"\r\n").decode("utf-8", "replace")
            self.tail.append(line)
            self._printer(prefix + line)
        self.proc.stdout.close()

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone already


class _SignalTrap:
    """Records SIGINT/SIGTERM/SIGHUP instead of dying, so children can be stopped."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_SignalTrap":
        # Handlers can only be set from the main thread; elsewhere (a caller's
        # worker thread) the caller owns signals.
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def _record(self, signum, frame) -> None:
        del frame
        self.received.append(signum)

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def supervise(specs: Sequence[ChildSpec], config: LaunchConfig,
              out: TextIO, err: TextIO) -> SuperviseResult:
    """Starts every child, streams its lines, and returns how the job ended.

    The result's `exit_code` is 0 when all succeed; the first failed
    child's code (128+signal when killed); 128+signal when the launcher is
    interrupted; 124 on timeout. Every child's process group is killed on
    the way out, whatever happens.

    Raises:
        LaunchError: a child could not be started (those already started
            are killed).
    """
    printer = _LinePrinter(out)
    children: list[_Child] = []
    with _SignalTrap() as trap:
        try:
            for spec in specs:
                children.append(_start(spec, config.tail_lines, printer))
            deadline = time.monotonic() + config.timeout if config.timeout > 0 else None
            result = _watch(children, trap, deadline)
            return _end(result, children, config, trap, err)
        finally:
            for child in children:
                child.signal_group(signal.SIGKILL)
            for child in children:
                child.proc.wait()
                child.reader.join(timeout=5)


def _start(spec: ChildSpec, tail_lines: int, printer) -> _Child:
    try:
        return _Child(spec, tail_lines, printer)
    except OSError as e:
        raise LaunchError(f"cannot start {spec.label} ({spec.argv[0]}): {e.strerror or e}.") from None


def _watch(children: Sequence[_Child], trap: _SignalTrap,
           deadline: Optional[float]) -> SuperviseResult:
    """Waits until the job ends one way or another; stops and prints nothing."""
    while True:
        if trap.received:
            signum = trap.received[0]
            return SuperviseResult(Ending.INTERRUPTED, 128 + signum, signum=signum)
        failed = next((i for i, c in enumerate(children)
                       if c.proc.poll() not in (None, 0)), None)
        if failed is not None:
            child = children[failed]
            how = ChildExit(failed, child.label, child.proc.returncode)
            return SuperviseResult(Ending.CHILD_FAILED, how.exit_code, failed=how)
        if all(c.proc.returncode == 0 for c in children):
            return SuperviseResult(Ending.SUCCEEDED, 0)
        if deadline is not None and time.monotonic() >= deadline:
            return SuperviseResult(Ending.TIMED_OUT, EXIT_TIMEOUT)
        time.sleep(0.05)


def _end(result: SuperviseResult, children: Sequence[_Child], config: LaunchConfig,
         trap: _SignalTrap, err: TextIO) -> SuperviseResult:
    """Stops the children still running as `result` calls for, and says why.

    Returns `result`, for a failed child with the tail of its output filled in.
    """
    if result.ending is Ending.INTERRUPTED:
        _say(err, f"got {signal.Signals(result.signum).name}; stopping all ranks.")
        _stop(children, result.signum, trap)
    elif result.ending is Ending.TIMED_OUT:
        _say(err, f"timed out after {config.timeout:g}s (--timeout); stopping all ranks.")
        _stop(children, signal.SIGTERM, trap)
    elif result.ending is Ending.CHILD_FAILED:
        _stop(children, signal.SIGTERM, trap)
        child = children[result.failed.index]
        child.reader.join(timeout=5)  # the last lines are the interesting ones
        tail = tuple(child.tail)[-config.tail_lines:] if config.tail_lines else ()
        result = dataclasses.replace(result, failed=dataclasses.replace(result.failed, tail=tail))
        _report_failure(result.failed, err)
    return result


def _stop(children: Sequence[_Child], signum: int, trap: _SignalTrap) -> None:
    """Sends `signum` to every live group; SIGKILL after the grace period."""
    already = len(trap.received)
    for child in children:
        if child.running:
            child.signal_group(signum)
    deadline = time.monotonic() + GRACE_SECONDS
    while any(c.running for c in children) and time.monotonic() < deadline:
        if len(trap.received) > already:  # a second Ctrl-C: no more waiting
            break
        time.sleep(0.05)
    for child in children:
        child.signal_group(signal.SIGKILL)


def _report_failure(failed: ChildExit, err: TextIO) -> None:
    lines = [f"keras-distrib: {failed.label} failed with {failed.describe()}; last output:"]
    lines += [f"    {line}" for line in failed.tail] or ["    (no output)"]
    err.write("\n".join(lines) + "\n")
    err.flush()


def _say(err: TextIO, message: str) -> None:
    err.write(f"keras-distrib: {message}\n")
    err.flush()
