"""This process's flight recorder: where it is, told when a job stalls.

A stuck multi-process job ends (the collective watchdog, the coordination
service's heartbeats), but which rank did not arrive, and where it was,
takes every rank's own account. Each rank of a launched job keeps what the
account needs: its step (`record_step`, after each call of the train
function), the collectives it waits in (the watchdog's armed collectives,
the eager ones in `in_collective`, with their bytes and since when), and,
taken when asked, every thread's Python stack.

`report(reason)` prints the account as one line on stderr
(`launch_contract.FLIGHT_RECORDER_LINE` and JSON), which the launcher reads
off the rank's output. A rank reports on its own when its watchdog fires or
it loses a peer (naming the ranks it could not reach, `lost`: an elastic
launch leaves out the one the others could not reach); the launcher asks
the others (and every rank on
`kill -USR1 <launcher>`, at a failure that followed a stall, and at
`--timeout`) through the control channel: the rank's standard input, whose
file descriptor `KERAS_DISTRIB_CONTROL_FD` names (set by the launcher, over
ssh too). A daemon thread reads it, so a rank answers while its main thread
waits in a collective or sleeps in a callback (both release the GIL); a
stopped (SIGSTOP) rank cannot, and the launcher says so.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
import weakref
from typing import Iterator, Optional, Sequence

from keras_distrib.cluster.launch_contract import CONTROL_FD_ENV, FLIGHT_RECORDER_LINE

# The innermost frames kept of each thread's stack.
MAX_FRAMES = 40

_lock = threading.Lock()
_step: Optional[dict] = None
_watchdogs: "weakref.WeakSet" = weakref.WeakSet()
_eager: dict[int, tuple[str, float]] = {}  # token -> (what, since: monotonic)
_tokens = itertools.count(1)
_reader: Optional[threading.Thread] = None
_progress_told = -1e9  # when this rank last told the launcher it progresses (monotonic)
# At most one progress line per this many seconds.
PROGRESS_SECONDS = 1.0


def record_step(epoch: int, step: int, steps_done: int) -> None:
    """This process finished `step` (1-based) of `epoch` (0-based), its
    `steps_done`-th optimizer step of the running `fit`. A launched rank
    tells the launcher it progresses, at most every `PROGRESS_SECONDS`
    (`--stall_warning` watches these lines)."""
    global _step, _progress_told
    _step = {"epoch": epoch + 1, "step": step, "steps_done": steps_done}
    now = time.monotonic()
    if _reader is not None and now - _progress_told >= PROGRESS_SECONDS:
        _progress_told = now
        _say(json.dumps({"progress": _step}, separators=(",", ":")))


def watch(watchdog) -> None:
    """Adds a `CollectiveWatchdog`, whose armed collectives the account lists."""
    _watchdogs.add(watchdog)


def described(what: str, nbytes: Optional[int]) -> str:
    """`what, 4096 bytes`, or `what` when the size is unknown (None)."""
    return what if nbytes is None else f"{what}, {nbytes} bytes"


@contextlib.contextmanager
def in_collective(what: str, nbytes: Optional[int]) -> Iterator[None]:
    """An eager collective named `what`, of `nbytes`, runs within."""
    token = next(_tokens)
    with _lock:
        _eager[token] = (described(what, nbytes), time.monotonic())
    try:
        yield
    finally:
        with _lock:
            _eager.pop(token, None)


def snapshot(reason: str, asked: bool = False, lost: Sequence[int] = ()) -> dict:
    """The account: rank, step, collectives waited in, every thread's stack;
    `reason` why it is taken, `asked` whether the launcher asked for it,
    `lost` the ranks this one could not reach (its own diagnosis, which the
    launcher weighs when it decides whom to leave out of an elastic job)."""
    now = time.monotonic()
    with _lock:
        eager = [(what, now - since) for what, since in _eager.values()]
    waiting = [w for dog in list(_watchdogs) for w in dog.in_flight()] + eager
    main = threading.main_thread().ident
    names = {t.ident: t.name for t in threading.enumerate()}
    threads = []
    for ident, frame in sys._current_frames().items():
        frames = [f for f in traceback.extract_stack(frame) if f.filename != __file__][-MAX_FRAMES:]
        threads.append(
            {
                "name": names.get(ident, str(ident)),
                "main": ident == main,
                "frames": [
                    [f.filename, f.lineno, f.name, f.line or "", is_user_code(f.filename)]
                    for f in frames
                ],
            }
        )
    threads.sort(key=lambda t: not t["main"])
    return {
        "rank": _rank(),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "reason": reason,
        "asked": asked,
        "lost": sorted(set(lost)),
        "step": _step,
        "collectives": [
            {"what": what, "waited": round(waited, 3)}
            for what, waited in sorted(waiting, key=lambda w: -w[1])
        ],
        "threads": threads,
    }


def report(reason: str, asked: bool = False, lost: Sequence[int] = ()) -> None:
    """Prints the account on stderr as one line the launcher reads."""
    _say(json.dumps(snapshot(reason, asked, lost), separators=(",", ":")))


def install() -> None:
    """Answers the launcher's requests from now on, when launched by it
    (`KERAS_DISTRIB_CONTROL_FD` set); else does nothing."""
    global _reader
    fd = os.environ.get(CONTROL_FD_ENV)
    if fd is None or _reader is not None or not fd.isdigit():
        return
    _reader = threading.Thread(
        target=_answer, args=(int(fd),), daemon=True, name="keras_distrib-flight-recorder"
    )
    _reader.start()
    _say('{"ready":true}')  # the launcher waits for answers from ranks that said so


def _say(text: str) -> None:
    stream = sys.__stderr__ or sys.stderr
    try:
        stream.write(FLIGHT_RECORDER_LINE + text + "\n")
        stream.flush()
    except (OSError, ValueError):
        pass  # no stderr left: nothing to tell anyone


def _answer(fd: int) -> None:
    """Reads `report <reason>` lines until the launcher closes the channel."""
    pending = b""
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:
            return
        if not data:
            return
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            command, _, reason = line.decode("utf-8", "replace").partition(" ")
            if command == "report":
                report(reason, asked=True)


def _rank() -> Optional[int]:
    value = os.environ.get("KERAS_DISTRIB_RANK")
    return int(value) if value is not None and value.isdigit() else None


_LIBRARIES = tuple(
    p
    for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if p
)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def is_user_code(filename: str) -> bool:
    """Whether a frame's file is the user's (not Python's, a library's or
    keras_distrib's own)."""
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    return not path.startswith(_LIBRARIES + (_PACKAGE + os.sep,))
