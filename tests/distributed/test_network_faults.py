"""Network faults between hosts: one line naming the peer, or a job that goes on.

Two hosts are two network namespaces (tests/netns_hosts.py); the launcher
starts one `multi_worker` rank on each through its `--ssh_command`, so the
workers talk over TensorFlow's collectives across the link, as on two
machines (`implementation="ring"`: "auto" may measure our TCP ring faster,
whose cut links tests/distributed/test_tcp_ring.py covers; and once
`implementation="gloo"`, whose link watch finds them). Every rank of
tests/workers/faults.py pauses after step 6 until the test has cut host
1's link (and, for a flap, restored it after a while); training then goes
on against the cut. TensorFlow's coordination
service decides when a peer is lost: its heartbeat timeout
(`KERAS_DISTRIB_HEARTBEAT_TIMEOUT`).
"""

import glob
import os
import re
import time

import pytest

import fault_job
from fault_job import FAULTS
from helpers import launch

pytestmark = pytest.mark.slow

PAUSE_AFTER = 6


def _cut_link(bed, out, host, seconds=None, also=None):
    """`launch(during=...)`: once every rank paused, cuts `host`'s link (for
    `seconds`, or for good), runs `also(bed)`, and lets the ranks go on."""

    def during(proc):
        deadline = time.monotonic() + 120
        while len(glob.glob(os.path.join(out, "paused-rank*"))) < bed.n:
            assert proc.poll() is None and time.monotonic() < deadline, "no rank paused"
            time.sleep(0.05)
        bed.cut(host)
        if also:
            also(bed)
        open(os.path.join(out, "go"), "w").close()
        if seconds is not None:
            time.sleep(seconds)  # the outage itself, not a wait for anything
            bed.restore(host)

    return during


def _launch_across(bed, out, fault, env=None, launch_flags=(), implementation="ring"):
    return launch(
        out,
        2,
        FAULTS,
        "--out",
        str(out),
        "--backup",
        str(out / "backup"),
        "--pause_after_step",
        str(PAUSE_AFTER),
        "--implementation",
        implementation,
        expect=None,
        env=env,
        timeout=200,
        during=fault,
        launch_flags=(
            "--hosts",
            bed.hosts_flag(),
            "--ssh",
            "--ssh_command",
            bed.ssh_command,
            *launch_flags,
        ),
    )


def _assert_nothing_left(bed, out):
    assert bed.pids() == [], "a process outlived the job on a host"
    # Ranks on other hosts get no shared-memory directory from the launcher.
    attempts = [a for runs in fault_job.attempts(out, bed.n).values() for a in runs]
    assert attempts and all(a.shm_dir == "-" for a in attempts), attempts


def test_a_cut_link_ends_both_workers_in_one_line_naming_the_peer(tmp_path, hosts):
    bed = hosts(2)
    code, output = _launch_across(
        bed, tmp_path, _cut_link(bed, tmp_path, 1), env={"KERAS_DISTRIB_HEARTBEAT_TIMEOUT": "3"}
    )
    assert code != 0, output[-3000:]
    a, b = (f"{address}:23456" for address in bed.addresses)
    # Worker 0 leads the coordination service and misses worker 1's heartbeats.
    assert re.search(
        rf"\[rank 0\] \S*PeerLostError: multi_worker: worker 1 at {b} is "
        r"unreachable: no heartbeat reached the coordination service for "
        r"KERAS_DISTRIB_HEARTBEAT_TIMEOUT=3s \(",
        output,
    ), output[-3000:]
    # Worker 1's heartbeats to worker 0 go unanswered.
    assert re.search(
        rf"\[rank 1\] \S*PeerLostError: multi_worker: worker 0 at {a}, the "
        r"coordination service's leader, is unreachable: this worker's heartbeat "
        r"got no answer within KERAS_DISTRIB_HEARTBEAT_TIMEOUT=3s",
        output,
    ), output[-3000:]
    summary = output[output.index("keras-distrib: rank ") :]
    assert (
        f"worker 1 at {b} is unreachable" in summary
        or f"worker 0 at {a}, the coordination service's leader, is unreachable" in summary
    )
    # The flight recorder's screen: the ranks said on their own whom they lost.
    screen = output[output.index("keras-distrib: flight recorder (") :]
    assert re.search(
        rf"reported on its own: it lost a peer: (worker 1 at {b} is unreachable|"
        rf"worker 0 at {a}, the coordination service's leader)",
        screen,
    ), screen
    _assert_nothing_left(bed, tmp_path)


def test_on_gloo_a_cut_link_ends_both_workers_in_one_line_naming_the_peer(tmp_path, hosts):
    """Gloo waits for a cut link's bytes for all of `collective_timeout`;
    each worker's link watch finds its neighbour's host silent after the
    heartbeat timeout and ends the wait (keras_distrib/collectives/
    link_watch.py)."""
    pytest.importorskip("horovod.tensorflow", reason="Gloo is Horovod's (make setup)")
    bed = hosts(2)
    code, output = _launch_across(
        bed,
        tmp_path,
        _cut_link(bed, tmp_path, 1),
        env={"KERAS_DISTRIB_HEARTBEAT_TIMEOUT": "3"},
        implementation="gloo",
    )
    assert code != 0, output[-3000:]
    assert "keras-distrib: timed out after" not in output, output[-3000:]
    for rank, peer in ((0, 1), (1, 0)):
        assert re.search(
            rf"\[rank {rank}\] \S*PeerLostError: multi_worker: worker {peer} at "
            rf"{bed.addresses[peer]}:23456 is unreachable: its host answered nothing for 3s "
            r"\(KERAS_DISTRIB_HEARTBEAT_TIMEOUT\); Horovod's Gloo collectives stopped",
            output,
        ), output[-3000:]
    _assert_nothing_left(bed, tmp_path)


def test_a_host_that_disappears_fails_the_launch_naming_its_rank(tmp_path, hosts):
    bed = hosts(2)
    # Worker 0 waits for the lost one in a collective; the launcher's
    # SIGTERM cannot end that step, so its SIGKILL follows after the grace.
    code, output = _launch_across(
        bed,
        tmp_path,
        _cut_link(bed, tmp_path, 1, also=lambda bed: bed.kill(1)),
        launch_flags=("--grace_seconds", "2"),
    )
    assert code != 0
    assert "keras-distrib: rank 1 failed with signal SIGKILL" in output, output[-3000:]
    _assert_nothing_left(bed, tmp_path)


def test_a_three_second_flap_is_ridden_out(tmp_path, hosts, uninterrupted, traced_job):
    bed = hosts(2)
    code, output = _launch_across(bed, tmp_path, _cut_link(bed, tmp_path, 1, seconds=3))
    assert code == 0, output[-3000:]
    fault_job.assert_equal_to(fault_job.results(tmp_path, 2), uninterrupted(2), traced_job())
    _assert_nothing_left(bed, tmp_path)


def test_an_outage_longer_than_the_timeout_restarts_and_ends_exact(
    tmp_path, hosts, uninterrupted, traced_job
):
    bed = hosts(2)
    code, output = _launch_across(
        bed,
        tmp_path,
        _cut_link(bed, tmp_path, 1, seconds=8),
        env={"KERAS_DISTRIB_HEARTBEAT_TIMEOUT": "3"},
        launch_flags=("--max_restarts", "2"),
    )
    assert code == 0, output[-3000:]
    assert "is unreachable" in output and "restart 1/2: rank " in output, output[-3000:]
    assert "restart 2/2" not in output
    fault_job.assert_equal_to(fault_job.results(tmp_path, 2), uninterrupted(2), traced_job())
    _assert_nothing_left(bed, tmp_path)
