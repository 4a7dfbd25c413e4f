"""`"horovod"`: data parallelism over Horovod collectives, one replica per process.

`horovod.tensorflow.keras` does not work with Keras 3 (its broadcast callback
crashes and its `DistributedOptimizer` never averages; see docs/design.md 1.3, row
2), but the low-level `horovod.tensorflow` ops do. This strategy uses only
those: `grouped_allreduce` for the gradients (with the sample count riding
along, see `DistributedModel.reduce_gradients`), `allgather` for
predictions, `broadcast_variables` for the initial state, and one
`allreduce` of the metric variables when epoch or `evaluate` metrics are
read (`read_summed_metrics`). Keras itself sees the default
`tf.distribute` strategy: nothing of `tf.distribute` replicates here.

Horovod pairs the collectives of the ranks by name, and by default names a
traced one after its input tensor, whose name holds the Keras layer's
(`HorovodGroupedAllreduce_gradient_tape_functional_1_dense_1_...`). Keras
numbers layer and model names per process, so a rank that made one more
layer or model before (a chief-only summary model, a second model of a
sweep) named every collective differently, and all ranks waited for each
other for good, silently. Every collective traced here is named by its kind
and its position in the traced function instead (`_collective_name`), the
same on every rank whatever the Keras names; the broadcast of variables is
our own traced loop for the same reason (`horovod.tensorflow`'s
`broadcast_variables` names each broadcast after its variable).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf

from keras_distrib import devices as devices_lib
from keras_distrib.strategies.base import Capabilities
from keras_distrib.strategies.per_process import PerProcessStrategy
from keras_distrib.arithmetic import optimizer_sharding as sharding_option
from keras_distrib.arithmetic.gradients import reduce_op_name

NOT_INSTALLED = (
    "strategy 'horovod' needs Horovod, which is not installed; build it with "
    "`scripts/install_horovod.sh .venv` (Horovod 0.28.1 against TF 2.21)"
)

# Dtypes Horovod 0.28.1's TensorFlow allreduce kernels take (not bfloat16);
# others travel as a wider dtype and are cast back (see _wire_dtype).
_ALLREDUCE_DTYPES = {tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16, tf.float32, tf.float64}

# Traced graph -> the count of Horovod collectives named in it so far.
_NAMED: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


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
    description = (
        "Data parallelism over Horovod collectives (Gloo on CPU, NCCL on GPU, MPI)."
    )

    def __init__(self, device: Optional[str] = None, optimizer_sharding: Optional[str] = None):
        self.optimizer_sharding = sharding_option.check(self.name, optimizer_sharding)
        hvd = _import_horovod()
        hvd.init()
        self._hvd = hvd
        self._size = int(hvd.size())
        local_rank = int(hvd.local_rank())
        if device is None:
            gpus = tf.config.list_physical_devices("GPU")
            device = devices_lib.normalize(f"/gpu:{local_rank % len(gpus)}" if gpus else "/cpu:0")
        else:
            device = devices_lib.check_device(device)
        super().__init__(device, rank=int(hvd.rank()), size=self._size, local_rank=local_rank)

    # -- the step -----------------------------------------------------------

    def all_reduce(self, values: Any, op: str = "sum") -> Any:
        flat = tf.nest.flatten(values)
        reduced = _grouped_all_reduce(self._hvd, flat, self._hvd_op(op))
        return tf.nest.pack_sequence_as(values, reduced)

    def all_gather(self, value: Any) -> Any:
        return self._hvd.allgather(tf.convert_to_tensor(value)[None],
                                   name=_collective_name("allgather"), ignore_name_scope=True)

    def reduce_scatter(self, tables: Sequence[Any]) -> list:
        # One reducescatter of the tables side by side: Horovod splits the
        # first dimension over the ranks, so rank r gets row r of each.
        tables = [tf.convert_to_tensor(t) for t in tables]
        block = self._hvd.reducescatter(tf.concat(tables, axis=1), op=self._hvd.Sum,
                                        name=_collective_name("reducescatter"),
                                        ignore_name_scope=True)
        return tf.split(tf.reshape(block, [-1]), [int(t.shape[1]) for t in tables])

    def concat(self, per_replica: Any) -> Any:
        # Rank r holds rows [start_r, start_r + count_r) of every global batch
        # (keras_distrib.input.sharding), so rank order is the global batch order.
        def gather(value):
            value = tf.convert_to_tensor(value)
            if value.shape.rank == 0:
                value = tf.reshape(value, [1])
            return self._hvd.allgather(value, name=_collective_name("allgather"),
                                       ignore_name_scope=True)

        return tf.nest.map_structure(gather, per_replica)

    # -- between steps: eager collectives across processes ---------------------

    def _sum_over_processes(self, flat: np.ndarray) -> np.ndarray:
        flat = np.asarray(flat)
        wire = flat.dtype
        if tf.as_dtype(wire) not in _ALLREDUCE_DTYPES:
            wire = np.dtype(np.float64 if np.issubdtype(wire, np.floating) else np.int64)
        summed = self._hvd.allreduce(tf.constant(flat.astype(wire)), op=self._hvd.Sum)
        return np.asarray(summed).astype(flat.dtype)

    def broadcast_variables(self, variables: Sequence[Any], root: int = 0) -> None:
        variables = list(variables)
        if self._size == 1 or not variables:
            return
        # Horovod's broadcast traces a tf.function over the variables, which
        # needs TensorFlow variables (a Keras variable would be traced as a
        # tensor): use the one under each Keras variable.
        native, others = [], []
        for v in variables:
            tf_var = v if isinstance(v, tf.Variable) else getattr(v, "value", None)
            if isinstance(tf_var, tf.Variable) and tf_var.dtype in _ALLREDUCE_DTYPES:
                native.append(tf_var)
            else:
                others.append(v)
        if native:
            _broadcast_in_place(self._hvd, native, root)
        if others:  # e.g. bool: the generic (sum-based) path of the base class
            super().broadcast_variables(others, root)

    def sync_initial_state(self, model) -> None:
        """Broadcasts rank 0's weights and optimizer state to every rank
        (`broadcast_model_state`: after every build, when they changed)."""
        self.broadcast_model_state(model)

    def read_metrics(self, model, read):
        """Epoch and evaluate metrics (read eagerly) summed over ranks
        (`read_summed_metrics`). Per-batch logs (read inside the step) are
        this rank's own: summing them would add a collective to every step."""
        if self._size == 1 or not tf.executing_eagerly():
            return super().read_metrics(model, read)
        return self.read_summed_metrics(model, read)

    def _hvd_op(self, op: str):
        return {"sum": self._hvd.Sum, "mean": self._hvd.Average}[reduce_op_name(op)]


def _import_horovod():
    """`horovod.tensorflow`, or a one-line `HorovodUnavailableError`."""
    try:
        import horovod.tensorflow as hvd
    except ModuleNotFoundError as e:
        if e.name in ("horovod", "horovod.tensorflow"):
            raise HorovodUnavailableError(NOT_INSTALLED) from None
        raise HorovodUnavailableError(_broken(e)) from None
    except (ImportError, tf.errors.NotFoundError, OSError) as e:
        # Installed, but built without TensorFlow or against another TF.
        raise HorovodUnavailableError(_broken(e)) from None
    return hvd


def _broken(error: Exception) -> str:
    cause = " ".join(str(error).split())[:300]
    return (
        f"strategy 'horovod' found Horovod but cannot load horovod.tensorflow "
        f"({type(error).__name__}: {cause}); rebuild it against this TensorFlow "
        "with `scripts/install_horovod.sh .venv`"
    )


def _wire_dtype(dtype: tf.DType, kind: str) -> tf.DType:
    """The dtype `dtype` travels as: its own where Horovod takes it."""
    if kind == "mean" and not dtype.is_floating:
        return tf.float64
    if dtype in _ALLREDUCE_DTYPES:
        return dtype
    if dtype.is_floating:
        return tf.float32 if dtype == tf.bfloat16 else tf.float64
    return tf.int64  # bool (a sum is then a logical or), int16, uint16, ...


def _grouped_all_reduce(hvd, tensors: Sequence[Any], op) -> list:
    """`hvd.grouped_allreduce` over mixed dtypes, order kept.

    Horovod groups take one dtype: one group per (wire) dtype, in order of
    first appearance (the same on every rank). bfloat16 travels as float32;
    IndexedSlices are made dense (a sum of their gathered rows would need a
    different scaling downstream). Means travel as sums divided here:
    Horovod fuses only collectives of the same reduction, so a metric mean
    can share a cycle (and a buffer) with the gradient sum of the same step.
    """
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    kind = "mean" if op == hvd.Average else "sum"
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault(_wire_dtype(t.dtype, kind), []).append(i)
    out: list = [None] * len(tensors)
    for wire, indices in groups.items():
        sent = [tf.cast(tensors[i], wire) for i in indices]
        summed = hvd.grouped_allreduce(sent, op=hvd.Sum, name=_collective_name("sum"),
                                       ignore_name_scope=True)
        for i, got in zip(indices, summed):
            if kind == "mean":
                got = got / tf.cast(hvd.size(), wire)
            out[i] = tf.cast(got, tensors[i].dtype)
    return out


def _collective_name(kind: str) -> Optional[str]:
    """The name of a Horovod collective traced now: `kind` and its position
    among those traced into the same graph (None when eager: Horovod pairs
    eager collectives in the order they run).

    Tracing runs the same code on every rank, so the n-th collective of a
    step gets the same name everywhere, unlike a name taken from a tensor
    (which carries Keras's per-process layer numbering).
    """
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    counter = _NAMED.setdefault(graph, itertools.count())
    return f"kd_{kind}_{next(counter)}"


def _broadcast_in_place(hvd, variables: Sequence[tf.Variable], root: int) -> None:
    """Sets every variable to its value on rank `root`: one traced function,
    its broadcasts named by position (`_collective_name`)."""
    @tf.function(autograph=False)
    def broadcast():
        for variable in variables:
            variable.assign(hvd.broadcast(variable, root, name=_collective_name("broadcast"),
                                          ignore_name_scope=True))

    broadcast()
