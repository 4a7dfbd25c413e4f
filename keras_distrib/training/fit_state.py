"""What `DistributedModel` keeps for one `fit` call, in one object.

`DistributedModel.fit` makes a `FitState` before Keras's loop starts and
drops it when the call returns (`model.fit_state` is None outside `fit`);
the train function, the preemption watch and the callbacks read and write
it there, instead of attributes scattered over the model.

Callbacks take part through a protocol, as Keras's own `BackupAndRestore`
sets the epoch Keras starts at: a callback with `resume_point(model)` and
`record_seed(seed)` (`Resumable`) tells `fit` where to resume and learns the
shuffle seed, whatever its class. Keras's own `BackupAndRestore` is no
`Resumable`: `fit` puts keras_distrib's in its place first
(`keras_distrib.callbacks.keras_backup`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol, runtime_checkable


@runtime_checkable
class Resumable(Protocol):
    """A callback that resumes an interrupted `fit` (at most one per call)."""

    backup_dir: Any

    def resume_point(self, model) -> Optional[Any]:
        """Where to resume (`keras_distrib.input.fit_input.Start`), or None;
        collective: every worker calls it."""

    def record_seed(self, seed: Optional[int]) -> None:
        """The shuffle seed `fit`'s input uses."""


@dataclasses.dataclass
class FitState:
    """One `fit` call's state.

    Attributes:
        backup: the `Resumable` callback among the call's callbacks, or None.
        replay: the calls of the train function still to replay as no-ops
            (they only pull their batches): the steps a resumed run had done
            in its first epoch before the backup.
        watch: the preemption watch the train function asks after each call.
        vote_carried: set when the traced step put this process's stop vote
            into its gradients' all-reduce.
        preempted_at: `(epoch, steps done in it)` where every worker stopped
            on a SIGTERM, or None.
    """

    backup: Optional[Resumable] = None
    replay: int = 0
    watch: Any = None
    vote_carried: bool = False
    preempted_at: Optional[tuple] = None


def resumable_among(callbacks: list) -> Optional[Resumable]:
    """The one `Resumable` callback in `callbacks`, or None.

    Raises:
        ValueError: more than one.
    """
    found = [c for c in callbacks if isinstance(c, Resumable)]
    if len(found) > 1:
        names = ", ".join(sorted({type(c).__name__ for c in found}))
        raise ValueError(f"Pass one backup callback per fit, not {len(found)} ({names}).")
    return found[0] if found else None
