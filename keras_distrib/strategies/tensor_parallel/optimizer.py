"""The optimizer on split variables: its files, `clipnorm`, what it refuses.

The optimizer updates each shard as a variable of its own, which equals
one device's update of the whole variable for element-wise optimizers.
Three things would differ, and are handled here:

* files: each split weight has one slot per shard; `OptimizerFiles` saves
  them as one whole slot, as a plain model's optimizer does;
* `clipnorm`: Keras clips each variable by its own norm, so the shards of
  a split variable are clipped together by their joint norm first
  (`clip_by_joint_norms`);
* optimizers whose update reads statistics of the whole variable
  (`WHOLE_VARIABLE_OPTIMIZERS`) are refused (`check_element_wise`).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib.arithmetic.optimizer_tree import keras_class_among, optimizers_in
from keras_distrib.strategies.tensor_parallel.split_layer import SplitLayer

# Keras optimizers whose update of a variable reads statistics of the whole
# variable, not of each element alone: name -> what it reads.
WHOLE_VARIABLE_OPTIMIZERS = {
    "Adafactor": "factored second moments and the update's RMS",
    "Lamb": "the trust ratio of the variable's and the update's norms",
    "Muon": "the orthogonalization of the whole matrix",
}


def check_element_wise(optimizer) -> None:
    """A one-line error for optimizers whose update reads whole variables
    (`optimizer` and those it applies through)."""
    for opt in optimizers_in(optimizer):
        name = keras_class_among(opt, WHOLE_VARIABLE_OPTIMIZERS)
        if name:
            raise ValueError(
                f"strategy='tensor_parallel': optimizer {name} updates each variable from "
                f"statistics of the whole variable ({WHOLE_VARIABLE_OPTIMIZERS[name]}), "
                "which on a split kernel would be each part's and differ from one device; "
                "use an element-wise optimizer (SGD, Adam, AdamW, Nadam, RMSprop, Lion, ...), "
                "or keep the split layers whole with layout={'<layer name pattern>': 'whole'}."
            )


def clip_by_joint_norms(grads, variables, groups, clipnorm) -> list:
    """`grads` (one per variable) with the gradients of each group of parts
    scaled by `clipnorm / max(joint norm, clipnorm)`, as `tf.clip_by_norm`
    scales a whole variable's (`values * clip_norm / maximum(l2norm, clip_norm)`,
    a zero norm left zero). Sparse gradients count their values' rows, as
    `tf.clip_by_norm` counts an `IndexedSlices`'s."""
    grads = list(grads)
    position = {id(v): i for i, v in enumerate(variables)}
    for parts in groups:
        where = [position.get(id(v)) for v in parts]
        if None in where or any(grads[i] is None for i in where):
            continue
        squares = [tf.reduce_sum(tf.square(_values(grads[i]))) for i in where]
        with tf.device(squares[0].device):
            l2sum = tf.add_n(squares)
            positive = l2sum > 0
            l2norm = tf.where(
                positive, tf.sqrt(tf.where(positive, l2sum, tf.ones_like(l2sum))), l2sum
            )
            limit = tf.cast(clipnorm, l2norm.dtype)
            denominator = tf.maximum(l2norm, limit)
        for i in where:
            grads[i] = _clipped(grads[i], limit, denominator)
    return grads


def _values(gradient):
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def _clipped(gradient, limit, denominator):
    def scale(values):
        return values * tf.cast(limit, values.dtype) / tf.cast(denominator, values.dtype)

    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(scale(gradient.values), gradient.indices, gradient.dense_shape)
    return scale(gradient)


class OptimizerFiles:
    """The optimizer's state saved as a plain model's optimizer saves it.

    Each split weight has one slot per shard (kept on the shard's device);
    in files they are one whole slot, in the plain model's order: the first
    shard's slot stands for the gathered slot and the others are left out.
    So a plain Keras model loads the optimizer state too (and a file of a
    plain model loads into the split one), as for the weights.
    """

    _HOOKED: "weakref.WeakSet[Any]" = weakref.WeakSet()

    @classmethod
    def install(cls, model) -> None:
        splits = [
            s
            for s in (SplitLayer.of(layer) for layer in _compat.direct_layers(model))
            if s is not None
        ]
        # Keras saves each of these on its own (a LossScaleOptimizer's inner
        # one, a MultiOptimizer's and its sub-optimizers: each their `variables`).
        for opt in optimizers_in(getattr(model, "optimizer", None)):
            if opt in cls._HOOKED or not splits:
                continue
            files = cls(opt, splits)
            object.__setattr__(opt, "save_own_variables", files.save_own_variables)
            object.__setattr__(opt, "load_own_variables", files.load_own_variables)
            cls._HOOKED.add(opt)

    def __init__(self, optimizer, splits):
        self.optimizer = weakref.proxy(optimizer)
        self.splits = [weakref.ref(s) for s in splits]

    def _entries(self) -> list[tuple[list, Optional[int]]]:
        """([variables], axis): one whole value each, in file order."""
        shard_of = {}  # slot prefix -> (group id, shard index, axis)
        for split in (ref() for ref in self.splits):
            for shards, axis in split.groups if split is not None else []:
                if axis is not None:
                    for i, shard in enumerate(shards):
                        shard_of[_compat.optimizer_slot_prefix(shard)] = (id(shards), i, axis)
        slots: dict[tuple[int, str], dict[int, Any]] = {}  # key -> {shard index: slot}
        order: list[tuple[Any, Optional[int]]] = []  # ([variable], None) or (key, axis)
        for variable in self.optimizer.variables:
            owner = next(((p, shard_of[p]) for p in shard_of if variable.name.startswith(p)), None)
            if owner is None:
                order.append(([variable], None))
                continue
            prefix, (group, index, axis) = owner
            key = (group, variable.name[len(prefix) :])
            slots.setdefault(key, {})[index] = variable
            if index == 0:
                order.append((key, axis))
        return [
            (entry, None)
            if axis is None
            else ([slots[entry][i] for i in sorted(slots[entry])], axis)
            for entry, axis in order
        ]

    def save_own_variables(self, store) -> None:
        for i, (variables, axis) in enumerate(self._entries()):
            store[str(i)] = (
                np.asarray(variables[0])
                if axis is None
                else np.concatenate([np.asarray(v) for v in variables], axis=axis)
            )

    def load_own_variables(self, store) -> None:
        entries = self._entries()
        if len(store.keys()) != len(entries):
            warnings.warn(
                f"Skipping variable loading for optimizer '{self.optimizer.name}', because "
                f"it has {len(entries)} variables whereas the saved optimizer has "
                f"{len(store.keys())} variables.",
                stacklevel=2,
            )
            return
        for i, (variables, axis) in enumerate(entries):
            value = np.asarray(store[str(i)])
            if axis is None:
                variables[0].assign(value)
                continue
            offsets = np.cumsum([v.shape[axis] for v in variables])[:-1]
            for variable, part in zip(variables, np.split(value, offsets, axis=axis)):
                variable.assign(part)
