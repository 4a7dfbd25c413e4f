"""A real Slurm cluster on the multi-host test bed: `slurmctld`, one `slurmd`
per namespace host, and `munged`, from Debian's packages
(scripts/install_test_beds.sh), with a `slurm.conf` of ours.

The bed's hosts (tests/netns_hosts.py) become nodes `n0`, `n1`, ... at
their addresses, each resolving the others by name (its /etc/hosts). The
controller runs on n0, as do the clients (`sbatch`, `scancel`, `scontrol`,
`squeue`: `bed.slurm(*argv)`), which find it through `SLURM_CONF`. A batch
job that exits 75 (its workers preempted, a backup saved) is queued again
(`RequeueExit=75`). Slurm
runs as root, tracks processes without cgroups (`proctrack/linuxproc`,
`task/none`; slurmd still opens the cgroup v1 hierarchies, mounted afresh
in each node's namespace because `ip netns exec` hides the machine's),
and keeps its state, spool, logs and munge key in one temporary directory
removed by `close`, which also stops every daemon.

`unavailable()` says in one line why there can be no such cluster here
(not root, no namespaces, no Slurm installed).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from typing import Optional

import netns_hosts

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch")
CGROUPS = ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "pids")


def unavailable() -> Optional[str]:
    """None when a Slurm bed can run here, else why not (one line)."""
    reason = netns_hosts.unavailable()
    if reason:
        return reason
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return (
            f"the Slurm bed needs {', '.join(missing)} (Debian: slurmctld slurmd "
            "slurm-client munge; scripts/install_test_beds.sh installs them)"
        )
    return None


def _conf(directory: str, addresses: list[str], munge_socket: str) -> str:
    nodes = "\n".join(
        f"NodeName=n{i} NodeAddr={a} CPUs=2 State=UNKNOWN" for i, a in enumerate(addresses)
    )
    names = ",".join(f"n{i}" for i in range(len(addresses)))
    return f"""ClusterName=kdbed
SlurmctldHost=n0({addresses[0]})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool-%n
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd-%n.pid
SlurmctldLogFile={directory}/slurmctld.log
SlurmdLogFile={directory}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
RequeueExit=75
KillWait=10
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{nodes}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmBed(netns_hosts.TestBed):
    """`n` hosts with a Slurm cluster on them; see the module doc.

    Example:

    ```python
    with SlurmBed(2) as bed:
        job = bed.sbatch(script, "-N", "2", "--ntasks-per-node=1")
        bed.wait_for_job(job)
    ```
    """

    __test__ = False

    def __init__(self, n: int):
        super().__init__(n)
        self.directory = tempfile.mkdtemp(prefix="kd-slurm-")
        os.chmod(self.directory, 0o755)
        self.conf = os.path.join(self.directory, "slurm.conf")
        self._daemons: list[subprocess.Popen] = []

    def _make(self) -> None:
        super()._make()
        d = self.directory
        for sub in ["state", *(f"spool-n{i}" for i in range(self.n))]:
            os.makedirs(os.path.join(d, sub))
        key, socket = os.path.join(d, "munge.key"), os.path.join(d, "munge.sock")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        with open(self.conf, "w") as f:
            f.write(_conf(d, self.addresses, socket))
        with open(os.path.join(d, "cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        for host in range(self.n):
            self.hosts_file(host, [f"{a} n{i}" for i, a in enumerate(self.addresses)])
        self._start(
            [
                "munged",
                "-F",
                "--force",
                f"--socket={socket}",
                f"--key-file={key}",
                f"--pid-file={d}/munged.pid",
                f"--log-file={d}/munged.log",
                f"--seed-file={d}/munged.seed",
            ]
        )
        self._start(self.on(0, ["slurmctld", "-D", "-f", self.conf], name="n0"))
        mounts = " && ".join(
            ["mount -t tmpfs none /sys/fs/cgroup"]
            + [
                f"mkdir -p /sys/fs/cgroup/{c} && mount -t cgroup -o {c} none /sys/fs/cgroup/{c}"
                for c in CGROUPS
            ]
        )
        for host in range(self.n):
            self._start(
                self.on(
                    host,
                    ["sh", "-c", f"{mounts} && exec slurmd -D -f {self.conf} -N n{host}"],
                    name=f"n{host}",
                )
            )
        self._wait_until_idle()

    def _start(self, argv: list[str]) -> None:
        log = open(os.path.join(self.directory, "daemons.log"), "a")
        self._daemons.append(
            subprocess.Popen(argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT)
        )
        log.close()

    def env(self, **extra) -> dict:
        return dict(os.environ, SLURM_CONF=self.conf, **extra)

    def slurm(self, *argv: str, check: bool = True, **env) -> subprocess.CompletedProcess:
        """Runs a Slurm client (`sbatch ...`) on n0; returns what it printed."""
        return subprocess.run(
            self.on(0, list(argv), name="n0"),
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=60,
            check=check,
        )

    def _wait_until_idle(self, seconds: float = 60) -> None:
        deadline = time.monotonic() + seconds
        while True:
            shown = self.slurm("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
            states = dict(line.split() for line in shown.splitlines() if line.strip())
            if len(states) == self.n and all(s == "idle" for s in states.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Slurm nodes are not idle after {seconds:g}s: {states}; "
                    f"see {self.directory}"
                )
            time.sleep(0.5)

    def sbatch(self, script: str, *options: str, args: tuple = (), **env) -> int:
        """Submits `script` with sbatch's `options` and the script's `args`;
        returns the job id."""
        said = self.slurm("sbatch", "--parsable", *options, script, *args, **env).stdout
        return int(re.match(r"\d+", said.strip())[0])

    def job_state(self, job: int) -> str:
        """`RUNNING`, `COMPLETED`, `FAILED`, ..., and for a pending job why:
        `PENDING BeginTime` (`scontrol show job`)."""
        shown = self.slurm("scontrol", "show", "job", str(job), check=False).stdout
        found = re.search(r"JobState=(\w+) Reason=(\w+)", shown)
        if not found:
            return "UNKNOWN"
        return f"PENDING {found[2]}" if found[1] == "PENDING" else found[1]

    def wait_for_job(
        self,
        job: int,
        seconds: float = 240,
        until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"),
    ) -> str:
        """Waits until the job is in one of `until`; returns that state."""
        deadline = time.monotonic() + seconds
        while True:
            state = self.job_state(job)
            if state in until:
                return state
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job} still {state} after {seconds:g}s")
            time.sleep(0.3)

    def close(self) -> None:
        for daemon in reversed(self._daemons):
            daemon.terminate()
        for daemon in reversed(self._daemons):
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        self._daemons.clear()
        super().close()
        shutil.rmtree(self.directory, ignore_errors=True)
