"""One Dense / Embedding split over devices: its shards, and their whole values.

`SplitLayer.install` trades a built layer's whole variables for one shard
per device (created on that device), and installs itself on the layer
object: its `call` (the forward of `split_forward`), `get_weights` /
`set_weights`, and `save_own_variables` / `load_own_variables`, which
concatenate the shards into, and split them from, the whole values. So the
layer's config stays a plain Dense / Embedding and its files hold the
whole variables under their plain keys.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib import devices as devices_lib
from keras_distrib.strategies.tensor_parallel import layout as tensor_layout
from keras_distrib.strategies.tensor_parallel.split_forward import SplitForward

SAME_ARCHITECTURE = "pass the get_weights() of a model of the same architecture"


class SplitLayer(SplitForward):
    """One Dense / Embedding split over devices: its shards, their whole
    values and saving; its forward pass is `SplitForward`'s.

    Installed on the layer object itself (its `call`, `save_own_variables`
    and `load_own_variables`), so the layer's config stays a plain Dense /
    Embedding and its files hold the whole variables under their plain keys.
    """

    _BY_LAYER: "weakref.WeakKeyDictionary[Any, SplitLayer]" = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, layer) -> Optional["SplitLayer"]:
        try:
            return cls._BY_LAYER.get(layer)
        except TypeError:
            return None

    @classmethod
    def install(cls, layer, kind: str, devices: Sequence[str]) -> "SplitLayer":
        split = cls(layer, kind, devices)
        cls._BY_LAYER[layer] = split
        object.__setattr__(layer, "call", split.call)
        object.__setattr__(layer, "save_own_variables", split.save_own_variables)
        object.__setattr__(layer, "load_own_variables", split.load_own_variables)
        object.__setattr__(layer, "get_weights", split.whole_values)
        object.__setattr__(
            layer,
            "set_weights",
            functools.partial(
                split.assign_whole, where=f"layer {layer.name!r}", fix=SAME_ARCHITECTURE
            ),
        )
        return split

    def __init__(self, layer, kind: str, devices: Sequence[str]):
        self.layer = weakref.proxy(layer)
        self.kind, self.devices, self.home = kind, tuple(devices), devices[0]
        self.is_dense = type(layer).__name__ == "Dense"
        self.last_output = None  # (output, parts) of the latest column call
        values = [np.asarray(v) for v in _compat.whole_layer_variables(layer)]
        axis = tensor_layout.split_axis(kind)
        self.sizes = tensor_layout.part_sizes(values[0].shape[axis], len(devices))
        self.offsets = np.cumsum(self.sizes)[:-1]
        _compat.drop_whole_layer_variables(layer)
        # Each entry: (shards, axis they split, or None for one whole variable).
        self.groups: list[tuple[list, Optional[int]]] = []
        role = "kernel" if self.is_dense else "embeddings"
        with _compat.layer_state_unlocked(layer):
            self.groups.append((self._shards(layer, role, values[0], axis), axis))
            if len(values) > 1:  # a Dense bias
                if kind == "column":
                    self.groups.append((self._shards(layer, "bias", values[1], 0), 0))
                else:
                    self.groups.append(
                        ([self._variable(layer, "bias", values[1], self.home)], None)
                    )

    def _shards(self, layer, role, value, axis) -> list:
        parts = np.split(value, self.offsets, axis=axis)
        return [
            self._variable(layer, f"{role}_shard{i}", part, device, role)
            for i, (part, device) in enumerate(zip(parts, self.devices))
        ]

    @staticmethod
    def _variable(layer, name, value, device, role=None):
        role = role or name
        with tf.device(device):
            variable = layer.add_weight(
                name=name,
                shape=value.shape,
                initializer="zeros",
                regularizer=getattr(layer, f"{role}_regularizer", None),
                trainable=layer.trainable,
            )
            variable.assign(value)
        devices_lib.mark_split(variable)
        return variable

    # -- whole values, saving ----------------------------------------------------------

    def whole_values(self) -> list[np.ndarray]:
        return [
            np.asarray(shards[0])
            if axis is None
            else np.concatenate([np.asarray(s) for s in shards], axis=axis)
            for shards, axis in self.groups
        ]

    def whole_shapes(self) -> list[tuple]:
        shapes = []
        for shards, axis in self.groups:
            shape = list(shards[0].shape)
            if axis is not None:
                shape[axis] = sum(s.shape[axis] for s in shards)
            shapes.append(tuple(shape))
        return shapes

    def variables(self) -> list:
        return [shard for shards, _ in self.groups for shard in shards]

    def assign_whole(
        self,
        values: Sequence[Any],
        where: str,
        fix: str = "save from a model of the same architecture",
    ) -> None:
        shapes = self.whole_shapes()
        if len(values) != len(shapes):
            raise ValueError(
                f"{where} holds {len(shapes)} whole variables (shapes {shapes}), "
                f"got {len(values)} values; {fix}."
            )
        for (shards, axis), value, shape in zip(self.groups, values, shapes):
            value = np.asarray(value)
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"{where}: a value of shape {tuple(value.shape)} was given for a variable "
                    f"of shape {shape}; {fix}."
                )
            parts = [value] if axis is None else np.split(value, self.offsets, axis=axis)
            for shard, part in zip(shards, parts):
                shard.assign(part)

    def save_own_variables(self, store) -> None:
        for i, value in enumerate(self.whole_values()):
            store[str(i)] = value

    def load_own_variables(self, store) -> None:
        values = [store[str(i)] for i in range(len(store.keys()))]
        self.assign_whole(values, where=f"layer {self.layer.name!r} in the file")
