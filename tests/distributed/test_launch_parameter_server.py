"""`keras-distrib launch --workers N --ps M`: parameter-server jobs, and the task server.

Three kinds of test:

* flags, with the launcher only (planning without processes is in
  tests/unit/test_launch_parameter_server_plan.py);
* supervision (worker restarts, a lost ps, signals, the timeout) with
  `--ps_tasks_run_script` and plain-Python scripts that act out each role
  by their `TF_CONFIG` task type, so they take a second, not TensorFlow's
  start-up;
* real clusters: servers run
  `python -m keras_distrib.strategies.parameter_server.task_server` and the
  chief script below connects to them with
  `tf.distribute.ParameterServerStrategy` + `ClusterCoordinator` directly
  (not through keras_distrib's strategy); the task server's own
  configuration is checked in one process in
  tests/integration/test_parameter_server_config.py. A worker killed and
  restarted, and a ps killed, in real clusters are in
  tests/distributed/test_parameter_server.py (through the strategy).

Every test that starts a process is marked `slow`, as setup.cfg defines
the marker (the plain-script ones take 1-4 s).

How a test finds and checks processes: each server prints its pid in its
`serving on` line, so a test kills a worker or ps by that pid; every
process a test starts inherits a variable with a token unique to the test
(`KD_PS_TEST`), and "nothing left running" means no process in /proc has
that token in its environment (zombies have none left). The fixture
SIGKILLs whatever still has it, whatever happened.
"""

import importlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

from helpers import CHILD_PYTHONPATH, kill_pids, kill_process_group
from pure_helpers import write_script
from keras_distrib import cluster, launch
from keras_distrib.launch import LaunchConfig

# The module whose PS_LOSS_GRACE_SECONDS the launcher reads.
ps_supervise_lib = importlib.import_module("keras_distrib.launch.parameter_server")

MARKER = "KD_PS_TEST"
SERVER_MODULE = ["-m", "keras_distrib.strategies.parameter_server.task_server"]

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------
# Processes: the marker, and a launcher whose output is read as it comes


def _marked_pids(token: str) -> list[int]:
    """Live processes (not this one) whose environment holds `MARKER=token`."""
    needle = f"{MARKER}={token}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:  # gone, or not ours
            pass
    return found


def _wait_until_gone(token: str, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := _marked_pids(token)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture
def token(monkeypatch):
    """A token every process started by the test inherits; all are killed after."""
    value = uuid.uuid4().hex
    monkeypatch.setenv(MARKER, value)
    yield value
    kill_pids(_marked_pids(value))


class _Launcher:
    """`python -m keras_distrib.launch launch ...`, its stdout and stderr read live."""

    def __init__(self, args, cwd):
        env = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "keras_distrib.launch", "launch", *args],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._changed = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(stream, lines), daemon=True)
            for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, lines):
        for line in stream:
            with self._changed:
                lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float, count: int = 1) -> list[re.Match]:
        """The first `count` matches of `pattern` in stdout+stderr lines, waiting."""
        regex = re.compile(pattern)

        def matches():
            return [m for m in map(regex.search, self.out + self.err) if m]

        with self._changed:
            self._changed.wait_for(
                lambda: len(matches()) >= count or self.proc.poll() is not None, timeout
            )
            found = matches()
        assert len(found) >= count, f"no {pattern!r} within {timeout}s:\n{self.text()}"
        return found[:count]

    def count(self, pattern: str) -> int:
        """How many stdout+stderr lines so far match `pattern`."""
        regex = re.compile(pattern)
        with self._changed:
            return sum(1 for line in self.out + self.err if regex.search(line))

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self.kill()
        for reader in self._readers:
            reader.join(timeout=5)
        return code

    def kill(self):
        kill_process_group(self.proc)

    def text(self) -> str:
        return "\n".join(["--- stdout", *self.out, "--- stderr", *self.err])


@pytest.fixture
def launcher(tmp_path, token):
    started = []

    def start(*args) -> _Launcher:
        started.append(_Launcher(args, cwd=tmp_path))
        return started[-1]

    yield start
    for run in started:
        run.kill()


# --------------------------------------------------------------------------
# Flags, through the command line


def _cli_error(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH}
    proc = subprocess.run(
        [sys.executable, "-m", "keras_distrib.launch", "launch", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("keras-distrib:")]
    return proc.returncode, proc.stdout, errors


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, fragment",
    [
        (["-n", "2", "--workers", "3"], "-n 2 and --workers 3 disagree"),
        (["--ps", "1"], "--workers is required with --ps"),
        (["--workers", "1", "--ps", "1", "--backend", "horovod"], "works with --backend=tf only"),
        (["--workers", "2", "--ps_tasks_run_script"], "--ps_tasks_run_script needs --ps"),
        (["--workers", "2", "--ps", "-1"], "flag --ps=-1"),
        (["--workers", "0", "--ps", "1"], "--workers must be >= 1 with --ps"),
    ],
)
def test_cli_bad_parameter_server_flags_give_one_line_error(tmp_path, token, args, fragment):
    script = write_script(tmp_path, "open('ran', 'w').close()")
    code, out, errors = _cli_error(tmp_path, *args, script)
    assert code == 2
    assert len(errors) == 1 and errors[0].startswith("keras-distrib: error: "), errors
    assert fragment in errors[0]
    assert not out and not (tmp_path / "ran").exists()


@pytest.mark.slow
def test_workers_flag_without_ps_is_n(tmp_path, token):
    # --workers N is -n N: the same ranks, `[rank N]` lines.
    script = write_script(
        tmp_path, "import os; print('size', os.environ['KERAS_DISTRIB_WORLD_SIZE'])"
    )
    code, out, errors = _cli_error(tmp_path, "--workers", "2", "-n", "2", script)
    assert code == 0, errors
    assert sorted(out.splitlines()) == ["[rank 0] size 2", "[rank 1] size 2"]


# --------------------------------------------------------------------------
# Supervision, with plain scripts acting out the roles (--ps_tasks_run_script)

# Every role records its pid and TF_CONFIG, per start, in ROLE-INDEX.sN.json.
ROLE_PRELUDE = textwrap.dedent("""\
    import json, os, sys, time
    HERE = os.path.dirname(os.path.abspath(__file__))
    CONFIG = json.loads(os.environ["TF_CONFIG"])
    ROLE, INDEX = CONFIG["task"]["type"], CONFIG["task"]["index"]
    NAME = f"{ROLE}-{INDEX}"

    def put(name, text=""):
        path = os.path.join(HERE, name)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)

    def starts(name):
        return sorted(f for f in os.listdir(HERE)
                      if f.startswith(name + ".s") and f.endswith(".json"))

    START = len(starts(NAME))
    put(f"{NAME}.s{START}.json", json.dumps({
        "pid": os.getpid(), "tf_config": CONFIG, "rank": os.environ.get("KERAS_DISTRIB_RANK"),
        "world_size": os.environ.get("KERAS_DISTRIB_WORLD_SIZE")}))
    print(f"TASK {ROLE} {INDEX} start {START}", flush=True)

    def wait_for(predicate, timeout=30):
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                sys.exit(f"{NAME}: timed out waiting")
            time.sleep(0.02)
""")


def _role_script(tmp_path, body: str) -> str:
    return write_script(tmp_path, ROLE_PRELUDE + textwrap.dedent(body))


def _records(tmp_path) -> dict[tuple[str, int], dict]:
    found = {}
    for path in tmp_path.glob("*.s*.json"):
        name, start = re.fullmatch(r"(.+)\.s(\d+)\.json", path.name).groups()
        found[name, int(start)] = json.loads(path.read_text())
    return found


def _ps_config(script, **kwargs) -> LaunchConfig:
    options = dict(
        nproc=2, ps=1, script=script, ps_tasks_run_script=True, grace_seconds=5, timeout=50
    )
    options.update(kwargs)
    return LaunchConfig(**options)


@pytest.mark.slow
def test_ps_tasks_run_script_runs_it_on_every_task_with_its_tf_config(tmp_path, capfd, token):
    script = _role_script(
        tmp_path,
        """\
        if ROLE != "chief":
            time.sleep(600)  # as a server: until the launcher stops it
        wait_for(lambda: all(starts(n) for n in ("worker-0", "worker-1", "ps-0")))
        print("all tasks up")
    """,
    )
    assert launch.launch(_ps_config(script)) == 0
    out, err = capfd.readouterr()
    for label, line in [
        ("chief", "TASK chief 0 start 0"),
        ("worker 0", "TASK worker 0 start 0"),
        ("worker 1", "TASK worker 1 start 0"),
        ("ps 0", "TASK ps 0 start 0"),
    ]:
        assert f"[{label}] {line}" in out.splitlines(), out
    assert "[chief] all tasks up" in out.splitlines()
    records = _records(tmp_path)
    assert set(records) == {("chief-0", 0), ("worker-0", 0), ("worker-1", 0), ("ps-0", 0)}
    cluster = records["chief-0", 0]["tf_config"]["cluster"]
    ports = [int(a.rsplit(":", 1)[1]) for role in ("chief", "worker", "ps") for a in cluster[role]]
    assert len(set(ports)) == 4
    for (name, _), record in records.items():
        role, index = name.split("-")
        assert record["tf_config"] == {
            "cluster": cluster,
            "task": {"type": role, "index": int(index)},
        }
    assert [records[n, 0]["rank"] for n in ("chief-0", "worker-0", "worker-1", "ps-0")] == [
        "0",
        "1",
        "2",
        None,
    ]
    assert "restarting" not in err
    assert not _wait_until_gone(token)


@pytest.mark.slow
def test_exited_worker_is_restarted_alone_with_the_same_tf_config(tmp_path, capfd, token):
    script = _role_script(
        tmp_path,
        """\
        if NAME == "worker-1" and START == 0:
            wait_for(lambda: starts("chief-0"))
            sys.exit(3)
        if ROLE != "chief":
            time.sleep(600)
        wait_for(lambda: len(starts("worker-1")) == 2)
        print("worker 1 is back")
    """,
    )
    assert launch.launch(_ps_config(script)) == 0
    out, err = capfd.readouterr()
    assert "[launcher] worker 1 exited (exit code 3); restarting it (restart 1)" in err.splitlines()
    assert "[chief] worker 1 is back" in out.splitlines()
    records = _records(tmp_path)
    # Only worker 1 started again, with the same TF_CONFIG (so the same port).
    assert set(records) == {
        ("chief-0", 0),
        ("worker-0", 0),
        ("worker-1", 0),
        ("worker-1", 1),
        ("ps-0", 0),
    }
    assert records["worker-1", 1]["tf_config"] == records["worker-1", 0]["tf_config"]
    assert records["worker-1", 1]["pid"] != records["worker-1", 0]["pid"]
    assert not _wait_until_gone(token)


@pytest.mark.slow
def test_worker_restarts_are_bounded_by_max_restarts(tmp_path, capfd, token):
    script = _role_script(
        tmp_path,
        """\
        if ROLE == "worker":
            sys.exit(3)
        time.sleep(600)
    """,
    )
    assert launch.launch(_ps_config(script, nproc=1, max_restarts=2)) == 3
    _, err = capfd.readouterr()
    lines = err.splitlines()
    assert "[launcher] worker 0 exited (exit code 3); restarting it (restart 1)" in lines
    assert "[launcher] worker 0 exited (exit code 3); restarting it (restart 2)" in lines
    assert (
        "[launcher] worker 0 exited (exit code 3); no restarts left (2 used, at most "
        "--max_restarts=2); stopping the job."
    ) in lines, err
    assert "keras-distrib: worker 0 failed with exit code 3; last output:" in lines
    assert len(_records(tmp_path)) == 1 + 3 + 1  # chief, worker 0 three times, ps
    assert not _wait_until_gone(token)


@pytest.mark.slow
def test_lost_ps_is_not_restarted_and_a_chief_running_on_is_stopped(
    tmp_path, capfd, token, monkeypatch
):
    monkeypatch.setattr(ps_supervise_lib, "PS_LOSS_GRACE_SECONDS", 1.0)
    script = _role_script(
        tmp_path,
        """\
        if ROLE == "ps":
            wait_for(lambda: starts("chief-0") and starts("worker-0"))
            os.kill(os.getpid(), 9)
        time.sleep(600)  # the chief too: as if it missed the loss
    """,
    )
    # The chief sleeps 600 s: the launch ends (within the test's timeout)
    # only because the launcher stops it.
    assert launch.launch(_ps_config(script, nproc=1)) == 1
    _, err = capfd.readouterr()
    lines = err.splitlines()
    assert (
        "[launcher] ps 0 exited (signal 9); not restarting it (its variables are lost); "
        "the chief should fail, else it is stopped in 1s."
    ) in lines, err
    assert (
        "[launcher] the chief still runs 1s after ps 0 was lost; stopping the job (exit code 1)."
    ) in lines, err
    assert set(_records(tmp_path)) == {("chief-0", 0), ("worker-0", 0), ("ps-0", 0)}
    assert not _wait_until_gone(token)


@pytest.mark.slow
def test_chief_failure_ends_the_job_with_its_code_and_tail(tmp_path, capfd, token):
    script = _role_script(
        tmp_path,
        """\
        if ROLE != "chief":
            time.sleep(600)
        wait_for(lambda: starts("ps-0"))
        raise ValueError("the chief gave up")
    """,
    )
    assert launch.launch(_ps_config(script, nproc=1)) == 1
    _, err = capfd.readouterr()
    lines = err.splitlines()
    first = lines.index("keras-distrib: chief failed with exit code 1; last output:")
    assert lines[-1].strip() == "ValueError: the chief gave up", err
    assert first < len(lines) - 1
    assert not _wait_until_gone(token)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["signal", "timeout"])
def test_signal_or_timeout_stops_every_task(tmp_path, capfd, token, how):
    script = _role_script(
        tmp_path,
        """\
        import signal
        if ROLE == "worker":  # a stubborn one: SIGKILL after --grace_seconds
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        put(f"{NAME}.ready")
        time.sleep(600)
    """,
    )

    def interrupt_when_ready():
        names = ("chief-0", "worker-0", "ps-0")
        deadline = time.monotonic() + 20
        while (
            not all((tmp_path / f"{n}.ready").exists() for n in names)
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)  # the launcher's trap gets it

    config = _ps_config(script, nproc=1, grace_seconds=1, timeout=50 if how == "signal" else 3)
    timer = threading.Thread(target=interrupt_when_ready) if how == "signal" else None
    if timer:
        timer.start()
    code = launch.launch(config)
    if timer:
        timer.join()
    _, err = capfd.readouterr()
    if how == "signal":
        assert code == 128 + signal.SIGINT
        assert "keras-distrib: got SIGINT; stopping all tasks." in err.splitlines()
    else:
        assert code == launch.EXIT_TIMEOUT
        assert (
            "keras-distrib: timed out after 3s (--timeout); stopping all tasks." in err.splitlines()
        )
    assert len(_records(tmp_path)) == 3
    assert not _wait_until_gone(token)


# --------------------------------------------------------------------------
# The task server


@pytest.mark.slow
def test_task_server_without_a_cluster_is_a_one_line_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = CHILD_PYTHONPATH
    proc = subprocess.run(
        [sys.executable, *SERVER_MODULE],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "keras_distrib.strategies.parameter_server.task_server: error: no cluster in the "
        "environment; set TF_CONFIG to this task's cluster and task (type 'worker' or 'ps')."
    ]


@pytest.mark.slow
def test_task_server_exits_0_quietly_and_at_once_on_sigterm(tmp_path, token):
    chief, worker, ps = (f"127.0.0.1:{p}" for p in cluster.free_ports(3))
    config = {
        "cluster": {"chief": [chief], "worker": [worker], "ps": [ps]},
        "task": {"type": "ps", "index": 0},
    }
    env = {
        **os.environ,
        "PYTHONPATH": CHILD_PYTHONPATH,
        "TF_CONFIG": json.dumps(config),
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    proc = subprocess.Popen(
        [sys.executable, *SERVER_MODULE],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "serving on" in line:
                break
        assert f"keras_distrib: ps 0 serving on {ps} (pid {proc.pid})\n" in lines
        # At once: its handler is in place from before TensorFlow's import,
        # so the signal is sent as soon as it serves.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert proc.stderr.read() == "" and proc.stdout.read() == ""
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------
# Real clusters: TensorFlow servers and a coordinating chief

# Connects to the servers as TF_CONFIG lists them, then schedules closures
# that add 1.0 to a variable on the ps: 20 of them, or with `until FILE`
# batches of 10 until FILE exists (`ran N` after each), then 20 more.
# Prints its progress.
CHIEF = textwrap.dedent("""\
    import json, os, sys, time
    import tensorflow as tf

    # At least 4 inter-op threads, as keras_distrib's servers have
    # (task_server.server_config): the default is one a core.
    tf.config.threading.set_inter_op_parallelism_threads(max(4, os.cpu_count() or 1))
    config = json.loads(os.environ["TF_CONFIG"])
    print("TF_CONFIG=" + json.dumps(config), flush=True)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(config["cluster"]), task_type="chief", task_id=0,
        rpc_layer="grpc")
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        v = tf.Variable(0.0)

    @tf.function
    def step():
        v.assign_add(1.0)

    def run(n):
        for _ in range(n):
            coordinator.schedule(step)
        coordinator.join()

    run(10)
    print("connected", float(v.numpy()), flush=True)
    if sys.argv[1:2] == ["until"]:
        deadline = time.monotonic() + 60
        while not os.path.exists(sys.argv[2]):
            if time.monotonic() > deadline:
                sys.exit("never told to finish")
            run(10)
            print("ran", float(v.numpy()), flush=True)
            time.sleep(0.1)
    run(20)
    print("VALUE", float(v.numpy()), flush=True)
""")

SERVING = (
    r"\[(?P<label>(?:worker|ps) \d+)\] keras_distrib: (?P=label) serving on "
    r"(?P<address>\S+) \(pid (?P<pid>\d+)\)"
)


def _serving(run: _Launcher, count: int) -> dict[str, tuple[str, int]]:
    """label -> (address, pid) of the first `count` servers to say they serve."""
    found = run.wait_for(SERVING, timeout=60, count=count)
    return {m["label"]: (m["address"], int(m["pid"])) for m in found}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_parameter_server_job_trains_and_leaves_nothing_running(tmp_path, launcher, token):
    script = write_script(tmp_path, CHIEF, "chief.py")
    # The servers, connected to by the coordinator, exit on SIGTERM: not
    # after --grace_seconds (SIGKILL), which would keep the job running
    # past finish()'s timeout.
    run = launcher(
        "--workers", "2", "--ps", "1", "--timeout", "100", "--grace_seconds", "600", script
    )
    run.wait_for(r"^\[chief\] VALUE", timeout=100)
    assert run.finish(timeout=60) == 0, run.text()
    assert "[chief] VALUE 30.0" in run.out, run.text()
    tf_config = json.loads(
        next(line for line in run.out if line.startswith("[chief] TF_CONFIG="))[18:]
    )
    assert tf_config["task"] == {"type": "chief", "index": 0}
    cluster = tf_config["cluster"]
    servers = _serving(run, 3)
    assert servers["worker 0"][0] == cluster["worker"][0]
    assert servers["worker 1"][0] == cluster["worker"][1]
    assert servers["ps 0"][0] == cluster["ps"][0]
    assert not any(line.startswith("[launcher]") for line in run.err), run.text()
    assert not _wait_until_gone(token)
