"""The cluster of an `mpirun` job (keras_distrib/cluster/openmpi.py), with
the MPI exchange given as a function; the real one (mpi4py under Open MPI's
mpirun) runs in tests/distributed/test_mpirun.py."""

import socket
import sys

import pytest

from keras_distrib.cluster import ClusterConfigError, from_openmpi, resolve

RANK1 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}


def _exchange(others):
    """An exchange where rank 0 reports `others` and this process, rank 1,
    its own entry."""
    return lambda mine: [others, mine]


def test_processes_on_two_hosts_are_reached_by_their_host_names():
    seen = []
    info = from_openmpi(RANK1, lambda mine: seen.append(mine) or [("node-a", 4000), mine])
    ((host, port),) = seen
    assert host == socket.gethostname() and 1 <= port <= 65535
    assert info.workers == ("node-a:4000", f"{host}:{port}")
    assert (info.rank, info.world_size, info.is_chief) == (1, 2, False)


def test_processes_on_one_host_listen_on_loopback():
    info = from_openmpi(RANK1, lambda mine: [(mine[0], 4000), mine])
    assert info.workers == ("127.0.0.1:4000", f"127.0.0.1:{info.workers[1].split(':')[1]}")


def test_outside_mpirun_there_is_none_and_tf_config_comes_first():
    assert from_openmpi({}) is None
    assert from_openmpi({"OMPI_COMM_WORLD_RANK": "0"}) is None
    tf_config = '{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 0}}'
    assert resolve(environ={**RANK1, "TF_CONFIG": tf_config}).workers == ("a:1", "b:2")


@pytest.mark.parametrize(
    "environ, message",
    [
        (
            {**RANK1, "OMPI_COMM_WORLD_SIZE": "two"},
            "OMPI_COMM_WORLD_SIZE='two' must be a whole number; start the job with mpirun.",
        ),
        ({**RANK1, "OMPI_COMM_WORLD_RANK": "2"}, "OMPI_COMM_WORLD_RANK=2"),
        (
            {**RANK1, "OMPI_COMM_WORLD_SIZE": "0", "OMPI_COMM_WORLD_RANK": "0"},
            "OMPI_COMM_WORLD_SIZE=0 must be >= 1",
        ),
    ],
)
def test_malformed_variables_fail_in_one_line(environ, message):
    with pytest.raises(
        ClusterConfigError,
        match="^" + message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\."),
    ) as caught:
        from_openmpi(environ, _exchange(("a", 1)))
    assert "\n" not in str(caught.value)


def test_an_exchange_of_another_job_size_is_refused():
    with pytest.raises(
        ClusterConfigError,
        match="exchanged 3 addresses for "
        "OMPI_COMM_WORLD_SIZE=2; start every process of the job with the "
        "same mpirun",
    ):
        from_openmpi(RANK1, lambda mine: [("a", 1), mine, ("c", 3)])


def test_without_mpi4py_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py fails as if missing
    with pytest.raises(
        ClusterConfigError,
        match=r"finds the other processes through mpi4py, "
        r"which cannot be loaded .*; pip install 'keras-distrib\[mpi\]'",
    ) as caught:
        from_openmpi(RANK1)
    assert "\n" not in str(caught.value)
