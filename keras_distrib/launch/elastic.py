"""Elastic launches (`--min_workers`): the job goes on with the workers left.

The job has `-n` slots: the places `--hosts` gives (on one machine, `-n`
processes). Each attempt runs one rank per member slot, numbered in slot
order, with a new `TF_CONFIG` for that many workers. When an attempt fails
and `--max_restarts` allows, the next one runs on the slots that still
answer:

* a remote host is present when ssh (`--ssh_command`) reaches it and,
  from it, a probe reaches the job's rendezvous over the training network
  (`keras_distrib.launch.reachability`: a port the launcher holds on its
  own address among the hosts); one that is not is lost, with all its
  slots (so is one that is not present before the first attempt);
* otherwise the failure is charged to one rank (`keras_distrib.launch.blame`:
  the ranks' own diagnosis of whom they could not reach, else the rank
  that failed first). Its slot is left out when it was charged in two
  attempts in a row, the second within `--elastic_grace` seconds of its
  start (a worker killed or stopped again and again, a host that fails at
  start-up), or at once when the ranks on both sides were alive and could
  not reach each other (a partition the probe does not see: the slot stays
  out). Under `--backend horovod` an attempt is one horovodrun on the
  member slots, and the rank that failed first is the one horovodrun names
  when it stops the others.

Below `--min_workers` slots the job fails, naming the hosts lost. While
hosts are out, a thread probes them every `PROBE_INTERVAL` seconds; when one
is present again, the job is asked to save and stop (SIGTERM: every rank stops at
the same step and `BackupAndRestore` writes its backup there, exit code
`PREEMPTED`), and the next attempt takes the host back (not counted as a
restart). Each change prints one line: `[launcher] 2 -> 1 workers: host
10.0.0.2 lost (ssh reaches it, but it cannot reach the job's rendezvous at
10.0.0.1:41234 on the training network); training goes on from the last
backup, step 12 (epoch 2, step 4)` (the step as the job's chief reported
it: `launch_contract.BACKUP_LINE`).

The training stays the one the user asked for whatever the membership:
the global batch is split over the workers there are, and a resumed
`fit` (`keras_distrib.callbacks.BackupAndRestore`) continues at the same
global step, with the same shuffle (docs/failures.md).

`ElasticJob` is the job's kind for the launcher's agent
(`keras_distrib.launch.agent`): it plans each attempt, stops one when a
lost host answers again, and decides the membership of the next.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
import time
from typing import Iterator, Optional, Sequence, TextIO, Union

from keras_distrib import cluster as cluster_lib
from keras_distrib.launch import backends, blame
from keras_distrib.launch.agent import Agent, Attempt, JobKind
from keras_distrib.launch.config import LaunchConfig
from keras_distrib.launch.endings import Ending, SuperviseResult
from keras_distrib.launch.output import Printer, note, say
from keras_distrib.launch.plan import parse_hosts, plan
from keras_distrib.launch.reachability import Rendezvous
from keras_distrib.launch.restarts import Job, finish, from_backup, should_restart

PROBE_INTERVAL = 5.0
EXIT_TOO_FEW = 1  # the exit code when fewer than --min_workers slots are left


def slot_hosts(config: LaunchConfig) -> list[str]:
    """The host of each of the `-n` slots."""
    if config.hosts:
        return parse_hosts(config.hosts, config.nproc)
    return [config.bind] * config.nproc


class _Rejoin:
    """Probes the hosts that are out, every `PROBE_INTERVAL` seconds, in a
    thread; `returned` holds the first that is present again."""

    def __init__(self, hosts: Sequence[str], rendezvous: Rendezvous):
        self.returned: Optional[str] = None
        self._hosts, self._rendezvous = list(hosts), rendezvous
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if self._hosts:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(PROBE_INTERVAL):
            back = [h for h in self._hosts if self._rendezvous.why_out(h) is None]
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
        return dataclasses.replace(
            config, nproc=len(self.members), hosts=tuple(f"{h}:{c}" for h, c in counts.items())
        )


class ElasticJob(JobKind):
    """What `supervise` runs for `--min_workers`: ranks on the slots of
    `config` that answer, planned again for every attempt (module doc).

    It holds the state of its run under way (the rendezvous, which slots
    are members), made again each time it runs (`session`).
    """

    def __init__(self, config: LaunchConfig):
        self.config = config
        self._hosts: list[str] = []  # of every slot
        self._rendezvous: Optional[Rendezvous] = None
        self._state: Optional[_Membership] = None
        self._last_culprit: Optional[int] = None  # the slot charged with the last failure
        self._last_ports: set = set()  # the ports of the last attempt's ranks
        self._returned: Optional[str] = None  # the host that answered again in the last attempt

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        self._hosts = slot_hosts(self.config)
        with Rendezvous(self._hosts, self.config.ssh_command) as rendezvous:
            self._rendezvous, self._last_culprit, self._last_ports = rendezvous, None, set()
            yield

    def _held(self) -> Rendezvous:
        """The rendezvous of the run under way (`session` holds it)."""
        assert self._rendezvous is not None
        return self._rendezvous

    def _membership(self) -> _Membership:
        """The slots of the run under way (from `first_attempt` on)."""
        assert self._state is not None
        return self._state

    def first_attempt(self, agent: Agent) -> Union[Attempt, SuperviseResult]:
        """On the slots whose hosts are present; says which are not."""
        config, hosts = self.config, self._hosts
        gone = self._held().out([h for h in hosts if not cluster_lib.is_local_host(h)])
        self._state = _Membership(
            hosts, [s for s, h in enumerate(hosts) if h not in gone], list(gone)
        )
        if gone:
            note(
                agent.printer,
                agent.err,
                f"{config.nproc} -> {len(self._state.members)} "
                f"workers before the start: {_out_because(gone)}.",
            )
        return self._attempt(0, 0, agent, None)

    def monitor(self, attempt: Attempt, agent: Agent) -> SuperviseResult:
        """Also ends the attempt when a lost host answers again (`RESIZING`)."""
        rejoin = _Rejoin(self._membership().lost, self._held())
        attempt.resize = lambda: rejoin.returned is not None
        try:
            return super().monitor(attempt, agent)
        finally:
            rejoin.stop()
            self._returned = rejoin.returned

    def next_attempt(
        self, attempt: Attempt, result: SuperviseResult, agent: Agent
    ) -> Union[Attempt, SuperviseResult]:
        """With a host taken back (not a restart); after a failure, while
        the restart policy allows, without the hosts lost or the slot
        charged with it (`_shrink`)."""
        config, state, restarts = self.config, self._membership(), attempt.restarts
        if result.ending is Ending.RESIZING:
            assert self._returned is not None  # RESIZING: a lost host answered again
            _take_back(state, self._returned, agent.printer, agent.err)
            return self._attempt(attempt.number + 1, restarts, agent, result)
        if not should_restart(result, restarts, agent):
            return finish(result, restarts, len(state.members), agent)
        restarts += 1
        # What the ranks said before the launcher stopped any of them.
        charged = _charged(
            result, config, agent.printer.accounts.lost_between(attempt.started, result.seen)
        )
        rank = charged.rank
        culprit = state.members[rank] if rank is not None and rank < len(state.members) else None
        again = (
            culprit is not None
            and culprit == self._last_culprit
            and time.monotonic() - attempt.started < config.elastic_grace
        )
        self._last_culprit = culprit
        left_out = culprit if (again or charged.partition) else None
        if _shrink(
            state,
            left_out,
            charged,
            result,
            restarts,
            config,
            self._held(),
            agent.printer,
            agent.err,
        ):
            self._last_culprit = None  # a lost host explains the failure
        return self._attempt(attempt.number + 1, restarts, agent, result)

    def _attempt(
        self, number: int, restarts: int, agent: Agent, last: Optional[SuperviseResult]
    ) -> Union[Attempt, SuperviseResult]:
        """The attempt on the member slots; below --min_workers, the job's end."""
        state = self._membership()
        if len(state.members) < self.config.min_workers:
            return _too_few(state, self.config, restarts, agent.err, last)
        job = _job(self.config, state, number, self._last_ports)
        return Attempt(
            number, functools.partial(job.specs, number), job.private_dir, restarts=restarts
        )


def _charged(result: SuperviseResult, config: LaunchConfig, lost: dict) -> blame.Charge:
    """Whom the failed attempt is charged to: the ranks' diagnosis, or the
    rank that failed first."""
    return blame.charge(_first(result, config), blame.ranks_of(lost))


def _job(config: LaunchConfig, state: _Membership, attempt: int, last_ports: set) -> Job:
    """One attempt's ranks on the member slots (new free ports on one
    machine), or horovodrun starting them."""
    if config.backend == "horovod":
        member_config = state.spec_config(config)
        local = all(cluster_lib.is_local_host(state.hosts[s]) for s in state.members)
        return Job(
            1,
            lambda restart, shm_dir: [
                backends.horovod_spec(member_config, shm_dir, restart=attempt)
            ],
            private_dir=local,
        )
    plans = plan(state.spec_config(config), avoid_ports=set(last_ports))
    last_ports.clear()
    last_ports.update(p.port for p in plans)
    told = [dataclasses.replace(p, restart=attempt) for p in plans]

    def specs(restart, shm_dir):
        return backends.rank_specs(
            [dataclasses.replace(p, shm_dir=shm_dir if p.local else None) for p in told], config
        )

    return Job(len(told), specs, private_dir=any(p.local for p in told))


def _shrink(
    state: _Membership,
    left_out: Optional[int],
    charged: blame.Charge,
    result: SuperviseResult,
    restarts: int,
    config: LaunchConfig,
    rendezvous: Rendezvous,
    printer: Printer,
    err: TextIO,
) -> bool:
    """After a failed attempt: leaves out the hosts that are not present
    (and returns True), or else the slot `left_out` (charged with the
    failure, see `_charged`); says what runs next."""
    before = len(state.members)
    gone = rendezvous.out(
        [state.hosts[s] for s in state.members if not cluster_lib.is_local_host(state.hosts[s])]
    )
    if gone:
        state.lost += list(gone)
        state.members = [s for s in state.members if state.hosts[s] not in gone]
        why = _out_because(gone)
    elif left_out is not None:
        state.members.remove(left_out)
        where = f"slot {left_out} on {_named([state.hosts[left_out]])} left out"
        if charged.partition:
            why = (
                f"{where} (its rank {charged.rank} and rank 0 could not reach each other, "
                "though it reaches the job's rendezvous; it stays out)"
            )
        else:
            who = (
                "its rank failed"
                if charged.rank == _first(result, config)
                else "the other ranks lost its rank"
            )
            why = f"{where} ({who} again within --elastic_grace={config.elastic_grace:g}s)"
    assert result.failed is not None  # a failed attempt's result names its child
    say(err, f"restart {restarts}/{config.max_restarts}: {result.failed.outcome()}.")
    if len(state.members) != before:
        note(
            printer,
            err,
            f"{before} -> {len(state.members)} workers: {why}; "
            f"training goes on from {from_backup(printer, 'the last backup')}.",
        )
    return bool(gone)


def _first(result: SuperviseResult, config: LaunchConfig) -> Optional[int]:
    """The rank that failed first; horovodrun, one child, says which of its
    ranks did (or nothing)."""
    failed = result.failed
    assert failed is not None  # a failed attempt's result names its child
    return failed.index if config.backend == "tf" else failed.first_rank


def _out_because(gone: dict) -> str:
    """`host b lost (it does not answer)`, the hosts grouped by why."""
    by_why: dict = {}
    for host, why in gone.items():
        by_why.setdefault(why, []).append(host)
    return "; ".join(
        f"{_named(hosts)} lost ({why[len(hosts) > 1]})" for why, hosts in by_why.items()
    )


def _take_back(state: _Membership, host: str, printer: Printer, err: TextIO) -> None:
    before = len(state.members)
    state.lost.remove(host)
    state.members = sorted(state.members + [s for s, h in enumerate(state.hosts) if h == host])
    note(
        printer,
        err,
        f"{before} -> {len(state.members)} workers: {_named([host])} answers "
        "again; training goes on from "
        f"{from_backup(printer, 'the backup the job just saved')}.",
    )


def _too_few(
    state: _Membership,
    config: LaunchConfig,
    restarts: int,
    err: TextIO,
    last: Optional[SuperviseResult],
) -> SuperviseResult:
    """Stops the job, saying why in one line: the slots left, the hosts
    lost, and the last failure with the failed rank's own last line (a
    damaged backup, a full disk: a cause no other membership cures)."""
    lost = f"; lost: {_named(state.lost)}" if state.lost else ""
    failure = ""
    if last is not None and last.failed is not None:
        failure = f"; the last failure: {last.failed.outcome_and_last_line()}"
    say(
        err,
        f"{len(state.members)} of {config.nproc} slots left, fewer than "
        f"--min_workers={config.min_workers}{lost}{failure}; stopping.",
    )
    return SuperviseResult(Ending.CHILD_FAILED, EXIT_TOO_FEW, restarts=restarts)


def _named(hosts: Sequence[str]) -> str:
    """`host a`, or `hosts a, b`."""
    return f"host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)}"
