"""The heartbeat timeout's setting and the peer a heartbeat failure names
(keras_distrib/collectives/heartbeats.py; the faults themselves, on real
hosts: tests/distributed/test_network_faults.py)."""

import pytest

from keras_distrib.cluster import ClusterConfigError, ClusterInfo
from keras_distrib.collectives import heartbeats

INFO = ClusterInfo(["10.0.0.1:2222", "10.0.0.2:2222", "10.0.0.3:2222"], 0)

# The ends of what TensorFlow 2.21 raises on each side of a cut link.
ON_THE_LEADER = (
    "Collective ops is aborted by: Error reported from /job:worker/task:1: The following "
    "tasks are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:2\n"
    "The tasks have crashed. Check the task logs for an earlier error, or scheduler events "
    "(e.g. preemption, eviction) to debug further."
)
ON_THE_CUT_HOST = (
    "Collective ops is aborted by: Deadline Exceeded\n\n"
    "RPC: /tensorflow.CoordinationService/Heartbeat\n"
    "The error could be from a previous operation. Restart your program to reset."
)


@pytest.mark.parametrize("value, seconds", [(None, 10.0), ("", 10.0), ("2.5", 2.5)])
def test_the_timeout_is_tensorflows_unless_set(monkeypatch, value, seconds):
    if value is None:
        monkeypatch.delenv(heartbeats.ENV, raising=False)
    else:
        monkeypatch.setenv(heartbeats.ENV, value)
    assert heartbeats.timeout() == seconds


@pytest.mark.parametrize("value", ["soon", "0", "-3"])
def test_a_bad_timeout_is_one_line_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(heartbeats.ENV, value)
    with pytest.raises(ClusterConfigError) as excinfo:
        heartbeats.timeout()
    message = str(excinfo.value)
    assert "\n" not in message
    assert f"KERAS_DISTRIB_HEARTBEAT_TIMEOUT={value!r} must be a positive number" in message


def test_the_leader_names_the_peer_that_went_silent(monkeypatch):
    monkeypatch.setenv(heartbeats.ENV, "4")
    line = heartbeats.lost_peer(RuntimeError(ON_THE_LEADER), INFO)
    assert "\n" not in line
    assert line.startswith(
        "worker 2 at 10.0.0.3:2222 is unreachable: no heartbeat reached "
        "the coordination service for KERAS_DISTRIB_HEARTBEAT_TIMEOUT=4s"
    )


def test_a_cut_off_worker_names_the_leader(monkeypatch):
    monkeypatch.delenv(heartbeats.ENV, raising=False)
    line = heartbeats.lost_peer(RuntimeError(ON_THE_CUT_HOST), INFO)
    assert "\n" not in line
    assert line.startswith(
        "worker 0 at 10.0.0.1:2222, the coordination service's leader, is "
        "unreachable: this worker's heartbeat got no answer within "
        "KERAS_DISTRIB_HEARTBEAT_TIMEOUT=10s"
    )


def test_other_errors_are_left_alone():
    assert heartbeats.lost_peer(ValueError("shapes differ"), INFO) is None


def test_a_heartbeat_failure_gives_the_ranks_it_names_for_the_launcher():
    assert heartbeats.lost_ranks(RuntimeError(ON_THE_LEADER)) == [2]
    assert heartbeats.lost_ranks(RuntimeError(ON_THE_CUT_HOST)) == [0]
    assert heartbeats.lost_ranks(ValueError("shapes differ")) == []
