"""`keras-distrib launch --workers N --ps M`: parameter-server jobs, and the task server.

Three kinds of test:

* planning and flags, without processes (or with the launcher only);
* supervision (worker restarts, a lost ps, signals, the timeout) with
  `--ps_tasks_run_script` and plain-Python scripts that act out each role
  by their `TF_CONFIG` task type, so they take a second, not TensorFlow's
  start-up;
* real clusters: servers run `python -m keras_distrib.strategies.parameter_server.task_server` and the
  chief script below connects to them with
  `tf.distribute.ParameterServerStrategy` + `ClusterCoordinator` directly
  (not through keras_distrib's strategy), ~10-25 s each on 2 cores.

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

from keras_distrib import cluster, launch
from keras_distrib.strategies.parameter_server import task_server
from keras_distrib.launch import LaunchConfig, LaunchError

# The module whose PS_LOSS_GRACE_SECONDS the launcher reads.
ps_supervise_lib = importlib.import_module("keras_distrib.launch.parameter_server")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    for pid in _marked_pids(value):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class _Launcher:
    """`python -m keras_distrib.launch launch ...`, its stdout and stderr read live."""

    def __init__(self, args, cwd):
        env = {**os.environ, "PYTHONPATH": REPO}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "keras_distrib.launch", "launch", *args], cwd=cwd,
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self._changed = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                         for stream, lines in ((self.proc.stdout, self.out),
                                               (self.proc.stderr, self.err))]
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
            self._changed.wait_for(lambda: len(matches()) >= count or self.proc.poll() is not None,
                                   timeout)
            found = matches()
        assert len(found) >= count, f"no {pattern!r} within {timeout}s:\n{self.text()}"
        return found[:count]

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self.kill()
        for reader in self._readers:
            reader.join(timeout=5)
        return code

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()

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
# Planning and flags


def _script(tmp_path, body: str, name: str = "train.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_plan_lays_out_chief_workers_and_ps_with_their_commands(tmp_path):
    script = _script(tmp_path, "")
    config = LaunchConfig(nproc=2, ps=1, script=script, script_args=("--lr", "1"))
    plans = launch.plan(config)
    assert [p.label for p in plans] == ["chief", "worker 0", "worker 1", "ps 0"]
    assert [(p.info.task_type, p.info.task_index) for p in plans] == [
        ("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0)]
    configs = [json.loads(p.env()["TF_CONFIG"]) for p in plans]
    cluster = configs[0]["cluster"]
    assert set(cluster) == {"chief", "worker", "ps"}
    assert (len(cluster["chief"]), len(cluster["worker"]), len(cluster["ps"])) == (1, 2, 1)
    addresses = cluster["chief"] + cluster["worker"] + cluster["ps"]
    assert len(set(addresses)) == 4 and all(a.startswith("127.0.0.1:") for a in addresses)
    for p, tf_config, address in zip(plans, configs, addresses):
        assert tf_config == {"cluster": cluster, "task": {"type": p.info.task_type,
                                                          "index": p.info.task_index}}
        assert p.info.address == address
    envs = [p.env() for p in plans]
    assert [e.get("KERAS_DISTRIB_RANK") for e in envs] == ["0", "1", "2", None]
    assert [e.get("KERAS_DISTRIB_WORLD_SIZE") for e in envs] == ["3", "3", "3", None]
    assert launch.task_argv(plans[0], config) == [sys.executable, script, "--lr", "1"]
    for p in plans[1:]:
        assert launch.task_argv(p, config) == [sys.executable, *SERVER_MODULE]
    kubeflow = LaunchConfig(nproc=2, ps=1, script=script, ps_tasks_run_script=True)
    for p in launch.plan(kubeflow):
        assert launch.task_argv(p, kubeflow) == [sys.executable, script]
    # Without --ps nothing changes: ranks, all running the script.
    sync = launch.plan(LaunchConfig(nproc=2, script=script))
    assert [p.label for p in sync] == ["rank 0", "rank 1"]
    assert json.loads(sync[1].env()["TF_CONFIG"])["task"] == {"type": "worker", "index": 1}


def test_check_config_refuses_bad_parameter_server_settings(tmp_path):
    script = _script(tmp_path, "")
    for config, fragment in [
        (LaunchConfig(nproc=0, ps=1, script=script), "--workers must be >= 1 with --ps"),
        (LaunchConfig(nproc=1, ps=-1, script=script), "--ps=-1 must be >= 0"),
        (LaunchConfig(nproc=2, script=script, ps_tasks_run_script=True),
         "--ps_tasks_run_script needs --ps"),
        (LaunchConfig(nproc=1, ps=1, script=script, backend="horovod"),
         "--ps=1 works with --backend=tf only"),
        (LaunchConfig(nproc=2, ps=1, script=script, port_base=65533),
         "no room for 4 ports"),
    ]:
        with pytest.raises(LaunchError, match=fragment):
            launch.check_config(config)
    with pytest.raises(LaunchError, match="the job has 4 tasks .* raise --workers"):
        launch.plan(LaunchConfig(nproc=2, ps=1, script=script,
                                 hosts=tuple(f"h{i}.invalid" for i in range(5))))


def test_multi_host_dry_run_names_each_task_by_role(tmp_path, capfd):
    script = _script(tmp_path, "open('ran', 'w').close()")
    out_dir = tmp_path / "out"
    config = LaunchConfig(nproc=2, ps=1, script=script, hosts=("a.invalid:2", "b.invalid:2"),
                          output_dir=str(out_dir))
    assert launch.launch(config) == 0
    out, _ = capfd.readouterr()
    assert out.startswith("keras-distrib: 4 tasks, not started: a.invalid, b.invalid are remote")
    expected = {"chief": ["a.invalid:23456"], "worker": ["a.invalid:23457", "b.invalid:23456"],
                "ps": ["b.invalid:23457"]}
    for label, host, name, task in [
            ("chief", "a.invalid", "chief-0", {"type": "chief", "index": 0}),
            ("worker 0", "a.invalid", "worker-0", {"type": "worker", "index": 0}),
            ("worker 1", "b.invalid", "worker-1", {"type": "worker", "index": 1}),
            ("ps 0", "b.invalid", "ps-0", {"type": "ps", "index": 0})]:
        lines = out.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith(f"{label} on {host}: "))
        tf_config = json.loads(lines[at].split("TF_CONFIG=", 1)[1])
        assert tf_config == {"cluster": expected, "task": task}
        assert json.loads((out_dir / f"{name}.tf_config.json").read_text()) == tf_config
        command = lines[at + 1].strip()
        runs_script = label == "chief"
        assert command.endswith(script if runs_script else "-m keras_distrib.strategies.parameter_server.task_server"), command
    host_b = (out_dir / "host-b.invalid.sh").read_text()
    assert "tasks worker 1, ps 0 of 4" in host_b and host_b.count("task_server") == 2
    assert not (tmp_path / "ran").exists()


def _cli_error(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-m", "keras_distrib.launch", "launch", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("keras-distrib:")]
    return proc.returncode, proc.stdout, errors


@pytest.mark.slow
@pytest.mark.parametrize("args, fragment", [
    (["-n", "2", "--workers", "3"], "-n 2 and --workers 3 disagree"),
    (["--ps", "1"], "--workers is required with --ps"),
    (["--workers", "1", "--ps", "1", "--backend", "horovod"], "works with --backend=tf only"),
    (["--workers", "2", "--ps_tasks_run_script"], "--ps_tasks_run_script needs --ps"),
    (["--workers", "2", "--ps", "-1"], "flag --ps=-1"),
    (["--workers", "0", "--ps", "1"], "--workers must be >= 1 with --ps"),
])
def test_cli_bad_parameter_server_flags_give_one_line_error(tmp_path, token, args, fragment):
    script = _script(tmp_path, "open('ran', 'w').close()")
    code, out, errors = _cli_error(tmp_path, *args, script)
    assert code == 2
    assert len(errors) == 1 and errors[0].startswith("keras-distrib: error: "), errors
    assert fragment in errors[0]
    assert not out and not (tmp_path / "ran").exists()


@pytest.mark.slow
def test_workers_flag_without_ps_is_n(tmp_path, token):
    # --workers N is -n N: the same ranks, `[rank N]` lines.
    script = _script(tmp_path, "import os; print('size', os.environ['KERAS_DISTRIB_WORLD_SIZE'])")
    code, out, errors = _cli_error(tmp_path, "--workers", "2", "-n", "2", script)
    assert code == 0, errors
    assert sorted(out.splitlines()) == ["[rank 0] size 2", "[rank 1] size 2"]


def test_usage_documents_parameter_servers():
    text = launch.usage()
    for fragment in ("--workers", "--ps", "--ps_tasks_run_script", "keras_distrib.strategies.parameter_server.task_server",
                     "[chief]", "[worker I]", "[ps I]", "(100 when 0)", "0: up to 100"):
        assert fragment in text, fragment


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
    return _script(tmp_path, ROLE_PRELUDE + textwrap.dedent(body))


def _records(tmp_path) -> dict[tuple[str, int], dict]:
    found = {}
    for path in tmp_path.glob("*.s*.json"):
        name, start = re.fullmatch(r"(.+)\.s(\d+)\.json", path.name).groups()
        found[name, int(start)] = json.loads(path.read_text())
    return found


def _ps_config(script, **kwargs) -> LaunchConfig:
    options = dict(nproc=2, ps=1, script=script, ps_tasks_run_script=True, grace_seconds=5,
                   timeout=50)
    options.update(kwargs)
    return LaunchConfig(**options)


@pytest.mark.slow
def test_ps_tasks_run_script_runs_it_on_every_task_with_its_tf_config(
        tmp_path, capfd, token):
    script = _role_script(tmp_path, """\
        if ROLE != "chief":
            time.sleep(600)  # as a server: until the launcher stops it
        wait_for(lambda: all(starts(n) for n in ("worker-0", "worker-1", "ps-0")))
        print("all tasks up")
    """)
    assert launch.launch(_ps_config(script)) == 0
    out, err = capfd.readouterr()
    for label, line in [("chief", "TASK chief 0 start 0"), ("worker 0", "TASK worker 0 start 0"),
                        ("worker 1", "TASK worker 1 start 0"), ("ps 0", "TASK ps 0 start 0")]:
        assert f"[{label}] {line}" in out.splitlines(), out
    assert "[chief] all tasks up" in out.splitlines()
    records = _records(tmp_path)
    assert set(records) == {("chief-0", 0), ("worker-0", 0), ("worker-1", 0), ("ps-0", 0)}
    cluster = records["chief-0", 0]["tf_config"]["cluster"]
    ports = [int(a.rsplit(":", 1)[1]) for role in ("chief", "worker", "ps") for a in cluster[role]]
    assert len(set(ports)) == 4
    for (name, _), record in records.items():
        role, index = name.split("-")
        assert record["tf_config"] == {"cluster": cluster,
                                       "task": {"type": role, "index": int(index)}}
    assert [records[n, 0]["rank"] for n in ("chief-0", "worker-0", "worker-1", "ps-0")] == [
        "0", "1", "2", None]
    assert "restarting" not in err
    assert not _wait_until_gone(token)


@pytest.mark.slow
def test_exited_worker_is_restarted_alone_with_the_same_tf_config(tmp_path, capfd, token):
    script = _role_script(tmp_path, """\
        if NAME == "worker-1" and START == 0:
            wait_for(lambda: starts("chief-0"))
            sys.exit(3)
        if ROLE != "chief":
            time.sleep(600)
        wait_for(lambda: len(starts("worker-1")) == 2)
        print("worker 1 is back")
    """)
    assert launch.launch(_ps_config(script)) == 0
    out, err = capfd.readouterr()
    assert "[launcher] worker 1 exited (exit code 3); restarting it (restart 1)" in err.splitlines()
    assert "[chief] worker 1 is back" in out.splitlines()
    records = _records(tmp_path)
    # Only worker 1 started again, with the same TF_CONFIG (so the same port).
    assert set(records) == {("chief-0", 0), ("worker-0", 0), ("worker-1", 0), ("worker-1", 1),
                            ("ps-0", 0)}
    assert records["worker-1", 1]["tf_config"] == records["worker-1", 0]["tf_config"]
    assert records["worker-1", 1]["pid"] != records["worker-1", 0]["pid"]
    assert not _wait_until_gone(token)


@pytest.mark.slow
def test_worker_restarts_are_bounded_by_max_restarts(tmp_path, capfd, token):
    script = _role_script(tmp_path, """\
        if ROLE == "worker":
            sys.exit(3)
        time.sleep(600)
    """)
    assert launch.launch(_ps_config(script, nproc=1, max_restarts=2)) == 3
    _, err = capfd.readouterr()
    lines = err.splitlines()
    assert "[launcher] worker 0 exited (exit code 3); restarting it (restart 1)" in lines
    assert "[launcher] worker 0 exited (exit code 3); restarting it (restart 2)" in lines
    assert ("[launcher] worker 0 exited (exit code 3); no restarts left (2 used, at most "
            "--max_restarts=2); stopping the job.") in lines, err
    assert "keras-distrib: worker 0 failed with exit code 3; last output:" in lines
    assert len(_records(tmp_path)) == 1 + 3 + 1  # chief, worker 0 three times, ps
    assert not _wait_until_gone(token)


@pytest.mark.slow
def test_lost_ps_is_not_restarted_and_a_chief_running_on_is_stopped(
        tmp_path, capfd, token, monkeypatch):
    monkeypatch.setattr(ps_supervise_lib, "PS_LOSS_GRACE_SECONDS", 1.0)
    script = _role_script(tmp_path, """\
        if ROLE == "ps":
            wait_for(lambda: starts("chief-0") and starts("worker-0"))
            os.kill(os.getpid(), 9)
        time.sleep(600)  # the chief too: as if it missed the loss
    """)
    start = time.monotonic()
    assert launch.launch(_ps_config(script, nproc=1)) == 1
    assert time.monotonic() - start < 20
    _, err = capfd.readouterr()
    lines = err.splitlines()
    assert ("[launcher] ps 0 exited (signal 9); not restarting it (its variables are lost); "
            "the chief should fail, else it is stopped in 1s.") in lines, err
    assert ("[launcher] the chief still runs 1s after ps 0 was lost; stopping the job "
            "(exit code 1).") in lines, err
    assert set(_records(tmp_path)) == {("chief-0", 0), ("worker-0", 0), ("ps-0", 0)}
    assert not _wait_until_gone(token)


@pytest.mark.slow
def test_chief_failure_ends_the_job_with_its_code_and_tail(tmp_path, capfd, token):
    script = _role_script(tmp_path, """\
        if ROLE != "chief":
            time.sleep(600)
        wait_for(lambda: starts("ps-0"))
        raise ValueError("the chief gave up")
    """)
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
    script = _role_script(tmp_path, """\
        import signal
        if ROLE == "worker":  # a stubborn one: SIGKILL after --grace_seconds
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        put(f"{NAME}.ready")
        time.sleep(600)
    """)

    def interrupt_when_ready():
        names = ("chief-0", "worker-0", "ps-0")
        deadline = time.monotonic() + 20
        while (not all((tmp_path / f"{n}.ready").exists() for n in names)
               and time.monotonic() < deadline):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)  # the launcher's trap gets it

    config = _ps_config(script, nproc=1, grace_seconds=1,
                        timeout=50 if how == "signal" else 3)
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
        assert ("keras-distrib: timed out after 3s (--timeout); stopping all tasks."
                in err.splitlines())
    assert len(_records(tmp_path)) == 3
    assert not _wait_until_gone(token)


# --------------------------------------------------------------------------
# The task server


def test_serve_refuses_a_chief_and_server_config_has_enough_inter_op_threads():
    info = cluster.ClusterInfo(("127.0.0.1:1", "127.0.0.1:2"), 0, ps=("127.0.0.1:3",),
                               has_chief=True, task_type="chief")
    with pytest.raises(ValueError) as excinfo:
        task_server.serve(info)
    assert "\n" not in str(excinfo.value) and "'chief' task" in str(excinfo.value)
    assert task_server.server_config().inter_op_parallelism_threads >= 4


@pytest.mark.slow
def test_task_server_without_a_cluster_is_a_one_line_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = REPO
    proc = subprocess.run([sys.executable, *SERVER_MODULE], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "keras_distrib.strategies.parameter_server.task_server: error: no cluster in the environment; set TF_CONFIG to "
        "this task's cluster and task (type 'worker' or 'ps')."]


@pytest.mark.slow
def test_task_server_exits_0_quietly_and_at_once_on_sigterm(tmp_path, token):
    chief, worker, ps = (f"127.0.0.1:{p}" for p in cluster.free_ports(3))
    config = {"cluster": {"chief": [chief], "worker": [worker], "ps": [ps]},
              "task": {"type": "ps", "index": 0}}
    env = {**os.environ, "PYTHONPATH": REPO, "TF_CONFIG": json.dumps(config),
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.Popen([sys.executable, *SERVER_MODULE], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "serving on" in line:
                break
        assert f"keras_distrib: ps 0 serving on {ps} (pid {proc.pid})\n" in lines
        time.sleep(0.5)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert time.monotonic() - start < 2
        assert proc.stderr.read() == "" and proc.stdout.read() == ""
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------
# Real clusters: TensorFlow servers and a coordinating chief

# Connects to the servers as TF_CONFIG lists them, then schedules closures
# that add 1.0 to a variable on the ps: 20 of them, or with `until FILE`
# batches of 10 until FILE exists, then 20 more. Prints its progress.
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
            time.sleep(0.1)
    run(20)
    print("VALUE", float(v.numpy()), flush=True)
""")

SERVING = (r"\[(?P<label>(?:worker|ps) \d+)\] keras_distrib: (?P=label) serving on "
           r"(?P<address>\S+) \(pid (?P<pid>\d+)\)")


def _serving(run: _Launcher, count: int) -> dict[str, tuple[str, int]]:
    """label -> (address, pid) of the first `count` servers to say they serve."""
    found = run.wait_for(SERVING, timeout=60, count=count)
    return {m["label"]: (m["address"], int(m["pid"])) for m in found}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_parameter_server_job_trains_and_leaves_nothing_running(tmp_path, launcher, token):
    script = _script(tmp_path, CHIEF, "chief.py")
    run = launcher("--workers", "2", "--ps", "1", "--timeout", "100", "--grace_seconds", "30",
                   script)
    run.wait_for(r"^\[chief\] VALUE", timeout=100)
    done = time.monotonic()
    assert run.finish(timeout=100) == 0, run.text()
    # The servers, connected to by the coordinator, exit on SIGTERM: not
    # after --grace_seconds (SIGKILL).
    assert time.monotonic() - done < 15, run.text()
    assert "[chief] VALUE 30.0" in run.out, run.text()
    tf_config = json.loads(next(l for l in run.out if l.startswith("[chief] TF_CONFIG="))[18:])
    assert tf_config["task"] == {"type": "chief", "index": 0}
    cluster = tf_config["cluster"]
    servers = _serving(run, 3)
    assert servers["worker 0"][0] == cluster["worker"][0]
    assert servers["worker 1"][0] == cluster["worker"][1]
    assert servers["ps 0"][0] == cluster["ps"][0]
    assert not any(l.startswith("[launcher]") for l in run.err), run.text()
    assert not _wait_until_gone(token)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_worker_killed_mid_run_is_restarted_and_the_chief_finishes(tmp_path, launcher, token):
    script = _script(tmp_path, CHIEF, "chief.py")
    go = tmp_path / "go"
    run = launcher("--workers", "2", "--ps", "1", "--timeout", "100", script, "until", str(go))
    try:
        run.wait_for(r"^\[chief\] connected", timeout=90)
        address, pid = _serving(run, 3)["worker 1"]
        os.kill(pid, signal.SIGKILL)
        run.wait_for(r"^\[launcher\] worker 1 exited \(signal 9\); restarting it \(restart 1\)$",
                     timeout=10)
        again = run.wait_for(SERVING, timeout=60, count=4)[-1]
        assert (again["label"], again["address"]) == ("worker 1", address)
        assert int(again["pid"]) != pid
        time.sleep(2)  # some closures while the coordinator reconnects
    finally:
        go.touch()
    assert run.finish(timeout=60) == 0, run.text()
    value = next(l for l in run.out if l.startswith("[chief] VALUE "))
    assert float(value.split()[-1]) >= 30, run.text()  # closures re-run may add more
    assert sum(l.startswith("[launcher]") for l in run.err) == 1, run.text()
    assert not _wait_until_gone(token)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_killed_ps_fails_the_job_and_nothing_is_left(tmp_path, launcher, token):
    script = _script(tmp_path, CHIEF, "chief.py")
    go = tmp_path / "go"  # never made: the chief runs until the ps is lost
    run = launcher("--workers", "1", "--ps", "1", "--timeout", "100", script, "until", str(go))
    run.wait_for(r"^\[chief\] connected", timeout=90)
    _, pid = _serving(run, 2)["ps 0"]
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    code = run.finish(timeout=90)
    assert code != 0 and time.monotonic() - start < 90, run.text()
    assert ("[launcher] ps 0 exited (signal 9); not restarting it (its variables are lost); "
            "the chief should fail, else it is stopped in 60s.") in run.err, run.text()
    assert "keras-distrib: chief failed with exit code 1; last output:" in run.err, run.text()
    assert not _wait_until_gone(token)
