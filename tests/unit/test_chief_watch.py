"""A parameter-server task's server takes its chief for gone only once the
chief's port, having answered, refuses connections for CHIEF_GONE_SECONDS
in a row (keras_distrib/strategies/parameter_server/task_server.py); the
whole path, servers ending with their chief under a real `srun`, is in
tests/distributed/test_slurm.py."""

import socket
import time

from keras_distrib.strategies.parameter_server import task_server


def _listening():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_chief_not_yet_up_is_not_gone_one_that_went_away_is(monkeypatch):
    monkeypatch.setattr(task_server, "CHIEF_GONE_SECONDS", 0.3)
    chief = _listening()
    port = chief.getsockname()[1]
    chief.close()
    watch = task_server._ChiefWatch(f"127.0.0.1:{port}")
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # refused, but never answered: still starting
        assert not watch.gone()
    chief = socket.socket()
    chief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    chief.bind(("127.0.0.1", port))
    chief.listen()
    assert not watch.gone()  # it answers
    chief.close()
    assert not watch.gone()  # refused since just now
    time.sleep(0.35)
    assert watch.gone()


def test_a_chief_answering_again_starts_the_count_afresh(monkeypatch):
    monkeypatch.setattr(task_server, "CHIEF_GONE_SECONDS", 0.3)
    chief = _listening()
    host, port = chief.getsockname()
    watch = task_server._ChiefWatch(f"{host}:{port}")
    assert not watch.gone()
    chief.close()
    assert not watch.gone()
    time.sleep(0.2)
    chief = socket.socket()
    chief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    chief.bind((host, port))
    chief.listen()
    assert not watch.gone()
    chief.close()
    time.sleep(0.2)
    assert not watch.gone()  # counted from the refusal after it answered again
