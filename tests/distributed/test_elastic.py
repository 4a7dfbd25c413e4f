"""Elastic launches (`--min_workers`): the job goes on with the workers left,
takes a lost host back, and ends where an uninterrupted one-process run
ends (tests/workers/faults.py: a learning-rate schedule, shuffled arrays, a
backup every 4 steps).

On this host a slot is a process: one killed (or stopped: the others
report losing it) twice in a row is left out (hybrid `tensor_parallel` and
`pipeline`, each worker's model split over its two logical CPUs;
`horovod`, whose horovodrun names the rank that failed first). Across
hosts (network namespaces, tests/netns_hosts.py, whose ssh stand-in
cannot reach a host whose link is down), a host whose link is cut is lost
and, when the link is back, taken in again at the
job's next backup (`multi_worker`; `horovod` through horovodrun; hybrid
`tensor_parallel` and `pipeline`), also when only its training link is cut
and ssh still reaches it (`multi_worker`, `horovod`); one cut for good
stays out (`multi_worker`).
"""

import glob
import os
import re
import time

import pytest

import fault_job
from fault_job import FAULTS
from helpers import launch, process_alive

pytestmark = pytest.mark.slow

ELASTIC = ("--min_workers", "1", "--max_restarts", "3")


def _assert_ends_as_one_process(out, n, uninterrupted, traced_job, *script_flags):
    """Every rank took all the steps and holds the weights of the
    one-process run with `script_flags`: the sums over another number of
    workers round differently, within the bounds of the job's math in other
    orders (`fault_job.assert_equal_to`)."""
    fault_job.assert_equal_to(
        fault_job.results(out, n), uninterrupted(1, *script_flags), traced_job(*script_flags)
    )


def _assert_goes_on_from_the_step_it_names(output, line_start):
    """The launcher's line `line_start` (text, or a compiled pattern) +
    `step N (epoch E, step S).` is there, and the job's next attempt
    resumes from that step."""
    lines = output.splitlines()
    start = line_start if isinstance(line_start, re.Pattern) else re.compile(re.escape(line_start))
    at = next((i for i, line in enumerate(lines) if start.match(line)), None)
    assert at is not None, output[-3000:]
    point = re.fullmatch(
        r"(step \d+ \(epoch \d+, step \d+\))\.", lines[at][start.match(lines[at]).end() :]
    )
    assert point, lines[at]
    resumed = next(line for line in lines[at:] if "keras_distrib: resuming from" in line)
    assert f"keras_distrib: resuming from {point.group(1)} of the backup" in resumed, (
        lines[at],
        resumed,
    )


def _optimizer_flags(optimizer):
    """The worker's flags for `optimizer`: none for Adam, its default, so
    that the one-process reference is made once for every Adam test."""
    return ("--optimizer", "sgd") if optimizer == "sgd" else ()


def _assert_nothing_left(out, n):
    attempts = [a for runs in fault_job.attempts(out, n).values() for a in runs]
    assert not [a.pid for a in attempts if process_alive(a.pid, zombies_count=False)]
    assert not [a.shm_dir for a in attempts if a.shm_dir != "-" and os.path.exists(a.shm_dir)]


def _hurt_twice(out, fault, *script_flags, env=None, launch_flags=()):
    """Rank 1 sends itself `fault` (SIGKILL, SIGSTOP) after its 5th step on
    the first two attempts."""
    return launch(
        out,
        2,
        FAULTS,
        "--out",
        str(out),
        "--backup",
        str(out / "backup"),
        "--fault",
        fault,
        "--fault_attempts",
        "2",
        *script_flags,
        expect=None,
        launch_flags=(*launch_flags, *ELASTIC),
        env=env,
    )


# One machine, where a slot is a process: hybrid data x model parallelism
# (each worker's model split over its 2 logical CPUs, the workers
# data-parallel), each with the optimizer its lost-host case below does not
# use, so that both run SGD and Adam (whose slots the model-parallel
# strategies split over the devices); and `horovod`, whose slot horovodrun
# names. A stopped rank 1 makes rank 0 fail first; rank 0's diagnosis (it
# lost rank 1) charges slot 1 all the same.
@pytest.mark.parametrize(
    "strategy, optimizer, fault",
    [("tensor_parallel", "sgd", "stop"), ("pipeline", "adam", "kill"), ("horovod", "sgd", "kill")],
)
def test_a_worker_hurt_again_is_left_out_and_the_rest_ends_exact(
    tmp_path, uninterrupted, traced_job, strategy, optimizer, fault
):
    flags = _optimizer_flags(optimizer)
    if strategy == "horovod":
        pytest.importorskip("horovod.tensorflow")
        env, launch_flags = None, ("--backend", "horovod")
    else:
        env, launch_flags = {"FAULTS_LOGICAL_CPUS": "2"}, ()
    code, output = _hurt_twice(
        tmp_path, fault, "--strategy", strategy, *flags, env=env, launch_flags=launch_flags
    )
    assert code == 0, output[-3000:]
    who = "its rank failed" if fault == "kill" else "the other ranks lost its rank"
    _assert_goes_on_from_the_step_it_names(
        output,
        f"[launcher] 2 -> 1 workers: slot 1 on host 127.0.0.1 left out ({who} again "
        "within --elastic_grace=60s); training goes on from the last backup, ",
    )
    assert "the rank succeeded; 2 of 3 restarts used; exit code 0." in output
    assert [len(runs) for runs in fault_job.attempts(tmp_path, 2).values()] == [3, 2]
    _assert_ends_as_one_process(tmp_path, 1, uninterrupted, traced_job, *flags)
    _assert_nothing_left(tmp_path, 2)


def _lose_and_return(bed, out, returns=True, training_only=False):
    """`launch(during=...)`: cuts host 1's link (`training_only`: the
    training link, ssh still reaches the host) once both ranks paused
    (attempt 0), lets them go on against the cut, and (`returns`) restores
    the link once the job runs on host 0 alone and holds there (attempt 1)."""

    def wait_for(pattern, proc):
        deadline = time.monotonic() + 150
        while not glob.glob(os.path.join(out, pattern)):
            assert proc.poll() is None and time.monotonic() < deadline, f"no {pattern}"
            time.sleep(0.05)

    def during(proc):
        wait_for("paused-rank1", proc)
        wait_for("paused-rank0", proc)
        bed.cut(1, training_only=training_only)
        open(os.path.join(out, "go"), "w").close()
        if returns:
            wait_for("held-rank0", proc)
            bed.restore(1)

    return during


def test_a_host_cut_off_for_good_is_left_out_and_the_rest_ends_exact(
    tmp_path, hosts, uninterrupted, traced_job
):
    """A permanent partition: the job ends on host 0 alone, and the rank
    behind the cut does not outlive it."""
    bed = hosts(2)
    code, output = launch(
        tmp_path,
        2,
        FAULTS,
        "--out",
        str(tmp_path),
        "--backup",
        str(tmp_path / "backup"),
        "--pause_after_step",
        "6",
        "--implementation",
        "ring",  # TensorFlow's heartbeats find the lost host
        expect=None,
        timeout=280,
        during=_lose_and_return(bed, tmp_path, returns=False),
        env={"KERAS_DISTRIB_HEARTBEAT_TIMEOUT": "3"},
        launch_flags=(
            "--hosts",
            bed.hosts_flag(),
            "--ssh",
            "--ssh_command",
            bed.ssh_command,
            *ELASTIC,
        ),
    )
    assert code == 0, output[-3000:]
    _assert_goes_on_from_the_step_it_names(
        output,
        f"[launcher] 2 -> 1 workers: host {bed.addresses[1]} lost (it does not "
        "answer); training goes on from the last backup, ",
    )
    assert "answers again" not in output, output[-3000:]
    assert [len(runs) for runs in fault_job.attempts(tmp_path, 2).values()] == [2, 1]
    _assert_ends_as_one_process(tmp_path, 1, uninterrupted, traced_job)
    assert bed.pids() == [], "a process outlived the job on a host"


# `training`: only host 1's training link is cut; ssh (the test bed's
# management link) still reaches it, and the launcher, on host 0, finds it
# lost because from it nothing reaches the job's rendezvous on host 0.
# multi_worker across the cut training link on TensorFlow's ring, whose
# heartbeats find the lost host; across the cut link on our TCP ring, whose
# connections find it unreachable after the heartbeat timeout too.
@pytest.mark.parametrize(
    "engine, optimizer, cut",
    [
        ("multi_worker", "adam", "training"),
        ("multi_worker-tcp", "sgd", "link"),
        ("horovod", "adam", "training"),
        ("horovod", "sgd", "link"),
        # hybrid: each worker's model split over its 2 logical CPUs
        ("tensor_parallel", "adam", "link"),
        ("pipeline", "sgd", "link"),
    ],
)
def test_a_lost_host_is_left_out_and_taken_back_and_the_run_ends_exact(
    tmp_path, hosts, uninterrupted, traced_job, engine, optimizer, cut
):
    """Under `--backend horovod` each attempt is one horovodrun on the hosts
    that answer: the launcher runs on host 0, horovodrun reaches host 1 with
    the test bed's ssh, and Gloo's timeout ends the attempt."""
    optimizer_flags = _optimizer_flags(optimizer)
    bed = hosts(2)
    a, b = bed.addresses
    wrap = (lambda argv: bed.on(0, argv)) if cut == "training" else None
    if engine != "horovod":
        flags = ("--ssh", "--ssh_command", bed.ssh_command)
        # Named, not "auto"'s measured choice.
        env = {"KERAS_DISTRIB_HEARTBEAT_TIMEOUT": "3"}
        engine, _, implementation = engine.partition("-")
        script_flags: tuple = ("--implementation", implementation or "ring")
        if engine != "multi_worker":
            env["FAULTS_LOGICAL_CPUS"] = "2"
            script_flags += ("--strategy", engine)
    else:
        pytest.importorskip("horovod.tensorflow")
        flags = ("--backend", "horovod")
        env = {
            "PATH": bed.ssh_program(str(tmp_path)) + os.pathsep + os.environ["PATH"],
            "HOROVOD_GLOO_TIMEOUT_SECONDS": "10",
        }
        wrap, script_flags = (lambda argv: bed.on(0, argv)), ("--strategy", "horovod")
    code, output = launch(
        tmp_path,
        2,
        FAULTS,
        "--out",
        str(tmp_path),
        "--backup",
        str(tmp_path / "backup"),
        "--pause_after_step",
        "6",
        "--hold_after_step",
        "6",
        "--hold_on_attempt",
        "1",
        *script_flags,
        *optimizer_flags,
        expect=None,
        timeout=280,
        during=_lose_and_return(bed, tmp_path, training_only=cut == "training"),
        env=env,
        wrap=wrap,
        launch_flags=("--hosts", bed.hosts_flag(), *flags, *ELASTIC),
    )
    assert code == 0, output[-3000:]
    why = (
        re.escape(f"ssh reaches it, but it cannot reach the job's rendezvous at {a}:")
        + r"\d+ on the training network"
        if cut == "training"
        else re.escape("it does not answer")
    )
    _assert_goes_on_from_the_step_it_names(
        output,
        re.compile(
            re.escape(f"[launcher] 2 -> 1 workers: host {b} lost (")
            + why
            + re.escape("); training goes on from the last backup, ")
        ),
    )
    _assert_goes_on_from_the_step_it_names(
        output,
        f"[launcher] 1 -> 2 workers: host {b} answers again; training goes on from "
        "the backup the job just saved, ",
    )
    # Each resumed attempt says from which step, and that the steps are the same.
    resumed = re.findall(
        r"\[rank 0\] keras_distrib: resuming from step \d+ .* It was made "
        r"with (\d) replicas?, this run has (\d): each replica's share of the "
        r"global batch changes, the steps do not\.",
        output,
    )
    assert resumed == [("2", "1"), ("1", "2")], output[-3000:]
    # Host 0 ran every attempt (2, then 1, then 2 workers); host 1 the first and last.
    assert [len(runs) for runs in fault_job.attempts(tmp_path, 2).values()] == [3, 2]
    _assert_ends_as_one_process(tmp_path, 2, uninterrupted, traced_job, *optimizer_flags)
    assert bed.pids() == [], "a process outlived the job on a host"
