"""The TCP connections of a ring all-reduce: joining, and moving bytes with a deadline.

For `TcpRing` (`keras_distrib.collectives.tcp_ring`, whose docstring
describes the protocol): each worker listens on its own host (`listen`),
connects to the next worker of the ring and accepts the previous one
(`join_ring`). A connection is authenticated by the job's secret: the
connecting side's first bytes are a magic, the secret and its rank; the
accepting side answers one byte if they are right and closes the socket
otherwise (another job's worker, a port scanner), then goes on waiting for
the right one.

`Link` wraps one connected socket and the peer at its other end, and turns
every way a transfer can fail into a `PeerLostError` naming that peer: it
closed or reset the connection (it exited, or its host dropped it: seen at
once), sent or took nothing for `timeout` seconds (it is stuck, stopped,
or its host is unreachable), or left data or keepalive probes unanswered
for `unreachable_after` seconds (a cut link, a host gone). Waits poll
every `POLL` seconds, so a caller can also check what else may have
failed meanwhile. `Sender` is the thread
that sends a ring's queued segments to its right neighbour, in order.

Standard library only.
"""

from __future__ import annotations

import errno
import hmac
import queue
import socket
import struct
import threading
import time
from typing import Callable, Optional, Sequence

from keras_distrib.collectives.shm_peers import PeerLostError

MAGIC = b"kd-ring1"
SECRET_BYTES = 16
_HELLO = struct.Struct(f"<{len(MAGIC)}s{SECRET_BYTES}sI")  # magic, secret, sender's rank
_ACCEPTED = b"\x01"
POLL = 0.25  # seconds between checks while a transfer waits
_TCP_CLOSE = 7  # tcp_info's tcpi_state of a connection the kernel has ended
_HANDSHAKE_SECONDS = 10.0
# What a socket call raises when its kernel timeout passes with nothing moved.
_WAITED = (BlockingIOError, socket.timeout)  # a connection must send its hello within this
# Socket buffers asked for (the kernel caps them at net.core.[rw]mem_max);
# None leaves Linux's autotuning alone.
BUFFER_BYTES: Optional[int] = None


def address_text(host: str, port: int) -> str:
    """`host:port`, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(host: str, port: int = 0) -> socket.socket:
    """A socket listening on `host` (an address or name of this host; ""
    for every interface) at `port` (0: a free one, `getsockname()[1]`)."""
    if not host and socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=16)


class Link:
    """One connected socket to the worker `rank` at `address`."""

    def __init__(
        self,
        sock: socket.socket,
        rank: int,
        address: str,
        what: str,
        unreachable_after: Optional[float] = None,
    ):
        self.sock, self.rank, self.address, self.what = sock, rank, address, what
        self.timeout: Optional[float] = None
        self.unreachable_after = unreachable_after
        _tune(sock, unreachable_after)

    def lost(self, how: str) -> PeerLostError:
        return PeerLostError(
            f"{self.what}: worker {self.rank} at {self.address} {how}", peers=[self.rank]
        )

    def closed(self, error: Optional[BaseException] = None) -> PeerLostError:
        cause = f" ({error.strerror or error})" if isinstance(error, OSError) else ""
        return self.lost(
            f"closed the connection{cause}: it exited or failed; see its output for the cause."
        )

    def failed(self, error: Optional[OSError] = None) -> PeerLostError:
        """What a failed socket call (`error`; None: the connection ended)
        means: the kernel gave up on an unanswered connection
        (`unreachable_after`), or the peer closed it."""
        if self.unreachable_after is not None and _gave_up(self.sock, error):
            return self.lost(
                f"is unreachable: the connection got no answer for {self.unreachable_after:g}s "
                "(KERAS_DISTRIB_HEARTBEAT_TIMEOUT in a multi_worker job): its host is down, "
                "the network to it is cut, or its process is gone."
            )
        return self.closed(error)

    def late(self, doing: str) -> PeerLostError:
        return self.lost(
            f"{doing} for {self.timeout:g}s (collective_timeout): it is stuck, stopped, "
            "runs different code, or its host is unreachable."
        )

    def send(self, view: memoryview, check: Callable[[], None]) -> None:
        """Sends all of `view`; `check()` runs whenever a wait lasts `POLL`."""
        sent, last = 0, time.monotonic()
        while sent < len(view):
            try:
                n = self.sock.send(view[sent:])
            except _WAITED:
                check()
                if self.timeout is not None and time.monotonic() - last > self.timeout:
                    raise self.late("took no data") from None
                continue
            except OSError as e:
                raise self.failed(e) from None
            sent, last = sent + n, time.monotonic()

    def recv_into(self, view: memoryview, check: Callable[[], None]) -> None:
        """Fills `view`; `check()` runs whenever a wait lasts `POLL`."""
        got, last = 0, time.monotonic()
        while got < len(view):
            try:
                n = self.sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
            except _WAITED:
                check()
                if self.timeout is not None and time.monotonic() - last > self.timeout:
                    raise self.late("sent nothing") from None
                continue
            except OSError as e:
                raise self.failed(e) from None
            if not n:
                raise self.failed()
            got, last = got + n, time.monotonic()

    def check_open(self) -> None:
        """Fails if the peer closed this connection (on which it sends nothing)."""
        try:
            data = self.sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK)
        except (BlockingIOError, socket.timeout):
            return
        except OSError as e:
            raise self.failed(e) from None
        if not data:
            raise self.failed()

    def close(self) -> None:
        """Shuts the connection down (waking a thread blocked on it) and closes it."""
        for end in (lambda: self.sock.shutdown(socket.SHUT_RDWR), self.sock.close):
            try:
                end()
            except OSError:
                pass


def _gave_up(sock: socket.socket, error: Optional[OSError]) -> bool:
    """Whether the kernel dropped `sock` for want of answers (its user
    timeout), not the peer: the call failed with ETIMEDOUT, or the
    connection ended without the peer's FIN or reset (its state is CLOSE:
    a FIN leaves it in CLOSE_WAIT, a reset fails the call with ECONNRESET)."""
    if error is not None and error.errno == errno.ETIMEDOUT:
        return True
    if error is not None and error.errno == errno.ECONNRESET:
        return False
    try:
        state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    except OSError:
        return False
    return state == _TCP_CLOSE


def _tune(sock: socket.socket, unreachable_after: Optional[float] = None) -> None:
    """No Nagle; blocking calls that give up after `POLL` in the kernel
    (`SO_RCVTIMEO`/`SO_SNDTIMEO`), so that one `recv(MSG_WAITALL)` or
    `send` moves a whole segment: one system call and one wake-up, where
    Python's own timeouts make the socket non-blocking and poll before
    every call. With `unreachable_after` (seconds), keepalive probes every
    second of silence and `TCP_USER_TIMEOUT`: the kernel drops a connection
    whose data or probes go unanswered that long (a cut link, a host gone:
    no FIN ever comes), and the next call fails with ETIMEDOUT."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if unreachable_after is not None and hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, int(unreachable_after)))
        milliseconds = max(1, int(unreachable_after * 1000))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, milliseconds)
    if BUFFER_BYTES is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER_BYTES)
    sock.settimeout(None)
    seconds = int(POLL)
    interval = struct.pack("ll", seconds, int((POLL - seconds) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, interval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, interval)


def join_ring(
    listener: socket.socket,
    rank: int,
    addresses: list,
    secret: bytes,
    timeout: float,
    what: str,
    names: Optional[Sequence[int]] = None,
    unreachable_after: Optional[float] = None,
) -> tuple:
    """`(left, right)`: the `Link`s from worker `rank - 1` and to `rank + 1`.

    Connects and says hello (on a thread: the neighbour may not listen
    yet) while accepting, then waits for the answer: no order of starts
    deadlocks. Raises `PeerLostError` naming a worker not joined within
    `timeout` seconds, or one that refused this worker's secret. Errors
    and links name each worker as `names` does (its rank in the job, by
    index in the ring; default: the index). `unreachable_after`: see `Link`.

    Two workers, each the other's left and right, share one connection
    (worker 0 dials): its acknowledgements ride on the data going the other
    way, where a connection per direction sends them in packets of their
    own, so it moves the same bytes on less CPU (benchmarks/tcp_engine.py).
    """
    world = len(addresses)
    left_index, right_index = (rank - 1) % world, (rank + 1) % world
    name = list(range(world)) if names is None else list(names)
    left_rank, right_rank = name[left_index], name[right_index]
    deadline = time.monotonic() + timeout
    right_at = address_text(*addresses[right_index])
    dialer = None
    if world > 2 or rank == 0:  # two workers: worker 0 dials, worker 1 accepts
        hello = _HELLO.pack(MAGIC, secret, rank)  # the hello holds the index
        dialer = _Dialer(addresses[right_index], right_rank, hello, deadline, what)
    left = right = None
    try:
        try:
            if world > 2 or rank == 1:
                where = address_text(*addresses[left_index])
                left_sock = _accept(listener, left_index, left_rank, secret, deadline, what, where)
                left = Link(left_sock, left_rank, where, what, unreachable_after)
        finally:
            if dialer is not None:
                dialer.join()
        if dialer is not None:
            right = Link(dialer.connected(), right_rank, right_at, what, unreachable_after)
            right.timeout = max(deadline - time.monotonic(), 0.0)
            right.recv_into(memoryview(bytearray(1)), lambda: None)  # accepted
    except BaseException as e:
        for link in (left, right):
            if link is not None:
                link.close()
        dialed = None if dialer is None else dialer.sock
        raise _join_failed(e, dialed, right, right_rank, right_at, timeout) from None
    left, right = left or right, right or left
    assert left is not None and right is not None
    left.timeout = right.timeout = None
    return left, right


class _Dialer:
    """Connects to `(host, port)` and says `hello`, on a thread of its own
    (the neighbour may not listen yet), until `deadline`."""

    def __init__(self, address: tuple, peer: int, hello: bytes, deadline: float, what: str):
        self.sock: Optional[socket.socket] = None
        self._error: Optional[BaseException] = None
        self._args = (*address, peer, deadline, what)
        self._hello = hello
        self._thread = threading.Thread(
            target=self._dial, name="keras_distrib-tcp-ring-dial", daemon=True
        )
        self._thread.start()

    def _dial(self) -> None:
        try:
            self.sock = _connect(*self._args)
            self.sock.sendall(self._hello)
        except BaseException as e:  # raised by `connected`
            self._error = e

    def join(self) -> None:
        self._thread.join()

    def connected(self) -> socket.socket:
        """The socket, handed over (the dialer's error if it failed)."""
        if self._error is not None:
            raise self._error
        sock, self.sock = self.sock, None
        assert sock is not None
        return sock


def _join_failed(
    error: BaseException,
    dialed: Optional[socket.socket],
    right: Optional[Link],
    right_rank: int,
    address: str,
    timeout: float,
) -> BaseException:
    """What to raise for `error` while joining: a refusal by the right
    neighbour (it closed the connection we made, `dialed`, or never
    answered on `right`) named as such."""
    if not isinstance(error, PeerLostError):
        return error
    if dialed is not None:  # we never got to wait for the answer
        refused = _refused(dialed)
        dialed.close()
        if refused:
            return PeerLostError(
                f"{str(error).split(':', 1)[0]}: worker {right_rank} at {address} "
                "refused this worker's connection: not a worker of this job (another secret).",
                peers=[right_rank],
            )
    if right is not None and error.peers == (right_rank,):
        return right.lost(
            f"refused this worker's connection within {timeout:g}s: not a worker "
            "of this job (another secret), or it failed."
        )
    return error


def _refused(sock: socket.socket) -> bool:
    """Whether the other end closed `sock` (a connection we made and said hello on)."""
    try:
        return sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except (BlockingIOError, socket.timeout):
        return False
    except OSError:
        return True


def _connect(host: str, port: int, peer: int, deadline: float, what: str) -> socket.socket:
    """A connection to `host:port`, retried until `deadline` while refused."""
    while True:
        left = deadline - time.monotonic()
        try:
            return socket.create_connection((host, port), timeout=max(min(left, 5.0), 0.1))
        except OSError as e:
            if time.monotonic() + 0.05 >= deadline:
                raise PeerLostError(
                    f"{what}: could not connect to worker {peer} at "
                    f"{address_text(host, port)} ({e.strerror or e}); check that it runs "
                    "and that this host reaches it.",
                    peers=[peer],
                ) from None
            time.sleep(0.05)


def _accept(
    listener: socket.socket,
    peer: int,
    name: int,
    secret: bytes,
    deadline: float,
    what: str,
    where: str = "",
) -> socket.socket:
    """The connection of the worker at index `peer` (named `name`, listening
    at `where`) that says the right hello; any other is closed. Fails at
    `deadline`, saying so if that worker's hello came with another secret."""
    refused = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            if refused:
                raise PeerLostError(
                    f"{what}: worker {name} at {where} connected with another secret and "
                    "this worker refused its connection: not a worker of this job.",
                    peers=[name],
                )
            raise PeerLostError(
                f"{what}: worker {name} did not connect (with this job's secret) in time; "
                "check that it runs and reaches this host.",
                peers=[name],
            )
        listener.settimeout(min(left, POLL))
        try:
            sock, _ = listener.accept()
        except socket.timeout:
            continue
        hello = _hello(sock, min(_HANDSHAKE_SECONDS, max(left, 0.1)))
        if hello is not None and hello[0] == MAGIC and hello[2] == peer:
            if hmac.compare_digest(hello[1], secret):
                sock.sendall(_ACCEPTED)
                return sock
            refused = True
        sock.close()


def _hello(sock: socket.socket, seconds: float) -> Optional[tuple]:
    """`(magic, secret, index)` of the hello `sock` sends first (None: it
    sent none within `seconds`)."""
    sock.settimeout(seconds)
    hello = bytearray(_HELLO.size)
    got = 0
    try:
        while got < len(hello):
            n = sock.recv_into(memoryview(hello)[got:])
            if not n:
                return None
            got += n
    except OSError:
        return None
    return _HELLO.unpack(hello)


class Sender:
    """The thread that sends the queued segments to the right neighbour, in order."""

    def __init__(self, link) -> None:
        self._link = link
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = False
        # Segments queued (counted by the caller's thread) and sent or
        # dropped (by this thread): each counter has one writer.
        self._queued = self._done = 0
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(
            target=self._run, name="keras_distrib-tcp-ring-send", daemon=True
        )
        self._thread.start()

    @property
    def pending(self) -> int:
        """Segments queued and not yet sent."""
        return self._queued - self._done

    def put(self, view: memoryview) -> None:
        self._queued += 1
        self._queue.put(view)

    def mark(self) -> threading.Event:
        """An event set once everything queued before it is sent (or failed)."""
        done = threading.Event()
        self._queue.put(done)
        return done

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
            elif self.error is None:
                try:
                    self._link.send(item, self._check)
                except BaseException as e:
                    self.error = e
            if not isinstance(item, threading.Event):
                self._done += 1

    def _check(self) -> None:
        if self._stopping:
            raise RuntimeError(f"{self._link.what}: closed while sending.")

    def stop(self) -> None:
        self._stopping = True
        self._queue.put(None)

    def join(self) -> None:
        self._thread.join(timeout=2 * POLL + 1)
