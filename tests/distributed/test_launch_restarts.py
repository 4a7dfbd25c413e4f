"""`keras-distrib launch`: restarts, preemption, signals, the private shm directory.

Every test runs the real command (`python -m keras_distrib.launch launch`)
on tiny plain-Python workers (no TensorFlow) written to tmp_path. Each
worker records, per attempt, its pid, TF_CONFIG and what it sees of
KERAS_DISTRIB_SHM_DIR in `rank{R}.a{RESTART}.json`; the fixture kills the
launcher's process group and every recorded worker whatever happens, and
the tests check that nothing was left for it to kill. One elastic test
runs them on two hosts made of network namespaces (tests/netns_hosts.py).
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import CHILD_PYTHONPATH, kill_pids, kill_process_group, process_alive

from keras_distrib.cluster.launch_contract import PREEMPTED

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

PRELUDE = textwrap.dedent("""\
    import json, os, signal, stat, sys, time
    RANK = int(os.environ["KERAS_DISTRIB_RANK"])
    RESTART = int(os.environ["KERAS_DISTRIB_RESTART"])
    HERE = os.path.dirname(os.path.abspath(__file__))

    def put(name, text=""):
        path = os.path.join(HERE, name)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)  # atomic: never read half written

    def wait_for(name):
        while not os.path.exists(os.path.join(HERE, name)):
            time.sleep(0.01)

    def _record():
        shm = os.environ.get("KERAS_DISTRIB_SHM_DIR")
        info = {"pid": os.getpid(), "tf_config": json.loads(os.environ["TF_CONFIG"]),
                "shm_dir": shm}
        if shm is not None:
            st = os.stat(shm)
            info.update(shm_mode=stat.S_IMODE(st.st_mode), shm_is_dir=stat.S_ISDIR(st.st_mode),
                        shm_uid=st.st_uid)
            # As the workers do: their files in a subdirectory of it.
            os.makedirs(os.path.join(shm, f"rank{RANK}"), exist_ok=True)
            open(os.path.join(shm, f"rank{RANK}", "segment"), "w").close()
        put(f"rank{RANK}.a{RESTART}.json", json.dumps(info))

    _record()
""")


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "worker.py"
    path.write_text(PRELUDE + textwrap.dedent(body))
    return str(path)


def _records(tmp_path) -> dict[tuple[int, int], dict]:
    """{(rank, attempt): what that worker recorded}."""
    found = {}
    for path in tmp_path.glob("rank*.a*.json"):
        rank, attempt = re.fullmatch(r"rank(\d+)\.a(\d+)\.json", path.name).groups()
        found[int(rank), int(attempt)] = json.loads(path.read_text())
    return found


def _ports(record: dict) -> set[int]:
    return {int(a.rsplit(":", 1)[1]) for a in record["tf_config"]["cluster"]["worker"]}


def _launcher_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("keras-distrib: ")]


def _wait_for(path, timeout=20.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)


@pytest.fixture
def launcher(tmp_path):
    """`start(*flags, script)`: a running launcher; everything killed at the end."""
    started = []

    def start(*args) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH}
        proc = subprocess.Popen(
            [sys.executable, "-m", "keras_distrib.launch", "launch", *args],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            kill_process_group(proc)
            proc.communicate()
        kill_pids(record["pid"] for record in _records(tmp_path).values())


def _run(launcher, *args, timeout=40) -> tuple[int, str, str]:
    proc = launcher(*args)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _assert_all_gone(tmp_path) -> None:
    records = _records(tmp_path)
    assert records
    for (rank, attempt), record in records.items():
        assert not process_alive(record["pid"]), f"rank {rank} of attempt {attempt} is alive"
        if record["shm_dir"] is not None:
            assert not os.path.exists(record["shm_dir"]), record["shm_dir"]


# --------------------------------------------------------------------------
# Restarts


# Rank 1 exits 3 once rank 0 has started; on a restart both succeed.
RANK_1_FAILS_ONCE = """\
    if RESTART == 0 and RANK == 1:
        wait_for("rank0.a0.json")
        sys.exit(3)
    if RESTART == 0:
        time.sleep(600)
"""


def test_rank_failing_once_is_restarted_on_new_ports(tmp_path, launcher):
    script = _script(tmp_path, RANK_1_FAILS_ONCE)
    code, out, err = _run(launcher, "-n", "2", "--max-restarts", "2", script)
    assert code == 0, err
    lines = _launcher_lines(err)
    assert lines.count("keras-distrib: rank 1 failed with exit code 3; last output:") == 1, err
    assert [line for line in lines if "restart 1/" in line] == [
        "keras-distrib: restart 1/2: rank 1 failed with exit code 3; starting all 2 ranks again."
    ], err
    assert lines[-1] == "keras-distrib: all 2 ranks succeeded; 1 of 2 restarts used; exit code 0."
    records = _records(tmp_path)
    assert set(records) == {(0, 0), (1, 0), (0, 1), (1, 1)}
    assert _ports(records[0, 0]) == _ports(records[1, 0])
    assert _ports(records[0, 1]) == _ports(records[1, 1])
    assert not _ports(records[0, 0]) & _ports(records[0, 1])  # new ports
    # One private directory per attempt, shared by its ranks.
    assert records[0, 0]["shm_dir"] == records[1, 0]["shm_dir"]
    assert records[0, 1]["shm_dir"] == records[1, 1]["shm_dir"] != records[0, 0]["shm_dir"]
    _assert_all_gone(tmp_path)


def test_always_failing_rank_exits_with_its_code_after_every_restart(tmp_path, launcher):
    script = _script(
        tmp_path,
        """\
        if RANK == 1:
            wait_for(f"rank0.a{RESTART}.json")
            sys.exit(3)
        time.sleep(600)
    """,
    )
    code, _, err = _run(launcher, "-n", "2", "--max_restarts=2", script)
    assert code == 3, err
    lines = _launcher_lines(err)
    assert [line for line in lines if line.startswith("keras-distrib: restart ")] == [
        f"keras-distrib: restart {k}/2: rank 1 failed with exit code 3; starting all 2 ranks again."
        for k in (1, 2)
    ], err
    assert lines[-1] == (
        "keras-distrib: rank 1 failed with exit code 3; 2 of 2 restarts used; exit code 3."
    )
    assert {attempt for _, attempt in _records(tmp_path)} == {0, 1, 2}
    _assert_all_gone(tmp_path)


def test_rank_killed_by_sigkill_is_restarted(tmp_path, launcher):
    script = _script(
        tmp_path,
        """\
        if RESTART == 0 and RANK == 1:
            wait_for("rank0.a0.json")
            os.kill(os.getpid(), signal.SIGKILL)
        if RESTART == 0:
            time.sleep(600)
    """,
    )
    code, _, err = _run(launcher, "-n", "2", "--max-restarts", "1", script)
    assert code == 0, err
    assert (
        "keras-distrib: restart 1/1: rank 1 failed with signal SIGKILL (exit code 137); "
        "starting all 2 ranks again."
    ) in _launcher_lines(err), err
    assert set(_records(tmp_path)) == {(0, 0), (1, 0), (0, 1), (1, 1)}
    _assert_all_gone(tmp_path)


@pytest.mark.parametrize("max_restarts", [0, 1])
def test_preempted_rank_is_restarted_or_ends_the_job_as_preempted(tmp_path, launcher, max_restarts):
    script = _script(
        tmp_path,
        f"""\
        if RESTART == 0 and RANK == 1:
            wait_for("rank0.a0.json")
            sys.exit({PREEMPTED})
        if RESTART == 0:
            time.sleep(600)
    """,
    )
    code, _, err = _run(launcher, "-n", "2", "--max-restarts", str(max_restarts), script)
    lines = _launcher_lines(err)
    preempted = f"keras-distrib: rank 1 was preempted (exit code {PREEMPTED}); last output:"
    assert preempted in lines, err
    assert not any("failed" in line for line in lines), err
    if max_restarts:
        assert code == 0, err
        assert (
            f"keras-distrib: restart 1/1: rank 1 was preempted (exit code {PREEMPTED}); "
            "starting all 2 ranks again."
        ) in lines, err
        assert set(_records(tmp_path)) == {(0, 0), (1, 0), (0, 1), (1, 1)}
    else:
        assert code == PREEMPTED, err
        assert not any("restart" in line for line in lines), err
        assert set(_records(tmp_path)) == {(0, 0), (1, 0)}
    _assert_all_gone(tmp_path)


def test_timeout_bounds_all_attempts_together(tmp_path, launcher):
    # Attempt 0 takes over 1s of the 6s, so attempt 1 is stopped before it
    # writes "late" 5.5s after it starts, which a deadline counted per
    # attempt would let it do.
    script = _script(
        tmp_path,
        """\
        if RESTART == 0 and RANK == 1:
            time.sleep(1)
            sys.exit(3)
        if RESTART == 1:
            time.sleep(5.5)
            put(f"late{RANK}")
        time.sleep(600)
    """,
    )
    code, _, err = _run(launcher, "-n", "2", "--max-restarts", "5", "--timeout", "6", script)
    assert code == 124, err
    lines = _launcher_lines(err)
    assert "keras-distrib: timed out after 6s (--timeout); stopping all ranks." in lines, err
    assert lines[-1] == "keras-distrib: timed out after 6s; 1 of 5 restarts used; exit code 124."
    assert not list(tmp_path.glob("late*"))
    assert set(_records(tmp_path)) == {(0, 0), (1, 0), (0, 1), (1, 1)}
    _assert_all_gone(tmp_path)


# Rank 1 exits 3 on every attempt, once rank 0 has started.
RANK_1_ALWAYS_FAILS = """\
    if RANK == 1:
        wait_for(f"rank0.a{RESTART}.json")
        sys.exit(3)
    time.sleep(600)
"""


def test_an_elastic_launch_left_with_fewer_than_min_workers_stops_in_one_line(tmp_path, launcher):
    """Rank 1 fails first twice within --elastic_grace, so its slot is left
    out (a slot is a process on one host); 1 slot is fewer than
    --min_workers=2 (tests/distributed/test_elastic.py has jobs that go on)."""
    code, _, err = _run(
        launcher,
        "-n",
        "2",
        "--min_workers",
        "2",
        "--max_restarts",
        "3",
        _script(tmp_path, RANK_1_ALWAYS_FAILS),
    )
    assert code == 1, err
    assert err.rstrip().endswith(
        "keras-distrib: 1 of 2 slots left, fewer than --min_workers=2; the last failure: "
        "rank 1 failed with exit code 3; stopping."
    ), err
    assert set(_records(tmp_path)) == {(0, 0), (1, 0), (0, 1), (1, 1)}
    _assert_all_gone(tmp_path)


# Under horovodrun (HOROVOD_RANK, no TF_CONFIG): rank 1 kills itself on
# every attempt with 2 ranks, once rank 0 runs; rank 0 then waits to be
# stopped, and alone it succeeds.
HOROVOD_RANK_1_KILLED_AGAIN = textwrap.dedent("""\
    import json, os, signal, sys, time
    RANK, SIZE = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    RESTART = int(os.environ["KERAS_DISTRIB_RESTART"])
    HERE = os.path.dirname(os.path.abspath(__file__))
    record = os.path.join(HERE, f"rank{RANK}.a{RESTART}.json")
    with open(record + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "size": SIZE,
                   "shm_dir": os.environ.get("KERAS_DISTRIB_SHM_DIR")}, f)
    os.replace(record + ".tmp", record)
    if SIZE == 1:
        sys.exit(0)
    if RANK == 1:
        while not os.path.exists(os.path.join(HERE, f"rank0.a{RESTART}.json")):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
""")


def test_under_horovod_a_slot_whose_rank_is_killed_again_is_left_out(tmp_path, launcher):
    """horovodrun, one child, names the rank that failed first when it stops
    the others: that rank's slot goes as under `--backend tf`."""
    pytest.importorskip("horovod")
    script = tmp_path / "worker.py"
    script.write_text(HOROVOD_RANK_1_KILLED_AGAIN)
    code, _, err = _run(
        launcher,
        "-n",
        "2",
        "--backend",
        "horovod",
        "--min_workers",
        "1",
        "--max_restarts",
        "3",
        str(script),
    )
    assert code == 0, err
    assert [line for line in _launcher_lines(err) if "restart " in line] == [
        f"keras-distrib: restart {k}/3: horovodrun failed with exit code 1 (its rank 1 first)."
        for k in (1, 2)
    ], err
    assert (
        "[launcher] 2 -> 1 workers: slot 1 on host 127.0.0.1 left out (its rank failed "
        "again within --elastic_grace=60s); training goes on from the last backup."
    ) in err.splitlines(), err
    assert err.rstrip().endswith(
        "keras-distrib: the rank succeeded; 2 of 3 restarts used; exit code 0."
    ), err
    records = _records(tmp_path)
    assert set(records) == {(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)}
    assert records[0, 2]["size"] == 1
    _assert_all_gone(tmp_path)


# Rank 0 reports backups as BackupAndRestore's chief does under the
# launcher (after a progress bar's text, too), or the backup it resumed
# from; rank 1 then fails, on every attempt with 2 workers.
BACKUPS_THEN_RANK_1_FAILS = """\
    if RANK == 0:
        if RESTART == 0:
            print("keras_distrib: backup saved at step 4 (epoch 1, step 4).", flush=True)
            print("\\r1/9 [===]keras_distrib: backup saved at step 8 (epoch 1, step 8).",
                  flush=True)
        else:
            print("keras_distrib: resuming from step 8 (epoch 1, step 8) of the backup in "
                  "/b.", flush=True)
        put(f"reported.a{RESTART}")
        if int(os.environ["KERAS_DISTRIB_WORLD_SIZE"]) == 2:
            time.sleep(600)
    else:
        wait_for(f"reported.a{RESTART}")
        sys.exit(3)
"""


@pytest.mark.parametrize("elastic", [False, True])
def test_a_restart_names_the_step_of_the_last_backup_the_chief_reported(
    tmp_path, launcher, elastic
):
    flags = ("--min_workers", "1") if elastic else ()
    code, out, err = _run(
        launcher,
        "-n",
        "2",
        "--max_restarts",
        "2",
        *flags,
        _script(tmp_path, BACKUPS_THEN_RANK_1_FAILS),
    )
    restart = (
        "keras-distrib: restart 1/2: rank 1 failed with exit code 3; starting all 2 "
        "ranks again, from the last backup, step 8 (epoch 1, step 8)."
    )
    if elastic:
        assert code == 0, err
        assert (
            "[launcher] 2 -> 1 workers: slot 1 on host 127.0.0.1 left out (its rank failed "
            "again within --elastic_grace=60s); training goes on from the last backup, "
            "step 8 (epoch 1, step 8)."
        ) in err.splitlines(), err
    else:
        assert code == 3, err
        assert restart in _launcher_lines(err), err
    # The reports are the launcher's: not shown, nor in a failed rank's tail;
    # the resumed run's own line is, and what preceded a report on its line.
    assert "backup saved" not in out + err, out + err
    assert "[rank 0] keras_distrib: resuming from step 8 (epoch 1, step 8)" in out, out
    assert "[rank 0] 1/9 [===]\n" in out, out
    _assert_all_gone(tmp_path)


def test_an_elastic_launch_that_loses_a_host_below_min_workers_stops_naming_it(
    tmp_path, launcher, hosts
):
    """Two hosts (network namespaces): host 1's link is cut and its rank
    fails; the launcher finds host 1 does not answer, which leaves 1 slot,
    fewer than --min_workers=2."""
    bed = hosts(2)
    script = _script(
        tmp_path,
        """\
        if RANK == 1:
            wait_for("cut")
            sys.exit(3)
        time.sleep(600)
    """,
    )
    proc = launcher(
        "-n",
        "2",
        "--hosts",
        bed.hosts_flag(),
        "--ssh",
        "--ssh_command",
        bed.ssh_command,
        "--min_workers",
        "2",
        "--max_restarts",
        "3",
        script,
    )
    _wait_for(tmp_path / "rank0.a0.json")
    _wait_for(tmp_path / "rank1.a0.json")
    bed.cut(1)
    (tmp_path / "cut").touch()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert err.rstrip().endswith(
        f"keras-distrib: 1 of 2 slots left, fewer than --min_workers=2; lost: host "
        f"{bed.addresses[1]}; the last failure: rank 1 failed with exit code 3; stopping."
    ), err
    assert set(_records(tmp_path)) == {(0, 0), (1, 0)}  # nothing started again
    assert bed.pids() == [], "a process outlived the job on a host"
    _assert_all_gone(tmp_path)


# --------------------------------------------------------------------------
# Signals to the launcher


SIGTERM_BODY = """\
    TRAP = {trap!r}
    if TRAP == "preempted":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit({preempted}))
    elif TRAP == "ignore" or (TRAP == "rank 1 ignores" and RANK == 1):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif TRAP == "rank 1 ignores":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit({preempted}))
    put(f"ready{{RANK}}.a{{RESTART}}")
    time.sleep(600)
"""


@pytest.mark.parametrize(
    "trap, code",
    [
        ("preempted", PREEMPTED),  # every rank exits 75: the job was preempted
        ("default", 128 + signal.SIGTERM),  # killed by SIGTERM: as before
        ("rank 1 ignores", 128 + signal.SIGTERM),  # rank 1 is SIGKILLed after the grace
    ],
)
def test_sigterm_to_the_launcher_stops_all_ranks_without_restart(tmp_path, launcher, trap, code):
    script = _script(tmp_path, SIGTERM_BODY.format(trap=trap, preempted=PREEMPTED))
    proc = launcher("-n", "2", "--max-restarts", "3", "--grace-seconds", "1", script)
    for rank in range(2):
        _wait_for(tmp_path / f"ready{rank}.a0")
    records = _records(tmp_path)
    assert all(r["shm_dir"] and os.path.isdir(r["shm_dir"]) for r in records.values())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    lines = _launcher_lines(err)
    assert "keras-distrib: got SIGTERM; stopping all ranks." in lines, err
    assert not any(line.startswith("keras-distrib: restart ") for line in lines), err
    assert (
        f"keras-distrib: every rank exited with {PREEMPTED} (preempted) or 0; "
        f"exit code {PREEMPTED}." in lines
    ) == (code == PREEMPTED), err
    assert lines[-1] == (
        f"keras-distrib: stopped by SIGTERM; 0 of 3 restarts used; exit code {code}."
    )
    assert set(_records(tmp_path)) == {(0, 0), (1, 0)}
    _assert_all_gone(tmp_path)


def test_rank_ignoring_sigterm_is_killed_after_grace_seconds(tmp_path, launcher):
    script = _script(tmp_path, SIGTERM_BODY.format(trap="ignore", preempted=PREEMPTED))
    proc = launcher("-n", "2", "--grace_seconds", "1", script)
    for rank in range(2):
        _wait_for(tmp_path / f"ready{rank}.a0")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)  # the default grace would be 30s
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "keras-distrib: got SIGINT; stopping all ranks." in _launcher_lines(err)
    _assert_all_gone(tmp_path)


# --------------------------------------------------------------------------
# The private shared-memory directory


def test_shm_dir_is_private_shared_by_local_ranks_and_removed_after_success(tmp_path, launcher):
    script = _script(tmp_path, "")
    code, _, err = _run(launcher, "-n", "2", script)
    assert code == 0, err
    records = _records(tmp_path)
    assert set(records) == {(0, 0), (1, 0)}
    shm_dir = records[0, 0]["shm_dir"]
    assert shm_dir == records[1, 0]["shm_dir"]
    assert os.path.basename(shm_dir).startswith("kd-")
    if os.access("/dev/shm", os.W_OK | os.X_OK):
        assert os.path.dirname(shm_dir) == "/dev/shm"
    for record in records.values():
        assert record["shm_is_dir"] and record["shm_mode"] == 0o700
        assert record["shm_uid"] == os.getuid()
    _assert_all_gone(tmp_path)


def test_shm_dir_is_removed_after_a_failure(tmp_path, launcher):
    script = _script(
        tmp_path,
        """\
        if RANK == 1:
            wait_for("rank0.a0.json")
            sys.exit(3)
        time.sleep(600)
    """,
    )
    code, _, err = _run(launcher, "-n", "2", script)
    assert code == 3, err
    assert not any("restart" in line for line in _launcher_lines(err)), err
    assert _records(tmp_path)[0, 0]["shm_dir"]
    _assert_all_gone(tmp_path)


def test_ranks_over_ssh_get_the_restart_count_but_no_shm_dir(tmp_path, launcher):
    # Rank 0 runs here, rank 1 on "another host" through a stand-in for ssh
    # that runs the remote command here, as sshd would.
    from keras_distrib.cluster import free_ports

    fake_ssh = tmp_path / "fake_ssh.py"
    fake_ssh.write_text("import os, sys\nos.execvp('sh', ['sh', '-c', sys.argv[-1]])\n")
    script = _script(tmp_path, RANK_1_FAILS_ONCE)
    port = free_ports(1)[0]
    code, _, err = _run(
        launcher,
        "-n",
        "2",
        "--hosts",
        "127.0.0.1,node-b.invalid",
        "--ssh",
        "--ssh_command",
        f"{sys.executable} {fake_ssh}",
        "--port_base",
        str(port),
        "--max_restarts",
        "1",
        script,
    )
    assert code == 0, err
    records = _records(tmp_path)
    assert set(records) == {(0, 0), (1, 0), (0, 1), (1, 1)}
    for attempt in range(2):
        assert records[0, attempt]["shm_dir"] is not None
        assert records[1, attempt]["shm_dir"] is None
    # Fixed ports (--port_base) are the same on every attempt.
    assert _ports(records[0, 0]) == _ports(records[0, 1]) == {port}
    _assert_all_gone(tmp_path)


# --------------------------------------------------------------------------
# Blame


def test_failure_while_a_rank_is_stopped_names_the_stopped_rank(tmp_path, launcher):
    script = _script(
        tmp_path,
        """\
        if RANK == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(600)
        wait_for("rank1.a0.json")
        with open(os.path.join(HERE, "rank1.a0.json")) as f:
            pid = json.load(f)["pid"]
        def state():
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            return stat[stat.rfind(")") + 2]
        while state() != "T":
            time.sleep(0.01)
        print("rank 1 is stopped", flush=True)
        sys.exit(1)
    """,
    )
    # The default grace (30s) is longer than the wait below: the stopped rank
    # must act on SIGTERM, so the launcher must send SIGCONT.
    code, out, err = _run(launcher, "-n", "2", script, timeout=20)
    assert code == 1, err
    assert "[rank 0] rank 1 is stopped" in out.splitlines()
    pid = _records(tmp_path)[1, 0]["pid"]
    assert (
        f"keras-distrib: rank 0 failed with exit code 1 while rank 1 (pid {pid}) was "
        "stopped (SIGSTOP); the stopped rank is the likely cause."
    ) in _launcher_lines(err)
    _assert_all_gone(tmp_path)


# --------------------------------------------------------------------------
# Flags


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--max_restarts", "-1"], "flag --max_restarts=-1: -1 is not a non-negative integer"),
        (["--max-restarts=two"], "flag --max_restarts=two"),
        (["--grace-seconds", "-1"], "flag --grace_seconds=-1"),
        (
            ["--backend", "horovod", "--max_restarts", "1"],
            "--max_restarts=1 works with --backend=tf only",
        ),
    ],
)
def test_bad_restart_flags_give_one_line_error(tmp_path, launcher, args, fragment):
    script = _script(tmp_path, "")
    code, out, err = _run(launcher, "-n", "2", *args, script)
    assert code == 2
    errors = _launcher_lines(err)
    assert len(errors) == 1 and errors[0].startswith("keras-distrib: error: "), err
    assert fragment in errors[0], err
    assert not out and not _records(tmp_path)


def test_shm_dir_is_removed_when_the_launcher_raises(tmp_path, capfd):
    """A child that cannot start: LaunchError, and nothing of the attempt is left."""
    from keras_distrib import launch

    made = []

    def specs(restart, shm_dir):
        made.append(shm_dir)
        sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
        return [
            launch.ChildSpec("rank 0", sleeper, {}),
            launch.ChildSpec("rank 1", [str(tmp_path / "no-such-program")], {}),
        ]

    config = launch.LaunchConfig(nproc=2, script=__file__)
    with pytest.raises(launch.LaunchError, match="cannot start rank 1"):
        launch.supervise(launch.Job(2, specs, private_dir=True), config, sys.stdout, sys.stderr)
    assert len(made) == 1 and made[0] is not None
    assert not os.path.exists(made[0])
