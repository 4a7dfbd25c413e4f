"""Elastic launches (`--min_workers`): the job goes on with the workers left.

The job has `-n` slots: the places `--hosts` gives (on one machine, `-n`
processes). Each attempt runs one rank per member slot, numbered in slot
order, with a new `TF_CONFIG` for that many workers. When an attempt fails
and `--max_restarts` allows, the next one runs on the slots that still
answer:

* a remote host is asked to run `true` through `--ssh_command`; one that
  does not within `PROBE_SECONDS` is lost, with all its slots (so is one
  that cannot be reached before the first attempt);
* a slot whose rank failed first in two attempts in a row, the second
  within `--elastic_grace` seconds of its start, is left out (a worker
  killed again and again, a host that fails at start-up). Under
  `--backend horovod` an attempt is one horovodrun on the member slots,
  and the rank that failed first is the one horovodrun names when it
  stops the others.

Below `--min_workers` slots the job fails, naming the hosts lost. While
hosts are out, a thread asks them every `PROBE_INTERVAL` seconds; when one
answers, the job is asked to save and stop (SIGTERM: every rank stops at
the same step and `BackupAndRestore` writes its backup there, exit code
`PREEMPTED`), and the next attempt takes the host back (not counted as a
restart). Each change prints one line: `[launcher] 2 -> 1 workers: host
10.0.0.2 lost (it does not answer); training goes on from the last backup,
step 12 (epoch 2, step 4)` (the step as the job's chief reported it:
`launch_contract.BACKUP_LINE`).

The training stays the one the user asked for whatever the membership:
the global batch is split over the workers there are, and a resumed
`fit` (`keras_distrib.callbacks.BackupAndRestore`) continues at the same
global step, with the same shuffle (docs/failures.md).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import shlex
import subprocess
import threading
import time
from typing import Optional, Sequence, TextIO

from keras_distrib import cluster as cluster_lib
from keras_distrib.launch import backends
from keras_distrib.launch.config import LaunchConfig
from keras_distrib.launch.endings import Ending, SuperviseResult
from keras_distrib.launch.output import Printer, note, say
from keras_distrib.launch.plan import parse_hosts, plan
from keras_distrib.launch.processes import SignalTrap
from keras_distrib.launch.restarts import Job, finish, from_backup, run_attempt, should_restart

PROBE_SECONDS = 10.0
PROBE_INTERVAL = 5.0
EXIT_TOO_FEW = 1  # the exit code when fewer than --min_workers slots are left


def slot_hosts(config: LaunchConfig) -> list[str]:
    """The host of each of the `-n` slots."""
    if config.hosts:
        return parse_hosts(config.hosts, config.nproc)
    return [config.bind] * config.nproc


def answers(host: str, config: LaunchConfig) -> bool:
    """Whether `host` runs `true` through `--ssh_command` within
    `PROBE_SECONDS` (this machine always does)."""
    if cluster_lib.is_local_host(host):
        return True
    argv = [*shlex.split(config.ssh_command), host.strip("[]"), "true"]
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=PROBE_SECONDS).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def unreachable(hosts: Sequence[str], config: LaunchConfig) -> list[str]:
    """The hosts among `hosts` that do not answer, asked all at once."""
    hosts = list(dict.fromkeys(hosts))
    if not hosts:
        return []
    with concurrent.futures.ThreadPoolExecutor(len(hosts)) as pool:
        answered = list(pool.map(lambda h: answers(h, config), hosts))
    return [h for h, ok in zip(hosts, answered) if not ok]


class _Rejoin:
    """Asks the hosts that are out, every `PROBE_INTERVAL` seconds, in a
    thread; `returned` holds the first that answers."""

    def __init__(self, hosts: Sequence[str], config: LaunchConfig):
        self.returned: Optional[str] = None
        self._hosts, self._config = list(hosts), config
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if self._hosts:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(PROBE_INTERVAL):
            back = [h for h in self._hosts if answers(h, self._config)]
            if back and not self._stop.is_set():
                self.returned = back[0]
                return

    def stop(self) -> None:
        self._stop.set()


@dataclasses.dataclass
class _Membership:
    """The slots of the job, which of them run, and the hosts out."""

    hosts: list[str]  # of every slot
    members: list[int]
    lost: list[str] = dataclasses.field(default_factory=list)  # hosts out, in order lost

    def spec_config(self, config: LaunchConfig) -> LaunchConfig:
        """`config` for the member slots only."""
        if not config.hosts:
            return dataclasses.replace(config, nproc=len(self.members))
        counts = collections.Counter(self.hosts[s] for s in self.members)
        return dataclasses.replace(config, nproc=len(self.members),
                                   hosts=tuple(f"{h}:{c}" for h, c in counts.items()))


@dataclasses.dataclass(frozen=True)
class ElasticJob:
    """What `supervise` runs for `--min_workers`: ranks on the slots of
    `config` that answer, planned again for every attempt."""

    config: LaunchConfig


def run_elastic(job: ElasticJob, printer: Printer, deadline: Optional[float],
                err: TextIO) -> SuperviseResult:
    """Runs the attempts of an elastic job (see module doc); returns how the last ended."""
    config = job.config
    hosts = slot_hosts(config)
    gone = unreachable([h for h in hosts if not cluster_lib.is_local_host(h)], config)
    state = _Membership(hosts, [s for s, h in enumerate(hosts) if h not in gone], list(gone))
    if gone:
        note(printer, err, f"{config.nproc} -> {len(state.members)} workers before the start: "
                           f"{_named(gone)} {'does' if len(gone) == 1 else 'do'} not answer.")
    with SignalTrap() as trap:
        restarts, attempts, last_culprit, last_ports = 0, 0, None, set()
        while True:
            if len(state.members) < config.min_workers:
                return _too_few(state, config, restarts, err)
            job = _job(config, state, attempts, last_ports)
            rejoin = _Rejoin(state.lost, config)
            started = time.monotonic()
            try:
                result = run_attempt(job, attempts, config, trap, deadline, printer, err,
                                     resize=lambda: rejoin.returned is not None)
            finally:
                rejoin.stop()
            attempts += 1
            if result.ending is Ending.RESIZING:
                _take_back(state, rejoin.returned, printer, err)
                continue
            if not should_restart(result, restarts, config, trap, deadline):
                return finish(result, restarts, len(state.members), config, trap, err)
            restarts += 1
            # Ranks are numbered in member-slot order; horovodrun, one child,
            # says which of its ranks failed first (or nothing).
            rank = (result.failed.index if config.backend == "tf"
                    else result.failed.first_rank)
            known = rank is not None and rank < len(state.members)
            culprit = state.members[rank] if known else None
            again = (culprit is not None and culprit == last_culprit
                     and time.monotonic() - started < config.elastic_grace)
            last_culprit = culprit
            if _shrink(state, culprit if again else None, result, restarts, config, printer,
                       err):
                last_culprit = None  # a lost host explains the failure


def _job(config: LaunchConfig, state: _Membership, attempt: int, last_ports: set) -> Job:
    """One attempt's ranks on the member slots (new free ports on one
    machine), or horovodrun starting them."""
    if config.backend == "horovod":
        member_config = state.spec_config(config)
        local = all(cluster_lib.is_local_host(state.hosts[s]) for s in state.members)
        return Job(1, lambda restart, shm_dir: [
            backends.horovod_spec(member_config, shm_dir, restart=attempt)], private_dir=local)
    plans = plan(state.spec_config(config), avoid_ports=set(last_ports))
    last_ports.clear()
    last_ports.update(p.port for p in plans)
    told = [dataclasses.replace(p, restart=attempt) for p in plans]

    def specs(restart, shm_dir):
        return backends.rank_specs(
            [dataclasses.replace(p, shm_dir=shm_dir if p.local else None) for p in told],
            config)

    return Job(len(told), specs, private_dir=any(p.local for p in told))


def _shrink(state: _Membership, bad_slot: Optional[int], result: SuperviseResult,
            restarts: int, config: LaunchConfig, printer: Printer, err: TextIO) -> list:
    """After a failed attempt: leaves out the hosts that do not answer (and
    returns them), or else `bad_slot`; says what runs next."""
    before = len(state.members)
    gone = unreachable([state.hosts[s] for s in state.members
                        if not cluster_lib.is_local_host(state.hosts[s])], config)
    if gone:
        state.lost += gone
        state.members = [s for s in state.members if state.hosts[s] not in gone]
        why = f"{_named(gone)} lost ({'it does' if len(gone) == 1 else 'they do'} not answer)"
    elif bad_slot is not None:
        state.members.remove(bad_slot)
        why = (f"slot {bad_slot} on {_named([state.hosts[bad_slot]])} left out (its rank "
               f"failed again within --elastic_grace={config.elastic_grace:g}s)")
    say(err, f"restart {restarts}/{config.max_restarts}: {result.failed.outcome()}.")
    if len(state.members) != before:
        note(printer, err, f"{before} -> {len(state.members)} workers: {why}; "
                           f"training goes on from {from_backup(printer, 'the last backup')}.")
    return gone


def _take_back(state: _Membership, host: str, printer: Printer, err: TextIO) -> None:
    before = len(state.members)
    state.lost.remove(host)
    state.members = sorted(state.members + [s for s, h in enumerate(state.hosts) if h == host])
    note(printer, err, f"{before} -> {len(state.members)} workers: {_named([host])} answers "
                       "again; training goes on from "
                       f"{from_backup(printer, 'the backup the job just saved')}.")


def _too_few(state: _Membership, config: LaunchConfig, restarts: int,
             err: TextIO) -> SuperviseResult:
    lost = f"; lost: {_named(state.lost)}" if state.lost else ""
    say(err, f"{len(state.members)} of {config.nproc} slots left, fewer than "
             f"--min_workers={config.min_workers}{lost}; stopping.")
    return SuperviseResult(Ending.CHILD_FAILED, EXIT_TOO_FEW, restarts=restarts)


def _named(hosts: Sequence[str]) -> str:
    """`host a`, or `hosts a, b`."""
    return f"host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)}"
