"""Tensors cut into pieces of at most `max_bytes` for TensorFlow's
collectives, and joined back after.

`bytes_per_pack` (TensorFlow's `CommunicationOptions`) packs small
tensors into one all-reduce but never cuts a large one, and TensorFlow's
ring all-reduce over gRPC moves one large tensor at well below the link's
rate, and the same bytes in pieces near it (docs/design.md, section 1.2,
row 15). The pieces are whole elements of the
flattened tensor, so each element is summed as before; `join` restores
the shapes.
"""

from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

# One entry per value: None (passed whole) or (number of pieces, shape).
Plan = list[Optional[tuple[int, tf.TensorShape]]]


def cut(values: Sequence[tf.Tensor], max_bytes: int) -> tuple[list, Plan]:
    """`values` with each one larger than `max_bytes` (> 0) replaced by
    the consecutive pieces of its flattened elements, and the plan
    `join` needs. Values of unknown shape pass whole."""
    pieces: list[tf.Tensor] = []
    plan: Plan = []
    for value in values:
        count = value.shape.num_elements()
        per_piece = max(1, max_bytes // value.dtype.size)
        if count is None or count <= per_piece:
            pieces.append(value)
            plan.append(None)
            continue
        sizes = [per_piece] * (count // per_piece) + (
            [count % per_piece] if count % per_piece else []
        )
        pieces.extend(tf.split(tf.reshape(value, [-1]), sizes))
        plan.append((len(sizes), value.shape))
    return pieces, plan


def join(pieces: Sequence[tf.Tensor], plan: Plan) -> list:
    """The values `cut` made `pieces` of (reduced or not), whole again."""
    values, i = [], 0
    for entry in plan:
        if entry is None:
            values.append(pieces[i])
            i += 1
            continue
        count, shape = entry
        values.append(tf.reshape(tf.concat(list(pieces[i : i + count]), 0), shape))
        i += count
    return values
