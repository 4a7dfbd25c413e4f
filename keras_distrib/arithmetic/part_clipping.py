"""Keras's gradient clipping of whole gradients, done on this replica's
parts of them: stage 2 of optimizer sharding
(`keras_distrib.arithmetic.optimizer_shards`), whose reduce-scatter leaves
each replica only its parts of the reduced gradients.

Norm clipping (`clipnorm`, `global_clipnorm`) needs the whole norms: they
come from each replica's sums of squares, reduced in one small all-reduce.
Value clipping is elementwise and needs nothing more.
"""

from __future__ import annotations

import tensorflow as tf

from keras_distrib.arithmetic.gradients import scaled_gradient


def clipped_pieces(optimizer, strategy, pieces: list) -> list:
    """Keras's clipping (`BaseOptimizer._clip_gradients`) by `optimizer` of
    whole gradients, done on this replica's parts `pieces`: the norms come
    from each replica's sums of squares, reduced in one all-reduce of
    `strategy`'s (a sparse gradient, whole on every replica, adds its own)."""
    clipnorm, global_clipnorm = optimizer.clipnorm, optimizer.global_clipnorm
    whole = [isinstance(g, tf.IndexedSlices) for g in pieces]  # on every replica
    if clipnorm and clipnorm > 0 or global_clipnorm and global_clipnorm > 0:
        # A sparse gradient's norm is its rows' (as tf.clip_by_norm takes it).
        squares = [tf.reduce_sum(tf.square(g.values if w else g)) for g, w in zip(pieces, whole)]
        (l2sums,) = strategy.all_reduce(
            [tf.stack([tf.zeros([]) if w else s for s, w in zip(squares, whole)])], "sum"
        )
        l2sums = [s if w else l2sums[k] for k, (s, w) in enumerate(zip(squares, whole))]
        if clipnorm and clipnorm > 0:  # BaseOptimizer._clip_by_norm, per variable
            out = []
            for g, l2sum in zip(pieces, l2sums):
                l2norm = tf.where(l2sum > 0, tf.sqrt(tf.where(l2sum > 0, l2sum, 1.0)), l2sum)
                out.append(scaled_gradient(g, clipnorm / tf.maximum(l2norm, clipnorm)))
            return out
        use_norm = tf.sqrt(tf.add_n(l2sums))  # keras's clip_by_global_norm
        scale = global_clipnorm * tf.minimum(1.0 / use_norm, 1.0 / global_clipnorm)
        scale = scale + (use_norm - use_norm)
        return [scaled_gradient(g, scale) for g in pieces]
    if optimizer.clipvalue and optimizer.clipvalue > 0:
        # Keras clips a sparse gradient dense (its duplicate rows summed).
        v = optimizer.clipvalue
        return [tf.clip_by_value(tf.convert_to_tensor(g), -v, v) for g in pieces]
    return pieces
