"""`"tpu"`: the TPU cores of one TPU host or pod slice (`tf.distribute.TPUStrategy`).

Which TensorFlow can run it: TPUs need a TensorFlow build with TPU support
(`tensorflow-tpu` / libtpu). The last such build is TensorFlow 2.20;
TensorFlow 2.21, which this package is tested on, has none, so on 2.21 this
strategy fails at creation with one line saying so. On a TPU VM with
TensorFlow <= 2.20 (outside this package's tested range: importing it
there warns) the code paths below are those of every tf.distribute
strategy, but they have not been run on a TPU by this project's tests; only
the error and the input checks are tested here.

What the step needs on a TPU, and how this strategy provides it:

* XLA compiles the whole step, so shapes must be static: array input must
  split into whole batches, and `tf.data` input must be batched with
  `drop_remainder=True` (checked with a one-line error, never trimmed
  silently);
* no Python inside the step: the per-replica math is pure TensorFlow, and
  no `tf.numpy_function` collective (such as the shared-memory all-reduce of
  `multi_worker`) is used.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import tensorflow as tf

from keras_distrib.strategies.tf_distribute import TFDistributeStrategy


class TPUUnavailableError(ValueError):
    """No TPU can be reached from here; the message says what is needed."""


class TPU(TFDistributeStrategy):
    """Synchronous data parallelism over TPU cores.

    Args:
        tpu: The TPU's name or gRPC address, as `TPUClusterResolver` takes
            it (`None`: the TPU of this TPU VM, from the environment;
            `"local"`: the TPU attached to this host).

    Example:

    ```python
    model = keras_distrib.DistributedModel(inputs, outputs,
        strategy=keras_distrib.strategies.get("tpu", tpu="local"))
    model.fit(dataset.batch(1024, drop_remainder=True), epochs=3)
    ```
    """

    name = "tpu"
    aliases = ("tpu_strategy",)
    capabilities = dataclasses.replace(TFDistributeStrategy.capabilities, one_per_process=True)
    description = "TPU cores via TPUClusterResolver (needs a TensorFlow build with TPU support)."

    def __init__(self, tpu: Optional[str] = None):
        try:
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
            tf.config.experimental_connect_to_cluster(resolver)
            tf.tpu.experimental.initialize_tpu_system(resolver)
        except (ValueError, tf.errors.OpError, RuntimeError) as e:
            cause = " ".join(str(e).split())[:160]
            raise TPUUnavailableError(
                f"strategy 'tpu' found no TPU (tpu={tpu!r}: {cause}); it needs a TPU VM or "
                f"TPU host and a TensorFlow build with TPU support (tensorflow-tpu, last "
                f"released for TensorFlow 2.20; this is TensorFlow {tf.__version__}), so use "
                "'mirrored' or 'multi_worker' here."
            ) from None
        engine = tf.distribute.TPUStrategy(resolver)
        super().__init__(engine, num_processes=1, process_index=0)

    def distribute_fit_input(self, fit):
        check_static_batches(fit.x, fit.batch_size)
        if fit.validation_data is not None:
            check_static_batches(fit.validation_data, fit.validation_batch_size or fit.batch_size)
        return super().distribute_fit_input(fit)

    def distribute_input(self, x, y=None, sample_weight=None, batch_size=None):
        check_static_batches(x, batch_size)
        return super().distribute_input(x, y, sample_weight, batch_size)


def check_static_batches(x, batch_size: Optional[int]) -> None:
    """One-line error unless every batch of `x` has the same, static size.

    XLA on TPUs compiles the step for one batch shape; a last partial batch
    would need a second program (and TPUStrategy refuses dynamic shapes).

    Raises:
        ValueError: arrays whose length is not a multiple of `batch_size`, or
            a `tf.data.Dataset` whose batch dimension is not static.
    """
    if isinstance(x, tf.data.Dataset):
        leaves = tf.nest.flatten(x.element_spec)
        if any(spec.shape.rank and spec.shape[0] is None for spec in leaves):
            raise ValueError(
                "strategy 'tpu' needs static batch shapes, but this tf.data.Dataset's "
                "batch dimension is unknown; batch it with "
                ".batch(global_batch_size, drop_remainder=True)."
            )
        return
    if isinstance(x, tuple) and len(x) in (2, 3):  # validation_data=(x, y[, w])
        x = x[0]
    leaves = [t for t in tf.nest.flatten(x) if hasattr(t, "shape")]
    if not leaves:
        return
    n, batch = int(leaves[0].shape[0]), batch_size or 32
    if n % batch:
        raise ValueError(
            f"strategy 'tpu' needs static batch shapes, but {n} samples leave a last "
            f"batch of {n % batch} with batch_size={batch}; use a batch size that divides "
            f"{n}, or pass a tf.data.Dataset batched with drop_remainder=True (which "
            f"skips {n % batch} samples per epoch)."
        )
