"""`keras_distrib.collectives.pieces`: tensors cut for TensorFlow's
collectives (multi_worker's `bytes_per_pack`) and joined back. Across real
workers: tests/distributed/test_multi_worker.py (3 hosts, 256-byte packs)."""

import numpy as np
import tensorflow as tf

from keras_distrib.collectives import pieces


def test_large_tensors_are_cut_into_pieces_of_at_most_max_bytes_and_joined_back():
    values = [
        tf.reshape(tf.range(15, dtype=tf.float32), (3, 5)),
        tf.constant(2.0),
        tf.ones((2, 2), tf.float16),
        tf.range(4, dtype=tf.int64),
    ]
    cut, plan = pieces.cut(values, 16)
    # 15 float32 -> 4 + 4 + 4 + 3; the scalar, the 8-byte float16 and the
    # 32-byte int64 (2 per piece) as they are or in two.
    assert [int(p.shape.num_elements()) for p in cut] == [4, 4, 4, 3, 1, 4, 2, 2]
    assert all(p.shape.num_elements() * p.dtype.size <= 16 for p in cut)
    joined = pieces.join([p * 2 for p in cut], plan)
    for got, want in zip(joined, values):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got.numpy(), (want * 2).numpy())


def test_a_tensor_of_unknown_shape_passes_whole():
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def cut_and_join(x):
        cut, plan = pieces.cut([x, tf.zeros([8])], 4)
        assert cut[0] is x and len(cut) == 9
        return pieces.join(cut, plan)

    x = tf.range(10, dtype=tf.float32)
    np.testing.assert_array_equal(cut_and_join(x)[0].numpy(), x.numpy())
