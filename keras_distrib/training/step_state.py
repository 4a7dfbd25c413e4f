"""What the model's mixins share, declared once and typed.

`DistributedModel` is made of four mixins (`StrategyAdoption`,
`ReplicaStep`, `GradientReduction`, `EntryPoints`). Besides Keras's own
attributes, what they share is:

* the model's strategy, `_strategy`, a `Strategy`: each mixin reaches it
  through that interface only (the type checker holds every call to it);
* one `StepState`, `_kd_state`: what the model keeps for its steps and its
  `fit` calls, made with the model (`DistributedTrainer._init_distribution`);
* two facts of a training step, read from those and the optimizer:
  `_accumulation_steps` and `_sums_sample_losses`.

`TrainerPart`, the mixins' common base, declares them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from keras_distrib import preemption
from keras_distrib.arithmetic.reduction_switch import ReductionSwitch
from keras_distrib.strategies.base import Strategy
from keras_distrib.training.fit_state import FitState


@dataclasses.dataclass(eq=False)
class StepState:
    """What a `DistributedModel` keeps for its steps and its `fit` calls.

    A plain object the model holds (`_kd_state`): neither Keras nor
    TensorFlow tracks or saves what it holds.

    Attributes:
        reduction_switch: on while the step applies the gradients it
            reduced; read by every optimizer the model adopts
            (`keras_distrib.arithmetic.reduction_switch`).
        jit_replicas: whether XLA compiles each replica's math separately
            (set by the strategy when it makes the step function, through
            `ReplicaStep.compile_replicas_separately`).
        jit_cache: those compiled functions, by function name and replica.
        vote: the stop vote the step's all-reduce carries, made by the
            first `fit` with several processes (`keras_distrib.preemption`).
        fit_state: the state of the `fit` call running now (`model.fit_state`),
            or None.
    """

    reduction_switch: ReductionSwitch = dataclasses.field(default_factory=ReductionSwitch)
    jit_replicas: bool = False
    jit_cache: dict[tuple[str, int], Callable[..., Any]] = dataclasses.field(default_factory=dict)
    vote: Optional[preemption.Vote] = None
    fit_state: Optional[FitState] = None


class TrainerPart:
    """The base of `DistributedModel`'s mixins: what they share (see module doc)."""

    # The model's: its strategy and state (`_init_distribution`), and Keras's
    # optimizer.
    _strategy: Strategy
    _kd_state: StepState
    optimizer: Any

    @property
    def _accumulation_steps(self) -> int:
        """Batches whose gradients one update applies (the optimizer's
        `backward_passes_per_step`: `keras_distrib.optimizers.DistributedOptimizer`)."""
        steps: int = getattr(self.optimizer, "backward_passes_per_step", 1)
        return steps

    @property
    def _sums_sample_losses(self) -> bool:
        """Whether the step takes gradients of summed (not averaged)
        per-sample losses: what can be added across replicas and steps and
        divided by the sample count. With one replica and no accumulation
        the step is Keras's own."""
        return self._strategy.num_replicas > 1 or self._accumulation_steps > 1
