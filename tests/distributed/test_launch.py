"""`keras-distrib launch`: real worker processes (plain Python, no TensorFlow).

Some tests call `launch.launch(config)` in this process; the command-line
tests run `python -m keras_distrib.launch`. The launcher never imports
TensorFlow or Keras; the test that checks a launch driven from Python runs
in a fresh process, since this one may have imported TensorFlow (the other
tiers do). What needs no process (flags, planning, the output printer) is in
tests/unit/test_launch_options.py.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from helpers import CHILD_PYTHONPATH, kill_pids, kill_process_group, process_alive
from pure_helpers import HEAVY_MODULES, RANK_PRELUDE, rank_pids, rank_script, run_python

from keras_distrib import launch
from keras_distrib.launch import LaunchConfig

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def no_leftovers(tmp_path):
    """Yields a list for Popen objects; kills them and any worker on exit."""
    started = []
    yield started
    for proc in started:
        kill_process_group(proc)
    kill_pids(rank_pids(tmp_path).values())


def _lines_of(output: str, rank: int) -> list[str]:
    prefix = f"[rank {rank}] "
    return [line[len(prefix) :] for line in output.splitlines() if line.startswith(prefix)]


def _cli(*args, cwd=None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.Popen(
        [sys.executable, "-m", "keras_distrib.launch", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _error_lines(stderr: str) -> list[str]:
    # TensorFlow's import may log to stderr; ours start with the program name.
    return [line for line in stderr.splitlines() if line.startswith("keras-distrib:")]


REPORT_BODY = """\
    print("TF_CONFIG=" + os.environ["TF_CONFIG"])
    print("ENV=" + json.dumps({k: os.environ[k] for k in (
        "KERAS_DISTRIB_RANK", "KERAS_DISTRIB_WORLD_SIZE", "KERAS_DISTRIB_LOCAL_RANK",
        "PYTHONUNBUFFERED")}))
    print("ARGS=" + json.dumps(sys.argv[1:]))
    print("to stderr", file=sys.stderr)
"""


def _check_report(output: str, nproc: int, args, host="127.0.0.1"):
    configs = []
    for rank in range(nproc):
        lines = _lines_of(output, rank)
        assert "to stderr" in lines
        config = json.loads(next(line for line in lines if line.startswith("TF_CONFIG="))[10:])
        env = json.loads(next(line for line in lines if line.startswith("ENV="))[4:])
        assert env["KERAS_DISTRIB_RANK"] == str(rank)
        assert env["KERAS_DISTRIB_WORLD_SIZE"] == str(nproc)
        assert env["PYTHONUNBUFFERED"] == "1"
        assert json.loads(next(line for line in lines if line.startswith("ARGS="))[5:]) == list(
            args
        )
        assert config["task"] == {"type": "worker", "index": rank}
        configs.append(config)
    workers = configs[0]["cluster"]["worker"]
    assert all(c["cluster"] == {"worker": workers} for c in configs)
    assert len(set(workers)) == nproc
    for address in workers:
        address_host, port = address.rsplit(":", 1)
        assert host is None or address_host == host
        assert 1 <= int(port) <= 65535
    return configs


# --------------------------------------------------------------------------
# Local launches: real processes


@pytest.mark.slow
def test_two_workers_succeed_with_prefixed_lines_and_own_tf_config(tmp_path, capfd, no_leftovers):
    args = ("--nproc", "9", "-n", "3", "it's a b")
    config = LaunchConfig(nproc=2, script=rank_script(tmp_path, REPORT_BODY), script_args=args)
    assert launch.launch(config) == 0
    out, _ = capfd.readouterr()
    assert all(line.startswith(("[rank 0] ", "[rank 1] ")) for line in out.splitlines()), out
    _check_report(out, 2, args)
    assert not any(process_alive(pid) for pid in rank_pids(tmp_path).values())


@pytest.mark.slow
@pytest.mark.parametrize(
    "body, code, text",
    [
        ("sys.stderr.write('boom: bad batch\\n'); sys.exit(3)", 3, "boom: bad batch"),
        ("raise ValueError('shapes do not match')", 1, "ValueError: shapes do not match"),
    ],
)
def test_failing_rank_stops_the_others_and_sets_exit_code(
    tmp_path, capfd, no_leftovers, body, code, text
):
    script = rank_script(
        tmp_path,
        f"""\
        if RANK == 0:
            print("ready", flush=True)
            time.sleep(600)
        while not os.path.exists(os.path.join(HERE, "rank0.pid")):
            time.sleep(0.01)
        {body}
    """,
    )
    # Rank 0 stops on the launcher's SIGTERM. Had it to wait for SIGKILL,
    # the grace would keep the launch running past the test's timeout.
    config = LaunchConfig(nproc=2, script=script, grace_seconds=600)
    assert launch.launch(config) == code
    out, err = capfd.readouterr()
    assert text in "\n".join(_lines_of(out, 1))
    summary = err.splitlines()
    first = summary.index(f"keras-distrib: rank 1 failed with exit code {code}; last output:")
    assert any(text in line for line in summary[first + 1 :]), err
    pids = rank_pids(tmp_path)
    assert set(pids) == {0, 1}
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_rank_killed_by_signal_gives_128_plus_signum(tmp_path, capfd, no_leftovers):
    script = rank_script(tmp_path, "os.kill(os.getpid(), 9) if RANK == 1 else time.sleep(600)")
    assert launch.launch(LaunchConfig(nproc=2, script=script)) == 128 + 9
    _, err = capfd.readouterr()
    assert "rank 1 failed with signal SIGKILL (exit code 137)" in err
    assert not any(process_alive(pid) for pid in rank_pids(tmp_path).values())


@pytest.mark.slow
def test_a_rank_left_running_after_another_exited_0_is_named(tmp_path, capfd, no_leftovers):
    # Rank 0 would wait for rank 1 (in a collective, say); the launcher
    # names it, keeps waiting, and here its --timeout ends the job.
    script = rank_script(tmp_path, "time.sleep(600) if RANK == 0 else sys.exit(0)")
    config = LaunchConfig(nproc=2, script=script, straggler_warning=1, timeout=8)
    assert launch.launch(config) == 124
    _, err = capfd.readouterr()
    lines = _error_lines(err)
    warning = next(i for i, line in enumerate(lines) if "still runs" in line)
    assert lines[warning].startswith(
        "keras-distrib: rank 0 still runs 1s after rank 1 exited with 0; a rank waiting for "
        "rank 1 in a collective waits until its collective timeout"
    ), lines
    assert any("timed out after 8s" in line for line in lines[warning + 1 :]), lines


@pytest.mark.slow
def test_timeout_stops_all_ranks(tmp_path, capfd, no_leftovers):
    script = rank_script(tmp_path, "time.sleep(600)")
    config = LaunchConfig(nproc=2, script=script, timeout=1)
    assert launch.launch(config) == launch.EXIT_TIMEOUT
    assert "timed out after 1s" in capfd.readouterr().err
    assert len(rank_pids(tmp_path)) == 2
    assert not any(process_alive(pid) for pid in rank_pids(tmp_path).values())


@pytest.mark.slow
def test_interrupt_escalates_to_sigkill_for_stubborn_ranks(tmp_path, capfd, no_leftovers):
    script = rank_script(
        tmp_path,
        """\
        import signal
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(os.path.join(HERE, f"ready{RANK}"), "w").close()  # handlers in place
        print("ready", flush=True)
        time.sleep(600)
    """,
    )

    def interrupt_when_ready():
        ready = [tmp_path / f"ready{rank}" for rank in range(2)]
        deadline = time.monotonic() + 20
        while not all(r.exists() for r in ready) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)  # the launcher's trap gets it

    timer = threading.Thread(target=interrupt_when_ready)
    timer.start()
    # The ranks ignore SIGTERM and sleep 600 s: the launch ends (within
    # the test's timeout) only if SIGKILL follows after grace_seconds.
    code = launch.launch(LaunchConfig(nproc=2, script=script, grace_seconds=1.0))
    timer.join()
    assert code == 128 + signal.SIGINT
    assert "got SIGINT; stopping all ranks" in capfd.readouterr().err
    assert not any(process_alive(pid) for pid in rank_pids(tmp_path).values())


# --------------------------------------------------------------------------
# Output: progress bars (\r redraws), CRLF, TensorFlow's C++ logs


PROGRESS_BODY = """\
    for i in range(5):
        print(f"\\r{i}/5", end="", flush=True)
        time.sleep(0.05)
    print()
    sys.stdout.write("\\r1/2\\r2/2\\r\\ncrlf line\\r\\n")
    print("done")
"""


@pytest.mark.slow
def test_progress_bar_of_a_real_rank_is_one_updating_line(tmp_path, capfd, no_leftovers):
    script = rank_script(tmp_path, PROGRESS_BODY)
    assert launch.launch(LaunchConfig(nproc=1, script=script)) == 0
    out, _ = capfd.readouterr()
    bar, rest = out.split("\n", 1)
    pieces = bar.split("\r")
    assert pieces[0] == "" and len(pieces) >= 2, repr(out)
    shown = [p.removeprefix("[rank 0] ") for p in pieces[1:]]
    assert all(p.startswith("[rank 0] ") for p in pieces[1:]), repr(out)
    # Every redraw shown (or, when reads merged, at least the last), in order.
    assert shown[-1] == "4/5" and shown == sorted(shown), repr(out)
    assert set(shown) <= {f"{i}/5" for i in range(5)}, repr(out)
    # CRLF ends lines, also after redraws: no \r left inside a line.
    lines = rest.split("\n")
    assert lines[-1] == "" and lines[-2] == "[rank 0] done", repr(out)
    assert "[rank 0] crlf line" in lines and lines[0].endswith("[rank 0] 2/2"), repr(out)


class _Watched:
    """A stdout for `launch` that a test can wait on while the launch runs."""

    def __init__(self):
        self.text = ""
        self._changed = threading.Condition()

    def write(self, text):
        with self._changed:
            self.text += text
            self._changed.notify_all()

    def flush(self):
        pass

    def wait_for(self, fragment: str, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: fragment in self.text, timeout)


@pytest.mark.slow
def test_a_redraw_shows_before_its_line_ends(tmp_path, no_leftovers):
    go = tmp_path / "go"
    script = rank_script(
        tmp_path,
        f"""\
        print("\\r1/2", end="", flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        print("\\r2/2")
    """,
    )
    out, codes = _Watched(), []
    runner = threading.Thread(
        target=lambda: codes.append(
            launch.launch(LaunchConfig(nproc=1, script=script), out=out, err=out)
        )
    )
    runner.start()
    try:
        shown = out.wait_for("\r[rank 0] 1/2", timeout=20)
    finally:
        go.touch()  # lets the rank finish whatever happened
        runner.join(timeout=30)
    assert shown, repr(out.text)
    assert codes == [0]
    assert out.text.endswith("\r[rank 0] 1/2\r[rank 0] 2/2\n"), repr(out.text)


@pytest.mark.slow
@pytest.mark.parametrize("user_value, want", [(None, "2"), ("0", "0")])
def test_tf_cpp_min_log_level_defaults_to_2_and_the_users_value_wins(
    tmp_path, capfd, no_leftovers, monkeypatch, user_value, want
):
    if user_value is None:
        monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", user_value)
    script = rank_script(
        tmp_path, 'print("LEVEL=" + os.environ.get("TF_CPP_MIN_LOG_LEVEL", "unset"))'
    )
    assert launch.launch(LaunchConfig(nproc=2, script=script)) == 0
    out, _ = capfd.readouterr()
    for rank in range(2):
        assert f"LEVEL={want}" in _lines_of(out, rank), out
    # Ranks started over ssh get it in their command line.
    config = LaunchConfig(nproc=2, script=script, hosts=("node-a.invalid", "node-b.invalid"))
    assert f"TF_CPP_MIN_LOG_LEVEL={want} " in launch.shell_command(launch.plan(config)[1], config)


# Real lines of TF 2.21 on a CPU (the first two even with TF_CPP_MIN_LOG_LEVEL=2).
TF_BANNERS = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795414310.502428   26383 port.cc:153] oneDNN custom operations are on. "
    "You may see slightly different numerical results due to floating-point round-off "
    "errors from different computation orders. To turn them off, set the environment "
    "variable `TF_ENABLE_ONEDNN_OPTS=0`.",
    "I0000 00:00:1795414310.556435   26383 cpu_feature_guard.cc:227] This TensorFlow binary "
    "is optimized to use available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild "
    "TensorFlow with the appropriate compiler flags.",
    "2024-05-01 12:00:00.123456: I tensorflow/core/util/port.cc:113] oneDNN custom operations "
    "are on.",
    "E0000 00:00:1795414311.000000   26383 cuda_executor.cc:1228] failed call to cuInit: "
    "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
]
AT_EXIT_BANNER = (
    "I0000 00:00:1795414312.000000   26383 coordination_service_agent.cc:500] "
    "Coordination agent has successfully shut down."
)


@pytest.mark.slow
def test_failure_tail_leaves_out_tf_banners_and_ends_with_the_traceback(
    tmp_path, capfd, no_leftovers
):
    script = rank_script(
        tmp_path,
        f"""\
        import atexit
        atexit.register(lambda: print({AT_EXIT_BANNER!r}, file=sys.stderr, flush=True))
        for line in {TF_BANNERS!r}:
            print(line, file=sys.stderr, flush=True)
        print("epoch 1", flush=True)
        raise ValueError("boom")
    """,
    )
    config = LaunchConfig(nproc=1, script=script, tail_lines=8)
    assert launch.launch(config) == 1
    out, err = capfd.readouterr()
    assert AT_EXIT_BANNER in _lines_of(out, 0)  # the live output shows everything
    summary = err.splitlines()
    first = summary.index("keras-distrib: rank 0 failed with exit code 1; last output:")
    tail = [line.strip() for line in summary[first + 1 :]]
    assert tail[-1] == "ValueError: boom", err
    assert tail[0] == "epoch 1" and "Traceback (most recent call last):" in tail, err
    for banner in (*TF_BANNERS, AT_EXIT_BANNER):
        assert banner not in tail, err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_horovod_backend_output_has_one_prefix_style(tmp_path, capfd, no_leftovers):
    pytest.importorskip("horovod.tensorflow")
    script = tmp_path / "hvd_worker.py"
    script.write_text(
        RANK_PRELUDE.replace('"KERAS_DISTRIB_RANK"', '"HOROVOD_RANK"')
        + textwrap.dedent("""\
        print("hello", flush=True)
        if RANK == 0:
            for i in range(5):
                print(f"\\r{i}/5", end="", flush=True)
                time.sleep(0.05)
            print()
        print("to stderr", file=sys.stderr, flush=True)
    """)
    )
    config = LaunchConfig(nproc=2, script=str(script), backend="horovod", timeout=100)
    assert launch.launch(config) == 0
    out, _ = capfd.readouterr()
    assert "<stdout>:" not in out and "<stderr>:" not in out, out
    for line in out.split("\n")[:-1]:
        for piece in line.split("\r"):
            assert piece == "" or piece.startswith(("[rank 0] ", "[rank 1] ", "[horovodrun] ")), (
                repr(out)
            )
    for rank in range(2):
        assert {"hello", "to stderr"} <= set(_lines_of(out, rank)), out
    assert "\r[rank 0] " in out and ("\r[rank 0] 4/5\n" in out or "\n[rank 0] 4/5\n" in out), repr(
        out
    )
    assert not any(process_alive(pid) for pid in rank_pids(tmp_path).values())


# --------------------------------------------------------------------------
# Multi-host


@pytest.mark.slow
def test_ssh_runs_remote_ranks_through_the_ssh_command(tmp_path, capfd, no_leftovers):
    # A stand-in for ssh that runs the remote command here, as sshd would.
    fake_ssh = tmp_path / "fake_ssh.py"
    fake_ssh.write_text("import os, sys\nos.execvp('sh', ['sh', '-c', sys.argv[-1]])\n")
    args = ("quote's", "two words")
    config = LaunchConfig(
        nproc=2,
        script=rank_script(tmp_path, REPORT_BODY),
        script_args=args,
        hosts=("node-a.invalid", "node-b.invalid"),
        ssh=True,
        ssh_command=f"{sys.executable} {fake_ssh}",
    )
    assert launch.launch(config) == 0
    out, _ = capfd.readouterr()
    configs = _check_report(out, 2, args, host=None)
    assert configs[0]["cluster"]["worker"] == ["node-a.invalid:23456", "node-b.invalid:23456"]


@pytest.mark.slow
def test_ranks_run_on_their_hosts_and_their_exit_reaches_the_launcher(
    tmp_path, capfd, no_leftovers, hosts
):
    bed = hosts(2)  # two network namespaces (tests/netns_hosts.py)
    script = rank_script(
        tmp_path,
        textwrap.dedent(REPORT_BODY)
        + textwrap.dedent("""\
        import pathlib
        import socket
        me = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][RANK].rsplit(":", 1)[0]
        socket.create_server((me, 0)).close()  # the address is this host's own
        print("on " + me, flush=True)
        said = pathlib.Path(__file__).with_name("rank0-said")  # the hosts share this disk
        if RANK == 0:
            said.touch()
        if RANK == 1:
            while not said.exists():  # give up only after rank 0 has reported
                time.sleep(0.05)
            sys.stderr.write("rank 1 gives up\\n")
            sys.exit(3)
        time.sleep(600)
    """),
    )
    config = LaunchConfig(
        nproc=2, script=script, hosts=tuple(bed.addresses), ssh=True, ssh_command=bed.ssh_command
    )
    assert launch.launch(config) == 3
    out, err = capfd.readouterr()
    configs = _check_report(out, 2, (), host=None)
    assert configs[0]["cluster"]["worker"] == [f"{a}:23456" for a in bed.addresses]
    for rank, address in enumerate(bed.addresses):
        assert f"on {address}" in _lines_of(out, rank)
    assert "keras-distrib: rank 1 failed with exit code 3; last output:" in err
    assert "rank 1 gives up" in err
    assert bed.pids() == []  # rank 0, stopped by the launcher, is gone from its host


# --------------------------------------------------------------------------
# The command line (separate processes)


@pytest.mark.slow
def test_cli_runs_workers_and_passes_script_flags_untouched(tmp_path, no_leftovers):
    script = rank_script(tmp_path, REPORT_BODY)
    args = ("-n", "5", "--hosts=x", "--ssh", "--", "tail")
    proc = _cli("launch", "-n", "2", "--tail_lines", "5", script, *args)
    no_leftovers.append(proc)
    out, err = proc.communicate(timeout=45)
    assert proc.returncode == 0, err
    _check_report(out, 2, args)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, fragment",
    [
        (["launch", "-n", "0", "{script}"], "-n/--nproc must be >= 1, got 0"),
        (["launch", "-n", "2"], "missing the script to run"),
        (["launch", "--nproc=two", "{script}"], "flag --nproc=two"),
        (["train", "-n", "2", "{script}"], "unknown subcommand 'train'; valid subcommands: launch"),
    ],
)
def test_cli_bad_flags_give_one_line_error(tmp_path, no_leftovers, args, fragment):
    script = rank_script(tmp_path, "open(os.path.join(HERE, 'ran'), 'w').close()")
    proc = _cli(*[a.replace("{script}", script) for a in args], cwd=tmp_path)
    no_leftovers.append(proc)
    out, err = proc.communicate(timeout=45)
    assert proc.returncode == 2
    errors = _error_lines(err)
    assert len(errors) == 1 and errors[0].startswith("keras-distrib: error: "), err
    assert fragment in errors[0]
    assert not out and not rank_pids(tmp_path)


def _launch_two_sleepers(tmp_path, no_leftovers) -> subprocess.Popen:
    """`keras-distrib launch -n 2` of ranks that sleep; returns once both are up."""
    script = rank_script(tmp_path, 'print("ready", flush=True)\ntime.sleep(600)\n')
    proc = _cli("launch", "-n", "2", script)
    no_leftovers.append(proc)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    ready, deadline = set(), time.monotonic() + 40
    while not {"[rank 0] ready\n", "[rank 1] ready\n"} <= ready:
        ready.add(lines.get(timeout=max(deadline - time.monotonic(), 0.1)))
    return proc


@pytest.mark.slow
def test_cli_sigint_stops_all_workers(tmp_path, no_leftovers):
    proc = _launch_two_sleepers(tmp_path, no_leftovers)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=20) == 128 + signal.SIGINT
    assert "got SIGINT; stopping all ranks" in proc.stderr.read()
    pids = rank_pids(tmp_path)
    assert set(pids) == {0, 1}
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_workers_die_with_a_launcher_killed_by_sigkill(tmp_path, no_leftovers):
    """SIGKILL runs none of the launcher's clean-up; the kernel must."""
    proc = _launch_two_sleepers(tmp_path, no_leftovers)
    pids = rank_pids(tmp_path)
    assert set(pids) == {0, 1}
    with open(f"/proc/{pids[0]}/environ", "rb") as f:
        environ = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    shm_dir = environ[b"KERAS_DISTRIB_SHM_DIR"].decode()
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(process_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(pid) for pid in pids.values())
    # Nothing ran to remove the launcher's private directory: the one thing
    # a SIGKILLed launcher leaves behind (empty here).
    assert os.listdir(shm_dir) == []
    os.rmdir(shm_dir)


# --------------------------------------------------------------------------
# The launcher never imports TensorFlow or Keras (a fresh process: this one
# may have imported TensorFlow)


@pytest.mark.slow
def test_a_launch_driven_from_python_imports_no_tensorflow(tmp_path, no_leftovers):
    # The console script's own entry point, in a process we can look inside.
    script = rank_script(tmp_path, 'print("hello", json.dumps(sys.argv[1:]))')
    code = textwrap.dedent("""\
        import json, sys
        from keras_distrib.launch import cli
        script, heavy = sys.argv[1], sys.argv[2:]
        sys.argv = ["keras-distrib", "launch", "-n", "1", script, "-n", "7"]
        try:
            cli.run()
        except SystemExit as e:
            code = e.code
        print(json.dumps({"code": code, "heavy": [m for m in heavy if m in sys.modules]}))
    """)
    proc = run_python(code, script, *HEAVY_MODULES, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert '[rank 0] hello ["-n", "7"]' in lines, proc.stdout
    assert json.loads(lines[-1]) == {"code": 0, "heavy": []}, proc.stdout + proc.stderr
    assert set(rank_pids(tmp_path)) == {0}
    assert not any(process_alive(pid) for pid in rank_pids(tmp_path).values())
