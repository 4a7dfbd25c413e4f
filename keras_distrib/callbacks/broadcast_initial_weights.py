"""`BroadcastInitialWeights`: every process starts from `root`'s state."""

from __future__ import annotations

from typing import Any

import keras

from keras_distrib.callbacks import _common


class BroadcastInitialWeights(keras.callbacks.Callback):  # type: ignore[misc]  # Keras has no types
    """Copies the model's and the optimizer's variables from process `root`.

    Runs once per callback instance, at the start of the first `fit`, on
    every process (it is a collective: all processes must use it). The
    optimizer is built first if needed, so its state (step count, slots)
    starts equal too.

    Use it when processes may start from different states: weights loaded
    or changed on one process only, or an engine that does not broadcast
    initial values itself. With one process it does nothing (replicas that
    one process mirrors are equal already).

    Args:
        root: Rank of the process whose values everyone takes.

    Example:

    ```python
    if model.strategy.is_chief:
        model.load_weights("pretrained.weights.h5")
    model.fit(x, y, callbacks=[keras_distrib.callbacks.BroadcastInitialWeights(root=0)])
    ```
    """

    def __init__(self, root: int = 0):
        super().__init__()
        if not isinstance(root, int) or root < 0:
            raise ValueError(f"root={root!r} must be a rank (an int >= 0).")
        self.root = root
        self.broadcast_done = False

    def on_train_begin(self, logs: _common.Logs = None) -> None:
        if self.broadcast_done:
            return
        strategy = _common.strategy_of(self)
        self.broadcast_done = True
        if strategy.world_size == 1:
            return
        if self.root >= strategy.world_size:
            raise ValueError(
                f"root={self.root} is not a rank of this job (world_size={strategy.world_size})."
            )
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            with strategy.scope():
                optimizer.build(self.model.trainable_variables)
        variables: list[Any] = []
        seen: set[int] = set()
        for variable in [*self.model.variables, *(optimizer.variables if optimizer else [])]:
            if id(variable) not in seen:
                seen.add(id(variable))
                variables.append(variable)
        strategy.broadcast_variables(variables, root=self.root)
        strategy.broadcast_derived_state(self.model, root=self.root)
