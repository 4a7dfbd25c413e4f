"""Pipeline parallelism without TensorFlow: stages and the order of work.

Pure Python, so it can be read, tested and reasoned about on its own:

* `partition`: cut a sequence of layers (by parameter count) into
  contiguous, balanced stages;
* `stage_orders`: for each stage, the order of its forward (`"F"`) and
  backward (`"B"`) passes over the micro-batches, for GPipe (all forwards,
  then all backwards; Huang et al. 2019, arXiv:1811.06965) or 1F1B (a few
  forwards to fill the pipeline, then one forward for one backward;
  PipeDream-Flush, Narayanan et al. 2021, arXiv:2006.09503);
* `peak_live_activations`: how many micro-batches' activations each stage
  holds at once under an order (stored by a forward, not yet consumed by
  its backward): GPipe holds all `m`, 1F1B at most `p - stage`;
* `emission_order`: one global order of all passes that respects both the
  data dependencies and every stage's order (what a builder of the step
  emits ops in), with the time step each pass runs at when every pass
  takes one unit;
* `bubble_fraction`: the idle share of an ideal pipeline, `(p-1)/(m+p-1)`.

Example:

```python
from keras_distrib.strategies.pipeline import schedule as ps
ps.partition([10, 0, 10, 10], 2)              # [0, 0, 0, 1]: stage per item
orders = ps.stage_orders("1f1b", num_micro_batches=8, num_stages=2)
ps.peak_live_activations(orders)             # [2, 1]
ps.peak_live_activations(ps.stage_orders("gpipe", 8, 2))   # [8, 8]
```
"""

from __future__ import annotations

from typing import Sequence

SCHEDULES = ("gpipe", "1f1b")

Pass = tuple[str, int]  # ("F" or "B", micro-batch index)


def partition(weights: Sequence[int], num_stages: int) -> list[int]:
    """Stage index of each item: contiguous stages, the largest as small as can be.

    Every stage gets at least one item. Among the cuts with the smallest
    largest stage, the one that puts the most weight early is chosen (a
    deterministic rule, so a model and its copy are cut the same way).

    Args:
        weights: non-negative weight (parameter count) of each item, in order.
        num_stages: how many stages, 1 <= num_stages <= len(weights).

    Raises:
        ValueError: more stages than items, or fewer than one stage.
    """
    n = len(weights)
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1.")
    if num_stages > n:
        raise ValueError(f"Cannot cut {n} layers into {num_stages} stages; use num_stages <= {n}.")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + int(w))
    inf = float("inf")
    # best[k][i]: smallest largest stage when the first i items form k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                # `>=`: on ties the latest cut wins (most weight early).
                if cost <= best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    stages, end = [0] * n, n
    for k in range(num_stages, 0, -1):
        start = cut[k][end]
        for i in range(start, end):
            stages[i] = k - 1
        end = start
    return stages


def stage_orders(schedule: str, num_micro_batches: int, num_stages: int) -> list[list[Pass]]:
    """Each stage's passes in the order it runs them.

    Args:
        schedule: `"gpipe"` or `"1f1b"`.
        num_micro_batches: `m`, micro-batches per step (>= 1).
        num_stages: `p`, pipeline stages (>= 1).

    Raises:
        ValueError: an unknown schedule.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown schedule {schedule!r}; use one of {list(SCHEDULES)}.")
    m, p = num_micro_batches, num_stages
    orders = []
    for stage in range(p):
        if schedule == "gpipe":
            orders.append([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            continue
        # 1F1B: stage s runs p - s - 1 forwards ahead (the micro-batches
        # still on their way to the last stage), then alternates.
        warmup = min(p - stage - 1, m)
        order = [("F", i) for i in range(warmup)]
        forward, backward = warmup, 0
        while backward < m:
            if forward < m:
                order.append(("F", forward))
                forward += 1
            order.append(("B", backward))
            backward += 1
        orders.append(order)
    return orders


def peak_live_activations(orders: Sequence[Sequence[Pass]]) -> list[int]:
    """Per stage, the most micro-batches whose forward ran and backward has not."""
    peaks = []
    for order in orders:
        live = peak = 0
        for kind, _ in order:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def emission_order(orders: Sequence[Sequence[Pass]]) -> list[tuple[int, int, str, int]]:
    """All passes as `(time, stage, kind, micro_batch)`, in time order.

    Simulates the pipeline with every pass taking one time unit: at each
    time step each stage runs its next pass if its inputs are ready (the
    forward of the same micro-batch on the stage before; for a backward, its
    own forward and the backward on the stage after). Building the passes in
    this order never uses a value before it exists.

    Raises:
        RuntimeError: the orders deadlock (a stage waits for a pass that
            waits for it), which no order from `stage_orders` does.
    """
    p = len(orders)
    done: set[tuple[int, str, int]] = set()
    position = [0] * p
    emitted, time = [], 0
    while any(position[s] < len(orders[s]) for s in range(p)):
        ready = []
        for s in range(p):
            if position[s] == len(orders[s]):
                continue
            kind, i = orders[s][position[s]]
            if kind == "F":
                inputs = [] if s == 0 else [(s - 1, "F", i)]
            else:
                inputs = [(s, "F", i)] + ([] if s == p - 1 else [(s + 1, "B", i)])
            if all(d in done for d in inputs):
                ready.append((s, kind, i))
        if not ready:
            raise RuntimeError(f"Pipeline orders deadlock at time {time}: {orders}")
        for s, kind, i in ready:
            emitted.append((time, s, kind, i))
            done.add((s, kind, i))
            position[s] += 1
        time += 1
    return emitted


def bubble_fraction(num_micro_batches: int, num_stages: int) -> float:
    """Idle share of each device in an ideal pipeline: `(p-1)/(m+p-1)`."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)
