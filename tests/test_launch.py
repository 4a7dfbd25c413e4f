"""`keras-distrib launch`: real worker processes (plain Python, no TensorFlow).

In-process tests call `launch.launch(config)`; the command-line tests run
`python -m keras_distrib.launch`. The launcher never imports TensorFlow or
Keras; the tests that check this run in fresh processes, since this one
imports TensorFlow in conftest.
"""

import importlib
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
from helpers import process_alive

from keras_distrib import launch
from keras_distrib.launch import LaunchConfig, LaunchError

# The module of the printer and the output streams.
output_lib = importlib.import_module("keras_distrib.launch.output")

pytestmark = pytest.mark.timeout(60)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every worker script starts with this: it records its PID (atomically, so
# the test never reads half a file) for the "nothing left behind" checks.
PRELUDE = textwrap.dedent("""\
    import json, os, sys, time
    RANK = int(os.environ["KERAS_DISTRIB_RANK"])
    HERE = os.path.dirname(os.path.abspath(__file__))
    def _write_pid():
        path = os.path.join(HERE, f"rank{RANK}.pid")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
    _write_pid()
""")


def _script(tmp_path, body: str, name: str = "worker.py") -> str:
    path = tmp_path / name
    path.write_text(PRELUDE + textwrap.dedent(body))
    return str(path)


def _pids(tmp_path) -> dict[int, int]:
    return {int(p.name[4:-4]): int(p.read_text()) for p in tmp_path.glob("rank*.pid")}


@pytest.fixture
def no_leftovers(tmp_path):
    """Yields a list for Popen objects; kills them and any worker on exit."""
    started = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for pid in _pids(tmp_path).values():
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _lines_of(output: str, rank: int) -> list[str]:
    prefix = f"[rank {rank}] "
    return [line[len(prefix):] for line in output.splitlines() if line.startswith(prefix)]


def _cli(*args, cwd=None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.Popen(
        [sys.executable, "-m", "keras_distrib.launch", *args], cwd=cwd, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)


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
        config = json.loads(next(l for l in lines if l.startswith("TF_CONFIG="))[10:])
        env = json.loads(next(l for l in lines if l.startswith("ENV="))[4:])
        assert env["KERAS_DISTRIB_RANK"] == str(rank)
        assert env["KERAS_DISTRIB_WORLD_SIZE"] == str(nproc)
        assert env["PYTHONUNBUFFERED"] == "1"
        assert json.loads(next(l for l in lines if l.startswith("ARGS="))[5:]) == list(args)
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
# Pure helpers (no processes)


@pytest.mark.parametrize("argv, head, tail", [
    (["kd", "launch", "-n", "2", "t.py", "-n", "5", "--ssh"],
     ["kd", "launch", "-n", "2"], ["t.py", "-n", "5", "--ssh"]),
    (["kd", "-n", "2", "--ssh", "launch", "--hosts", "a,b", "t.py"],
     ["kd", "-n", "2", "--ssh", "launch", "--hosts", "a,b"], ["t.py"]),
    (["kd", "launch", "--nproc=2", "--", "-weird.py", "x"],
     ["kd", "launch", "--nproc=2"], ["-weird.py", "x"]),
    (["kd", "launch", "-n", "2"], ["kd", "launch", "-n", "2"], []),
    (["kd"], ["kd"], []),
])
def test_split_argv_keeps_script_flags_away_from_absl(argv, head, tail):
    assert launch.split_argv(argv) == (head, tail)


def test_parse_hosts():
    assert launch.parse_hosts(["a", "b"], 4) == ["a", "a", "b", "b"]
    assert launch.parse_hosts(["a", "b"], 3) == ["a", "a", "b"]
    assert launch.parse_hosts(["a:1", "b:3"], 4) == ["a", "b", "b", "b"]
    assert launch.parse_hosts(["a:4", "b:4"], 2) == ["a", "a"]
    assert launch.parse_hosts(["[fe80::1]:2"], 2) == ["[fe80::1]", "[fe80::1]"]


@pytest.mark.parametrize("hosts, nproc, fragment", [
    (["a:1", "b:1"], 3, "gives 2 slots but -n is 3"),
    (["a", "b", "c"], 2, "lists 3 hosts but -n is 2"),
    (["a", "a:2"], 2, "lists 'a' twice"),
    (["a:0"], 1, "slots must be >= 1"),
    (["fe80::1"], 1, "IPv6 hosts in brackets"),
    (["a:x"], 1, "not host or host:slots"),
])
def test_parse_hosts_errors(hosts, nproc, fragment):
    with pytest.raises(LaunchError, match=fragment):
        launch.parse_hosts(hosts, nproc)


def test_check_config_errors(tmp_path):
    script = _script(tmp_path, "")
    for config, fragment in [
        (LaunchConfig(nproc=0, script=script), "must be >= 1, got 0"),
        (LaunchConfig(nproc=1, script=str(tmp_path / "no.py")), "not found"),
        (LaunchConfig(nproc=2, script=script, port_base=65535), "no room for 2 ports"),
        (LaunchConfig(nproc=1, script=script, timeout=-1), "--timeout=-1"),
        (LaunchConfig(nproc=1, script=script, max_restarts=-1), "--max_restarts=-1 must be >= 0"),
        (LaunchConfig(nproc=1, script=script, grace_seconds=-1), "--grace_seconds=-1 must be >= 0"),
        (LaunchConfig(nproc=1, script=script, backend="horovod", max_restarts=1),
         "works with --backend=tf only"),
    ]:
        with pytest.raises(LaunchError, match=fragment):
            launch.check_config(config)


def test_port_base_in_use_is_refused(tmp_path):
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        config = LaunchConfig(nproc=2, script=_script(tmp_path, ""), port_base=port)
        with pytest.raises(LaunchError, match=f"port {port} is already in use.*--port_base"):
            launch.launch(config)
    assert not _pids(tmp_path)  # refused before starting anything


# --------------------------------------------------------------------------
# Local launches: real processes


@pytest.mark.slow
def test_two_workers_succeed_with_prefixed_lines_and_own_tf_config(tmp_path, capfd, no_leftovers):
    args = ("--nproc", "9", "-n", "3", "it's a b")
    config = LaunchConfig(nproc=2, script=_script(tmp_path, REPORT_BODY), script_args=args)
    assert launch.launch(config) == 0
    out, _ = capfd.readouterr()
    assert all(line.startswith(("[rank 0] ", "[rank 1] ")) for line in out.splitlines()), out
    _check_report(out, 2, args)
    assert not any(process_alive(pid) for pid in _pids(tmp_path).values())


@pytest.mark.slow
@pytest.mark.parametrize("body, code, text", [
    ("sys.stderr.write('boom: bad batch\\n'); sys.exit(3)", 3, "boom: bad batch"),
    ("raise ValueError('shapes do not match')", 1, "ValueError: shapes do not match"),
])
def test_failing_rank_stops_the_others_and_sets_exit_code(
        tmp_path, capfd, no_leftovers, body, code, text):
    script = _script(tmp_path, f"""\
        if RANK == 0:
            print("ready", flush=True)
            time.sleep(600)
        while not os.path.exists(os.path.join(HERE, "rank0.pid")):
            time.sleep(0.01)
        {body}
    """)
    start = time.monotonic()
    assert launch.launch(LaunchConfig(nproc=2, script=script)) == code
    assert time.monotonic() - start < 8
    out, err = capfd.readouterr()
    assert text in "\n".join(_lines_of(out, 1))
    summary = err.splitlines()
    first = summary.index(f"keras-distrib: rank 1 failed with exit code {code}; last output:")
    assert any(text in line for line in summary[first + 1:]), err
    pids = _pids(tmp_path)
    assert set(pids) == {0, 1}
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_rank_killed_by_signal_gives_128_plus_signum(tmp_path, capfd, no_leftovers):
    script = _script(tmp_path, "os.kill(os.getpid(), 9) if RANK == 1 else time.sleep(600)")
    assert launch.launch(LaunchConfig(nproc=2, script=script)) == 128 + 9
    _, err = capfd.readouterr()
    assert "rank 1 failed with signal SIGKILL (exit code 137)" in err
    assert not any(process_alive(pid) for pid in _pids(tmp_path).values())


@pytest.mark.slow
def test_timeout_stops_all_ranks(tmp_path, capfd, no_leftovers):
    script = _script(tmp_path, "time.sleep(600)")
    config = LaunchConfig(nproc=2, script=script, timeout=1)
    assert launch.launch(config) == launch.EXIT_TIMEOUT
    assert "timed out after 1s" in capfd.readouterr().err
    assert len(_pids(tmp_path)) == 2
    assert not any(process_alive(pid) for pid in _pids(tmp_path).values())


@pytest.mark.slow
def test_interrupt_escalates_to_sigkill_for_stubborn_ranks(tmp_path, capfd, no_leftovers):
    script = _script(tmp_path, """\
        import signal
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(600)
    """)

    def interrupt_when_ready():
        deadline = time.monotonic() + 20
        while len(_pids(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # let the workers install their handlers
        os.kill(os.getpid(), signal.SIGINT)  # the launcher's trap gets it

    timer = threading.Thread(target=interrupt_when_ready)
    timer.start()
    start = time.monotonic()
    code = launch.launch(LaunchConfig(nproc=2, script=script, grace_seconds=1.0))
    timer.join()
    assert code == 128 + signal.SIGINT
    assert time.monotonic() - start < 10
    assert "got SIGINT; stopping all ranks" in capfd.readouterr().err
    assert not any(process_alive(pid) for pid in _pids(tmp_path).values())


# --------------------------------------------------------------------------
# Output: progress bars (\r redraws), CRLF, TensorFlow's C++ logs


def _feed(chunks_by_source, hide_tf_noise=False) -> str:
    """What the printer writes for `(source, chunk)` pairs fed in order."""
    import io
    stream = io.StringIO()
    printer = output_lib.Printer(stream, hide_tf_noise=hide_tf_noise)
    tail: list[str] = []
    sources = {}
    for source, chunk in chunks_by_source:
        if source not in sources:
            sources[source] = output_lib.Stream(f"[{source}] ", printer, tail)
        sources[source].feed(chunk)
    for source in sources.values():
        source.close()
    printer.end_line()
    return stream.getvalue()


def test_redraws_show_as_one_updating_line_and_crlf_ends_lines():
    # Keras's progbar: backspaces over the old text, \r, the new text.
    bar = [("r0", "\r0/3"), ("r0", "\b\b\b\r1/3"), ("r0", "\b\b\b\r2/3"), ("r0", "\n")]
    assert _feed(bar) == "\r[r0] 0/3\r[r0] 1/3\r[r0] 2/3\n"
    # ssh -tt: CRLF line ends, also when a read ends between \r and \n.
    assert _feed([("r0", "one\r\ntwo\r\nthree\r"), ("r0", "\nfour\r\n")]) == (
        "[r0] one\n[r0] two\n\r[r0] three\n[r0] four\n")
    # A bar ended by CRLF; several redraws in one read show the last.
    assert _feed([("r0", "\r1/3\r2/3"), ("r0", "\r3/3\r\n")]) == "\r[r0] 2/3\r[r0] 3/3\n"
    # A plain partial line still waits for its end.
    assert _feed([("r0", "Epo"), ("r0", "ch 1\n")]) == "[r0] Epoch 1\n"


def test_banners_left_by_tf_cpp_min_log_level_are_dropped_unless_asked_for():
    banners = ("WARNING: All log messages before absl::InitializeLog() is called are "
               "written to STDERR\nI0000 00:00:1795414363.840102   27521 port.cc:153] oneDNN "
               "custom operations are on.\n")
    chunks = [("r0", banners + "Epoch 1/2\n")]
    assert _feed(chunks, hide_tf_noise=True) == "[r0] Epoch 1/2\n"
    assert _feed(chunks).count("[r0] ") == 3


def test_another_sources_line_ends_an_open_redraw_first():
    out = _feed([("r0", "\r1/3"), ("r1", "hello\n"), ("r0", "\r2/3"), ("r0", "\n"),
                 ("r1", "bye\n")])
    assert out == "\r[r0] 1/3\n[r1] hello\n\r[r0] 2/3\n[r1] bye\n"


def test_horovodrun_prefixes_become_rank_labels():
    import io
    from keras_distrib.launch import backends
    stream = io.StringIO()
    printer = output_lib.Printer(stream)
    tail: list = []
    own = output_lib.Stream("[horovodrun] ", printer, tail)
    demux = output_lib.RankDemux(backends.HOROVODRUN_RANK_PREFIX, own, printer, tail)
    # As horovodrun forwards a Keras bar on rank 0 (each piece behind the
    # prefix, ending in \r or \n), reads cut anywhere.
    text = ("[0]<stdout>:\r[0]<stdout>:1/2 \b\b\b\b\r[1]<stdout>:hi\n"
            "[0]<stdout>:2/2\n[1]<stderr>:warn\nProcess 1 exit with status code 0.\n"
            "Mon Nov  3 06:13:52 2026[1]<stdout>:stamped\n")
    for i in range(0, len(text), 7):
        demux.feed(text[i:i + 7])
    demux.close()
    assert stream.getvalue() == (
        "\r[rank 0] 1/2 \n[rank 1] hi\n[rank 0] 2/2\n[rank 1] warn\n"
        "[horovodrun] Process 1 exit with status code 0.\n[rank 1] stamped\n")
    assert "[rank 1] warn" in tail


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
    script = _script(tmp_path, PROGRESS_BODY)
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
    script = _script(tmp_path, f"""\
        print("\\r1/2", end="", flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        print("\\r2/2")
    """)
    out, codes = _Watched(), []
    runner = threading.Thread(
        target=lambda: codes.append(launch.launch(LaunchConfig(nproc=1, script=script),
                                                  out=out, err=out)))
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
        tmp_path, capfd, no_leftovers, monkeypatch, user_value, want):
    if user_value is None:
        monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", user_value)
    script = _script(tmp_path, 'print("LEVEL=" + os.environ.get("TF_CPP_MIN_LOG_LEVEL", "unset"))')
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
    "2024-05-01 12:00:00.123456: I tensorflow/core/util/port.cc:113] oneDNN custom operations are on.",
    "E0000 00:00:1795414311.000000   26383 cuda_executor.cc:1228] failed call to cuInit: "
    "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
]
AT_EXIT_BANNER = ("I0000 00:00:1795414312.000000   26383 coordination_service_agent.cc:500] "
                  "Coordination agent has successfully shut down.")


@pytest.mark.slow
def test_failure_tail_leaves_out_tf_banners_and_ends_with_the_traceback(
        tmp_path, capfd, no_leftovers):
    script = _script(tmp_path, f"""\
        import atexit
        atexit.register(lambda: print({AT_EXIT_BANNER!r}, file=sys.stderr, flush=True))
        for line in {TF_BANNERS!r}:
            print(line, file=sys.stderr, flush=True)
        print("epoch 1", flush=True)
        raise ValueError("boom")
    """)
    config = LaunchConfig(nproc=1, script=script, tail_lines=8)
    assert launch.launch(config) == 1
    out, err = capfd.readouterr()
    assert AT_EXIT_BANNER in _lines_of(out, 0)  # the live output shows everything
    summary = err.splitlines()
    first = summary.index("keras-distrib: rank 0 failed with exit code 1; last output:")
    tail = [line.strip() for line in summary[first + 1:]]
    assert tail[-1] == "ValueError: boom", err
    assert tail[0] == "epoch 1" and "Traceback (most recent call last):" in tail, err
    for banner in (*TF_BANNERS, AT_EXIT_BANNER):
        assert banner not in tail, err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_horovod_backend_output_has_one_prefix_style(tmp_path, capfd, no_leftovers):
    pytest.importorskip("horovod.tensorflow")
    script = tmp_path / "hvd_worker.py"
    script.write_text(PRELUDE.replace('"KERAS_DISTRIB_RANK"', '"HOROVOD_RANK"') + textwrap.dedent("""\
        print("hello", flush=True)
        if RANK == 0:
            for i in range(5):
                print(f"\\r{i}/5", end="", flush=True)
                time.sleep(0.05)
            print()
        print("to stderr", file=sys.stderr, flush=True)
    """))
    config = LaunchConfig(nproc=2, script=str(script), backend="horovod", timeout=100)
    assert launch.launch(config) == 0
    out, _ = capfd.readouterr()
    assert "<stdout>:" not in out and "<stderr>:" not in out, out
    for line in out.split("\n")[:-1]:
        for piece in line.split("\r"):
            assert piece == "" or piece.startswith(
                ("[rank 0] ", "[rank 1] ", "[horovodrun] ")), repr(out)
    for rank in range(2):
        assert {"hello", "to stderr"} <= set(_lines_of(out, rank)), out
    assert "\r[rank 0] " in out and ("\r[rank 0] 4/5\n" in out or "\n[rank 0] 4/5\n" in out), repr(out)
    assert not any(process_alive(pid) for pid in _pids(tmp_path).values())


# --------------------------------------------------------------------------
# Multi-host


@pytest.mark.slow
def test_multi_host_dry_run_prints_and_writes_tf_config(tmp_path, capfd, no_leftovers):
    script = _script(tmp_path, "open(os.path.join(HERE, 'ran'), 'w').close()")
    out_dir = tmp_path / "out"
    config = LaunchConfig(nproc=3, script=script, script_args=("--lr", "0.1"),
                          hosts=("node-a.invalid:2", "node-b.invalid"),
                          output_dir=str(out_dir))
    assert launch.launch(config) == 0
    out, _ = capfd.readouterr()
    expected_workers = ["node-a.invalid:23456", "node-a.invalid:23457", "node-b.invalid:23456"]
    for rank, host in enumerate(["node-a.invalid", "node-a.invalid", "node-b.invalid"]):
        line = next(l for l in out.splitlines() if l.startswith(f"rank {rank} on {host}: "))
        tf_config = json.loads(line.split("TF_CONFIG=", 1)[1])
        assert tf_config == {"cluster": {"worker": expected_workers},
                             "task": {"type": "worker", "index": rank}}
        assert json.loads((out_dir / f"rank-{rank}.tf_config.json").read_text()) == tf_config
    commands = [l.strip() for l in out.splitlines() if l.startswith("  cd ")]
    assert len(commands) == 3
    assert all(c.endswith(f"{script} --lr 0.1") for c in commands)
    assert "KERAS_DISTRIB_RANK=2" in commands[2]
    host_a = (out_dir / "host-node-a.invalid.sh").read_text()
    assert commands[0] in host_a and commands[1] in host_a and commands[2] not in host_a
    assert (out_dir / "host-node-b.invalid.sh").exists()
    assert not (tmp_path / "ran").exists() and not _pids(tmp_path)


@pytest.mark.slow
def test_ssh_runs_remote_ranks_through_the_ssh_command(tmp_path, capfd, no_leftovers):
    # A stand-in for ssh that runs the remote command here, as sshd would.
    fake_ssh = tmp_path / "fake_ssh.py"
    fake_ssh.write_text("import os, sys\nos.execvp('sh', ['sh', '-c', sys.argv[-1]])\n")
    args = ("quote's", "two words")
    config = LaunchConfig(nproc=2, script=_script(tmp_path, REPORT_BODY), script_args=args,
                          hosts=("node-a.invalid", "node-b.invalid"), ssh=True,
                          ssh_command=f"{sys.executable} {fake_ssh}")
    assert launch.launch(config) == 0
    out, _ = capfd.readouterr()
    configs = _check_report(out, 2, args, host=None)
    assert configs[0]["cluster"]["worker"] == ["node-a.invalid:23456", "node-b.invalid:23456"]


# --------------------------------------------------------------------------
# The command line (separate processes)


@pytest.mark.slow
def test_cli_runs_workers_and_passes_script_flags_untouched(tmp_path, no_leftovers):
    script = _script(tmp_path, REPORT_BODY)
    args = ("-n", "5", "--hosts=x", "--ssh", "--", "tail")
    proc = _cli("launch", "-n", "2", "--tail_lines", "5", script, *args)
    no_leftovers.append(proc)
    out, err = proc.communicate(timeout=45)
    assert proc.returncode == 0, err
    _check_report(out, 2, args)


@pytest.mark.slow
@pytest.mark.parametrize("args, fragment", [
    (["launch", "-n", "0", "{script}"], "-n/--nproc must be >= 1, got 0"),
    (["launch", "-n", "2"], "missing the script to run"),
    (["launch", "--nproc=two", "{script}"], "flag --nproc=two"),
    (["train", "-n", "2", "{script}"], "unknown subcommand 'train'; valid subcommands: launch"),
])
def test_cli_bad_flags_give_one_line_error(tmp_path, no_leftovers, args, fragment):
    script = _script(tmp_path, "open(os.path.join(HERE, 'ran'), 'w').close()")
    proc = _cli(*[a.replace("{script}", script) for a in args], cwd=tmp_path)
    no_leftovers.append(proc)
    out, err = proc.communicate(timeout=45)
    assert proc.returncode == 2
    errors = _error_lines(err)
    assert len(errors) == 1 and errors[0].startswith("keras-distrib: error: "), err
    assert fragment in errors[0]
    assert not out and not _pids(tmp_path)


def _launch_two_sleepers(tmp_path, no_leftovers) -> subprocess.Popen:
    """`keras-distrib launch -n 2` of ranks that sleep; returns once both are up."""
    script = _script(tmp_path, 'print("ready", flush=True)\ntime.sleep(600)\n')
    proc = _cli("launch", "-n", "2", script)
    no_leftovers.append(proc)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout], daemon=True).start()
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
    pids = _pids(tmp_path)
    assert set(pids) == {0, 1}
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_usage_lists_flags_and_env_contract():
    text = launch.usage()
    for fragment in ("-n,--nproc", "--hosts", "--port_base", "--bind", "--ssh",
                     "--timeout", "--tail_lines", "--max_restarts", "--grace_seconds",
                     "KERAS_DISTRIB_WORLD_SIZE", "KERAS_DISTRIB_RESTART",
                     "KERAS_DISTRIB_SHM_DIR", "TF_CPP_MIN_LOG_LEVEL"):
        assert fragment in text


@pytest.mark.slow
def test_workers_die_with_a_launcher_killed_by_sigkill(tmp_path, no_leftovers):
    """SIGKILL runs none of the launcher's clean-up; the kernel must."""
    proc = _launch_two_sleepers(tmp_path, no_leftovers)
    pids = _pids(tmp_path)
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
# The launcher never imports TensorFlow or Keras (fresh processes: this one
# imported TensorFlow in conftest)

_HEAVY = ("tensorflow", "keras")


def _python(code: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=45)


def test_importing_the_launcher_imports_no_tensorflow():
    code = textwrap.dedent("""\
        import importlib, json, pkgutil, sys
        import keras_distrib.launch as package
        names = [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
        for name in names:  # __main__ too: it runs nothing unless run as a script
            importlib.import_module(name)
        print(json.dumps({"modules": names,
                          "heavy": [m for m in sys.argv[1:] if m in sys.modules]}))
    """)
    proc = _python(code, *_HEAVY)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    for module in ("cli", "plan", "supervise", "backends", "__main__"):
        assert f"keras_distrib.launch.{module}" in result["modules"]
    assert result["heavy"] == [], result


@pytest.mark.slow
def test_a_launch_driven_from_python_imports_no_tensorflow(tmp_path, no_leftovers):
    # The console script's own entry point, in a process we can look inside.
    script = _script(tmp_path, 'print("hello", json.dumps(sys.argv[1:]))')
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
    proc = _python(code, script, *_HEAVY, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert '[rank 0] hello ["-n", "7"]' in lines, proc.stdout
    assert json.loads(lines[-1]) == {"code": 0, "heavy": []}, proc.stdout + proc.stderr
    assert set(_pids(tmp_path)) == {0}
    assert not any(process_alive(pid) for pid in _pids(tmp_path).values())
