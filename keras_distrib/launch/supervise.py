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

Each attempt with children on this host gets a private directory (mode
0700, in /dev/shm when there is one: `private_directory`) for the
workers' shared-memory files, removed when the attempt ends, whatever way.

Stopping means SIGTERM to each child's process group, then SIGCONT (a
stopped child can only act on SIGTERM once it runs), up to
`config.grace_seconds` to exit (the chief may be writing a backup), then
SIGKILL. SIGINT, SIGTERM or SIGHUP to the launcher stop the job for good
(no restart); it exits with `PREEMPTED` when every child then exited with
`PREEMPTED` or 0. A child that fails while another is stopped (SIGSTOP:
`T` in /proc/PID/stat) is reported with the stopped one as the likely cause.

Output is read in chunks as it comes, not line by line: a line redrawn
with carriage returns (Keras's progress bar: `\r1/7 ...`, `\r2/7 ...`)
is shown at once as one updating line, `\r[label] 2/7 ...` without a
newline; `\r\n` ends a line like `\n`. A line from another child ends
the open redrawn line first, so outputs never glue together. A child
whose output carries its own per-rank prefixes (horovodrun's
`[N]<stdout>:`, `ChildSpec.rank_prefix`) is shown as `[rank N] ` lines.
A failed child's tail leaves out TensorFlow's start-up log lines
(`TF_LOG_NOISE`), so that it ends with the Python traceback; unless the
user set `TF_CPP_MIN_LOG_LEVEL`, they are left out of the live output too.

Watching (`_watch`: what happened?) and ending (`_end`: stop the others,
say why) are separate steps; the restart policy (`_should_restart`) sits
after them, in `supervise`'s loop over attempts.

A parameter-server job (`ParameterServerJob`: a chief, worker and ps
tasks) is supervised differently, in one attempt (`_watch_parameter_server`):
the job ends when the chief exits, with its exit code, and then the
servers are stopped. A worker task that exits meanwhile is started again
at once, alone, with the same argv and environment (the same port): it is
stateless, and TensorFlow's coordinator re-queues its work and reconnects
when it is back; at most `--max_restarts` times over all workers (100
when that is 0). A ps task that exits is not (its variables are gone): the
chief is expected to fail, and if it still runs `PS_LOSS_GRACE_SECONDS`
later the launcher stops everything and exits with 1. Those events are
one `[launcher] ...` line each on `err`.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import dataclasses
import enum
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Iterator, Optional, Sequence, TextIO, Union

from keras_distrib.launch.config import LaunchConfig, LaunchError
from keras_distrib.cluster.launch_contract import PREEMPTED

EXIT_TIMEOUT = 124


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


class Ending(enum.Enum):
    """Why supervision stopped."""

    SUCCEEDED = "succeeded"  # every child exited with 0
    CHILD_FAILED = "child failed"  # a child exited non-zero or was killed
    INTERRUPTED = "interrupted"  # the launcher got SIGINT, SIGTERM or SIGHUP
    TIMED_OUT = "timed out"  # --timeout passed


@dataclasses.dataclass(frozen=True)
class ChildExit:
    """How one child ended."""

    index: int  # its position in its attempt's specs
    label: str
    returncode: int  # as Popen reports it: -N when killed by signal N
    tail: tuple[str, ...] = ()  # its last lines of output, up to --tail_lines

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
            return f"signal {_signal_name(-self.returncode)} (exit code {self.exit_code})"
        return f"exit code {self.exit_code}"

    def outcome(self) -> str:
        """`rank 1 failed with exit code 3`, or `rank 1 was preempted (exit code 75)`."""
        if self.preempted:
            return f"{self.label} was preempted (exit code {PREEMPTED})"
        return f"{self.label} failed with {self.describe()}"


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


def exit_code(returncode: int) -> int:
    """A shell-style exit code: the code itself, or 128+signal when killed."""
    return 128 - returncode if returncode < 0 else returncode


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:  # a real-time signal has no name
        return str(signum)


# TensorFlow's C++ start-up and runtime logs, which every rank prints
# whatever the script does (some even with TF_CPP_MIN_LOG_LEVEL=2); a
# failed child's tail leaves them out so that it ends with the Python
# traceback. Each is matched at the start of a line.
TF_LOG_NOISE = (
    # absl-style INFO and WARNING lines:
    # "I0000 00:00:1712345678.123456   12345 port.cc:153] oneDNN custom operations are on..."
    # (before absl is set up the seconds count from 1970)
    r"[IW]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w./-]+:\d+\] ",
    # the same before TF 2.16: "2024-05-01 12:00:00.123456: I tensorflow/core/util/port.cc:113] ..."
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IW] [\w./-]+:\d+\] ",
    r"WARNING: All log messages before absl::InitializeLog\(\) is called",
    # the second line of cpu_feature_guard's notice
    r"To enable the following instructions: .*rebuild TensorFlow",
    # CUDA probing on a machine without a GPU, logged as errors
    r"(?:E\d{4} |\d{4}-\d\d-\d\d .*: E ).*\] (?:failed call to cuInit|Unable to register cu\w+ factory)",
)
_NOISE = re.compile("|".join(f"(?:{pattern})" for pattern in TF_LOG_NOISE))

# Where a line ends (\r\n: ssh -tt's line ends) or is redrawn (a bare \r).
_BREAKS = re.compile(r"(\r\n|\r|\n)")


def is_tf_log_noise(line: str) -> bool:
    """True for a line of TensorFlow's C++ logs that `TF_LOG_NOISE` names."""
    return _NOISE.match(line) is not None


class _Printer:
    """Writes the children's lines and redraws to one stream, from many threads.

    Whole lines never interleave. A redraw, `\r[label] text` without a
    newline, leaves its line open: the same source's next redraw replaces
    it, its line end ends it, and anything else ends it with a newline
    first. A source is whatever object writes (one `_Stream`).
    """

    def __init__(self, stream: TextIO, hide_tf_noise: bool = False):
        self._stream = stream
        self._hide_tf_noise = hide_tf_noise
        self._lock = threading.Lock()
        self._open: Optional[tuple[object, str]] = None  # (source, text) of the open line

    def write(self, source: object, prefix: str, lines: Sequence[str] = (),
              redraw: Optional[str] = None) -> None:
        """Prints `lines` (ended), then `redraw` as the open line, if given."""
        if self._hide_tf_noise:
            lines = [line for line in lines if not is_tf_log_noise(line)]
        with self._lock:
            parts = []
            for line in lines:
                if self._open == (source, line):  # already on screen
                    parts.append("\n")
                elif self._open is not None and self._open[0] is source:
                    parts.append(f"\r{prefix}{line}\n")
                else:
                    parts.append(self._end_open() + f"{prefix}{line}\n")
                self._open = None
            if redraw is not None and self._open != (source, redraw):
                if self._open is not None and self._open[0] is not source:
                    parts.append(self._end_open())
                parts.append(f"\r{prefix}{redraw}")
                self._open = (source, redraw)
            self._put("".join(parts))

    def end_line(self) -> None:
        """Ends an open redrawn line, before the launcher says something."""
        with self._lock:
            self._put(self._end_open())

    def _end_open(self) -> str:
        ended, self._open = self._open is not None, None
        return "\n" if ended else ""

    def _put(self, text: str) -> None:
        if not text:
            return
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError, UnicodeError):
            # A closed or narrow stdout must not stop the pipe from being
            # drained, or the child would block on a full pipe.
            pass


class _Stream:
    """One output stream's text, as whole lines and redraws of the open line.

    A line's text is what follows its last carriage return (what a
    terminal would show, for redraws that pad to the old width as Keras's
    do); trailing backspaces, which Keras writes before each \r, are
    dropped. A plain partial line waits for its end, as before; one that
    was redrawn is shown at the end of every chunk.
    """

    def __init__(self, prefix: str, printer: _Printer, tail: collections.deque,
                 tail_prefix: str = ""):
        self._prefix = prefix
        self._printer = printer
        self._tail = tail
        self._tail_prefix = tail_prefix
        self._segment = ""  # text since the last \r or line end
        self._last = ""  # the line's text as of its last \r
        self._redrawn = False  # the line had a bare \r
        self._shown: Optional[str] = None  # its text last redrawn

    def feed(self, text: str) -> None:
        lines = []
        for piece in _BREAKS.split(text):
            if piece in ("\n", "\r\n"):
                lines.append(self._current())
                self._segment, self._last, self._redrawn, self._shown = "", "", False, None
            elif piece == "\r":
                self._last, self._segment, self._redrawn = self._current(), "", True
            else:
                self._segment += piece
        redraw = None
        if self._redrawn:
            current = self._current()
            if current and current != self._shown:
                redraw = self._shown = current
        for line in lines:
            if not is_tf_log_noise(line):
                self._tail.append(self._tail_prefix + line)
        if lines or redraw is not None:
            self._printer.write(self, self._prefix, lines, redraw)

    def close(self) -> None:
        """Ends the last line, if the stream ended without a newline."""
        if self._current():
            self.feed("\n")

    def _current(self) -> str:
        return self._segment.rstrip("\b") or self._last


class _RankDemux:
    """horovodrun's output, `[N]<stdout>:piece` records, as `_Stream`s per rank.

    horovodrun writes each piece of a rank's output as soon as it ends in
    \r or \n, behind the rank's prefix; so only ended pieces are routed,
    and a record cut by a chunk waits for its rest. A rank's stdout and
    stderr (the prefix's optional group `stream`) are separate streams
    with the same label, so that a warning does not overwrite a progress
    bar.
    """

    _RECORD = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)")

    def __init__(self, rank_prefix: str, own: _Stream, printer: _Printer,
                 tail: collections.deque):
        self._prefix = re.compile(rank_prefix)
        self._own = own
        self._printer = printer
        self._tail = tail
        self._ranks: dict[tuple[int, Optional[str]], _Stream] = {}
        self._pending = ""

    def feed(self, text: str) -> None:
        self._pending += text
        cut = max(self._pending.rfind("\r"), self._pending.rfind("\n")) + 1
        ended, self._pending = self._pending[:cut], self._pending[cut:]
        for record in self._RECORD.findall(ended):
            self._route(record)

    def close(self) -> None:
        if self._pending:
            self._route(self._pending)
            self._pending = ""
        for stream in (self._own, *self._ranks.values()):
            stream.close()

    def _route(self, record: str) -> None:
        match = self._prefix.match(record)
        if match is None:
            self._own.feed(record)
            return
        key = (int(match.group("rank")), match.groupdict().get("stream"))
        if key not in self._ranks:
            label = f"[rank {key[0]}] "
            self._ranks[key] = _Stream(label, self._printer, self._tail, tail_prefix=label)
        self._ranks[key].feed(record[match.end():])


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

    def __init__(self, spec: ChildSpec, tail_lines: int, printer: _Printer):
        self.label = spec.label
        self.tail: collections.deque[str] = collections.deque(maxlen=max(tail_lines, 1))
        # Own session: a signal to the group reaches the rank and anything it
        # spawned, and a terminal's Ctrl-C reaches only the launcher, which
        # forwards it once (no double interrupt).
        self.proc = subprocess.Popen(
            _tied_to_launcher(spec.argv), env={**os.environ, **spec.env},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True)
        own = _Stream(f"[{self.label}] ", printer, self.tail)
        self._sink = own if spec.rank_prefix is None else _RankDemux(
            spec.rank_prefix, own, printer, self.tail)
        self.reader = threading.Thread(target=self._pump, name=f"pump {self.label}", daemon=True)
        self.reader.start()

    def _pump(self) -> None:
        # os.read, not readline: a progress bar's redraws end in no newline
        # and must show as they come.
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        fd = self.proc.stdout.fileno()
        try:
            while data := os.read(fd, 65536):
                self._sink.feed(decoder.decode(data))
            self._sink.feed(decoder.decode(b"", final=True))
            self._sink.close()
        finally:
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


def supervise(job: Union[Job, ParameterServerJob, Sequence[ChildSpec]], config: LaunchConfig,
              out: TextIO, err: TextIO) -> SuperviseResult:
    """Runs the job's attempts, streams their lines, and returns how the job ended.

    `job`: a `Job`, or a list of `ChildSpec`s (the same on every attempt).
    A failed attempt is followed by another while `config.max_restarts`
    allows, the launcher was not signalled and `config.timeout` (which
    bounds all attempts together) has not passed. A `ParameterServerJob`
    runs once, until its chief exits (see the module docstring).

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
    printer = _Printer(out, hide_tf_noise="TF_CPP_MIN_LOG_LEVEL" not in os.environ)
    deadline = time.monotonic() + config.timeout if config.timeout > 0 else None
    if isinstance(job, ParameterServerJob):
        return _supervise_parameter_server(job, config, printer, deadline, err)
    if not isinstance(job, Job):
        job = Job.of(job)
    with _SignalTrap() as trap:
        restarts = 0
        while True:
            result = _attempt(job, restarts, config, trap, deadline, printer, err)
            if not _should_restart(result, restarts, config, trap, deadline):
                break
            restarts += 1
            _say(err, f"restart {restarts}/{config.max_restarts}: {result.failed.outcome()}; "
                      f"starting all {len(job)} ranks again.")
        result = dataclasses.replace(result, restarts=restarts)
        if result.ending is Ending.CHILD_FAILED and restarts < config.max_restarts:
            why = (f"got {_signal_name(trap.received[0])}" if trap.received
                   else f"--timeout={config.timeout:g}s has passed")
            _say(err, f"no restart: {why}.")
        if config.max_restarts:
            _summarize(result, len(job), config, err)
        return result


def _attempt(job: Job, restart: int, config: LaunchConfig, trap: _SignalTrap,
             deadline: Optional[float], printer: _Printer, err: TextIO) -> SuperviseResult:
    """Starts, watches and ends one attempt; nothing of it outlives this call."""
    children: list[_Child] = []
    with private_directory(job.private_dir) as shm_dir:
        try:
            for spec in job.specs(restart, shm_dir):
                children.append(_start(spec, config.tail_lines, printer))
            result = _watch(children, trap, deadline)
            return _end(result, children, config, trap, printer, err)
        finally:
            for child in children:
                child.signal_group(signal.SIGKILL)
            for child in children:
                child.proc.wait()
                child.reader.join(timeout=5)
            printer.end_line()


def _should_restart(result: SuperviseResult, restarts: int, config: LaunchConfig,
                    trap: _SignalTrap, deadline: Optional[float]) -> bool:
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
    when there is one (`host_allreduce.default_directory`), so the files
    are memory. Yields None (and makes nothing) when not `wanted`.
    """
    if not wanted:
        yield None
        return
    # Imported here: NumPy (no TensorFlow), paid only when ranks run here.
    from keras_distrib.collectives import host_allreduce
    path = tempfile.mkdtemp(prefix="kd-", dir=host_allreduce.default_directory())
    try:
        os.chmod(path, 0o700)  # mkdtemp's 0700 may have been narrowed by the umask
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _start(spec: ChildSpec, tail_lines: int, printer: _Printer) -> _Child:
    try:
        return _Child(spec, tail_lines, printer)
    except OSError as e:
        raise LaunchError(f"cannot start {spec.label} ({spec.argv[0]}): {e.strerror or e}.") from None


def _watch(children: Sequence[_Child], trap: _SignalTrap,
           deadline: Optional[float]) -> SuperviseResult:
    """Waits until the attempt ends one way or another; stops and prints nothing."""
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
         trap: _SignalTrap, printer: _Printer, err: TextIO,
         unit: str = "rank") -> SuperviseResult:
    """Stops the children still running, and says why.

    Returns `result`, for a failed child with the tail of its output and
    the stopped children filled in; after a signal, with `PREEMPTED` as
    its exit code when every child exited with it or 0. `unit` names the
    children in messages (`rank`, or `task` in a parameter-server job).
    """
    if result.ending is Ending.INTERRUPTED:
        printer.end_line()  # a progress bar must not swallow the message
        _say(err, f"got {_signal_name(result.signum)}; stopping all {unit}s.")
        _stop(children, trap, config.grace_seconds)
        if children and all(c.proc.returncode in (0, PREEMPTED) for c in children):
            _say(err, f"every {unit} exited with {PREEMPTED} (preempted) or 0; "
                      f"exit code {PREEMPTED}.")
            result = dataclasses.replace(result, exit_code=PREEMPTED)
    elif result.ending is Ending.TIMED_OUT:
        printer.end_line()
        _say(err, f"timed out after {config.timeout:g}s (--timeout); stopping all {unit}s.")
        _stop(children, trap, config.grace_seconds)
    elif result.ending is Ending.CHILD_FAILED:
        stopped = tuple(filter(None, (_stopped(c) for c in children)))
        _stop(children, trap, config.grace_seconds)
        child = children[result.failed.index]
        child.reader.join(timeout=5)  # the last lines are the interesting ones
        tail = tuple(child.tail)[-config.tail_lines:] if config.tail_lines else ()
        result = dataclasses.replace(
            result, failed=dataclasses.replace(result.failed, tail=tail), stopped=stopped)
        printer.end_line()
        _report_failure(result, err)
    return result


# --------------------------------------------------------------------------
# Parameter-server jobs


def _supervise_parameter_server(job: ParameterServerJob, config: LaunchConfig,
                                printer: _Printer, deadline: Optional[float],
                                err: TextIO) -> SuperviseResult:
    """Runs a parameter-server job until its chief exits (module docstring).

    Nothing of it outlives this call, replaced worker tasks included.
    """
    specs = job.specs
    children: list[Optional[_Child]] = [None] * len(specs)
    replaced: list[_Child] = []  # worker tasks that exited and were started again
    with _SignalTrap() as trap:
        try:
            # The servers first: the chief connects to them as soon as it can.
            for i in [*range(1, len(specs)), 0]:
                children[i] = _start(specs[i], config.tail_lines, printer)
            result = _watch_parameter_server(job, children, replaced, config, trap,
                                             deadline, printer, err)
            if result.ending is Ending.SUCCEEDED:  # the servers' work is done
                _stop(children, trap, config.grace_seconds)
            return _end(result, children, config, trap, printer, err, unit="task")
        finally:
            running = [c for c in children if c is not None]
            for child in running:
                child.signal_group(signal.SIGKILL)
            for child in running + replaced:
                child.proc.wait()
                child.reader.join(timeout=5)
            printer.end_line()


def _watch_parameter_server(job: ParameterServerJob, children: list[_Child],
                            replaced: list[_Child], config: LaunchConfig,
                            trap: _SignalTrap, deadline: Optional[float],
                            printer: _Printer, err: TextIO) -> SuperviseResult:
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
                _note(printer, err, f"{child.label} exited ({_short(how)}); no restarts "
                                    f"left ({restarts} used, at most {flag}); stopping the job.")
                return SuperviseResult(Ending.CHILD_FAILED, how.exit_code, failed=how,
                                       restarts=restarts)
            restarts += 1
            _note(printer, err, f"{child.label} exited ({_short(how)}); "
                                f"restarting it (restart {restarts})")
            child.signal_group(signal.SIGKILL)  # whatever it started in its group
            replaced.append(child)
            children[i] = _start(specs[i], config.tail_lines, printer)
        for i in ps_tasks:
            child = children[i]
            if child.proc.poll() is None or any(h.index == i for _, h in lost_ps):
                continue
            how = ChildExit(i, child.label, child.proc.returncode)
            lost_ps.append((time.monotonic(), how))
            _note(printer, err, f"{child.label} exited ({_short(how)}); not restarting it "
                                "(its variables are lost); the chief should fail, else it is "
                                f"stopped in {PS_LOSS_GRACE_SECONDS:g}s.")
        if lost_ps and time.monotonic() - lost_ps[0][0] >= PS_LOSS_GRACE_SECONDS:
            how = lost_ps[0][1]
            _note(printer, err, f"the chief still runs {PS_LOSS_GRACE_SECONDS:g}s after "
                                f"{how.label} was lost; stopping the job (exit code 1).")
            return SuperviseResult(Ending.CHILD_FAILED, 1, failed=how, restarts=restarts)
        time.sleep(0.05)


def _short(how: ChildExit) -> str:
    """`signal 9` or `exit code 3`, for the one-line `[launcher]` notes."""
    if how.returncode < 0:
        return f"signal {-how.returncode}"
    return f"exit code {how.returncode}"


def _note(printer: _Printer, err: TextIO, message: str) -> None:
    """One `[launcher] message` line on `err`, after any open redrawn line."""
    printer.end_line()
    err.write(f"[launcher] {message}\n")
    err.flush()


def _stop(children: Sequence[_Child], trap: _SignalTrap, grace: float) -> None:
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


def _stopped(child: _Child) -> Optional[str]:
    """`rank 1 (pid 123) was stopped (SIGSTOP)` when it is; else None.

    A stopped rank cannot answer its peers, which then fail (timeouts,
    lost connections): it, not they, is what to look at.
    """
    state = _process_state(child.proc.pid) if child.running else None
    how = {"T": "SIGSTOP", "t": "held by a debugger"}.get(state)
    return f"{child.label} (pid {child.proc.pid}) was stopped ({how})" if how else None


def _process_state(pid: int) -> Optional[str]:
    """The state letter in /proc/PID/stat (R, S, D, T...); None off Linux or when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # "PID (COMMAND) STATE ...": the command may hold spaces and parentheses.
    return stat[stat.rfind(")") + 2:][:1] or None


def _report_failure(result: SuperviseResult, err: TextIO) -> None:
    failed = result.failed
    lines = [f"keras-distrib: {failed.outcome()}; last output:"]
    lines += [f"    {line}" for line in failed.tail] or ["    (no output)"]
    for stopped in result.stopped:
        lines.append(f"keras-distrib: {failed.outcome()} while {stopped}; "
                     "the stopped rank is the likely cause.")
    err.write("\n".join(lines) + "\n")
    err.flush()


def _summarize(result: SuperviseResult, size: int, config: LaunchConfig, err: TextIO) -> None:
    """The last line under --max_restarts: how the job ended, restarts used."""
    if result.ending is Ending.SUCCEEDED:
        what = f"all {size} ranks succeeded"
    elif result.ending is Ending.CHILD_FAILED:
        what = result.failed.outcome()
    elif result.ending is Ending.INTERRUPTED:
        what = f"stopped by {_signal_name(result.signum)}"
    else:
        what = f"timed out after {config.timeout:g}s"
    plural = "" if config.max_restarts == 1 else "s"
    _say(err, f"{what}; {result.restarts} of {config.max_restarts} restart{plural} used; "
              f"exit code {result.exit_code}.")


def _say(err: TextIO, message: str) -> None:
    err.write(f"keras-distrib: {message}\n")
    err.flush()
