"""How a rank or a whole job is started: the argv (and env) of each child.

- `tf` (the default): one child per rank, `python script.py ...` here or
  `ssh host 'cd ... && exec env TF_CONFIG=... python script.py ...'`;
- `horovod`: one child, horovodrun, which starts and numbers the ranks;
  its `[N]<stdout>:` prefixes are turned into the launcher's `[rank N] `.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import shlex
import shutil
import sys
from typing import Sequence

from keras_distrib.launch.config import LaunchConfig, LaunchError
from keras_distrib.launch.plan import RankPlan, parse_hosts, shell_command, tf_log_env
from keras_distrib.launch.supervise import ChildSpec


def local_argv(config: LaunchConfig) -> list[str]:
    """`python script.py *args` with this interpreter."""
    return [sys.executable, config.script, *config.script_args]


def ssh_argv(rank_plan: RankPlan, config: LaunchConfig) -> list[str]:
    """`--ssh_command host 'cd ... && exec env ... python script.py ...'`."""
    remote = shell_command(rank_plan, config, exec_=True)
    return [*shlex.split(config.ssh_command), rank_plan.host.strip("[]"), remote]


def rank_argv(rank_plan: RankPlan, config: LaunchConfig) -> list[str]:
    """The argv that starts `rank_plan` from this machine."""
    if rank_plan.local:
        return local_argv(config)
    return ssh_argv(rank_plan, config)


def rank_specs(plans: Sequence[RankPlan], config: LaunchConfig) -> list[ChildSpec]:
    """One child per rank, labelled `rank N`, with the rank's environment."""
    return [ChildSpec(f"rank {p.rank}", rank_argv(p, config), p.env()) for p in plans]


# How horovodrun prefixes each piece of a rank's output (gloo: `[0]<stdout>:`,
# mpirun: `[1,0]<stdout>:`; an optional timestamp in front with
# --prefix-output-with-timestamp). horovodrun has no option to turn it off.
HOROVODRUN_RANK_PREFIX = r"(?:\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4})?\[(?:\d+,)?(?P<rank>\d+)\]<(?P<stream>std(?:out|err))>:"


def horovod_spec(config: LaunchConfig) -> ChildSpec:
    """The one child of `--backend=horovod`: horovodrun (Gloo), which does
    its own rank bookkeeping.

    Raises:
        LaunchError: Horovod or horovodrun is not installed.
    """
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
    command = "exec " + shlex.join(local_argv(config))
    argv = [horovodrun, "--gloo", "-np", str(config.nproc), "-H", hosts,
            "/bin/sh", "-c", command]
    return ChildSpec("horovodrun", argv, {"PYTHONUNBUFFERED": "1", **tf_log_env()},
                     rank_prefix=HOROVODRUN_RANK_PREFIX)
