"""The `keras-distrib` command: start the workers of a multi-worker job.

Usage:

    keras-distrib launch -n 2 train.py --epochs 3
    python -m keras_distrib.launch launch -n 4 --hosts node1:2,node2:2 train.py

On one machine, `launch` starts N copies of `python train.py ...`, each
with its own `TF_CONFIG` (all addresses on `--bind`, 127.0.0.1 by default,
free ports), and prints every line they write as `[rank N] line`. When a
rank fails the others are stopped and the launcher exits with that rank's
exit code; Ctrl-C stops them all. Nothing is left running.

With `--hosts` naming other machines, nothing is started: the launcher
prints (and with `--output_dir` writes) each rank's `TF_CONFIG` and the
command to run on its host; `--ssh` starts them over ssh instead.

Every child gets these environment variables:

    TF_CONFIG                 {"cluster": {"worker": [...]}, "task": {"type": "worker", "index": RANK}}
    KERAS_DISTRIB_RANK        its rank, 0..N-1
    KERAS_DISTRIB_WORLD_SIZE  N
    KERAS_DISTRIB_LOCAL_RANK  its index among the ranks on its host
    PYTHONUNBUFFERED          1, so lines arrive as they are printed

Everything after the script path goes to the script untouched.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Optional, Sequence, TextIO

from absl import app
from absl import flags

from keras_distrib import cluster as cluster_lib

SUBCOMMANDS = ("launch",)
USAGE = "keras-distrib launch -n N [--hosts H1:S1,H2:S2] script.py [script args...]"

# Seconds a rank gets to exit after SIGTERM/SIGINT before SIGKILL: enough for
# Keras to finish writing a checkpoint, short enough that Ctrl-C feels live.
GRACE_SECONDS = 10.0
# Ports on remote hosts cannot be probed from here, so multi-host launches
# without --port_base use fixed ones (base + index of the rank on its host).
DEFAULT_REMOTE_PORT_BASE = 23456
# -tt gives the remote command a terminal, so it gets SIGHUP and dies when
# the launcher kills ssh; without it remote ranks would outlive the launcher.
DEFAULT_SSH_COMMAND = "ssh -o BatchMode=yes -tt"
EXIT_USAGE = 2
EXIT_TIMEOUT = 124
# absl's own help flags print only main-module flags, which is nothing for
# the console script; these print our usage instead.
_HELP_TOKENS = ("-h", "--help", "-help", "--helpshort", "-?")

FLAGS = flags.FLAGS
flags.DEFINE_integer("nproc", None, "Number of worker processes (ranks), >= 1.",
                     short_name="n")
flags.DEFINE_list("hosts", [], "Comma list of host or host:slots. Without slots "
                  "-n is split evenly; with slots ranks fill hosts in order. "
                  "Default: all ranks on this machine.")
flags.DEFINE_integer("port_base", 0, "First port; rank r uses port_base + its "
                     "index on its host. 0: free ports on this machine, "
                     f"{DEFAULT_REMOTE_PORT_BASE} on remote hosts.")
flags.DEFINE_string("bind", "127.0.0.1", "Address of this machine written into "
                    "TF_CONFIG for local ranks. Note that TensorFlow's gRPC "
                    "server listens on all interfaces whatever this says.")
flags.DEFINE_enum("backend", "tf", ["tf", "horovod"], "tf: TF_CONFIG workers; "
                  "horovod: delegate to horovodrun (needs Horovod installed).")
flags.DEFINE_string("output_dir", None, "Write each rank's TF_CONFIG "
                    "(rank-R.tf_config.json) and each host's commands "
                    "(host-H.sh) here.")
flags.DEFINE_bool("ssh", False, "Start ranks on remote hosts with ssh.")
flags.DEFINE_string("ssh_command", DEFAULT_SSH_COMMAND, "ssh program and "
                    "options used with --ssh; the host and command are appended.")
flags.DEFINE_float("timeout", 0, "Stop all ranks after this many seconds "
                   "(exit code 124); 0: no limit.")
flags.DEFINE_integer("tail_lines", 40, "Lines of a failed rank's output "
                     "repeated in the failure summary.")


class LaunchError(Exception):
    """A one-line usage or configuration error; nothing was started."""


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """What to start and where; the parsed form of `keras-distrib launch`.

    Example:

    ```python
    config = LaunchConfig(nproc=2, script="train.py", script_args=("--epochs", "3"))
    exit_code = launch(config)
    ```
    """

    nproc: int
    script: str
    script_args: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()
    port_base: int = 0
    bind: str = "127.0.0.1"
    backend: str = "tf"
    output_dir: Optional[str] = None
    ssh: bool = False
    ssh_command: str = DEFAULT_SSH_COMMAND
    timeout: float = 0.0
    tail_lines: int = 40


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """Where one rank runs and what it is told."""

    host: str  # as the user wrote it; the bind address for local launches
    local_rank: int
    local: bool
    info: cluster_lib.ClusterInfo

    @property
    def rank(self) -> int:
        return self.info.rank

    def env(self) -> dict[str, str]:
        """The variables this rank gets on top of the launcher's environment."""
        return {
            "TF_CONFIG": self.info.tf_config_json(),
            "KERAS_DISTRIB_RANK": str(self.info.rank),
            "KERAS_DISTRIB_WORLD_SIZE": str(self.info.world_size),
            "KERAS_DISTRIB_LOCAL_RANK": str(self.local_rank),
            "PYTHONUNBUFFERED": "1",
        }


# --------------------------------------------------------------------------
# Command line


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Splits argv into the launcher's part and `[script, *script_args]`.

    absl would parse the script's own flags (`train.py --epochs 3`) as the
    launcher's, so the script and what follows are cut off before absl
    sees the command line. The script is the second positional token (the
    first is the subcommand), or whatever follows `--`.

    Example:

    ```python
    split_argv(["kd", "launch", "-n", "2", "t.py", "-n", "5"])
    # (["kd", "launch", "-n", "2"], ["t.py", "-n", "5"])
    ```
    """
    head, have_subcommand, i = [argv[0]], False, 1
    while i < len(argv):
        token = argv[i]
        if token == "--":
            rest = list(argv[i + 1:])
            if not have_subcommand and rest:
                head.append(rest.pop(0))
            return head, rest
        if token.startswith("-") and len(token) > 1:
            head.append(token)
            if _takes_value(token) and i + 1 < len(argv):
                i += 1
                head.append(argv[i])
        elif not have_subcommand:
            head.append(token)
            have_subcommand = True
        else:
            return head, list(argv[i:])
        i += 1
    return head, []


def _takes_value(token: str) -> bool:
    """True for `--flag` / `-f` naming a non-boolean flag without `=value`."""
    if "=" in token:
        return False
    name = token.lstrip("-")
    try:
        return not FLAGS[name].boolean
    except KeyError:  # unknown or --noflag: absl reports it, we do not guess
        return False


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl `flags_parser`: parses the launcher's flags, keeps the script's.

    Returns `[prog, subcommand, script, *script_args]` (shorter when parts
    are missing). A bad flag prints one line and exits with status 2.
    """
    head, tail = split_argv(argv)
    if any(token in _HELP_TOKENS for token in head[1:]):
        print(usage())
        sys.exit(0)
    try:
        rest = FLAGS(head)
    except flags.Error as e:
        _print_error(f"{e}; see `keras-distrib launch --help`.")
        sys.exit(EXIT_USAGE)
    return list(rest) + tail


def usage() -> str:
    """This module's docstring and its flags, for `--help`."""
    module = sys.modules[__name__]
    return f"{__doc__.strip()}\n\nFlags of `launch`:\n{FLAGS.module_help(module)}"


def config_from_flags(positional: Sequence[str]) -> LaunchConfig:
    """Builds and checks a `LaunchConfig` from parsed FLAGS and `[script, *args]`."""
    if not positional:
        raise LaunchError(f"missing the script to run; usage: {USAGE}")
    if FLAGS.nproc is None:
        raise LaunchError("-n/--nproc is required, e.g. `keras-distrib launch -n 2 train.py`.")
    config = LaunchConfig(
        nproc=FLAGS.nproc,
        script=positional[0],
        script_args=tuple(positional[1:]),
        hosts=tuple(FLAGS.hosts),
        port_base=FLAGS.port_base,
        bind=FLAGS.bind,
        backend=FLAGS.backend,
        output_dir=FLAGS.output_dir,
        ssh=FLAGS.ssh,
        ssh_command=FLAGS.ssh_command,
        timeout=FLAGS.timeout,
        tail_lines=FLAGS.tail_lines,
    )
    check_config(config)
    return config


def check_config(config: LaunchConfig) -> None:
    """Raises `LaunchError` naming the first bad setting and its fix."""
    if config.nproc < 1:
        raise LaunchError(f"-n/--nproc must be >= 1, got {config.nproc}.")
    if not os.path.isfile(config.script):
        raise LaunchError(
            f"script {config.script!r} not found (cwd {os.getcwd()}); pass the "
            "path of a Python file as the first argument after the flags."
        )
    if not 0 <= config.port_base <= 65535 - config.nproc + 1:
        raise LaunchError(
            f"--port_base={config.port_base} leaves no room for {config.nproc} "
            "ports; use 0 (free ports) or a base in 1024..60000."
        )
    if config.timeout < 0:
        raise LaunchError(f"--timeout={config.timeout:g} must be >= 0 (0: no limit).")
    if config.tail_lines < 0:
        raise LaunchError(f"--tail_lines={config.tail_lines} must be >= 0.")


# --------------------------------------------------------------------------
# Planning: which rank runs where, on which port


def parse_hosts(hosts: Sequence[str], nproc: int) -> list[str]:
    """The host of every rank, from `--hosts` entries `host` or `host:slots`.

    Without slots, ranks are split evenly in blocks (rank 0 on the first
    host); with slots (missing ones count 1) ranks fill hosts in order.

    Example:

    ```python
    parse_hosts(["a", "b"], 4)      # ["a", "a", "b", "b"]
    parse_hosts(["a:1", "b:3"], 4)  # ["a", "b", "b", "b"]
    ```
    """
    entries = [_parse_host_entry(h) for h in hosts]
    names = [name for name, _ in entries]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise LaunchError(f"--hosts lists {repeated[0]!r} twice; give it once with slots, e.g. {repeated[0]}:2.")
    if all(slots is None for _, slots in entries):
        if nproc < len(entries):
            raise LaunchError(
                f"--hosts lists {len(entries)} hosts but -n is {nproc}; every "
                "host needs a rank, so list fewer hosts or raise -n."
            )
        base, extra = divmod(nproc, len(entries))
        slots = [base + (i < extra) for i in range(len(entries))]
    else:
        slots = [s or 1 for _, s in entries]
        if sum(slots) < nproc:
            raise LaunchError(
                f"--hosts gives {sum(slots)} slots but -n is {nproc}; add "
                "slots as host:count or lower -n."
            )
    per_rank = [name for name, count in zip(names, slots) for _ in range(count)]
    return per_rank[:nproc]


def _parse_host_entry(entry: str) -> tuple[str, Optional[int]]:
    entry = entry.strip()
    match = re.fullmatch(r"(\[[^\]]+\]|[^:\[\]]+)(?::(\d+))?", entry)
    if not match:
        raise LaunchError(
            f"--hosts entry {entry!r} is not host or host:slots (IPv6 hosts "
            "in brackets, e.g. [fe80::1]:2)."
        )
    host, slots = match.group(1), match.group(2)
    if slots is not None and int(slots) < 1:
        raise LaunchError(f"--hosts entry {entry!r}: slots must be >= 1.")
    return host, int(slots) if slots is not None else None


def plan(config: LaunchConfig) -> list[RankPlan]:
    """Decides each rank's host, port and `TF_CONFIG`.

    Example:

    ```python
    for p in plan(LaunchConfig(nproc=2, script="train.py")):
        print(p.rank, p.info.address, p.env()["TF_CONFIG"])
    ```
    """
    hosts = parse_hosts(config.hosts, config.nproc) if config.hosts else []
    local = [cluster_lib.is_local_host(h) for h in hosts]
    if all(local):  # one machine: every address is on --bind
        if not cluster_lib.is_local_host(config.bind):
            raise LaunchError(
                f"--bind={config.bind} is not an address of this machine; use "
                "127.0.0.1 or one of this machine's IPs."
            )
        hosts, local = [config.bind] * config.nproc, [True] * config.nproc
    local_ranks = _local_ranks(hosts)
    ports = _ports(config, hosts, local_ranks, all(local))
    workers = tuple(_format_address(h, p) for h, p in zip(hosts, ports))
    try:
        infos = [cluster_lib.ClusterInfo(workers, r) for r in range(config.nproc)]
    except cluster_lib.ClusterConfigError as e:
        raise LaunchError(str(e)) from None
    return [RankPlan(h, lr, loc, info)
            for h, lr, loc, info in zip(hosts, local_ranks, local, infos)]


def _local_ranks(hosts: Sequence[str]) -> list[int]:
    seen: collections.Counter[str] = collections.Counter()
    result = []
    for host in hosts:
        result.append(seen[host])
        seen[host] += 1
    return result


def _ports(config: LaunchConfig, hosts, local_ranks, all_local: bool) -> list[int]:
    if all_local and config.port_base == 0:
        return cluster_lib.free_ports(config.nproc, config.bind.strip("[]"))
    if all_local:  # a fixed base on one machine: ranks count up from it
        return [config.port_base + r for r in range(config.nproc)]
    base = config.port_base or DEFAULT_REMOTE_PORT_BASE
    return [base + lr for lr in local_ranks]


def _format_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def shell_command(rank_plan: RankPlan, config: LaunchConfig, exec_: bool = False) -> str:
    """The shell line that starts `rank_plan` on its host from this directory.

    Example:

    ```python
    shell_command(p, config)
    # "cd /work && env TF_CONFIG='{...}' KERAS_DISTRIB_RANK=1 ... /usr/bin/python3 train.py"
    ```
    """
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in rank_plan.env().items())
    argv = " ".join(shlex.quote(a) for a in (sys.executable, config.script, *config.script_args))
    # exec: under ssh the remote shell is replaced by Python, so SIGHUP from
    # the dropped connection reaches Python itself.
    prefix = "exec env" if exec_ else "env"
    return f"cd {shlex.quote(os.getcwd())} && {prefix} {env} {argv}"


# --------------------------------------------------------------------------
# Entry points


def launch(config: LaunchConfig, out: Optional[TextIO] = None,
           err: Optional[TextIO] = None) -> int:
    """Runs (or, for remote hosts without --ssh, prints) the job; returns the exit code.

    Raises:
        LaunchError: bad configuration; nothing was started.

    Example:

    ```python
    code = launch(LaunchConfig(nproc=2, script="train.py"))
    ```
    """
    out, err = out or sys.stdout, err or sys.stderr
    check_config(config)
    if config.backend == "horovod":
        return _launch_horovod(config, out, err)
    plans = plan(config)
    if config.output_dir:
        write_output_dir(plans, config)
    remote = [p for p in plans if not p.local]
    if remote and not config.ssh:
        print_dry_run(plans, config, out)
        return 0
    _check_local_ports(plans, config)
    specs = [_ChildSpec(f"rank {p.rank}", _child_argv(p, config), p.env())
             for p in plans]
    return supervise(specs, config, out, err)


def _check_local_ports(plans: Sequence[RankPlan], config: LaunchConfig) -> None:
    # Free ports were just picked by the OS; a user's --port_base may collide.
    if config.port_base == 0 and all(p.local for p in plans):
        return
    for p in plans:
        if p.local:
            try:
                cluster_lib.check_own_port_free(p.info)
            except cluster_lib.ClusterConfigError as e:
                raise LaunchError(f"{e} (pick another --port_base, or 0 for free ports)") from None


def _child_argv(rank_plan: RankPlan, config: LaunchConfig) -> list[str]:
    if rank_plan.local:
        return [sys.executable, config.script, *config.script_args]
    remote = shell_command(rank_plan, config, exec_=True)
    return [*shlex.split(config.ssh_command), rank_plan.host.strip("[]"), remote]


def print_dry_run(plans: Sequence[RankPlan], config: LaunchConfig, out: TextIO) -> None:
    """Prints each rank's host, TF_CONFIG and command, for multi-host jobs."""
    remote = list(dict.fromkeys(p.host for p in plans if not p.local))
    verb = "is" if len(remote) == 1 else "are"
    lines = [
        f"keras-distrib: {len(plans)} ranks, not started: {', '.join(remote)} "
        f"{verb} remote; run each command below on its host, or pass --ssh."
    ]
    for p in plans:
        lines.append(f"rank {p.rank} on {p.host}: TF_CONFIG={p.info.tf_config_json()}")
        lines.append(f"  {shell_command(p, config)}")
    if config.output_dir:
        lines.append(f"keras-distrib: wrote TF_CONFIG files and host scripts to {config.output_dir}")
    out.write("\n".join(lines) + "\n")
    out.flush()


def write_output_dir(plans: Sequence[RankPlan], config: LaunchConfig) -> None:
    """Writes `rank-R.tf_config.json` per rank and `host-H.sh` per host."""
    os.makedirs(config.output_dir, exist_ok=True)
    by_host: dict[str, list[RankPlan]] = {}
    for p in plans:
        by_host.setdefault(p.host, []).append(p)
        path = os.path.join(config.output_dir, f"rank-{p.rank}.tf_config.json")
        with open(path, "w") as f:
            f.write(p.info.tf_config_json() + "\n")
    for host, host_plans in by_host.items():
        ranks = ", ".join(str(p.rank) for p in host_plans)
        lines = ["#!/bin/sh", f"# keras-distrib: ranks {ranks} of {len(plans)}; run on {host}."]
        lines += [shell_command(p, config) + " &" for p in host_plans]
        lines.append("wait")
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", host)
        path = os.path.join(config.output_dir, f"host-{safe}.sh")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(path, 0o755)


def _launch_horovod(config: LaunchConfig, out: TextIO, err: TextIO) -> int:
    """Delegates to horovodrun (Gloo), which does its own rank bookkeeping."""
    horovodrun = shutil.which(
        "horovodrun", path=os.path.dirname(sys.executable)) or shutil.which("horovodrun")
    if importlib.util.find_spec("horovod") is None or horovodrun is None:
        raise LaunchError(
            "--backend=horovod needs Horovod (and horovodrun), which is not "
            "installed here; build it with `scripts/install_horovod.sh .venv`, "
            "or use --backend=tf (the default)."
        )
    hosts = f"localhost:{config.nproc}"
    if config.hosts:  # horovodrun needs host:slots; ours may leave slots out
        per_rank = collections.Counter(parse_hosts(config.hosts, config.nproc))
        hosts = ",".join(f"{host}:{count}" for host, count in per_rank.items())
    # horovodrun's argparse reads the script's own flags too and fails on any
    # that abbreviates several of its options (`--n 5`: --num-proc or
    # --network-interface?), so the script's command line goes as one token.
    command = "exec " + shlex.join([sys.executable, config.script, *config.script_args])
    argv = [horovodrun, "--gloo", "-np", str(config.nproc), "-H", hosts,
            "/bin/sh", "-c", command]
    spec = _ChildSpec("horovodrun", argv, {"PYTHONUNBUFFERED": "1"})
    return supervise([spec], config, out, err)


def main(argv: Sequence[str]) -> int:
    """Dispatches `argv = [prog, subcommand, script, *args]` (flags already parsed).

    Example:

    ```python
    app.run(main, flags_parser=parse_flags)
    ```
    """
    if len(argv) < 2:
        _print_error(f"missing subcommand; usage: {USAGE}")
        return EXIT_USAGE
    if argv[1] not in SUBCOMMANDS:
        _print_error(f"unknown subcommand {argv[1]!r}; valid subcommands: {', '.join(SUBCOMMANDS)}.")
        return EXIT_USAGE
    try:
        return launch(config_from_flags(argv[2:]))
    except (LaunchError, cluster_lib.ClusterConfigError) as e:
        _print_error(str(e))
        return EXIT_USAGE


def run() -> None:
    """Console entry point of `keras-distrib`."""
    app.run(main, flags_parser=parse_flags)


def _print_error(message: str) -> None:
    print(f"keras-distrib: error: {' '.join(message.split())}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Running and supervising children


@dataclasses.dataclass(frozen=True)
class _ChildSpec:
    label: str
    argv: list[str]
    env: dict[str, str]


class _LinePrinter:
    """Writes whole lines from many threads without interleaving them."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self._lock:
            try:
                self._stream.write(line + "\n")
                self._stream.flush()
            except (OSError, ValueError, UnicodeError):
                # A closed or narrow stdout must not stop the pipe from being
                # drained, or the child would block on a full pipe.
                pass


# Run in front of every rank's command: asks the kernel to SIGKILL the rank
# when the launcher dies, even by SIGKILL (when none of our clean-up runs),
# then becomes the rank's command (the request survives exec).
_DIE_WITH_LAUNCHER = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(137)  # the launcher died before the request was made\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def _tied_to_launcher(argv: Sequence[str]) -> list[str]:
    """`argv`, started so that it cannot outlive this process (Linux)."""
    if not sys.platform.startswith("linux") or shutil.which(argv[0]) is None:
        return list(argv)  # a missing program still fails in Popen, clearly
    return [sys.executable, "-c", _DIE_WITH_LAUNCHER, str(os.getpid()), *argv]


class _Child:
    """One started process, its own process group, and the thread reading it."""

    def __init__(self, spec: _ChildSpec, tail_lines: int, printer: Callable[[str], None]):
        self.label = spec.label
        self.tail: collections.deque[str] = collections.deque(maxlen=max(tail_lines, 1))
        # Own session: a signal to the group reaches the rank and anything it
        # spawned, and a terminal's Ctrl-C reaches only the launcher, which
        # forwards it once (no double interrupt).
        self.proc = subprocess.Popen(
            _tied_to_launcher(spec.argv), env={**os.environ, **spec.env},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True)
        self._printer = printer
        self.reader = threading.Thread(target=self._pump, name=f"pump {self.label}", daemon=True)
        self.reader.start()

    def _pump(self) -> None:
        prefix = f"[{self.label}] "
        for raw in iter(self.proc.stdout.readline, b""):
            # \r: ssh -tt sends CRLF line ends.
            line = raw.rstrip(b"\r\n").decode("utf-8", "replace")
            self.tail.append(line)
            self._printer(prefix + line)
        self.proc.stdout.close()

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone already


class _SignalTrap:
    """Records SIGINT/SIGTERM/SIGHUP instead of dying, so children can be stopped."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_SignalTrap":
        # Handlers can only be set from the main thread; elsewhere (a caller's
        # worker thread) the caller owns signals.
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def _record(self, signum, frame) -> None:
        del frame
        self.received.append(signum)

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def supervise(specs: Sequence[_ChildSpec], config: LaunchConfig,
              out: TextIO, err: TextIO) -> int:
    """Starts every child, streams its lines, and returns the job's exit code.

    0 when all succeed; the first failed rank's code (128+signal when
    killed); 128+signal when the launcher is interrupted; 124 on timeout.
    Every child's process group is killed on the way out, whatever happens.
    """
    printer = _LinePrinter(out)
    children: list[_Child] = []
    with _SignalTrap() as trap:
        try:
            for spec in specs:
                children.append(_start(spec, config.tail_lines, printer))
            return _watch(children, config, trap, err)
        finally:
            for child in children:
                child.signal_group(signal.SIGKILL)
            for child in children:
                child.proc.wait()
                child.reader.join(timeout=5)


def _start(spec: _ChildSpec, tail_lines: int, printer) -> _Child:
    try:
        return _Child(spec, tail_lines, printer)
    except OSError as e:
        raise LaunchError(f"cannot start {spec.label} ({spec.argv[0]}): {e.strerror or e}.") from None


def _watch(children: list[_Child], config: LaunchConfig, trap: _SignalTrap,
           err: TextIO) -> int:
    deadline = time.monotonic() + config.timeout if config.timeout > 0 else None
    while True:
        if trap.received:
            signum = trap.received[0]
            _say(err, f"got {signal.Signals(signum).name}; stopping all ranks.")
            _stop(children, signum, trap)
            return 128 + signum
        failed = next((c for c in children if c.proc.poll() not in (None, 0)), None)
        if failed is not None:
            _stop(children, signal.SIGTERM, trap)
            _report_failure(failed, config.tail_lines, err)
            return exit_code(failed.proc.returncode)
        if all(c.proc.returncode == 0 for c in children):
            return 0
        if deadline is not None and time.monotonic() >= deadline:
            _say(err, f"timed out after {config.timeout:g}s (--timeout); stopping all ranks.")
            _stop(children, signal.SIGTERM, trap)
            return EXIT_TIMEOUT
        time.sleep(0.05)


def _stop(children: Sequence[_Child], signum: int, trap: _SignalTrap) -> None:
    """Sends `signum` to every live group; SIGKILL after the grace period."""
    already = len(trap.received)
    for child in children:
        if child.running:
            child.signal_group(signum)
    deadline = time.monotonic() + GRACE_SECONDS
    while any(c.running for c in children) and time.monotonic() < deadline:
        if len(trap.received) > already:  # a second Ctrl-C: no more waiting
            break
        time.sleep(0.05)
    for child in children:
        child.signal_group(signal.SIGKILL)


def _report_failure(child: _Child, tail_lines: int, err: TextIO) -> None:
    child.reader.join(timeout=5)  # the last lines are the interesting ones
    code = exit_code(child.proc.returncode)
    how = f"exit code {code}"
    if child.proc.returncode < 0:
        how = f"signal {signal.Signals(-child.proc.returncode).name} (exit code {code})"
    tail = list(child.tail)[-tail_lines:] if tail_lines else []
    lines = [f"keras-distrib: {child.label} failed with {how}; last output:"]
    lines += [f"    {line}" for line in tail] or ["    (no output)"]
    err.write("\n".join(lines) + "\n")
    err.flush()


def exit_code(returncode: int) -> int:
    """A shell-style exit code: the code itself, or 128+signal when killed."""
    return 128 - returncode if returncode < 0 else returncode


def _say(err: TextIO, message: str) -> None:
    err.write(f"keras-distrib: {message}\n")
    err.flush()


if __name__ == "__main__":
    run()
