"""`ReplicaConsistencyCheck`: stop when replicas go non-finite or apart."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import keras
import numpy as np

from keras_distrib.callbacks import _common
from keras_distrib.strategies.base import Strategy

# Per local replica: [non-finite flag, sum, sum of squares].
_PER_REPLICA = 3
# Per process, before the replicas: [first global replica, loss non-finite,
# number of local replicas].
_HEADER = 3


class ReplicaDivergenceError(RuntimeError):
    """Training state is non-finite or replicas no longer hold equal weights."""


class ReplicaConsistencyCheck(keras.callbacks.Callback):  # type: ignore[misc]  # Keras has no types
    """Every `every_n_steps` training steps, checks that training is sound.

    Three checks, over all replicas of all processes:

    1. the batch loss in the logs is finite on every process;
    2. every trainable weight is finite on every local replica;
    3. replicas have not drifted apart: each replica's checksum of its
       trainable weights (float64 sum and sum of squares) equals global
       replica 0's within `atol` (only checked when all weights are finite).

    Each process's findings travel in one collective, so every process
    reaches the same verdict at the same step and all raise
    `ReplicaDivergenceError` together (a process raising alone would leave
    the others hanging in the next collective). The message is one line
    naming the step (training steps counted over this callback's `fit`
    calls) and what was wrong where, e.g.
    `step 40: replica 1 (rank 1) weights differ from replica 0 (rank 0): ...`.

    It is a collective: every process must run it.

    Args:
        every_n_steps: Check after every this many training steps.
        atol: Largest difference of checksums still taken as equal.

    Example:

    ```python
    model.fit(x, y, callbacks=[
        keras_distrib.callbacks.ReplicaConsistencyCheck(every_n_steps=100)])
    ```
    """

    def __init__(self, every_n_steps: int = 100, atol: float = 0.0):
        super().__init__()
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps!r} must be an int >= 1.")
        if atol < 0:
            raise ValueError(f"atol={atol!r} must be >= 0.")
        self.every_n_steps = every_n_steps
        self.atol = atol
        self._counter = _common.StepCounter()

    @property
    def step(self) -> int:
        """Training steps seen so far."""
        return self._counter.total

    def on_train_begin(self, logs: _common.Logs = None) -> None:
        self._strategy = _common.strategy_of(self)

    def on_epoch_begin(self, epoch: int, logs: _common.Logs = None) -> None:
        self._counter.new_epoch()

    def on_train_batch_end(self, batch: int, logs: _common.Logs = None) -> None:
        before = self._counter.total
        self._counter.advance(batch)
        if self._counter.total // self.every_n_steps > before // self.every_n_steps:
            self.check((logs or {}).get("loss"))

    def check(self, loss: Any = None) -> None:
        """Runs the checks now (on every process); raises on a finding."""
        strategy = self._strategy
        mine = self._local_findings(strategy, loss)
        gathered = strategy.sync_gather(mine)
        message = verdict(gathered, self.step, self.atol)
        if message:
            raise ReplicaDivergenceError(message)

    def _local_findings(self, strategy: Strategy, loss: Any) -> np.ndarray:
        loss_bad = loss is not None and not np.all(np.isfinite(np.asarray(loss, np.float64)))
        replicas: Optional[list[list[float]]] = None
        for variable in self.model.trainable_variables:
            copies = strategy.local_replica_values(variable)
            if replicas is None:
                replicas = [[0.0, 0.0, 0.0] for _ in copies]
            for stats, copy in zip(replicas, copies):
                values = np.asarray(copy, np.float64)
                stats[0] = max(stats[0], float(not np.all(np.isfinite(values))))
                stats[1] += float(values.sum())
                stats[2] += float(np.square(values).sum())
        if replicas is None:
            replicas = [[0.0, 0.0, 0.0] for _ in range(strategy.num_local_replicas)]
        header = [strategy.first_local_replica, float(loss_bad), len(replicas)]
        return np.array(header + [x for stats in replicas for x in stats], np.float64)


def verdict(gathered: np.ndarray, step: int, atol: float) -> Optional[str]:
    """The one-line finding from every process's row, or None if all is well.

    `gathered[r]` is process r's row as `_local_findings` builds it.
    """
    bad_loss = [rank for rank, row in enumerate(gathered) if row[1]]
    # (global index, rank, non-finite, sum, sum of squares)
    replicas: list[tuple[int, int, bool, float, float]] = []
    for rank, row in enumerate(gathered):
        first, count = int(row[0]), int(row[2])
        stats = row[_HEADER : _HEADER + _PER_REPLICA * count].reshape(count, _PER_REPLICA)
        for i, (nonfinite, total, squares) in enumerate(stats):
            replicas.append((first + i, rank, bool(nonfinite), total, squares))
    replicas.sort()

    findings: list[str] = []
    if bad_loss:
        findings.append(f"non-finite loss on {_ranks(bad_loss)}")
    nonfinite = [(g, r) for g, r, bad, _, _ in replicas if bad]
    if nonfinite:
        findings.append(f"non-finite weights on {_replicas(nonfinite)}")
    elif replicas:
        ref = replicas[0]
        apart = [
            rep
            for rep in replicas[1:]
            if abs(rep[3] - ref[3]) > atol or abs(rep[4] - ref[4]) > atol
        ]
        if apart:
            one = apart[0]
            findings.append(
                f"{_replicas([(g, r) for g, r, *_ in apart])} weights differ from replica "
                f"{ref[0]} (rank {ref[1]}): checksum (sum, sum of squares) "
                f"({one[3]:.9g}, {one[4]:.9g}) vs ({ref[3]:.9g}, {ref[4]:.9g})"
            )
    if not findings:
        return None
    return f"step {step}: " + "; ".join(findings)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(f"rank {r}" for r in ranks)


def _replicas(pairs: Sequence[tuple[int, int]]) -> str:
    word = "replica" if len(pairs) == 1 else "replicas"
    return f"{word} " + ", ".join(f"{g} (rank {r})" for g, r in pairs)
