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

from keras_distrib import launch
from keras_distrib.launch import LaunchConfig, LaunchError

# The module, for GRACE_SECONDS; `launch.supervise` is the function.
supervise_lib = importlib.import_module("keras_distrib.launch.supervise")

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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


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
    assert not any(_alive(pid) for pid in _pids(tmp_path).values())


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
    assert not any(_alive(pid) for pid in _pids(tmp_path).values())


@pytest.mark.slow
def test_timeout_stops_all_ranks(tmp_path, capfd, no_leftovers):
    script = _script(tmp_path, "time.sleep(600)")
    config = LaunchConfig(nproc=2, script=script, timeout=1)
    assert launch.launch(config) == launch.EXIT_TIMEOUT
    assert "timed out after 1s" in capfd.readouterr().err
    assert len(_pids(tmp_path)) == 2
    assert not any(_alive(pid) for pid in _pids(tmp_path).values())


@pytest.mark.slow
def test_interrupt_escalates_to_sigkill_for_stubborn_ranks(
        tmp_path, capfd, no_leftovers, monkeypatch):
    monkeypatch.setattr(supervise_lib, "GRACE_SECONDS", 1.0)
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
    code = launch.launch(LaunchConfig(nproc=2, script=script))
    timer.join()
    assert code == 128 + signal.SIGINT
    assert time.monotonic() - start < 10
    assert "got SIGINT; stopping all ranks" in capfd.readouterr().err
    assert not any(_alive(pid) for pid in _pids(tmp_path).values())


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
                     "--timeout", "--tail_lines", "KERAS_DISTRIB_WORLD_SIZE"):
        assert fragment in text


@pytest.mark.slow
def test_workers_die_with_a_launcher_killed_by_sigkill(tmp_path, no_leftovers):
    """SIGKILL runs none of the launcher's clean-up; the kernel must."""
    proc = _launch_two_sleepers(tmp_path, no_leftovers)
    pids = _pids(tmp_path)
    assert set(pids) == {0, 1}
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids.values())


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
    assert not any(_alive(pid) for pid in _pids(tmp_path).values())
