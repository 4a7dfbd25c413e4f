"""`DistributedOptimizer`: gradient compression and accumulation for any strategy.

Like Horovod's, the wrapper is an instance of a subclass of the wrapped
optimizer's own class, with the same name and module: a model saved with it
records a plain `SGD`/`Adam`/... and loads (for inference, or to keep
training without the wrapper) without `keras_distrib`. Compression and
accumulation are not saved; wrap again after loading to keep them.

Where the work happens: `DistributedModel.reduce_gradients` asks the
optimizer's `compression` to cast gradients down before the all-reduce and
back after, and `DistributedModel`'s train step accumulates local gradients
in the optimizer for `backward_passes_per_step` steps and all-reduces and
applies them once (so accumulation also saves communication).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import keras
import tensorflow as tf

from keras_distrib.arithmetic.compression import COMPRESSIONS, Compression

__all__ = ["DistributedOptimizer", "Compression"]


def DistributedOptimizer(  # noqa: N802 (reads as a class, like Horovod's)
    optimizer: Union[str, keras.optimizers.Optimizer],
    compression: str = "none",
    backward_passes_per_step: int = 1,
) -> keras.optimizers.Optimizer:
    """Wraps a Keras 3 optimizer for distributed training.

    Args:
        optimizer: A Keras optimizer (or its name). Its configuration is
            copied; the returned object is the one to pass to `compile`.
        compression: `"none"`, `"fp16"` or `"bf16"`: the dtype gradients
            travel in during the all-reduce (cast back after). fp16 has a
            narrow range (max 65504): gradients of the summed per-sample
            losses of a large batch can overflow it; bf16 cannot overflow.
        backward_passes_per_step: Apply once every k training steps, with the
            average gradient of the k batches (k steps of batch B == one step
            of batch k*B). The all-reduce also runs once every k steps.

    Returns:
        An optimizer of a subclass of the wrapped optimizer's class.

    Example:

    ```python
    optimizer = keras_distrib.optimizers.DistributedOptimizer(
        keras.optimizers.SGD(0.1), compression="bf16", backward_passes_per_step=4)
    model.compile(optimizer=optimizer, loss="mse")
    ```
    """
    if compression not in COMPRESSIONS:
        raise ValueError(f"Unknown compression={compression!r}; use one of {sorted(COMPRESSIONS)}.")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(
            f"backward_passes_per_step={backward_passes_per_step!r} must be an int >= 1."
        )
    optimizer = keras.optimizers.get(optimizer)
    if optimizer.built:
        raise ValueError(
            "The optimizer to wrap has already been used; wrap a new one "
            "(its state would not carry over)."
        )
    base = type(optimizer)
    if issubclass(base, _Distributed):
        base = base._kd_wrapped
    cls: type[Any] = type(
        base.__name__,
        (_Distributed, base),
        {
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "_kd_wrapped": base,
            "compression": COMPRESSIONS[compression],
            "backward_passes_per_step": backward_passes_per_step,
        },
    )
    return cls.from_config(optimizer.get_config())


class _Distributed:
    """Mixed into the wrapped optimizer's class by `DistributedOptimizer`."""

    _kd_wrapped: type
    compression: Compression = COMPRESSIONS["none"]
    backward_passes_per_step: int = 1
    # Made by `build` when accumulating: per-replica sums of local gradients
    # and of sample counts (`tf.Variable`s).
    _kd_accumulators: list[tf.Variable]
    _kd_samples: tf.Variable

    def build(self, variables: Sequence[Any]) -> None:
        # The wrapped optimizer's, next after this class in the class
        # `DistributedOptimizer` makes.
        super().build(variables)  # type: ignore[misc]  # not this mixin's base class
        if self.backward_passes_per_step > 1:
            # Per-replica (sync-on-read) sums of local gradients: each replica
            # accumulates its own until the step that all-reduces them. Kept
            # out of the optimizer's tracked variables so saved files stay
            # those of the plain optimizer.
            def local_zeros(shape: Any, dtype: Any, name: str) -> tf.Variable:
                return tf.Variable(
                    tf.zeros(shape, dtype),
                    trainable=False,
                    name=name,
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.SUM,
                )

            accumulators = [
                local_zeros(v.shape, v.dtype, f"accumulated_{i}") for i, v in enumerate(variables)
            ]
            object.__setattr__(self, "_kd_accumulators", accumulators)
            object.__setattr__(
                self, "_kd_samples", local_zeros([], tf.float32, "accumulated_samples")
            )

    def accumulate(self, gradients: Sequence[Optional[tf.Tensor]], num_samples: Any) -> None:
        """Adds one batch's local gradients (replica context)."""
        for accumulator, gradient in zip(self._kd_accumulators, gradients):
            if gradient is not None:
                accumulator.assign_add(tf.cast(gradient, accumulator.dtype))
        self._kd_samples.assign_add(tf.cast(num_samples, tf.float32))

    def take_accumulated(
        self, gradients: Sequence[Optional[tf.Tensor]]
    ) -> tuple[list[Optional[tf.Tensor]], tf.Tensor]:
        """Returns the accumulated local gradients and sample count; resets them."""
        taken: list[Optional[tf.Tensor]] = []
        for accumulator, gradient in zip(self._kd_accumulators, gradients):
            if gradient is None:
                taken.append(None)
                continue
            taken.append(tf.identity(accumulator.read_value()))
            accumulator.assign(tf.zeros_like(accumulator))
        samples = tf.identity(self._kd_samples.read_value())
        self._kd_samples.assign(0.0)
        return taken, samples
