"""The link's ceiling for an all-reduce: the bytes a 2-rank ring all-reduce
puts on the wire, exchanged over one plain TCP connection.

A 2-rank ring all-reduce of S bytes is a reduce-scatter then an all-gather:
each rank sends S/2 bytes to the other and receives S/2, twice. This does
exactly that, with no reduction, no serialization and no framework: what
the two hosts and the link between them can carry, for benchmarks/
multi_host.py to set beside the all-reduce engines (bus bandwidth = S /
time, as theirs). On a test bed whose hosts share the machine's cores it
is also what those cores can copy through the kernel's network stack.

    python _sockets.py serve --sizes 1M,4M [--core 0]    # prints its port, then JSON
    python _sockets.py connect HOST:PORT --sizes 1M,4M [--core 1]

Both sides take the same `--sizes` and `--repeats`; the serving side
prints one JSON line: {"cases": [{"bytes": S, "times": [...]}, ...]}.
No TensorFlow.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

from absl import app, flags

import _harness

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["1M"], "Bytes per all-reduce, with K/M suffixes.")
flags.DEFINE_integer("repeats", 3, "Timings per size.", lower_bound=1)
flags.DEFINE_float("timeout", 60.0, "Seconds any socket operation may wait.")
flags.DEFINE_integer(
    "core", -1, "Pin this process to this core (as the engines' workers are; -1: not pinned)."
)

# Each command and the length of its argv: the script, the command, its arguments.
_COMMANDS = {"serve": 2, "connect": 3}


def _recv_into(sock: socket.socket, buffer: bytearray) -> None:
    view, got = memoryview(buffer), 0
    while got < len(buffer):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("the peer closed the connection")
        got += n


def _exchange(sock: socket.socket, out: bytearray, into: bytearray) -> None:
    """Send `out` while receiving `into`: both directions at once, as a ring step."""
    receiver = threading.Thread(target=_recv_into, args=(sock, into))
    receiver.start()
    sock.sendall(out)
    receiver.join()


def _sync(sock: socket.socket) -> None:
    sock.sendall(b"s")
    _recv_into(sock, bytearray(1))


def measure(sock: socket.socket, sizes: list[int], repeats: int) -> list[dict]:
    cases = []
    for size in sizes:
        out, into = bytearray(size // 2), bytearray(size // 2)
        _sync(sock)
        _exchange(sock, out, into)  # warm-up: grows the socket buffers
        times = []
        for _ in range(repeats):
            _sync(sock)
            start = time.perf_counter()
            _exchange(sock, out, into)  # reduce-scatter
            _exchange(sock, out, into)  # all-gather
            times.append(time.perf_counter() - start)
        cases.append({"bytes": size, "times": times})
    return cases


def main(argv):
    if len(argv) < 2 or _COMMANDS.get(argv[1]) != len(argv):
        raise app.UsageError("use: _sockets.py serve | _sockets.py connect HOST:PORT")
    sizes = [_harness.parse_size(s) for s in FLAGS.sizes]
    if FLAGS.core >= 0:
        os.sched_setaffinity(0, {FLAGS.core % os.cpu_count()})
    if argv[1] == "serve":
        with socket.create_server(("0.0.0.0", 0)) as listener:
            listener.settimeout(FLAGS.timeout)
            print(listener.getsockname()[1], flush=True)
            sock, _ = listener.accept()
    else:
        host, _, port = argv[2].rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=FLAGS.timeout)
    with sock:
        sock.settimeout(FLAGS.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cases = measure(sock, sizes, FLAGS.repeats)
    if argv[1] == "serve":
        print(json.dumps({"cases": cases}), flush=True)
    return 0


if __name__ == "__main__":
    app.run(main)
