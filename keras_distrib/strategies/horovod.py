"""`"horovod"`: data parallelism over Horovod collectives, one replica per process.

The collectives are the transport
`keras_distrib.collectives.horovod_collectives` (the low-level
`horovod.tensorflow` ops, each named by its place in the step); this module
imports Horovod when the strategy is made, and says in one line what to do
when it cannot. Keras itself sees the default `tf.distribute` strategy:
nothing of `tf.distribute` replicates here.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from keras_distrib import devices as devices_lib
from keras_distrib.collectives import registry as transports
from keras_distrib.strategies.base import Capabilities
from keras_distrib.strategies.per_process import PerProcessStrategy
from keras_distrib.arithmetic import optimizer_sharding as sharding_option

NOT_INSTALLED = (
    "{who} needs Horovod, which is not installed; build it with "
    "`scripts/install_horovod.sh .venv` (Horovod 0.28.1 against TF 2.21)"
)


class HorovodUnavailableError(ImportError, ValueError):
    """Horovod (or its TensorFlow extension) cannot be imported here.

    Both an `ImportError` (what it is) and a `ValueError` (what
    `keras_distrib.strategies.get` raises for unusable strategies).
    """


class Horovod(PerProcessStrategy):
    """Synchronous data parallelism on Horovod's collectives (Gloo, MPI, NCCL).

    One replica per process: start one process per device with `horovodrun`
    (or `keras-distrib launch --backend horovod -n N script.py`). Each
    process trains on its rows of every global batch; gradients of the
    per-process sum of losses are summed across processes together with the
    sample counts in one grouped all-reduce per dtype, so the update equals
    one device's with the global batch. Rank 0's initial weights and
    optimizer state are broadcast to all ranks when the model is first built
    for `fit`/`evaluate`/`predict` (and again whenever its set of variables
    grows, e.g. when the optimizer is built).

    Epoch, validation and `evaluate` metrics are exact: read with every
    metric variable summed over the ranks, they are what one device reports
    for the global batches, also when the ranks' shares differ (Horovod's
    `MetricAverageCallback` averages each rank's value instead, which is
    exact only for equal shares). Per-batch logs are this rank's own.

    Works without `horovodrun` too, as a single process (size 1).

    Args:
        device: Device this process's replica runs on. Default: GPU number
            `hvd.local_rank()` (modulo the visible GPUs) when there are GPUs,
            else the CPU. With GPUs, make each process see only its own GPU
            (`CUDA_VISIBLE_DEVICES` or `tf.config.set_visible_devices`) so
            TensorFlow does not take memory on the others.
        optimizer_sharding: None (every rank keeps the optimizer's slots for
            every variable), `"optimizer"` (ZeRO stage 1: each keeps them
            for 1/N of each variable) or `"gradients"` (stage 2: and
            receives only that part's reduced gradients, by Horovod's
            `reducescatter`); see `keras_distrib.arithmetic.optimizer_shards`.

    Example:

    ```python
    # horovodrun -np 2 -H localhost:2 --gloo python train.py
    # or: keras-distrib launch --backend horovod -n 2 train.py
    model = keras_distrib.DistributedModel(inputs, outputs, strategy="horovod")
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=64)  # global batch, split over the ranks
    ```
    """

    name = "horovod"
    aliases = ("hvd",)
    capabilities = Capabilities(one_per_process=True)
    description = "Data parallelism over Horovod collectives (Gloo on CPU, NCCL on GPU, MPI)."

    def __init__(self, device: Optional[str] = None, optimizer_sharding: Optional[str] = None):
        self.optimizer_sharding = sharding_option.check(self.name, optimizer_sharding)
        hvd = import_horovod()
        transport = transports.create("horovod", hvd=hvd)  # initializes Horovod
        local_rank = int(hvd.local_rank())
        if device is None:
            gpus = tf.config.list_physical_devices("GPU")
            device = devices_lib.normalize(f"/gpu:{local_rank % len(gpus)}" if gpus else "/cpu:0")
        else:
            device = devices_lib.check_device(device)
        super().__init__(
            device,
            rank=int(hvd.rank()),
            size=int(hvd.size()),
            local_rank=local_rank,
            transport=transport,
        )

    def sync_initial_state(self, model) -> None:
        """Broadcasts rank 0's weights and optimizer state to every rank
        (`broadcast_model_state`: after every build, when they changed)."""
        self.broadcast_model_state(model)

    def read_metrics(self, model, read):
        """Epoch and evaluate metrics (read eagerly) summed over ranks
        (`read_summed_metrics`). Per-batch logs (read inside the step) are
        this rank's own: summing them would add a collective to every step."""
        if self.world_size == 1 or not tf.executing_eagerly():
            return super().read_metrics(model, read)
        return self.read_summed_metrics(model, read)


def import_horovod(who: str = "strategy 'horovod'"):
    """`horovod.tensorflow`, or a one-line `HorovodUnavailableError`
    saying that `who` needs it."""
    try:
        import horovod.tensorflow as hvd
    except ModuleNotFoundError as e:
        if e.name in ("horovod", "horovod.tensorflow"):
            raise HorovodUnavailableError(NOT_INSTALLED.format(who=who)) from None
        raise HorovodUnavailableError(_broken(e, who)) from None
    except (ImportError, tf.errors.NotFoundError, OSError) as e:
        # Installed, but built without TensorFlow or against another TF.
        raise HorovodUnavailableError(_broken(e, who)) from None
    return hvd


def _broken(error: Exception, who: str) -> str:
    cause = " ".join(str(error).split())[:300]
    return (
        f"{who} found Horovod but cannot load horovod.tensorflow "
        f"({type(error).__name__}: {cause}); rebuild it against this TensorFlow "
        "with `scripts/install_horovod.sh .venv`"
    )
