"""The link watch behind `implementation="gloo"`'s cut links
(keras_distrib/collectives/link_watch.py), on real sockets. On the bed:
tests/distributed/test_network_faults.py (a cut link, on Gloo)."""

import contextlib
import socket
import time

from keras_distrib.cluster import free_ports
from keras_distrib.collectives import link_watch


@contextlib.contextmanager
def _silent():
    """`host:port` where a connection gets no answer at all, as behind a cut
    link: a listener whose accept queue is full (Linux drops the SYNs)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        queued = [socket.socket() for _ in range(3)]
        try:
            for sock in queued:
                sock.setblocking(False)
                sock.connect_ex(listener.getsockname())
            address = "127.0.0.1:%d" % listener.getsockname()[1]
            deadline = time.monotonic() + 30
            while link_watch.answers(address) and time.monotonic() < deadline:
                pass  # the queue fills as the handshakes complete
            yield address
        finally:
            for sock in queued:
                sock.close()


def test_a_refusal_is_an_answer_and_silence_is_not():
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert link_watch.answers(f"127.0.0.1:{server.getsockname()[1]}")
    (closed,) = free_ports(1)
    assert link_watch.answers(f"127.0.0.1:{closed}")  # nothing listens: the host is there
    with _silent() as silent:
        assert not link_watch.answers(silent)


def test_cutting_ends_a_wait_on_a_connection_to_that_host():
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname(), timeout=30)
        accepted, _ = server.accept()
        with client, accepted:
            assert link_watch.cut_connections_to("127.0.0.1") >= 1
            assert client.recv(1) == b""  # the wait ends at once, not after 30 s


def test_a_silent_neighbour_is_lost_in_one_line_naming_it():
    with socket.create_server(("127.0.0.1", 0)) as server, _silent() as silent:
        workers = [f"127.0.0.1:{server.getsockname()[1]}", silent]
        watch = link_watch.LinkWatch(workers, 0, unreachable_after=1.0)
        try:
            deadline = time.monotonic() + 60
            while watch.lost is None and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            watch.stop()
    assert watch.lost == (
        f"worker 1 at {silent} is unreachable: its host answered nothing for 1s "
        "(KERAS_DISTRIB_HEARTBEAT_TIMEOUT)"
    )
