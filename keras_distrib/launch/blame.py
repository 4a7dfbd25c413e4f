"""Whom an elastic job's failed attempt is charged to: the ranks' own diagnosis.

A rank that loses a peer says which ranks it could not reach (its
flight-recorder report, `lost`: a heartbeat that stopped, a peer that never
answered at start-up, a shared-memory peer that exited or stopped). The
rank that fails first is often not the cause: rank 0 fails when rank 1,
stopped or hung, stops answering. So:

1. A rank the others could not reach and that said nothing itself (it was
   killed, stopped, hung, or never started) is charged.
2. When every rank named said the same of others (each side alive, unable
   to reach the other: the training network between them is cut), the
   job's rendezvous decides: rank 0 holds it (the coordination service's
   leader), so a rank that rank 0 could not reach (or, when rank 0 said
   nothing, one that could not reach rank 0) is charged, as a partition.
3. Without a diagnosis, the rank that failed first is.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional


@dataclasses.dataclass(frozen=True)
class Charge:
    """The rank an attempt's failure is charged to (None: unknown), and
    whether the ranks were alive on both sides (`partition`: the network
    between them is cut, not a process)."""

    rank: Optional[int]
    partition: bool = False


def charge(first: Optional[int], lost: Mapping[int, frozenset]) -> Charge:
    """The charge for an attempt whose rank `first` failed first (None:
    unknown), where rank r said it could not reach the ranks `lost[r]`."""
    lost = {rank: frozenset(r for r in named if r != rank) for rank, named in lost.items()}
    absent = sorted({r for named in lost.values() for r in named if r not in lost})
    if absent:
        return Charge(absent[0])
    if lost.get(0):
        return Charge(min(lost[0]), partition=True)
    cut_off = sorted(rank for rank, named in lost.items() if 0 in named)
    if cut_off:
        return Charge(cut_off[0], partition=True)
    return Charge(first)


def ranks_of(lost_by_label: Mapping[str, frozenset]) -> dict[int, frozenset]:
    """`{rank: ranks}` from the launcher's `{"rank N": ranks}`; other
    labels (a horovodrun child's own lines) are left out."""
    found = {}
    for label, named in lost_by_label.items():
        word, _, number = label.partition(" ")
        if word == "rank" and number.isdigit():
            found[int(number)] = frozenset(named)
    return found
