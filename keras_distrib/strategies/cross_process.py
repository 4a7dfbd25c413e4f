"""The strategy's cross-process helpers: eager collectives between steps.

Callbacks, metric reads and the initial broadcast call them on every
process, in the same order on all of them; each carries many values in one
collective. `CrossProcessHelpers` builds them all on the strategy's
transport (`Transport.sum_over_processes`, one elementwise sum of a 1-D
array per process, and `Transport.broadcast`) and on one method a strategy
implements, `local_replica_values`. `Strategy` inherits them, so they are
part of its interface; this module holds them apart from the interface's
in-step methods, with what a layer keeps besides its variables (adapted
vocabularies and statistics), which travels with them.
"""

from __future__ import annotations

import abc
import json
import os
import tempfile
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from keras_distrib.collectives import flight_recorder

if TYPE_CHECKING:
    from keras_distrib.collectives.transport import Transport


class CrossProcessHelpers(abc.ABC):
    """Collectives across processes, eager, for use between steps.

    Uses the strategy's `world_size`, `rank` and `is_chief` (`Strategy`'s
    topology properties) and its `transport`.
    """

    if TYPE_CHECKING:  # `Strategy`'s transport and topology properties, which these use
        transport: Transport

        @property
        def world_size(self) -> int: ...

        @property
        def rank(self) -> int: ...

        @property
        def is_chief(self) -> bool: ...

    @abc.abstractmethod
    def local_replica_values(self, variable: Any) -> list[np.ndarray]:
        """This process's copies of `variable`, one per local replica."""

    def local_replica_variables(self, variable: Any) -> list[Any]:
        """The variables holding `local_replica_values(variable)`, to assign
        each its own value (one, `variable`, with one replica per process)."""
        return [variable]

    def sync_sum(self, values: Sequence[Any]) -> list[np.ndarray]:
        """Elementwise sums over processes of one value per process (eager).

        All values travel in one collective. With one process this is the
        identity.
        """
        arrays = [np.asarray(v) for v in values]
        if self.world_size == 1:
            return arrays
        dtype = np.result_type(*arrays) if arrays else np.float64
        flat = np.concatenate([a.astype(dtype).ravel() for a in arrays])
        with flight_recorder.in_collective("an eager sum over processes", flat.nbytes):
            summed = np.asarray(self.transport.sum_over_processes(flat))
        out, start = [], 0
        for a in arrays:
            out.append(summed[start : start + a.size].reshape(a.shape).astype(a.dtype))
            start += a.size
        return out

    def sync_gather(self, value: Any) -> np.ndarray:
        """Stacks one value per process into `[world_size, ...]` (eager)."""
        value = np.asarray(value)
        slots = np.zeros((self.world_size, *value.shape), value.dtype)
        slots[self.rank] = value
        return self.sync_sum([slots])[0]

    def broadcast_variables(self, variables: Sequence[Any], root: int = 0) -> None:
        """Gives every process `root`'s values of `variables` (eager): by the
        transport's broadcast where it has one, else as sums."""
        if self.world_size == 1 or not variables:
            return
        variables = self.transport.broadcast(list(variables), root)
        if not variables:
            return
        mine = [
            np.asarray(v) if self.rank == root else np.zeros(v.shape, np_dtype(v))
            for v in variables
        ]
        for variable, value in zip(variables, self.sync_sum(mine)):
            variable.assign(value)

    def broadcast_derived_state(self, model: Any, root: int = 0) -> None:
        """Called once `model`'s variables hold `root`'s values: what its
        layers keep besides variables comes from `root` too, then they
        reload (`reload_derived_state`).

        An adapted vocabulary (`StringLookup`, `TextVectorization`) is an
        asset, not a variable. Workers that each adapted on their own data
        can hold different vocabularies of one size, which no shape check
        sees: a token would have other ids on other workers. Each such
        layer's asset files travel from `root` (two collectives) and load.
        """
        if self.world_size > 1:
            for layer in _layer_tree(model):
                if _has_assets(layer):
                    self._broadcast_assets(layer, root)
        reload_derived_state(model)

    def _broadcast_assets(self, layer: Any, root: int) -> None:
        payload = json.dumps(_asset_files(layer)).encode() if self.rank == root else b""
        (size,) = self.sync_sum([np.int64(len(payload))])
        mine = np.zeros(int(size), np.int32)
        if self.rank == root:
            mine[:] = np.frombuffer(payload, np.uint8)
        (received,) = self.sync_sum([mine])
        if self.rank != root:
            _load_asset_files(layer, json.loads(received.astype(np.uint8).tobytes()))

    def broadcast_model_state(self, model: Any) -> None:
        """Gives every process process 0's weights and optimizer state (eager).

        For engines that do not broadcast when variables are created
        (Horovod, hybrid), from their `sync_initial_state`: it runs after
        every build for fit/evaluate/predict, and the broadcast happens only
        when the model's variables differ from those broadcast last time
        (the first call, and when the optimizer has been built since).
        """
        variables = list(model.variables)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and getattr(optimizer, "built", False):
            known = {id(v) for v in variables}
            variables += [v for v in optimizer.variables if id(v) not in known]
        key = tuple(id(v) for v in variables)
        memo = self.__dict__.setdefault("_broadcast_for", weakref.WeakKeyDictionary())
        try:
            if memo.get(model) == key:
                return
        except TypeError:  # not weak-referenceable: broadcast every time
            pass
        self.broadcast_variables(variables, root=0)
        self.broadcast_derived_state(model)
        try:
            memo[model] = key
        except TypeError:
            pass

    def agree_on_seed(self, seed: Optional[int] = None) -> int:
        """A seed every process agrees on: the chief's.

        Unless given, the chief draws it from TensorFlow's random state, so
        `keras.utils.set_random_seed(...)` makes it (and the shuffles it
        seeds) the same from run to run, as in plain Keras; it is random
        otherwise.
        """
        if seed is None:
            seed = int(tf.random.uniform([], 0, 2**31 - 1, dtype=tf.int64))
        return int(self.sync_sum([np.int64(seed if self.is_chief else 0)])[0])

    def read_summed_metrics(self, model: Any, read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """`read()` while every metric variable of `model` holds its sum over
        the processes (one collective, eager): what one device reports for
        all their samples, since metric states are sums (totals and counts,
        confusion counts).

        A variable declaring another tf.distribute `aggregation` (Keras's
        `Metric.add_variable(..., aggregation=...)`) is read as such: "mean"
        its mean over the processes, "only_first_replica" worker 0's value
        (on every worker, so that callbacks decide alike), "none" this
        process's own. Keras reads the sums through a `keras.StatelessScope`,
        so the variables keep this process's values, to which its next steps
        add; results are taken inside it (a `result()` may return its
        variable itself).
        """
        variables = [v for metric in model.metrics for v in metric.variables]
        local = [np.asarray(v) for v in variables]
        kinds = [_aggregation(v) for v in variables]
        sent = [
            np.zeros_like(value) if kind == "only_first_replica" and self.rank != 0 else value
            for value, kind in zip(local, kinds)
        ]
        summed = []
        for variable, value, kind, total in zip(variables, local, kinds, self.sync_sum(sent)):
            if kind == "mean":
                total = (total / self.world_size).astype(value.dtype)
            if kind != "none":
                summed.append((variable, total))
        with keras.StatelessScope(state_mapping=summed):
            return {name: _read_now(value) for name, value in read().items()}


def reload_derived_state(model: Any) -> None:
    """After `model`'s variables were assigned directly (a broadcast of
    process 0's values), has each layer that derives state from them
    reload them through Keras's hook, as loading a file does: an adapted
    `Normalization` then normalizes with the values its variables now hold,
    not with those it computed from its own `adapt`."""
    for layer in _layer_tree(model):
        if _has_derived_state(layer):
            _load_own_variables(layer, layer)


def _load_own_variables(layer: Any, source: Any) -> None:
    """`layer.load_own_variables` of what `source.save_own_variables` gives."""
    store: dict[str, Any] = {}
    source.save_own_variables(store)
    layer.load_own_variables(store)


def _asset_files(layer: Any) -> dict[str, str]:
    """The files `layer.save_assets` writes, name -> content (latin-1 text)."""
    with tempfile.TemporaryDirectory(prefix="kd-assets-") as directory:
        layer.save_assets(directory)
        files = {}
        for name in sorted(os.listdir(directory)):
            with open(os.path.join(directory, name), "rb") as f:
                files[name] = f.read().decode("latin-1")
        return files


def _load_asset_files(layer: Any, files: dict[str, str]) -> None:
    """`layer.load_assets` of a directory holding `files` (`_asset_files`)."""
    with tempfile.TemporaryDirectory(prefix="kd-assets-") as directory:
        for name, content in files.items():
            with open(os.path.join(directory, name), "wb") as f:
                f.write(content.encode("latin-1"))
        layer.load_assets(directory)


def _layer_tree(layer: Any) -> list[Any]:
    # Not at import: keras_distrib sets up TensorFlow before Keras loads.
    from keras_distrib import _compat

    return [layer, *_compat.all_layers(layer)]


def _has_derived_state(layer: Any) -> bool:
    """Keras's adaptable preprocessing layers (`Normalization`,
    `Discretization`, `StringLookup`, `TextVectorization`, ...)."""
    return hasattr(layer, "finalize_state") or _has_assets(layer)


def _has_assets(layer: Any) -> bool:
    """Whether `layer` keeps files besides its variables (a vocabulary)."""
    return hasattr(layer, "save_assets") and hasattr(layer, "load_assets")


def np_dtype(variable: Any) -> np.dtype[Any]:
    dtype: np.dtype[Any] = np.dtype(getattr(variable.dtype, "as_numpy_dtype", variable.dtype))
    return dtype


def _aggregation(variable: Any) -> str:
    """A variable's tf.distribute aggregation, as Keras names it ("sum",
    "mean", "only_first_replica", "none"); Keras's and TensorFlow's
    variables both say."""
    kind = getattr(variable, "aggregation", "sum")
    return str(getattr(kind, "name", kind)).lower()


def _read_now(value: Any) -> Any:
    """`value`, or a variable's current value (a tensor) if it is one."""
    if hasattr(value, "assign_add"):  # a Keras or TensorFlow variable
        return tf.convert_to_tensor(value)
    return value
