"""`multi_worker`'s own engines across hosts: making them, and `"auto"`'s measured choice.

`network_transports` makes the TCP ring's transport (`"tcp"`), the
hierarchical one (`"hierarchical"`) and Horovod's Gloo (`"gloo"`) for the
workers of a cluster: each worker that listens (every worker for the TCP
ring and for Gloo's probe, each host's leader for the hierarchical ring,
the chief for Gloo's rendezvous store) does so on its own host, as the
cluster names it, at a free port; one sum over TensorFlow's collectives
shares every port, a secret the chief draws (128 random bits) that each
connection must present, the name of the shared memory's files (another
128 bits), which workers can load Horovod, and whether any worker skips
`"auto"`'s measurement. Gloo is joined last, and only once every worker
has reached the store and every other worker
(`keras_distrib.strategies.multi_worker_gloo`: Horovod ends a process
whose Gloo cannot join).

`choose_engine` is `"auto"` across hosts (one device per worker): it makes
the candidates of `keras_distrib.collectives.engine_choice`, times each
with every worker (TensorFlow's through the strategy's own eager sum),
keeps the fastest and closes the others; where ours cannot connect, it
keeps TensorFlow's and says why.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Optional, Sequence

import numpy as np

from keras_distrib.cluster.network import listen_address
from keras_distrib.collectives import engine_choice, heartbeats, hierarchical
from keras_distrib.collectives import registry as transports
from keras_distrib.collectives import tcp_links
from keras_distrib.collectives.engine_choice import GLOO, HIERARCHICAL, TCP, TENSORFLOW, Choice
from keras_distrib.collectives.transport import Transport
from keras_distrib.strategies import multi_worker_gloo

_SECRET_WORDS = 4  # 128 bits as uint32 words (summed as int64: exact)
# The engines whose workers may listen, in the order their ports are shared.
_LISTENING = (TCP, HIERARCHICAL, GLOO)
# Seconds "auto" waits for its candidates' peers: the workers already met
# over TensorFlow's collectives, so a neighbour that does not connect by
# then cannot be reached on our ports (a firewall): TensorFlow's it is.
AUTO_CONNECT_SECONDS = 20.0


def network_transports(
    strategy: Any,
    names: Sequence[str],
    timeout: Optional[float],
    connect_timeout: float,
    keep_going: bool = False,
) -> tuple[dict[str, Transport], bool, str]:
    """`({name: transport} of `names` ("tcp", "hierarchical", "gloo"),
    whether every worker wants "auto"'s measurement, "")`; `strategy` is
    the `MultiWorker` whose TensorFlow transport shares what the workers
    must agree on.

    With `keep_going`, a failure to join the engines (a neighbour that
    cannot be reached: a firewall on other ports) does not raise: what was
    made is closed, and its message comes back in place of "", the same
    on every worker (one more sum over the workers says whether any failed);
    Gloo, where some worker cannot load Horovod or reach the chief's store,
    is left out of the answer.
    """
    info = strategy.cluster
    hosts = info.worker_hosts
    where = hierarchical.plan(info.rank, hosts)
    listeners: dict = {}
    made: dict[str, Transport] = {}
    gloo = multi_worker_gloo.Start(strategy) if GLOO in names else None
    try:
        _listen(listeners, names, listen_address(hosts[info.rank]), where, info.world_size)
        shared = _share(strategy, listeners, gloo)
        try:
            _join(strategy, names, hosts, where, listeners, made, shared, timeout, connect_timeout)
            failed = ""
        except Exception as e:
            if not keep_going:
                raise
            failed = f"{type(e).__name__}: {e}"
        if keep_going:
            (anyone,) = strategy.sync_sum([np.array([1 if failed else 0], np.int64)])
            if int(anyone[0]) and not failed:
                failed = "another worker could not join them"
        if failed:
            for transport in made.values():
                transport.close()
            made = {}
        elif gloo is not None and not (keep_going and shared["skip"]):
            # (Unmeasured, "auto" follows the layout: Gloo would not be kept.)
            joined = multi_worker_gloo.join(
                strategy, gloo, shared, timeout, connect_timeout, keep_going
            )
            if joined is not None:
                made[GLOO] = joined
        return made, not int(shared["skip"]), failed
    finally:
        for listener in listeners.values():
            listener.close()
        if gloo is not None and GLOO not in made:
            gloo.stop()


def _listen(listeners: dict, names: Sequence[str], own_host: str, where: Any, world: int) -> None:
    """Into `listeners`: this worker's listening socket for each of `names`
    that listens here (Gloo's: a probe of where Gloo will listen)."""
    if TCP in names:
        listeners[TCP] = tcp_links.listen(own_host)
    if HIERARCHICAL in names and where.is_leader and len(where.leaders) > 1:
        listeners[HIERARCHICAL] = tcp_links.listen(own_host)
    if GLOO in names:
        listeners[GLOO] = multi_worker_gloo.listen(own_host, world)


def _share(strategy: Any, listeners: dict, gloo: Optional[multi_worker_gloo.Start]) -> dict:
    """One sum over the workers: the secret and the shared memory's name
    (the chief's draws), every listener's port, which workers can load
    Horovod and the chief's store's port, how many skip the probe."""
    info = strategy.cluster
    world = info.world_size
    secret = slice(0, 2 * _SECRET_WORDS)
    ports = slice(secret.stop, secret.stop + len(_LISTENING) * world)
    horovod = slice(ports.stop, ports.stop + world)
    store = horovod.stop  # then the probe's skips, last
    words = np.zeros(store + 2, np.int64)
    if strategy.is_chief:
        words[secret] = np.frombuffer(secrets.token_bytes(32), np.uint32)
    for i, name in enumerate(_LISTENING):
        if name in listeners:
            words[ports.start + i * world + info.rank] = listeners[name].getsockname()[1]
    if gloo is not None and gloo.hvd is not None:
        words[horovod.start + info.rank] = 1
        if gloo.store is not None:
            words[store] = gloo.store.port
    words[-1] = 0 if engine_choice.probe_wanted() else 1
    (shared,) = strategy.sync_sum([words])
    return {
        "secret": b"".join(int(w).to_bytes(4, "little") for w in shared[:_SECRET_WORDS]),
        "job_id": "".join(f"{int(w):08x}" for w in shared[_SECRET_WORDS : 2 * _SECRET_WORDS]),
        "ports": dict(zip(_LISTENING, shared[ports].reshape(len(_LISTENING), world))),
        "horovod": [bool(w) for w in shared[horovod]],
        "store_port": int(shared[store]),
        "skip": int(shared[-1]),
    }


def _join(strategy, names, hosts, where, listeners, made, shared, timeout, connect_timeout):
    """Makes the transports of `names` into `made` (each waits for its peers)."""
    info = strategy.cluster
    common = dict(rows=strategy.transport, rank=info.rank, timeout=timeout)
    common.update(connect_timeout=connect_timeout, bytes_per_pack=strategy.packing.bytes_per_pack)
    # A cut link or a lost host: found when TensorFlow's heartbeats would.
    common["unreachable_after"] = heartbeats.timeout()
    ports = shared["ports"]
    if TCP in names:
        made[TCP] = transports.create(
            TCP,
            world_size=info.world_size,
            addresses=[(h, int(p)) for h, p in zip(hosts, ports[TCP])],
            secret=shared["secret"],
            listener=listeners.pop(TCP),
            **common,
        )
    if HIERARCHICAL in names:
        made[HIERARCHICAL] = transports.create(
            HIERARCHICAL,
            hosts=hosts,
            job_id=shared["job_id"],
            addresses=[(hosts[r], int(ports[HIERARCHICAL][r])) for r in where.leaders],
            secret=shared["secret"],
            listener=listeners.pop(HIERARCHICAL, None),
            **common,
        )


def choose_engine(
    strategy: Any, timeout: Optional[float], connect_timeout: float
) -> tuple[Transport, Choice]:
    """`"auto"` across hosts: the transport of the fastest candidate (the
    strategy's own TensorFlow transport, or one of ours), and the choice.
    Where ours cannot join (`AUTO_CONNECT_SECONDS`), TensorFlow's."""
    hosts = strategy.cluster.worker_hosts
    names = engine_choice.candidates(hosts, gloo=True)
    ours = [n for n in names if n != TENSORFLOW]
    seconds = min(connect_timeout, AUTO_CONNECT_SECONDS)
    made, measure, failed = network_transports(strategy, ours, timeout, seconds, keep_going=True)
    if failed:
        rings = [n for n in ours if n != GLOO]
        return strategy.transport, Choice(
            TENSORFLOW, f"auto: {' and '.join(rings)} could not connect: {failed}"
        )
    names = [n for n in names if n in made or n == TENSORFLOW]
    candidates: dict[str, Transport] = {**made, TENSORFLOW: strategy.transport}
    if measure:
        *timings, seconds = _probe(strategy, [candidates[n] for n in names])
        choice = engine_choice.choose(names, timings, seconds)
    else:
        choice = engine_choice.rule(hosts, f"{engine_choice.PROBE_ENV}=0")
    for name, transport in made.items():
        if name != choice.name:
            transport.close()
    return candidates[choice.name], choice


def _probe(strategy: Any, candidates: Sequence[Transport]) -> list[float]:
    """Each candidate's time for each of `PROBE_SIZES` (its best of
    `REPEATS` after a warm-up), then the whole probe's: the slowest
    worker's, the same on every worker."""
    began = time.perf_counter()
    arrays = [np.zeros(n // 4, np.float32) for n in engine_choice.PROBE_SIZES]
    mine = []
    for transport in candidates:
        transport.sum_over_processes(arrays[-1])  # connections, buffers, tracing
        for array in arrays:
            best = float("inf")
            for _ in range(engine_choice.REPEATS):
                start = time.perf_counter()
                transport.sum_over_processes(array)
                best = min(best, time.perf_counter() - start)
            mine.append(best)
    mine.append(time.perf_counter() - began)
    table = np.zeros((strategy.world_size, len(mine)), np.float64)
    table[strategy.rank] = mine
    (summed,) = strategy.sync_sum([table])
    return engine_choice.slowest(summed.tolist())
