"""Whom an elastic job leaves out: the charge the ranks' own diagnosis
makes (keras_distrib/launch/blame.py), and the probe that asks a host to
reach the job's rendezvous over the training network
(keras_distrib/launch/reachability.py; the whole launcher on a namespace
bed whose training link is cut: tests/distributed/test_elastic.py)."""

import os
import sys

import pytest

from keras_distrib.launch import blame, reachability
from keras_distrib.launch.output import Accounts


@pytest.mark.parametrize(
    "first, lost, expected",
    [
        # Nobody said anything: the rank that failed first.
        (0, {}, blame.Charge(0)),
        (None, {}, blame.Charge(None)),
        # Rank 1 was stopped (or hung): rank 0 failed first, naming it.
        (0, {0: {1}}, blame.Charge(1)),
        # Rank 0 was killed: rank 1 named it and said nothing else.
        (1, {1: {0}}, blame.Charge(0)),
        # Both alive, each unable to reach the other: the side away from rank 0.
        (0, {0: {1}, 1: {0}}, blame.Charge(1, partition=True)),
        (0, {0: {2}, 1: {2}, 2: {0, 1}}, blame.Charge(2, partition=True)),
        # Rank 0 said nothing of its own, rank 2 could not reach it: rank 0 is absent.
        (2, {2: {0}, 1: {0}}, blame.Charge(0)),
        # A rank naming itself does not count.
        (1, {1: {1}}, blame.Charge(1)),
    ],
)
def test_a_failure_is_charged_to_the_rank_the_others_could_not_reach(first, lost, expected):
    assert blame.charge(first, {r: frozenset(n) for r, n in lost.items()}) == expected


def test_the_launcher_reads_the_ranks_diagnoses_from_their_reports():
    accounts = Accounts()
    accounts.add("rank 0", '{"rank": 0, "lost": [1], "reason": "it lost a peer"}')
    accounts.add("rank 0", '{"rank": 0, "lost": [], "reason": "asked"}')
    accounts.add("rank 1", '{"rank": 1, "reason": "asked"}')
    accounts.add("horovodrun", '{"lost": [3]}')
    lost = accounts.lost_between(0.0, float("inf"))
    assert lost == {"rank 0": frozenset({1}), "horovodrun": frozenset({3})}
    assert blame.ranks_of(lost) == {0: frozenset({1})}
    # What a rank says after the launcher saw the failure is no diagnosis.
    assert accounts.lost_between(0.0, 0.0) == {}


def _ssh_here(tmp_path, exit_code=None, cut=False):
    """An --ssh_command that runs the probe on this machine, as ssh would on
    the host (`exit_code`: exits with it instead, as ssh does when it cannot
    connect; `cut`: runs it in a network namespace of its own, a host whose
    training network does not reach this one)."""
    path = tmp_path / ("ssh-cut" if cut else "ssh")
    run = 'exec unshare --net sh -c "$1"' if cut else 'exec sh -c "$1"'
    body = f"exit {exit_code}" if exit_code is not None else f"shift; {run}"
    path.write_text(f"#!/bin/sh\n{body}\n")
    os.chmod(path, 0o755)
    return str(path)


def test_a_host_is_present_when_it_reaches_the_rendezvous(tmp_path):
    # The rendezvous on this machine's 127.0.0.1; 198.51.100.7 (TEST-NET-2)
    # stands for a remote host that the stand-in ssh "reaches".
    with reachability.Rendezvous(["127.0.0.1", "198.51.100.7"], _ssh_here(tmp_path)) as rendezvous:
        assert rendezvous.address.startswith("127.0.0.1:")
        assert rendezvous.why_out("198.51.100.7") is None
        assert rendezvous.why_out("127.0.0.1") is None  # this machine always is
        assert rendezvous.out(["198.51.100.7"]) == {}


def test_a_host_ssh_reaches_but_the_training_network_does_not_is_out(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the stand-in host is a network namespace, made as root")
    with reachability.Rendezvous(
        ["127.0.0.1", "198.51.100.7"], _ssh_here(tmp_path, cut=True)
    ) as rendezvous:
        where = f"the job's rendezvous at {rendezvous.address} on the training network"
        assert rendezvous.why_out("198.51.100.7") == (
            f"ssh reaches it, but it cannot reach {where}",
            f"ssh reaches them, but they cannot reach {where}",
        )


def test_a_closed_rendezvous_probes_no_more(tmp_path):
    rendezvous = reachability.Rendezvous(["127.0.0.1", "198.51.100.7"], _ssh_here(tmp_path))
    rendezvous.close()
    assert rendezvous.why_out("198.51.100.7") == reachability.NO_ANSWER


def test_a_host_ssh_does_not_reach_does_not_answer(tmp_path):
    with reachability.Rendezvous(
        ["127.0.0.1", "198.51.100.7"], _ssh_here(tmp_path, exit_code=255)
    ) as rendezvous:
        assert rendezvous.out(["198.51.100.7"]) == {"198.51.100.7": reachability.NO_ANSWER}


def test_without_this_machine_among_the_hosts_the_probe_is_ssh_alone(tmp_path):
    rendezvous = reachability.Rendezvous(["198.51.100.7", "198.51.100.8"], _ssh_here(tmp_path))
    assert rendezvous.address is None
    assert rendezvous.why_out("198.51.100.8") is None  # `true` through ssh
    assert sys.executable  # the probe's Python is the launcher's, as the ranks'


def test_closing_the_rendezvous_kills_the_probes_under_way(tmp_path):
    """A probe waiting for a host that is gone (ssh still connecting) does
    not outlive the launcher's job."""
    import threading
    import time

    slow = tmp_path / "ssh-slow"
    pid_file = tmp_path / "probe.pid"
    slow.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 60\n")
    os.chmod(slow, 0o755)
    rendezvous = reachability.Rendezvous(["127.0.0.1", "198.51.100.7"], str(slow))
    answers = []
    probing = threading.Thread(target=lambda: answers.append(rendezvous.why_out("198.51.100.7")))
    probing.start()
    deadline = time.monotonic() + 10
    while not (pid_file.exists() and pid_file.read_text().strip()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    rendezvous.close()
    probing.join(timeout=5)
    assert answers == [reachability.NO_ANSWER]
    pid = int(pid_file.read_text())
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
