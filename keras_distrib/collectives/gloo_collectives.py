"""Horovod's Gloo collectives in a `multi_worker` job, as a transport.

The collectives are `HorovodCollectives`' (Horovod's ops, traced into the
step); what differs is how the workers join: not under `horovodrun` but as
`multi_worker`'s workers, which meet at the chief's rendezvous store
(`keras_distrib.collectives.gloo_rendezvous`). Making one initializes
Horovod in this process (`hvd.init()`) and waits for every worker;
`close` shuts Horovod down again (and the chief's store), so a strategy
that measured Gloo and kept another engine leaves nothing running.

Horovod's error after a lost peer names no one (the peer is only in its
log); `explain` does: the watch's finding on a cut link
(`keras_distrib.collectives.link_watch`), else the first other worker
whose server no longer answers (one that exited).
Horovod is optional: this module never imports it; the caller hands
`horovod.tensorflow` in.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

from keras_distrib.cluster.addresses import parse_address
from keras_distrib.collectives import gloo_rendezvous, numpy_engine
from keras_distrib.collectives.link_watch import LinkWatch
from keras_distrib.collectives.horovod_collectives import HorovodCollectives


# Seconds to wait for a peer's server to take a connection after a failure.
_ANSWER_SECONDS = 2.0
# Seconds to go on asking after a failure: a killed process's sockets close
# one after another as it is torn down, its server's possibly after the
# connection whose reset stopped Horovod.
_GONE_SECONDS = 5.0


class GlooCollectives(HorovodCollectives):
    """Horovod's collectives over Gloo between the workers on `hosts`.

    Args:
        hvd: `horovod.tensorflow`, imported.
        rank: this worker's index in `hosts` (every worker's host, by rank).
        store: `(host, port)` of the rendezvous store the chief runs.
        interface: the network interface Gloo binds (None: Gloo's default).
        timeout: seconds a collective may wait for a peer (None: no limit).
        rendezvous: the store itself, on the chief (stopped by `close`).
        bytes_per_pack: the step's gradients in packs of about this many
            bytes, the last layers' first (0: one collective): each pack
            is one Horovod op, which runs as soon as the backward pass has
            made its gradients (Horovod's ops wait without holding a
            TensorFlow thread).
        workers: every worker's server address (`host:port`), by rank:
            those `explain` asks after a failure.
        unreachable_after: seconds after which a ring neighbour whose host
            answers nothing is lost (`LinkWatch`; None: no watch).
    """

    name = "gloo"

    def __init__(
        self,
        hvd: Any,
        rank: int,
        hosts: Sequence[str],
        store: tuple[str, int],
        interface: Optional[str] = None,
        timeout: Optional[float] = None,
        rendezvous: Optional[gloo_rendezvous.Rendezvous] = None,
        bytes_per_pack: int = 0,
        workers: Sequence[str] = (),
        unreachable_after: Optional[float] = None,
    ):
        self._rendezvous = rendezvous
        self._bytes_per_pack = bytes_per_pack
        self._rank, self._workers = rank, list(workers)
        env = gloo_rendezvous.environment(rank, hosts, store, interface, timeout)
        # Horovod reads them once, in hvd.init(); the process keeps its own.
        with gloo_rendezvous.environ(env):
            super().__init__(hvd)
        self._watch = (
            LinkWatch(self._workers, rank, unreachable_after)
            if unreachable_after is not None and len(self._workers) > 1
            else None
        )

    def mean_by_count(
        self, values: Sequence[Any], num_samples: Any, compression: Optional[Any] = None
    ) -> list[Any]:
        # Each pack is the default's all-reduce, the count riding along.
        return numpy_engine.by_packs(
            values,
            self._bytes_per_pack,
            lambda pack: super(GlooCollectives, self).mean_by_count(pack, num_samples, compression),
        )

    def explain(self, error: BaseException) -> Optional[str]:
        if _SHUT_DOWN not in str(error):
            return None
        if self._watch is not None and self._watch.lost is not None:
            return f"{self._watch.lost}; Horovod's Gloo collectives stopped"
        return lost_peer(self._workers, self._rank)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        self._hvd.shutdown()
        if self._rendezvous is not None:
            self._rendezvous.stop()
            self._rendezvous = None


# What Horovod's ops raise on every rank once a collective failed on one
# (a peer gone, its connection reset): the peer is only in Horovod's log.
_SHUT_DOWN = "Horovod has been shut down"


def lost_peer(workers: Sequence[str], rank: int) -> str:
    """One line after Horovod stopped: the first of the other `workers`
    (addresses, by rank) whose server no longer answers, which is the peer
    whose loss stopped it; or, when every one still answers after
    `_GONE_SECONDS`, Horovod's own sentence."""
    deadline = time.monotonic() + _GONE_SECONDS
    while True:
        for peer, address in enumerate(workers):
            if peer != rank and not gloo_rendezvous.reachable(
                parse_address(address), _ANSWER_SECONDS
            ):
                return (
                    f"worker {peer} at {address} is gone (its server does not answer): "
                    "Horovod's Gloo collectives stopped"
                )
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return (
        "Horovod's Gloo collectives stopped, every worker's server still answers; "
        "Horovod's log above names the failure"
    )
