"""What the tests of every tier share without TensorFlow: paths, processes
(a fresh interpreter, rank scripts, `keras-distrib launch` for real) and
cluster configurations.

tests/unit imports this module, so it must never import TensorFlow or Keras
(tests/unit/conftest.py fails a unit run that does); tests/helpers.py
re-exports the paths and processes the other tiers use.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The scripts the tests run as worker processes (shared by every tier).
WORKERS = os.path.join(ROOT, "tests", "workers")
KERAS_FEATURES_WORKER = os.path.join(WORKERS, "keras_features.py")
# On the path of every process the tests start (tests/conftest.py): its
# sitecustomize keeps modules no such process uses from loading.
CHILD_SITE = os.path.join(ROOT, "tests", "child_site")
# This repository (the tests' helper modules) and CHILD_SITE.
CHILD_PYTHONPATH = os.pathsep.join((ROOT, CHILD_SITE))


def process_alive(pid, zombies_count=True):
    """Whether process `pid` exists (an exited, unreaped one only if
    `zombies_count`: a worker whose launcher is gone waits for init to
    reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    if zombies_count:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def kill_process_group(proc) -> None:
    """SIGKILLs the process group `proc` leads (it was started with
    `start_new_session=True`: its children too), then reaps `proc`."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def kill_pids(pids) -> None:
    """SIGKILLs each pid a test recorded, and the process group it may lead."""
    for pid in pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


# -- a fresh interpreter ---------------------------------------------------------------

# What a process that must not load TensorFlow must not have in sys.modules.
HEAVY_MODULES = ("tensorflow", "keras")


def run_python(code: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    """`python -c code args...` with this repository first on its path."""
    env = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=45,
    )


# -- plain-Python rank scripts for the launcher's tests ---------------------------------

# Every rank script of rank_script() starts with this: it records its PID
# (atomically, so the test never reads half a file) for the "nothing left
# behind" checks.
RANK_PRELUDE = textwrap.dedent("""\
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


def write_script(directory, body: str, name: str = "train.py") -> str:
    """`body` (dedented) as the script `directory/name`; returns its path."""
    path = directory / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def rank_script(directory, body: str, name: str = "worker.py") -> str:
    """A rank script: RANK_PRELUDE, then `body`."""
    return write_script(directory, RANK_PRELUDE + textwrap.dedent(body), name)


def rank_pids(directory) -> dict[int, int]:
    """{rank: pid} of the rank scripts that started in `directory`."""
    return {int(p.name[4:-4]): int(p.read_text()) for p in directory.glob("rank*.pid")}


# -- keras-distrib launch, for real ------------------------------------------------------

# TensorFlow's gRPC server answers a request it fails to parse with INTERNAL
# "Unable to parse request" (tensorflow/core/distributed_runtime/rpc/
# grpc_call.h). CI saw it once, in a parameter-server job on a loaded
# 2-core machine (a remote copy from a worker to the chief; the coordinator
# does not count it as a worker failure, so `fit` fails); no other run of
# this suite has shown it, and no upstream issue was found. A job that
# fails with it, and nothing was done to it meanwhile, runs once more.
_TRANSPORT_FLAKE = 'grpc_message:"Unable to parse request"'


def launch(
    out,
    n,
    script,
    *script_args,
    launch_flags=(),
    timeout=300,
    expect=0,
    env=None,
    during=None,
    wrap=None,
):
    """Runs `keras-distrib launch -n n script ...` for real; returns its output.

    Fails with the output's tail unless the launcher exits with `expect`
    (every rank exited 0, by default); with `expect=None` returns
    `(exit code, output)` instead. `env` adds environment variables;
    `during(proc)`, if given, runs while the job does (to kill a task, say);
    `wrap(argv)`, if given, is the argv that runs the launcher's `argv`
    elsewhere (on a test bed's host: `bed.on(0, argv)`).
    The process group is killed whatever happens, so no worker outlives the
    test. A job that fails with TensorFlow's rare transport error (see
    `_TRANSPORT_FLAKE`) runs once more, unless `during` acted on it.
    """
    code, output = _launch_once(
        out, n, script, script_args, launch_flags, timeout, env, during, wrap
    )
    if code != 0 and during is None and _TRANSPORT_FLAKE in output:
        print(
            f"pure_helpers.launch: {_TRANSPORT_FLAKE} (TensorFlow's gRPC transport); "
            "running the job once more",
            file=sys.stderr,
        )
        code, output = _launch_once(
            out, n, script, script_args, launch_flags, timeout, env, during, wrap
        )
    if expect is None:
        return code, output
    assert code == expect, output[-5000:]
    return output


def _launch_once(out, n, script, script_args, launch_flags, timeout, env, during, wrap):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TMPDIR=str(out), **(env or {}))
    argv = [
        sys.executable,
        "-m",
        "keras_distrib.launch",
        "launch",
        "-n",
        str(n),
        "--timeout",
        str(timeout - 30),
        *launch_flags,
        script,
        *script_args,
    ]
    if wrap is not None:
        argv = wrap(argv)
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    chunks = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    try:
        if during is not None:
            during(proc)
        proc.wait(timeout=timeout)
        reader.join(timeout=10)
    finally:
        kill_process_group(proc)
    return proc.returncode, "".join(chunks)


# -- cluster configurations (TF_CONFIG, Slurm) ------------------------------------------


def tf_config_environ(config) -> dict:
    """An environment whose TF_CONFIG is `config` (a dict, or the text as is)."""
    return {"TF_CONFIG": config if isinstance(config, str) else json.dumps(config)}


def worker_cluster(*addresses, task_type="worker", index=0, **extra_tasks) -> dict:
    """A TF_CONFIG of workers at `addresses` (and `extra_tasks` roles)."""
    return {
        "cluster": {"worker": list(addresses), **extra_tasks},
        "task": {"type": task_type, "index": index},
    }


def assert_one_line_error(excinfo, *fragments):
    """The error is a ValueError of one line holding every fragment."""
    message = str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


# Task 3 of a Slurm job step of 4 tasks, 2 on each of 2 nodes.
SLURM_2x2 = {
    "SLURM_JOB_ID": "77",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURMD_NODENAME": "node02",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}


# -- the README's quickstart -------------------------------------------------------------

QUICKSTART_MARKER = "<!-- quickstart -->"


def quickstart_code() -> str:
    """The Python code block right after README.md's `<!-- quickstart -->`."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert text.count(QUICKSTART_MARKER) == 1, (
        f"README.md must hold {QUICKSTART_MARKER} exactly once"
    )
    found = re.search(re.escape(QUICKSTART_MARKER) + r"\s*\n```python\n(.*?)\n```", text, re.DOTALL)
    assert found, f"README.md has no ```python block right after {QUICKSTART_MARKER}"
    return found.group(1)


def plain_environment(**extra) -> dict:
    """This environment without any cluster (TF_CONFIG, Slurm, MPI, Horovod,
    ours): a plain one-process run."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TF_CONFIG", "SLURM_", "KERAS_DISTRIB_", "OMPI_", "HOROVOD_"))
    }
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(extra)
    return env
