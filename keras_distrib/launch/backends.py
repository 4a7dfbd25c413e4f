"""How a rank or a whole job is started: the argv (and env) of each child.

- `tf` (the default): one child per rank, `python script.py ...` here or
  `ssh host 'cd ... && exec env TF_CONFIG=... python script.py ...'`;
  `rank_job` plans the ranks again, with new ports, for each restart;
- `horovod`: one child, horovodrun, which starts and numbers the ranks;
  its `[N]<stdout>:` prefixes are turned into the launcher's `[rank N] `.
  `horovod_job` has no restarts (`check_config` refuses them).

A parameter-server job (`--ps`, `tf` only) is one child per task, the
chief running the script and the others `python -m
keras_distrib.strategies.parameter_server.task_server` (`plan.task_argv`): `parameter_server_job`.

Every child gets `KERAS_DISTRIB_RESTART`; those on this host get the
attempt's private directory in `KERAS_DISTRIB_SHM_DIR`.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import os
import shlex
import shutil
import sys
from typing import Optional, Sequence

from keras_distrib import cluster as cluster_lib
from keras_distrib.launch.config import LaunchConfig, LaunchError
from keras_distrib.launch.parameter_server import ParameterServerJob
from keras_distrib.launch.plan import (
    RankPlan,
    parse_hosts,
    plan,
    shell_command,
    task_argv,
    tf_log_env,
)
from keras_distrib.launch.processes import ChildSpec
from keras_distrib.launch.restarts import Job
from keras_distrib.cluster.launch_contract import RESTART_ENV, SHM_DIR_ENV


def local_argv(config: LaunchConfig) -> list[str]:
    """`python script.py *args` with this interpreter."""
    return [sys.executable, config.script, *config.script_args]


def ssh_argv(rank_plan: RankPlan, config: LaunchConfig) -> list[str]:
    """`--ssh_command host 'cd ... && exec env ... python script.py ...'`."""
    remote = shell_command(rank_plan, config, exec_=True)
    return [*shlex.split(config.ssh_command), rank_plan.host.strip("[]"), remote]


def rank_argv(rank_plan: RankPlan, config: LaunchConfig) -> list[str]:
    """The argv that starts `rank_plan` (a rank, or a task of a
    parameter-server job) from this machine."""
    if rank_plan.local:
        return task_argv(rank_plan, config)
    return ssh_argv(rank_plan, config)


def rank_specs(plans: Sequence[RankPlan], config: LaunchConfig) -> list[ChildSpec]:
    """One child per rank, labelled `rank N` (`chief`, `worker I`, `ps I` in
    a parameter-server job), with the rank's environment."""
    return [ChildSpec(p.label, rank_argv(p, config), p.env()) for p in plans]


def parameter_server_job(plans: Sequence[RankPlan], config: LaunchConfig) -> ParameterServerJob:
    """The tasks of a parameter-server job's `plans`, by role.

    Planned once: a worker task started again keeps its port and
    `TF_CONFIG` (the chief's coordinator reconnects to that address).
    """
    specs = rank_specs(plans, config)
    roles = [p.info.task_type for p in plans]
    return ParameterServerJob(
        chief=specs[roles.index(cluster_lib.CHIEF)],
        workers=tuple(s for s, r in zip(specs, roles) if r == cluster_lib.WORKER),
        ps=tuple(s for s, r in zip(specs, roles) if r == cluster_lib.PS),
    )


def rank_job(plans: Sequence[RankPlan], config: LaunchConfig) -> Job:
    """The ranks of `plans` as a `Job`: planned again for each restart.

    A restart gets new free ports, none of the last attempt's (a rank
    killed a moment ago may still hold its port); fixed ports
    (`--port_base`, remote hosts) stay. The first attempt runs `plans`
    as given, whose ports the caller has checked.
    """
    last = list(plans)

    def specs(restart: int, shm_dir: Optional[str]) -> list[ChildSpec]:
        nonlocal last
        if restart:
            last = plan(config, avoid_ports={p.port for p in last})
        told = [
            dataclasses.replace(p, restart=restart, shm_dir=shm_dir if p.local else None)
            for p in last
        ]
        return rank_specs(told, config)

    return Job(len(last), specs, private_dir=any(p.local for p in last))


# How horovodrun prefixes each piece of a rank's output (gloo: `[0]<stdout>:`,
# mpirun: `[1,0]<stdout>:`; an optional timestamp in front with
# --prefix-output-with-timestamp). horovodrun has no option to turn it off.
HOROVODRUN_RANK_PREFIX = (
    r"(?:\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4})?"
    r"\[(?:\d+,)?(?P<rank>\d+)\]<(?P<stream>std(?:out|err))>:"
)


def horovod_spec(
    config: LaunchConfig, shm_dir: Optional[str] = None, restart: int = 0
) -> ChildSpec:
    """The one child of `--backend=horovod`: horovodrun (Gloo), which does
    its own rank bookkeeping. `shm_dir`: for ranks on this host only;
    `restart`: the attempt (`KERAS_DISTRIB_RESTART`, elastic launches).

    Raises:
        LaunchError: Horovod or horovodrun is not installed.
    """
    horovodrun = shutil.which("horovodrun", path=os.path.dirname(sys.executable)) or shutil.which(
        "horovodrun"
    )
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
    command = "exec " + shlex.join(local_argv(config))
    argv = [horovodrun, "--gloo", "-np", str(config.nproc), "-H", hosts, "/bin/sh", "-c", command]
    env = {"PYTHONUNBUFFERED": "1", RESTART_ENV: str(restart), **tf_log_env()}
    if shm_dir is not None:
        env[SHM_DIR_ENV] = shm_dir
    return ChildSpec(
        "horovodrun", argv, env, rank_prefix=HOROVODRUN_RANK_PREFIX, ranks=config.nproc
    )


def horovod_job(config: LaunchConfig) -> Job:
    """horovodrun as a `Job`; its ranks get a private directory when all run here.

    Raises:
        LaunchError: Horovod or horovodrun is not installed.
    """
    horovod_spec(config)  # fail now, before anything starts, when it is missing
    hosts = parse_hosts(config.hosts, config.nproc) if config.hosts else []
    local = all(cluster_lib.is_local_host(h) for h in hosts)
    return Job(1, lambda restart, shm_dir: [horovod_spec(config, shm_dir)], private_dir=local)
