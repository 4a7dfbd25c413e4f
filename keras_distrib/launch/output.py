"""What the launcher prints: its children's output, prefixed, and its own lines.

Each child's output is read in chunks as it comes, not line by line, and
printed as `[label] line`. A line redrawn with carriage returns (Keras's
progress bar: `\r1/7 ...`, `\r2/7 ...`) is shown at once as one updating
line, `\r[label] 2/7 ...` without a newline; `\r\n` ends a line like
`\n`. A line from another child ends the open redrawn line first, so
outputs never glue together (`Printer`, one per stream, shared by all
children; `Stream`, one per child or rank). A child whose output carries
its own per-rank prefixes (horovodrun's `[N]<stdout>:`,
`ChildSpec.rank_prefix`) is shown as `[rank N] ` lines (`RankDemux`).

TensorFlow's start-up log lines (`TF_LOG_NOISE`) are left out of a failed
child's tail, so that it ends with the Python traceback; unless the user
set `TF_CPP_MIN_LOG_LEVEL`, they are left out of the live output too.

The launcher's own lines go to `err`: `keras-distrib: ...` (`say`), or
`[launcher] ...` for the events of a parameter-server job (`note`).
"""

from __future__ import annotations

import collections
import json
import re
import threading
import time
from typing import Optional, Sequence, TextIO

from keras_distrib.cluster.launch_contract import (
    BACKUP_LINE,
    FLIGHT_RECORDER_LINE,
    LINE_START,
    PREEMPTED_LINE,
    backup_point,
)

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
    r"(?:E\d{4} |\d{4}-\d\d-\d\d .*: E ).*\] "
    r"(?:failed call to cuInit|Unable to register cu\w+ factory)",
)
_NOISE = re.compile("|".join(f"(?:{pattern})" for pattern in TF_LOG_NOISE))

# Where a line ends (\r\n: ssh -tt's line ends) or is redrawn (a bare \r).
_BREAKS = re.compile(r"(\r\n|\r|\n)")

# horovodrun's own line when a rank fails and it stops the others
# (horovod/runner/gloo_run.py): said once, by the first rank's watcher
# that saw its rank fail.
_FIRST_FAILED = re.compile(r"Terminating remaining workers after failure of Process (\d+)\.")


def is_tf_log_noise(line: str) -> bool:
    """True for a line of TensorFlow's C++ logs that `TF_LOG_NOISE` names."""
    return _NOISE.match(line) is not None


class Printer:
    """Writes the children's lines and redraws to one stream, from many threads.

    Whole lines never interleave. A redraw, `\r[label] text` without a
    newline, leaves its line open: the same source's next redraw replaces
    it, its line end ends it, and anything else ends it with a newline
    first. A source is whatever object writes (one `Stream`).
    """

    def __init__(self, stream: TextIO, hide_tf_noise: bool = False):
        self._stream = stream
        self._hide_tf_noise = hide_tf_noise
        # The job's last backup as its chief reported it (`launch_contract.
        # backup_point`), or None: the step a restarted job goes on from.
        self.backup_point: Optional[str] = None
        # The children's flight-recorder accounts (`launch.flight`).
        self.accounts = Accounts()
        self._lock = threading.Lock()
        self._open: Optional[tuple[object, str]] = None  # (source, text) of the open line

    def write(
        self, source: object, prefix: str, lines: Sequence[str] = (), redraw: Optional[str] = None
    ) -> None:
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


class Accounts:
    """The latest flight-recorder account each child's stream delivered, by
    label, when each child's recorder said it was ready to answer, the
    peers each said it lost, and when any last said it made progress."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._latest: dict[str, tuple[float, dict]] = {}  # label -> (monotonic, account)
        self._ready: dict[str, float] = {}  # label -> monotonic
        # label -> [(monotonic, the ranks it could not reach)], its diagnoses
        self._lost: dict[str, list[tuple[float, frozenset]]] = {}
        self._progress: Optional[float] = None  # when a child last finished a step

    def add(self, label: str, text: str) -> None:
        """Keeps the account in `text` (JSON) from the child labelled `label`."""
        try:
            account = json.loads(text)
        except ValueError:
            return  # a line cut short (the rank died writing it): nothing to show
        with self._lock:
            if account.get("ready"):
                self._ready[label] = time.monotonic()
            elif account.get("progress"):
                self._progress = time.monotonic()
            else:
                self._latest[label] = (time.monotonic(), account)
                if account.get("lost"):
                    self._lost.setdefault(label, []).append(
                        (time.monotonic(), frozenset(account["lost"]))
                    )
            self._lock.notify_all()

    def ready_since(self, label: str, moment: float) -> bool:
        """Whether the child's recorder said it answers, at or after `moment`."""
        with self._lock:
            return self._ready.get(label, -1.0) >= moment

    def since(self, moment: float) -> dict[str, dict]:
        """`{label: account}` of the accounts that came at or after `moment`."""
        with self._lock:
            return {
                label: account for label, (when, account) in self._latest.items() if when >= moment
            }

    def last_progress(self) -> Optional[float]:
        """When a child last said it finished a training step (monotonic), or None."""
        with self._lock:
            return self._progress

    def lost_between(self, start: float, end: float) -> dict[str, frozenset]:
        """`{label: ranks}`: the ranks each child said it could not reach
        (a lost peer, one that never arrived) from `start` to `end`."""
        with self._lock:
            found = {
                label: [ranks for when, ranks in told if start <= when <= end]
                for label, told in self._lost.items()
            }
        return {label: frozenset().union(*said) for label, said in found.items() if said}

    def wait_for(self, labels: Sequence[str], moment: float, seconds: float) -> None:
        """Until every child of `labels` gave an account since `moment`, at
        most `seconds`."""
        deadline = time.monotonic() + seconds
        with self._lock:
            while not all(self._latest.get(label, (-1.0,))[0] >= moment for label in labels):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._lock.wait(left)


class Stream:
    """One output stream's text, as whole lines and redraws of the open line.

    A line's text is what follows its last carriage return (what a
    terminal would show, for redraws that pad to the old width as Keras's
    do); trailing backspaces, which Keras writes before each \r, are
    dropped. A plain partial line waits for its end; one that
    was redrawn is shown at the end of every chunk.
    """

    def __init__(
        self, prefix: str, printer: Printer, tail: collections.deque, tail_prefix: str = ""
    ):
        self._prefix = prefix
        self._label = prefix.strip("[] ")  # `[rank 1] `: the child's label
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
                line = self._current()
                line, account, given = line.partition(FLIGHT_RECORDER_LINE)
                if account:  # for the launcher only (launch.flight)
                    self._printer.accounts.add(self._label, given)
                    if not line:
                        self._segment, self._last, self._redrawn, self._shown = "", "", False, None
                        continue
                point = backup_point(line)
                if point is not None:
                    self._printer.backup_point = point
                line = line.partition(BACKUP_LINE)[0]  # that line is for the launcher only
                if line or point is None:
                    lines.append(line)
                self._segment, self._last, self._redrawn, self._shown = "", "", False, None
            elif piece == "\r":
                self._last, self._segment, self._redrawn = self._current(), "", True
            else:
                self._segment += piece
        redraw = None
        if self._redrawn:
            # A report to the launcher may follow a progress bar's text on its
            # line: the redraw shows the text before any keras_distrib line,
            # which shows, or not, when its line ends.
            current = self._current().partition(LINE_START)[0]
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


class RankDemux:
    """horovodrun's output, `[N]<stdout>:piece` records, as `Stream`s per rank.

    horovodrun writes each piece of a rank's output as soon as it ends in
    \r or \n, behind the rank's prefix; so only ended pieces are routed,
    and a record cut by a chunk waits for its rest. A rank's stdout and
    stderr (the prefix's optional group `stream`) are separate streams
    with the same label, so that a warning does not overwrite a progress
    bar.
    """

    _RECORD = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)")

    def __init__(self, rank_prefix: str, own: Stream, printer: Printer, tail: collections.deque):
        self._prefix = re.compile(rank_prefix)
        self._own = own
        self._printer = printer
        self._tail = tail
        self._ranks: dict[tuple[int, Optional[str]], Stream] = {}
        self._pending = ""
        self.preempted: set[int] = set()  # ranks that said so (PREEMPTED_LINE)
        self.first_failed: Optional[int] = None  # the rank horovodrun saw fail first

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
            failed = _FIRST_FAILED.match(record)
            if failed is not None and self.first_failed is None:
                self.first_failed = int(failed.group(1))
            self._own.feed(record)
            return
        key = (int(match.group("rank")), match.groupdict().get("stream"))
        if key not in self._ranks:
            label = f"[rank {key[0]}] "
            self._ranks[key] = Stream(label, self._printer, self._tail, tail_prefix=label)
        piece = record[match.end() :]
        if piece.startswith(PREEMPTED_LINE):
            self.preempted.add(key[0])
        self._ranks[key].feed(piece)


def say(err: TextIO, message: str) -> None:
    """One `keras-distrib: message` line on `err`."""
    err.write(f"keras-distrib: {message}\n")
    err.flush()


def note(printer: Printer, err: TextIO, message: str) -> None:
    """One `[launcher] message` line on `err`, after any open redrawn line."""
    printer.end_line()
    err.write(f"[launcher] {message}\n")
    err.flush()
