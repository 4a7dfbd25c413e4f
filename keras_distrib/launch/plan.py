"""Who runs where: each rank's host, port, `TF_CONFIG` and shell command.

Nothing here starts a process; `print_dry_run` and `write_output_dir` are
what a multi-host launch without `--ssh` does instead. A restart under
`--max_restarts` plans again (`plan(config, avoid_ports=...)`: new free
ports) and tells each rank its restart count and, on this host, the
attempt's private shared-memory directory (`RankPlan.restart`, `shm_dir`).

A parameter-server job (`--ps M`) plans one `chief`, `--workers N` `worker`
tasks and M `ps` tasks, laid out in that order over the host slots; each
`RankPlan` is then one task (`label`: `chief`, `worker 0`, `ps 0`), and
the worker and ps tasks run
`python -m keras_distrib.strategies.parameter_server.task_server` instead
of the script unless `--ps_tasks_run_script` (`task_argv`).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import shlex
import sys
from typing import Collection, Optional, Sequence, TextIO

from keras_distrib import cluster as cluster_lib
from keras_distrib.launch.config import LaunchConfig, LaunchError
from keras_distrib.cluster import gpu_share
from keras_distrib.cluster.launch_contract import CONTROL_FD_ENV, RESTART_ENV, SHM_DIR_ENV

# Ports on remote hosts cannot be probed from here, so multi-host launches
# without --port_base use fixed ones (base + index of the rank on its host).
DEFAULT_REMOTE_PORT_BASE = 23456

# TF_CPP_MIN_LOG_LEVEL for the children when the launcher's environment has
# none: 2 hides TensorFlow's C++ INFO and WARNING logs (start-up banners,
# coordination service chatter) in every rank; errors still show.
DEFAULT_TF_CPP_MIN_LOG_LEVEL = "2"


def tf_log_env() -> dict[str, str]:
    """`TF_CPP_MIN_LOG_LEVEL` for a child: the launcher's own, or 2.

    Given explicitly (not only inherited), so that ranks started over ssh
    get the user's value too.
    """
    return {
        "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", DEFAULT_TF_CPP_MIN_LOG_LEVEL)
    }


# What the worker and ps tasks of a parameter-server job run (a bare
# TensorFlow server) unless --ps_tasks_run_script.
TASK_SERVER_MODULE = "keras_distrib.strategies.parameter_server.task_server"


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """Where one rank (or, in a parameter-server job, one task) runs and
    what it is told."""

    host: str  # as the user wrote it; the bind address for local launches
    local_rank: int
    local: bool
    info: cluster_lib.ClusterInfo
    restart: int = 0  # restarts of the job before this attempt
    # The attempt's private shared-memory directory; only for a rank on
    # this host (a path here means nothing on another machine).
    shm_dir: Optional[str] = None
    local_size: int = 1  # the ranks (tasks) on its host
    gpus_per_worker: int = 1  # --gpus_per_worker
    gpus: Optional[str] = None  # its CUDA_VISIBLE_DEVICES (cluster.gpu_share); None: as is

    @property
    def rank(self) -> int:
        """The rank of a training task (chief first); a ps task has none."""
        return self.info.rank

    @property
    def label(self) -> str:
        """How output and messages name it: `rank 1`; or `chief`, `worker 0`, `ps 0`."""
        if not self.info.has_ps:
            return f"rank {self.info.rank}"
        if self.info.task_type == cluster_lib.CHIEF:
            return "chief"
        return f"{self.info.task_type} {self.info.task_index}"

    @property
    def port(self) -> int:
        return int(self.info.address.rsplit(":", 1)[1])

    def env(self) -> dict[str, str]:
        """The variables this rank gets on top of the launcher's environment.

        A ps task has no rank: it gets neither `KERAS_DISTRIB_RANK` nor
        `KERAS_DISTRIB_WORLD_SIZE` (the training tasks' count).
        """
        env = {"TF_CONFIG": self.info.tf_config_json()}
        if self.info.is_training_task:
            env["KERAS_DISTRIB_RANK"] = str(self.info.rank)
            env["KERAS_DISTRIB_WORLD_SIZE"] = str(self.info.world_size)
        env.update(
            {
                "KERAS_DISTRIB_LOCAL_RANK": str(self.local_rank),
                gpu_share.LOCAL_SIZE_ENV: str(self.local_size),
                gpu_share.GPUS_PER_WORKER_ENV: str(self.gpus_per_worker),
                RESTART_ENV: str(self.restart),
                CONTROL_FD_ENV: "0",  # its stdin: the launcher asks it for its account there
                "PYTHONUNBUFFERED": "1",
                **tf_log_env(),
            }
        )
        if self.shm_dir is not None:
            env[SHM_DIR_ENV] = self.shm_dir
        if self.gpus is not None:
            env[gpu_share.VISIBLE] = self.gpus
        return env


def parse_hosts(hosts: Sequence[str], nproc: int, parameter_server: bool = False) -> list[str]:
    """The host of every rank, from `--hosts` entries `host` or `host:slots`.

    Without slots, ranks are split evenly in blocks (rank 0 on the first
    host); with slots (missing ones count 1) ranks fill hosts in order.
    For a `parameter_server` job, `nproc` counts all its tasks (chief,
    workers, ps, laid out in that order), and the errors say so.

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
        raise LaunchError(
            f"--hosts lists {repeated[0]!r} twice; give it once with slots, e.g. {repeated[0]}:2."
        )
    if parameter_server:
        count = f"the job has {nproc} tasks (a chief, --workers, --ps)"
        unit, flag = "task", "--workers"
    else:
        count, unit, flag = f"-n is {nproc}", "rank", "-n"
    if all(slots is None for _, slots in entries):
        if nproc < len(entries):
            raise LaunchError(
                f"--hosts lists {len(entries)} hosts but {count}; every "
                f"host needs a {unit}, so list fewer hosts or raise {flag}."
            )
        base, extra = divmod(nproc, len(entries))
        slots = [base + (i < extra) for i in range(len(entries))]
    else:
        slots = [s or 1 for _, s in entries]
        if sum(slots) < nproc:
            raise LaunchError(
                f"--hosts gives {sum(slots)} slots but {count}; add "
                f"slots as host:count or lower {flag}."
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


def plan(config: LaunchConfig, avoid_ports: Collection[int] = ()) -> list[RankPlan]:
    """Decides each rank's host, port and `TF_CONFIG`.

    Free ports (one machine, no `--port_base`) are none of `avoid_ports`:
    a restart passes the last attempt's, which a dying rank may still hold.
    Fixed ports (`--port_base`, remote hosts) are the same every time.

    Example:

    ```python
    for p in plan(LaunchConfig(nproc=2, script="train.py")):
        print(p.rank, p.info.address, p.env()["TF_CONFIG"])
    ```
    """
    size = config.num_tasks
    hosts = parse_hosts(config.hosts, size, config.parameter_server) if config.hosts else []
    local = [cluster_lib.is_local_host(h) for h in hosts]
    if all(local):  # one machine: every address is on --bind
        if not cluster_lib.is_local_host(config.bind):
            raise LaunchError(
                f"--bind={config.bind} is not an address of this machine; use "
                "127.0.0.1 or one of this machine's IPs."
            )
        hosts, local = [config.bind] * size, [True] * size
    local_ranks = _local_ranks(hosts)
    ports = _ports(config, hosts, local_ranks, all(local), avoid_ports)
    addresses = tuple(_format_address(h, p) for h, p in zip(hosts, ports))
    try:
        if config.parameter_server:
            infos = _parameter_server_tasks(addresses, config.ps)
        else:
            infos = [cluster_lib.ClusterInfo(addresses, r) for r in range(size)]
    except cluster_lib.ClusterConfigError as e:
        raise LaunchError(str(e)) from None
    sizes = collections.Counter(hosts)
    # Each rank's own GPUs: a share of this machine's CUDA_VISIBLE_DEVICES
    # for ranks here, GPU numbers on other hosts.
    visible = os.environ.get(gpu_share.VISIBLE)
    return [
        RankPlan(
            h,
            lr,
            loc,
            info,
            local_size=sizes[h],
            gpus_per_worker=config.gpus_per_worker,
            gpus=gpu_share.share(lr, sizes[h], config.gpus_per_worker, visible if loc else None),
        )
        for h, lr, loc, info in zip(hosts, local_ranks, local, infos)
    ]


def _parameter_server_tasks(addresses: Sequence[str], num_ps: int) -> list[cluster_lib.ClusterInfo]:
    """The chief, worker and ps tasks on `addresses`, in that order."""
    training, ps = tuple(addresses[:-num_ps]), tuple(addresses[-num_ps:])
    roles = [(cluster_lib.CHIEF, 0)]
    roles += [(cluster_lib.WORKER, i) for i in range(len(training) - 1)]
    roles += [(cluster_lib.PS, i) for i in range(num_ps)]
    return [
        cluster_lib.ClusterInfo(training, index, ps=ps, has_chief=True, task_type=role)
        for role, index in roles
    ]


def _local_ranks(hosts: Sequence[str]) -> list[int]:
    seen: collections.Counter[str] = collections.Counter()
    result = []
    for host in hosts:
        result.append(seen[host])
        seen[host] += 1
    return result


def _ports(
    config: LaunchConfig, hosts, local_ranks, all_local: bool, avoid_ports: Collection[int] = ()
) -> list[int]:
    size = config.num_tasks
    if all_local and config.port_base == 0:
        # free_ports gives distinct ports, so at most len(avoid) are dropped.
        avoid = set(avoid_ports)
        ports = cluster_lib.free_ports(size + len(avoid), config.bind.strip("[]"))
        return [p for p in ports if p not in avoid][:size]
    if all_local:  # a fixed base on one machine: ranks count up from it
        return [config.port_base + r for r in range(size)]
    base = config.port_base or DEFAULT_REMOTE_PORT_BASE
    return [base + lr for lr in local_ranks]


def _format_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def check_local_ports(plans: Sequence[RankPlan], config: LaunchConfig) -> None:
    """Raises `LaunchError` when a local rank's port is taken already."""
    # Free ports were just picked by the OS; a user's --port_base may collide.
    if config.port_base == 0 and all(p.local for p in plans):
        return
    for p in plans:
        if p.local:
            try:
                cluster_lib.check_own_port_free(p.info)
            except cluster_lib.ClusterConfigError as e:
                raise LaunchError(f"{e} (pick another --port_base, or 0 for free ports)") from None


def runs_script(rank_plan: RankPlan, config: LaunchConfig) -> bool:
    """Whether this task runs the script: every rank does; in a
    parameter-server job the chief, and the others with
    `--ps_tasks_run_script`."""
    return (
        not config.parameter_server
        or config.ps_tasks_run_script
        or rank_plan.info.task_type == cluster_lib.CHIEF
    )


def task_argv(rank_plan: RankPlan, config: LaunchConfig) -> list[str]:
    """`python script.py *args`, or for a bare server task
    `python -m keras_distrib.strategies.parameter_server.task_server`, with this interpreter."""
    if runs_script(rank_plan, config):
        return [sys.executable, config.script, *config.script_args]
    return [sys.executable, "-m", TASK_SERVER_MODULE]


def shell_command(rank_plan: RankPlan, config: LaunchConfig, exec_: bool = False) -> str:
    """The shell line that starts `rank_plan` on its host from this directory.

    Example:

    ```python
    shell_command(p, config)
    # "cd /work && env TF_CONFIG='{...}' KERAS_DISTRIB_RANK=1 ... /usr/bin/python3 train.py"
    ```
    """
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in rank_plan.env().items())
    argv = " ".join(shlex.quote(a) for a in task_argv(rank_plan, config))
    # exec: under ssh the remote shell is replaced by Python, so SIGHUP from
    # the dropped connection reaches Python itself.
    prefix = "exec env" if exec_ else "env"
    return f"cd {shlex.quote(os.getcwd())} && {prefix} {env} {argv}"


def print_dry_run(plans: Sequence[RankPlan], config: LaunchConfig, out: TextIO) -> None:
    """Prints each rank's host, TF_CONFIG and command, for multi-host jobs.

    In a parameter-server job each task is named by its role (`chief`,
    `worker 0`, `ps 0`) instead of a rank.
    """
    remote = list(dict.fromkeys(p.host for p in plans if not p.local))
    verb = "is" if len(remote) == 1 else "are"
    what = "tasks" if config.parameter_server else "ranks"
    lines = [
        f"keras-distrib: {len(plans)} {what}, not started: {', '.join(remote)} "
        f"{verb} remote; run each command below on its host, or pass --ssh."
    ]
    for p in plans:
        lines.append(f"{p.label} on {p.host}: TF_CONFIG={p.info.tf_config_json()}")
        lines.append(f"  {shell_command(p, config)}")
    if config.output_dir:
        lines.append(
            f"keras-distrib: wrote TF_CONFIG files and host scripts to {config.output_dir}"
        )
    out.write("\n".join(lines) + "\n")
    out.flush()


def write_output_dir(plans: Sequence[RankPlan], config: LaunchConfig) -> None:
    """Writes `rank-R.tf_config.json` per rank and `host-H.sh` per host.

    In a parameter-server job the files are named by role and index:
    `chief-0.tf_config.json`, `worker-1.tf_config.json`, `ps-0.tf_config.json`.
    """
    output_dir = config.output_dir
    assert output_dir is not None  # called when --output_dir is given
    os.makedirs(output_dir, exist_ok=True)
    by_host: dict[str, list[RankPlan]] = {}
    for p in plans:
        by_host.setdefault(p.host, []).append(p)
        name = (
            f"{p.info.task_type}-{p.info.task_index}"
            if config.parameter_server
            else f"rank-{p.rank}"
        )
        path = os.path.join(output_dir, f"{name}.tf_config.json")
        with open(path, "w") as f:
            f.write(p.info.tf_config_json() + "\n")
    for host, host_plans in by_host.items():
        if config.parameter_server:
            what = f"tasks {', '.join(p.label for p in host_plans)}"
        else:
            what = f"ranks {', '.join(str(p.rank) for p in host_plans)}"
        lines = ["#!/bin/sh", f"# keras-distrib: {what} of {len(plans)}; run on {host}."]
        lines += [shell_command(p, config) + " &" for p in host_plans]
        lines.append("wait")
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", host)
        path = os.path.join(output_dir, f"host-{safe}.sh")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(path, 0o755)
