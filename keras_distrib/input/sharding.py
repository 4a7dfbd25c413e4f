"""Input across workers: each sample of an epoch is seen once, by one worker.

`batch_size` stays the global batch. Worker w keeps, from every global batch,
the contiguous rows of its replicas under the split rule of
`keras_distrib.input.data` (so N workers see exactly what one process would, in the
same order):

* numpy arrays / tensors: a `tf.data` pipeline shuffles indices with a seed
  all workers agree on, batches them globally, and gathers this worker's rows;
* `keras.utils.PyDataset`: every worker builds each global batch (in an order
  all workers agree on) and keeps its rows;
* `tf.data.Dataset` that reads files (TFRecord, text lines, fixed-length
  records): TensorFlow's file-based auto-sharding gives each worker its own
  files, and its batches are re-batched to this worker's share;
* any other `tf.data.Dataset`: each element (a global batch) is cut to this
  worker's rows.

All of this runs when more than one worker trains (the strategy's
`topology.num_data_shards > 1`); numpy arrays and tensors, and any input
of a resumable `fit`, take this path with one worker too (see
`Strategy.distribute_fit_input`).
"""

from __future__ import annotations

import itertools
from typing import Any, Optional, Union

import keras
import numpy as np
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib.input import data as data_lib
from keras_distrib.input.fit_input import FitInput, Start

_NO_END = 2**62  # epochs of an endless input

_FILE_READERS = {
    "TFRecordDataset",
    "TFRecordDatasetV2",
    "TextLineDataset",
    "FixedLengthRecordDataset",
    "FixedLengthRecordDatasetV2",
}


def fit_input(strategy, fit: FitInput) -> FitInput:
    """`fit` with the training and validation input sharded.

    `validation_split` is applied before sharding (arrays only), the shuffle
    seed is agreed on by all workers (or taken from `fit.start`, a `Start`
    to resume from), and array input becomes one endless iterator with
    `steps_per_epoch` from the data (see `shard`). The seed used comes back
    as `seed` (None without shuffling).
    """
    x, y, sample_weight = fit.x, fit.y, fit.sample_weight
    start = fit.start or Start()
    validation_data, class_weight = fit.validation_data, fit.class_weight
    if fit.validation_split:
        (x, y, sample_weight), validation_data = _compat.train_validation_split(
            (x, y, sample_weight), fit.validation_split
        )
    if class_weight is not None and is_array_like(x):
        sample_weight = _compat.class_weight_as_sample_weight(y, sample_weight, class_weight)
        class_weight = None
    seed = None
    if fit.shuffle:
        seed = start.seed if start.seed is not None else strategy.agree_on_seed()
    steps = None
    if fit.steps_per_epoch is None and fit.steps_per_execution == 1:
        # With several steps per execution the last execution of an epoch
        # must stop at the epoch's end, which only a finite epoch tells it.
        steps = array_steps(x, fit.batch_size)
    sharded, batch_size = shard(
        strategy,
        x,
        y,
        sample_weight,
        fit.batch_size,
        fit.shuffle,
        seed,
        repeat=steps is not None,
        first_epoch=start.epoch,
    )
    validation_batch_size = fit.validation_batch_size
    if validation_data is not None:
        validation_data, _ = shard(
            strategy, *unpack(validation_data), validation_batch_size or fit.batch_size
        )
        validation_batch_size = None
    return fit.replace(
        x=sharded,
        y=None,
        sample_weight=None,
        batch_size=batch_size,
        shuffle=False,
        validation_split=0.0,
        validation_data=validation_data,
        validation_batch_size=validation_batch_size,
        class_weight=class_weight,
        steps_per_epoch=steps if steps is not None else fit.steps_per_epoch,
        seed=seed,
    )


def shard(
    strategy: Any,
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    batch_size: Optional[int] = None,
    shuffle: Union[bool, str] = False,
    seed: Optional[int] = 0,
    repeat: bool = False,
    first_epoch: int = 0,
) -> tuple[Any, Optional[int]]:
    """This worker's share of `(x, y, sample_weight)` as one Keras input.

    With `repeat=True` (arrays only) the batches of one epoch follow each
    other without end (reshuffled every epoch): `fit` then passes
    `steps_per_epoch=array_steps(...)` and Keras keeps one iterator for the
    whole run instead of building and tearing down one per epoch (a
    teardown waits for tf.data's autotune thread, below).
    Shuffled arrays and PyDatasets start at epoch `first_epoch`'s order.

    `strategy` is the model's (a `keras_distrib.strategies` Strategy, a
    layer above this one).

    Returns:
        `(inputs, batch_size)` to hand to Keras in place of the originals
        (`y` and `sample_weight` are folded into `inputs`).
    """
    rows = _WorkerRows(strategy)
    if isinstance(x, tf.data.Dataset):
        _no_extras(y, sample_weight, "a tf.data.Dataset")
        return _shard_dataset(x, rows, strategy), None
    if isinstance(x, keras.utils.PyDataset):
        _no_extras(y, sample_weight, "a PyDataset")
        return _WorkerPyDataset(x, rows, seed if shuffle else None, first_epoch), None
    if is_array_like((x, y, sample_weight)):  # x may hold only None (an optional input)
        return _shard_arrays(
            x,
            y,
            sample_weight,
            batch_size or 32,
            rows,
            seed if shuffle else None,
            repeat,
            first_epoch,
        ), None
    raise TypeError(
        f"Multi-worker input must be numpy arrays, tensors, a tf.data.Dataset or "
        f"a keras.utils.PyDataset, got {type(x).__name__}; wrap a generator in a "
        "PyDataset so every worker can take its share of each batch."
    )


class _WorkerRows:
    """Which rows of a global batch belong to this worker."""

    def __init__(self, strategy):
        topology = strategy.topology
        self.first = topology.first_local_replica
        self.local = topology.num_local_replicas
        self.total = topology.num_replicas
        self.num_shards = topology.num_data_shards
        self.shard_index = topology.data_shard_index

    def bounds(self, global_size):
        """(start, count) as tensors of the dtype of `global_size`."""
        sizes = data_lib.replica_sizes(global_size, self.total)
        start = tf.add_n([tf.zeros_like(global_size)] + sizes[: self.first])
        count = tf.add_n(sizes[self.first : self.first + self.local])
        return start, count

    @property
    def whole(self) -> bool:
        """Whether this worker holds every replica (it keeps whole batches)."""
        return self.local == self.total

    def cut(self, batch):
        if self.whole:
            return batch  # nothing to trace or compute
        leaves = [t for t in tf.nest.flatten(batch) if t is not None]
        start, count = self.bounds(tf.shape(leaves[0], out_type=tf.int64)[0])
        return tf.nest.map_structure(
            lambda t: None if t is None else data_lib.take_rows(t, start, count), batch
        )

    def cut_numpy(self, batch):
        if self.whole:
            return batch
        leaves = [t for t in tf.nest.flatten(batch) if t is not None]
        start, count = (int(v) for v in self.bounds(tf.constant(len(leaves[0]), tf.int64)))
        return tf.nest.map_structure(
            lambda t: None if t is None else data_lib.take_rows(t, start, count), batch
        )


def array_steps(x, batch_size) -> Optional[int]:
    """Batches per epoch when `x` is arrays (the last one may be short), else None."""
    if not is_array_like(x):
        return None
    return -(-_num_rows(x) // (batch_size or 32)) or None


def _num_rows(arrays) -> int:
    """The rows of input arrays (the first that is not None)."""
    return int(next(t for t in tf.nest.flatten(arrays) if t is not None).shape[0])


def is_array_like(x) -> bool:
    """Whether `x` is numpy arrays or tensors (a structure of them, where
    an optional input may be None)."""
    leaves = [t for t in tf.nest.flatten(x) if t is not None]
    return bool(leaves) and all(
        isinstance(t, (np.ndarray, tf.Tensor, tf.RaggedTensor)) for t in leaves
    )


def _each_array(function):
    """`function` for `tf.nest.map_structure` over input arrays: None (an
    optional input given as None) stays None, which tf.data carries as is."""
    return lambda t: None if t is None else function(t)


def _no_extras(y, sample_weight, what):
    if y is not None or sample_weight is not None:
        raise ValueError(f"y and sample_weight must be None when x is {what}; put them in x.")


def _shard_arrays(x, y, sample_weight, batch_size, rows, seed, repeat=False, first_epoch=0):
    # tf.data would stack a list of inputs into one tensor: a multi-input
    # `x=[xa, xb]` stays a structure of separate inputs as a tuple.
    arrays = tuple(keras.tree.lists_to_tuples(a) for a in (x, y, sample_weight) if a is not None)
    if len(arrays) == 1:
        # `x` alone: each batch is `x`'s batch itself, not `(x,)`, as Keras's
        # own array input gives it (`pack_x_y_sample_weight`); a custom
        # `train_step(self, data)` (keras-io's GAN, VAE) reads `data` as x.
        arrays = keras.utils.pack_x_y_sample_weight(arrays[0])
    data_lib.check_same_length(x=x, y=y, sample_weight=sample_weight)
    n = _num_rows((x, y, sample_weight))
    ragged = any(isinstance(t, tf.RaggedTensor) for t in tf.nest.flatten(arrays))
    if seed is None and not ragged:
        dataset = _in_order(arrays, n, batch_size, rows)
        if repeat:
            dataset = dataset.repeat()
    else:  # ragged rows cannot be reshaped into batches: gathered, in order
        dataset = _gathered(arrays, n, batch_size, rows, seed, repeat, first_epoch)
    # No autotuning: this pipeline only slices or gathers rows, and tearing
    # down an iterator that a compiled step has read waits for tf.data's
    # autotune thread (a fraction of a second on TF 2.21), each time Keras drops
    # one (every epoch's validation, every evaluate). No static rewrites
    # either: there is nothing here for them to fuse, and they run at every
    # iterator's creation.
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.apply_default_optimizations = False
    return dataset.prefetch(2).with_options(options)


def _in_order(arrays, n, batch_size, rows) -> tf.data.Dataset:
    """This worker's rows of each batch of one epoch, in order, with no
    function to trace (tracing one is most of what a new pipeline costs, at
    every `fit`, validation and `evaluate`): the whole
    batches are one tensor `[batches, batch_size, ...]` sliced by tf.data,
    the short last batch one more element."""
    whole = n // batch_size

    def mine(size):
        start, count = (int(v) for v in rows.bounds(tf.constant(size, tf.int64)))
        return slice(start, start + count)

    pieces = []
    if whole:
        cut = mine(batch_size)
        pieces.append(
            tf.data.Dataset.from_tensor_slices(
                tf.nest.map_structure(
                    _each_array(
                        lambda t: tf.reshape(
                            t[: whole * batch_size], [whole, batch_size, *t.shape[1:]]
                        )[:, cut]
                    ),
                    arrays,
                )
            )
        )
    if n % batch_size:
        cut = mine(n % batch_size)
        pieces.append(
            tf.data.Dataset.from_tensors(
                tf.nest.map_structure(_each_array(lambda t: t[whole * batch_size :][cut]), arrays)
            )
        )
    dataset = pieces[0]
    for piece in pieces[1:]:
        dataset = dataset.concatenate(piece)
    return dataset


def _gathered(arrays, n, batch_size, rows, seed, repeat, first_epoch) -> tf.data.Dataset:
    """This worker's rows of each batch, gathered by index: epoch `e` in the
    order drawn from `(seed, e)` alone (the same on every worker, and again
    on resume), or in order when `seed` is None."""
    # Every `fit` builds this pipeline anew, and tracing its functions is most
    # of what that costs: there are two, neither
    # converted by AutoGraph (plain TensorFlow, nothing to convert), and
    # one batch of indices is one row of a ragged tensor (no function at all).
    batches = -(-n // batch_size)

    @tf.autograph.experimental.do_not_convert
    def epoch_indices(epoch):
        order = tf.range(n, dtype=tf.int64)
        if seed is not None:
            order = tf.random.experimental.stateless_shuffle(
                order, seed=tf.stack([tf.constant(seed, tf.int64), epoch])
            )
        # Whole batches cut from the order (not element by element then
        # batched: the same batches, with one op per batch instead of one per row).
        limits = tf.concat([tf.range(0, n, batch_size, dtype=tf.int64), [n]], 0)
        return tf.data.Dataset.from_tensor_slices(
            tf.RaggedTensor.from_row_splits(order, limits, validate=False)
        )

    if repeat:
        indices = tf.data.Dataset.range(first_epoch, _NO_END).flat_map(epoch_indices)
    else:
        # Keras iterates the dataset once per epoch: each iteration asks a
        # Python counter for its epoch (no variable, so any scope is fine).
        epochs = itertools.count(first_epoch)
        epoch = tf.data.Dataset.from_generator(
            lambda: iter([next(epochs)]), output_signature=tf.TensorSpec([], tf.int64)
        )
        indices = epoch.flat_map(epoch_indices)
        indices = indices.apply(tf.data.experimental.assert_cardinality(batches))

    @tf.autograph.experimental.do_not_convert
    def this_workers_rows(batch_indices, source):
        mine = rows.cut(batch_indices)
        return tf.nest.map_structure(_each_array(lambda t: tf.gather(t, mine)), source)

    # The arrays enter as one element repeated (not captured by the
    # function, which would copy them into its graph).
    source = tf.data.Dataset.from_tensors(arrays).repeat()
    return tf.data.Dataset.zip((indices, source)).map(this_workers_rows)


def _shard_dataset(dataset: tf.data.Dataset, rows: _WorkerRows, strategy) -> tf.data.Dataset:
    dataset = _agree_on_shuffles(dataset, strategy)
    if not reads_files(dataset):
        return dataset.map(lambda *e: rows.cut(e[0] if len(e) == 1 else e))
    global_batch = _compat.static_batch_size(dataset)
    if global_batch <= 0:
        raise ValueError(
            "Cannot find the batch size of this file-reading tf.data pipeline; "
            "call .batch(global_batch_size) on it as its last batching step."
        )
    sharded = _compat.shard_by_file(dataset, rows.num_shards, rows.shard_index, rows.total)
    _, count = rows.bounds(tf.constant(global_batch, tf.int64))
    return sharded.rebatch(int(count))


def _agree_on_shuffles(dataset: tf.data.Dataset, strategy) -> tf.data.Dataset:
    """`dataset` with its unseeded shuffles seeded alike on every worker.

    Each worker keeps its rows of every element (or its files), so all
    workers must produce the same elements in the same order; an unseeded
    `.shuffle()` would draw a different order in each, and samples would be
    seen twice or never. Every worker calls this with the same pipeline, so
    they agree on whether a seed is drawn.
    """
    try:
        return _compat.agree_on_shuffles(dataset, strategy.agree_on_seed)
    except _compat.UnseededShuffleError as error:
        raise ValueError(
            f"This tf.data pipeline shuffles without a seed ({error}), so each worker "
            "would see a different order and skip or repeat samples; pass seed= to "
            "shuffle() or call keras.utils.set_random_seed(...) before building it."
        ) from None


def reads_files(dataset: tf.data.Dataset) -> bool:
    """Whether the pipeline has a file reader source (so can shard by file)."""
    return bool(_compat.dataset_ops(dataset) & _FILE_READERS)


class _WorkerPyDataset(keras.utils.PyDataset):
    """This worker's rows of every batch of a PyDataset, in an agreed order."""

    def __init__(
        self,
        inner: keras.utils.PyDataset,
        rows: _WorkerRows,
        seed: Optional[int],
        first_epoch: int = 0,
    ):
        super().__init__(
            workers=inner.workers,
            use_multiprocessing=inner.use_multiprocessing,
            max_queue_size=inner.max_queue_size,
        )
        self.inner, self.rows, self.seed, self.epoch = inner, rows, seed, first_epoch
        self._order = self._permutation()

    def _permutation(self):
        n = len(self.inner)
        if self.seed is None:
            return np.arange(n)
        return np.random.default_rng([self.seed, self.epoch]).permutation(n)

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        return self.rows.cut_numpy(self.inner[int(self._order[index])])

    def on_epoch_end(self):
        self.inner.on_epoch_end()
        self.epoch += 1
        self._order = self._permutation()


def unpack(data) -> tuple[Any, Any, Any]:
    if isinstance(data, (tf.data.Dataset, keras.utils.PyDataset)):
        return data, None, None
    return keras.utils.unpack_x_y_sample_weight(data)
