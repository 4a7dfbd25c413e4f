"""Each replica draws its own random numbers: dropout masks, noise, augmentation.

Keras layers draw their randomness from a `keras.random.SeedGenerator`,
whose state is a variable. Every replica holds an equal copy of it (mirrored
copies in one process, worker 0's broadcast across processes) and advances
it equally, so every replica drew the same numbers: row i of each replica's
shard got the same dropout mask, where one device gives every row of the
global batch its own. The noise of N replicas was one shard's noise, N
times over, silently (Keras under tf.distribute does the same). `predict`
with a `Dropout(...)(x, training=True)` (Monte Carlo dropout) showed it:
the rows of the global batch repeated in blocks of one replica's shard.

Strategies run each replica's step `as_replica(index)`, `index` being its
global replica index. While a replica's step is traced, the seed of every
draw from a `SeedGenerator` (or from an unseeded op) is offset by the
index, in the TensorFlow backend's `draw_seed`. Replica 0 draws exactly
what one device draws; the generators' state stays as Keras keeps it (equal
on every replica, saved and restored as before), so after a restore every
replica draws its numbers again. A draw with an explicit integer seed
(`keras.random.uniform(..., seed=42)`) is the user's fixed stream and is
left alone. The parameter-server strategy is not covered: its workers draw
from generators the ps tasks hold, each advancing them on its own.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Union

import keras
import tensorflow as tf

# Replica r's seeds are the generator's plus [r * _STRIDE, 0]: an odd
# multiplier spreads the replicas over the int32 seeds the TensorFlow
# backend folds them into (`floormod(seed, 2**31 - 2)`).
_STRIDE = 0x9E3779B1

_current = threading.local()  # tf.distribute traces each replica in its own thread
_install_lock = threading.Lock()
_installed = False


@contextlib.contextmanager
def as_replica(index: Union[int, tf.Tensor]) -> Iterator[None]:
    """Random draws made inside are those of global replica `index`."""
    _install()
    saved = getattr(_current, "index", None)
    _current.index = index
    try:
        yield
    finally:
        _current.index = saved


def _install() -> None:
    global _installed
    with _install_lock:
        if not _installed:
            from keras_distrib import _compat

            _compat.wrap_backend_draw_seed(_offset_by_replica)
            _installed = True


def _offset_by_replica(keras_draw_seed, seed):
    value = keras_draw_seed(seed)
    index = getattr(_current, "index", None)
    if index is None or (isinstance(index, int) and index == 0):
        return value
    if seed is not None and not isinstance(seed, keras.random.SeedGenerator):
        return value  # an explicit integer seed: the same stream everywhere
    offset = tf.cast(index, tf.int64) * _STRIDE
    return value + tf.cast(tf.stack([offset, tf.zeros_like(offset)]), value.dtype)
