"""What each parameter-server worker trains on, from what the user gave `fit`.

Asynchronous workers take closures from one queue as they become free, so
no worker can own a fixed part of an epoch. Two ways of feeding them:

* **Streams** (numpy arrays, tensors, a `tf.data.Dataset`, or a function
  returning one): the input is rebuilt *on every worker*
  (`ClusterCoordinator.create_per_worker_dataset`) and repeated, so each
  worker streams the whole training data. Arrays are shuffled on each
  worker with its own seed, in a new order each pass, when
  `shuffle=True`; a dataset keeps the order it defines (an unseeded
  `.shuffle()` in it draws its own order on each worker). Arrays and
  tensors travel to the workers as constants of the dataset's graph (which
  TensorFlow limits to 2 GB); larger data should be read from files by a
  dataset (function). A dataset that runs Python (`from_generator`,
  `py_function`, `numpy_function`) cannot run on the workers: that is a
  one-line error.
* **Fed by the chief** (a `keras.utils.PyDataset`, whose Python code can
  only run where the script runs): the chief reads the batches in order
  and passes each closure its batches; every batch is used once per epoch,
  as in plain Keras.

An *epoch* is `steps_per_epoch` optimizer steps, applied by whichever
workers are free: by default as many steps as one pass over the data takes
(`ceil(samples / batch_size)`, or the dataset's number of batches). With
streams a sample can be used twice or not at all within one epoch; over
many epochs every sample is used about equally often.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import keras
import numpy as np
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib.input.fit_input import FitInput

# Python ops that run in the process that built the dataset, never on a
# remote worker.
_PYTHON_OPS = ("PyFunc", "EagerPyFunc", "PyFuncStateless", "GeneratorDataset")


@dataclasses.dataclass
class Plan:
    """How a `fit` call's training input reaches the workers.

    Attributes:
        steps_per_epoch: optimizer steps that make an epoch.
        dataset_fn: the stream each worker builds (streams): a dataset, or a
            function returning one; else None.
        py_dataset: the PyDataset the chief feeds from, else None.
        build_batch: one `(x, y, sample_weight)` batch, to build the model
            on the chief before training.
        validation_data: what `fit` validates on (on the chief), or None.
    """

    steps_per_epoch: int
    dataset_fn: Any
    py_dataset: Optional[keras.utils.PyDataset]
    build_batch: Any
    validation_data: Any


def plan(fit: FitInput) -> Plan:
    """The `Plan` for `fit` (see `Strategy.distribute_fit_input`)."""
    x, y, sample_weight = fit.x, fit.y, fit.sample_weight
    steps = fit.steps_per_epoch
    if fit.class_weight is not None:
        raise ValueError(
            "class_weight is not supported by strategy='parameter_server'; "
            "pass per-sample weights (sample_weight=) instead."
        )
    validation = fit.validation_data
    if isinstance(x, keras.utils.PyDataset):
        _no_split(fit, "a PyDataset")
        count = _known_length(x)
        steps = steps or count
        if not steps:
            raise ValueError(_unknown_steps("this PyDataset has no len()"))
        return Plan(steps, None, x, keras.utils.unpack_x_y_sample_weight(x[0]), validation)
    if isinstance(x, tf.data.Dataset) or (callable(x) and not _is_array(x)):
        _no_split(fit, "a dataset")
        dataset = x if isinstance(x, tf.data.Dataset) else _call_dataset_fn(x)
        _check_runs_remotely(dataset)
        count = int(dataset.cardinality())
        if not steps:
            if count == tf.data.INFINITE_CARDINALITY:
                raise ValueError(_unknown_steps("the dataset repeats forever"))
            if count == tf.data.UNKNOWN_CARDINALITY:
                raise ValueError(_unknown_steps("the dataset's length is unknown"))
            steps = count
        build = keras.utils.unpack_x_y_sample_weight(next(iter(dataset)))
        if isinstance(x, tf.data.Dataset):
            # A dataset made here is sent as its graph (capturing it in a
            # function would send this process's handle, which workers
            # cannot read).
            return Plan(steps, x.repeat(), None, build, validation)

        def dataset_fn():
            return _call_dataset_fn(x).repeat()

        return Plan(steps, dataset_fn, None, build, validation)
    return _arrays_plan(fit, x, y, sample_weight, steps, validation)


def _arrays_plan(fit, x, y, sample_weight, steps, validation) -> Plan:
    batch_size = fit.batch_size or 32
    arrays: tuple[Any, ...] = (x, y, sample_weight)
    split = fit.validation_split or 0.0
    if split:
        if validation is not None:
            split = 0.0  # Keras: validation_data wins
        else:
            arrays, validation = _split(arrays, split)
    # Leaf by leaf: x and y may be dicts or lists of arrays (several inputs
    # or outputs), which np.asarray would make one object array (or stack).
    arrays = tuple(
        None
        if a is None
        else keras.tree.map_structure(
            lambda leaf: leaf if tf.is_tensor(leaf) else np.asarray(leaf),
            keras.tree.lists_to_tuples(a),
        )
        for a in arrays
    )
    size = int(keras.tree.flatten(arrays[0])[0].shape[0])
    steps = steps or math.ceil(size / batch_size)
    shuffle = bool(fit.shuffle) and fit.shuffle != "batch"
    kept = tuple(a for a in arrays if a is not None)

    def dataset_fn():
        data = tf.data.Dataset.from_tensor_slices(kept)
        if shuffle:
            data = data.shuffle(size, seed=_worker_seed(), reshuffle_each_iteration=True)
        return data.repeat().batch(batch_size).prefetch(2)

    first = tuple(keras.tree.map_structure(lambda a: a[:batch_size], a) for a in kept)
    return Plan(steps, dataset_fn, None, keras.utils.unpack_x_y_sample_weight(first), validation)


def _worker_seed() -> tf.Tensor:
    """A shuffle seed that differs from worker to worker.

    The dataset function is traced once on the chief and the same graph
    runs on every worker, so a seed fixed at trace time (as
    `keras.utils.set_random_seed` fixes every op seed) would give all
    workers one order. The worker's clock and its own random state make
    the seed when the dataset is built there.
    """
    clock = tf.bitcast(tf.timestamp(), tf.int64)
    draw = tf.random.uniform([], maxval=2**62, dtype=tf.int64)
    return tf.bitwise.bitwise_xor(clock, draw)


def _split(arrays, fraction):
    """Keras's own `validation_split`: the last `fraction` of the rows validate."""
    train, validation = _compat.train_validation_split(arrays, fraction)
    return train, tuple(a for a in validation if a is not None)


def _no_split(fit, what) -> None:
    if fit.validation_split:
        raise ValueError(
            f"validation_split is only supported for arrays, not {what} "
            "(as in Keras); pass validation_data= instead."
        )


def _call_dataset_fn(fn) -> tf.data.Dataset:
    try:
        dataset = fn()
    except TypeError:
        dataset = fn(tf.distribute.InputContext())
    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError(
            f"The dataset function {getattr(fn, '__name__', fn)!r} returned "
            f"{type(dataset).__name__}, not a tf.data.Dataset."
        )
    return dataset


def _check_runs_remotely(dataset: tf.data.Dataset) -> None:
    ops = _compat.dataset_ops(dataset)
    python = sorted(set(ops) & set(_PYTHON_OPS))
    if python:
        raise ValueError(
            "strategy='parameter_server' rebuilds the training dataset on every worker, "
            f"but this one runs Python ({', '.join(python)}), which only exists in this "
            "process; build it from tensors or files, or pass a keras.utils.PyDataset "
            "(fed by the chief)."
        )


def _known_length(py_dataset) -> Optional[int]:
    try:
        return len(py_dataset)
    except TypeError:
        return None


def _unknown_steps(why: str) -> str:
    return (
        f"strategy='parameter_server' cannot know how many steps make an epoch: {why}; "
        "pass steps_per_epoch= to fit."
    )


def _is_array(x) -> bool:
    return isinstance(x, np.ndarray) or tf.is_tensor(x)
