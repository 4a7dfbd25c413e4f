"""Optimizer-state sharding (ZeRO stage 1): each replica updates its part.

With `optimizer_sharding="optimizer"` (an option of the data-parallel
strategies, `keras_distrib.arithmetic.optimizer_sharding`) the N replicas
(processes, or `mirrored`'s devices in one process) share out every
trainable variable: replica r owns
elements `[r*k, (r+1)*k)` of its flattened values (`k = ceil(size / N)`).
The optimizer is built on these parts, so its slots (Adam's two moments,
momentum, accumulators) take 1/N of the bytes on each replica, and
`model.optimizer.variables` are this replica's parts. Under `mirrored` a
part is a distributed variable whose component on each device holds that
device's part: Keras's update of it runs per device, as every mirrored
update does, and files read and write the components one by one
(`Strategy.local_replica_variables`).

A step (`OptimizerShards.apply`, which the optimizer's `apply` becomes):

1. the gradients arrive reduced (the step's one all-reduce; a custom
   `train_step`'s are reduced here), so every replica holds the global
   mean gradient;
2. Keras's own clipping runs on them whole (`clipnorm` and
   `global_clipnorm` need the whole norm);
3. the optimizer updates this replica's part of each variable with its
   part of the gradient (its slots, weight decay, learning rate schedule,
   step count: Keras's own code);
4. the updated parts travel to every replica in one all-gather per dtype
   (`Strategy.all_gather`: shared memory, TensorFlow's or Horovod's
   collective), and every replica assigns the whole variables, then
   applies their constraints.

With `optimizer_sharding="gradients"` (stage 2) the step's all-reduce
becomes a reduce-scatter (`reduce_scatter`, `Strategy.reduce_scatter`):
each replica receives the reduced gradient of its parts only, with the
sample count and the values that ride in the step's reduction
(`GradientReduction.reduce_with_statistics`) copied into every replica's
block; norm clipping then takes its norms from partial sums of squares,
reduced in one small all-reduce (`part_clipping`), and steps 3 and 4 are
the same. A custom `train_step`'s own `apply_gradients` reduces whole
gradients, as in stage 1.

Every update the sharded optimizers make is elementwise, so each element
gets the arithmetic it gets without sharding. A sparse gradient (an
`Embedding`'s `tf.IndexedSlices`) stays sparse: its rows arrive whole (in
stage 2 too: they are gathered, as without sharding, not scattered), and
each replica's part of it is the elements of those rows in its part,
indexed in the flat piece (`optimizer_parts.sparse_piece_of`), so Keras's sparse update
runs on the part as it runs on the whole table. Optimizers that read whole
tensors (LAMB's trust ratio, Adafactor's factored moments, Muon's
orthogonalization) are refused in one line. A `LossScaleOptimizer`
(mixed_float16) checks the whole reduced gradients for NaN/Inf, the same
answer on every replica, and its inner optimizer is the one sharded (stage
1; stage 2's parts cannot be checked whole, which is a one-line refusal).
With `use_ema=True` each replica
keeps the moving average of its parts; at the end of `fit` the weights
become the averages, gathered whole.

Files see whole values: `save_own_variables` gathers each slot whole (all
workers save together, as `keras_distrib.training.chief_only` has them do)
and `load_own_variables` keeps this replica's part of a whole file, so a
file written sharded loads into plain Keras, unsharded, or another number
of workers.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib.arithmetic import optimizer_sharding as sharding_option
from keras_distrib.arithmetic.optimizer_parts import Part, part_of, piece_of, piece_of_array, table
from keras_distrib.arithmetic.part_clipping import clipped_pieces

# Keras optimizers whose update of a variable is elementwise given its
# gradient (besides clipping, done whole here).
ELEMENTWISE = (
    keras.optimizers.SGD,
    keras.optimizers.Adam,
    keras.optimizers.AdamW,
    keras.optimizers.Adamax,
    keras.optimizers.Nadam,
    keras.optimizers.RMSprop,
    keras.optimizers.Adagrad,
    keras.optimizers.Adadelta,
    keras.optimizers.Ftrl,
    keras.optimizers.Lion,
)

_SHARDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def of(optimizer) -> Optional["OptimizerShards"]:
    """The sharding of `optimizer`, or None when it updates whole variables."""
    return _SHARDS.get(optimizer) if optimizer is not None else None


def install(optimizer, strategy, switch) -> "OptimizerShards":
    """Makes `optimizer` (adopted by a model on `strategy`) build on and
    update this replica's parts; `switch`: the model's `ReductionSwitch`.
    A `LossScaleOptimizer`'s inner optimizer is the one sharded; files
    hold the loss scale's variables and the inner one's, whole."""
    inner = optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        if strategy.optimizer_sharding == sharding_option.GRADIENTS:
            raise ValueError(
                "optimizer_sharding='gradients' cannot run a LossScaleOptimizer "
                "(mixed_float16): its finite check needs whole gradients; use "
                "optimizer_sharding='optimizer'."
            )
        inner = optimizer.inner_optimizer
    check_optimizer(inner)
    if (
        strategy.optimizer_sharding == sharding_option.GRADIENTS
        and getattr(getattr(inner, "compression", None), "dtype", None) is not None
    ):
        raise ValueError(
            "optimizer_sharding='gradients' reduce-scatters float32 gradients and cannot "
            "compress them; use optimizer_sharding='optimizer' with compression, or drop it."
        )
    shards = OptimizerShards(inner, strategy, switch, saved=optimizer)
    _SHARDS[optimizer] = _SHARDS[inner] = shards
    return shards


def check_optimizer(optimizer) -> None:
    """A one-line error for an optimizer whose update cannot be sharded."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, ELEMENTWISE):
        raise ValueError(
            f"optimizer_sharding cannot shard {name}: only optimizers that update each "
            f"element on its own do ({', '.join(c.__name__ for c in ELEMENTWISE)}); "
            "use optimizer_sharding=None."
        )
    if optimizer.built:
        raise ValueError(
            f"optimizer_sharding needs an optimizer that has not been built yet, but this "
            f"{name} has slots already; pass a new one (or its name) to compile()."
        )
    if getattr(optimizer, "backward_passes_per_step", 1) > 1:
        raise ValueError(
            "optimizer_sharding cannot run DistributedOptimizer(backward_passes_per_step>1); "
            "use the Keras optimizer's gradient_accumulation_steps instead."
        )
    clips = any(getattr(optimizer, a, None) for a in ("clipnorm", "global_clipnorm", "clipvalue"))
    if optimizer.gradient_accumulation_steps and clips:
        raise ValueError(
            f"optimizer_sharding cannot clip the accumulated gradients of {name}"
            "(gradient_accumulation_steps=..., clip...=...); drop one of the two."
        )


class _Scattered:
    """A gradient stage 2's reduction made: this replica's part of the
    global mean gradient (`piece`), handed through `apply_gradients`."""

    def __init__(self, piece):
        self.piece = piece


class OptimizerShards:
    """What one sharded optimizer needs (see module doc)."""

    def __init__(self, optimizer, strategy, switch, saved=None) -> None:
        self._optimizer = weakref.ref(optimizer)
        # What Keras saves and loads besides the optimizer: the
        # LossScaleOptimizer around it (its variables: its own, then the
        # inner one's).
        saved = optimizer if saved is None else saved
        self._strategy, self._switch = strategy, switch
        # Stage 2: the step's gradients arrive as this replica's parts.
        self.scatters = strategy.optimizer_sharding == sharding_option.GRADIENTS
        self.parts: list[Part] = []
        self._by_whole: dict[int, Part] = {}
        self._by_piece_key: dict = {}
        self._slot_part: dict[int, Part] = {}  # id(optimizer slot) -> its variable's part
        self._loaded: Optional[dict] = None  # id(slot) -> whole value, for share_loaded
        self._whole: Optional[dict] = None  # id(slot) -> whole value, for saves (gathered())
        keras_build, keras_apply = optimizer.build, optimizer.apply
        optimizer.build = lambda variables: self._build(keras_build, variables)
        optimizer.apply = lambda grads, trainable_variables=None: self._apply(
            keras_apply, grads, trainable_variables
        )
        optimizer.finalize_variable_values = lambda var_list: self._finalize(var_list)
        for obj in dict.fromkeys([saved, optimizer]):
            self._route_files(obj)
        # Weight decay decides by the whole variable (its name, or
        # `exclude_from_weight_decay(var_list=...)`).
        _compat.decide_weight_decay_by(optimizer, self._whole_of)

    @property
    def optimizer(self):
        return self._optimizer()

    def _route_files(self, obj) -> None:
        """`obj` (the optimizer, or the LossScaleOptimizer around it: Keras
        saves both, each with its own list of variables) saves whole slots
        and loads this replica's parts."""
        keras_load = obj.load_own_variables
        obj.save_own_variables = lambda store: self._save(obj, store)
        obj.load_own_variables = lambda store: self._load(obj, keras_load, store)

    # -- build -------------------------------------------------------------------

    def _build(self, keras_build, variables) -> None:
        optimizer, n = self.optimizer, self._strategy.num_replicas
        parts = []
        for whole in variables:
            size = int(np.prod(whole.shape))
            length = math.ceil(size / n)
            piece = keras.Variable(
                initializer="zeros",
                shape=(length,),
                dtype=whole.dtype,
                trainable=False,
                name=whole.name,
            )
            parts.append(Part(whole, piece, size, length, n))
        by_piece = {id(p.piece): p for p in parts}
        add_slot = optimizer.add_variable_from_reference

        def recording(reference, *args, **kwargs):
            slot = add_slot(reference, *args, **kwargs)
            if id(reference) in by_piece:
                self._slot_part[id(slot)] = by_piece[id(reference)]
            return slot

        optimizer.add_variable_from_reference = recording
        try:
            keras_build([p.piece for p in parts])
        finally:
            del optimizer.add_variable_from_reference
        self.parts = parts
        self._by_whole = {id(p.whole): p for p in parts}
        self._by_piece_key = {_compat.variable_key(optimizer, p.piece): p for p in parts}

    def _whole_of(self, variable):
        part = self._by_piece_key.get(_compat.variable_key(self.optimizer, variable))
        return variable if part is None else part.whole

    # -- the step (replica context) ---------------------------------------------------

    def _apply(self, keras_apply, grads, trainable_variables=None) -> None:
        optimizer = self.optimizer
        if trainable_variables is None:
            trainable_variables = [p.whole for p in self.parts]
        trainable_variables = list(trainable_variables)
        if not optimizer.built:
            optimizer.build(trainable_variables)
        pairs = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        if not pairs:
            return
        unknown = [v.path for _, v in pairs if id(v) not in self._by_whole]
        if unknown:
            raise ValueError(
                f"optimizer_sharding: the optimizer was built for other variables than "
                f"{unknown[0]!r}; use one optimizer per set of variables."
            )
        parts = [self._by_whole[id(v)] for _, v in pairs]
        here = self._strategy.replica_index()
        if any(isinstance(g, _Scattered) for g, _ in pairs):
            # Stage 2: this replica's parts, reduced; sparse gradients whole.
            whole = [not isinstance(g, _Scattered) for g, _ in pairs]
            grads = clipped_pieces(
                optimizer, self._strategy, [g if w else g.piece for (g, _), w in zip(pairs, whole)]
            )
            grads = [part_of(g, part, here) if w else g for g, part, w in zip(grads, parts, whole)]
        else:
            if not self._switch.reduced:
                # A custom train_step's own gradients: reduced once, here (Keras
                # would sum the parts, which differ from replica to replica).
                pairs = self._strategy.reduce_applied_gradients(pairs)
            # Sparse gradients stay sparse, as Keras clips and applies them.
            grads = _compat.clip_gradients(
                optimizer,
                [
                    g if isinstance(g, tf.IndexedSlices) else tf.convert_to_tensor(g)
                    for g, _ in pairs
                ],
            )
            grads = [part_of(g, part, here) for g, part in zip(grads, parts)]
        self._update(keras_apply, grads, parts)

    def _update(self, keras_apply, pieces: list, parts: list) -> None:
        """Keras's update of this replica's parts by `pieces` (their reduced,
        clipped gradients), then every replica's parts into the weights."""
        here = self._strategy.replica_index()
        for part in parts:
            part.piece.assign(piece_of(part.whole, part, here))
        with self._switch.applying_reduced(), _compat.clipping_off(self.optimizer):
            keras_apply(pieces, [p.piece for p in parts])
        for part, value in zip(parts, self._gathered(parts)):
            part.whole.assign(value)
            if part.whole.constraint is not None:
                part.whole.assign(part.whole.constraint(part.whole))

    def reduce_scatter(self, variables, gradients: list, num_samples, extras: list):
        """Stage 2's reduction of a step (replica context): each replica's
        gradients of its loss *sum* (aligned with `variables`, `None` where
        the loss does not reach) summed over the replicas, divided by the
        global sample count, and scattered: `(gradients, extras)`, the
        gradients as this replica's parts (to hand to `apply_gradients`),
        the `extras` (float32 tensors, each times this replica's count, as
        `reduce_with_statistics` makes them) as their global means.

        One `Strategy.reduce_scatter` of one `[replicas, length]` table per
        gradient (row r: replica r's part) and one of the extras and the
        sample count, which every replica writes into every row.
        """
        optimizer, n = self.optimizer, self._strategy.num_replicas
        if not optimizer.built:
            optimizer.build(list(variables))
        # Sparse gradients (an Embedding's) travel as rows, as without
        # sharding, and reach every replica whole; each updates its part.
        sparse = [i for i, g in enumerate(gradients) if isinstance(g, tf.IndexedSlices)]
        present = [i for i, g in enumerate(gradients) if g is not None and i not in sparse]
        for i in present:
            if gradients[i].dtype != tf.float32:
                raise ValueError(
                    f"optimizer_sharding='gradients' reduces float32 gradients, but that of "
                    f"{variables[i].path!r} is {gradients[i].dtype.name}; use "
                    "optimizer_sharding='optimizer'."
                )
        out: list = [None] * len(gradients)
        if sparse:
            gathered = self._strategy.gather_sparse_gradients(
                [gradients[i] for i in sparse], num_samples
            )
            for i, g in zip(sparse, gathered):
                out[i] = g
        parts = [self._by_whole[id(variables[i])] for i in present]
        tables = [table(gradients[i], p) for i, p in zip(present, parts)]
        shared = tf.concat(
            [
                *[tf.reshape(e, [-1]) for e in extras],
                tf.reshape(tf.cast(num_samples, tf.float32), [1]),
            ],
            axis=0,
        )
        tables.append(tf.tile(shared[None], [n, 1]))
        *rows, shared = self._strategy.reduce_scatter(tables)
        scale = 1.0 / tf.maximum(shared[-1], 1.0)
        for i, row in zip(present, rows):
            out[i] = _Scattered(row * scale)
        means, start = [], 0
        for e in extras:
            size = int(np.prod(e.shape))
            means.append(tf.reshape(shared[start : start + size] * scale, e.shape))
            start += size
        return out, means

    def _gathered(self, parts) -> list:
        """Every replica's updated parts, as whole values (one all-gather per dtype)."""
        out = {}
        for dtype in dict.fromkeys(p.whole.dtype for p in parts):
            group = [p for p in parts if p.whole.dtype == dtype]
            mine = tf.concat([tf.reshape(tf.convert_to_tensor(p.piece), [-1]) for p in group], 0)
            table = self._strategy.all_gather(mine)  # [replicas, sum of lengths]
            start = 0
            for p in group:
                flat = tf.reshape(table[:, start : start + p.length], [-1])[: p.size]
                out[id(p)] = tf.reshape(flat, p.whole.shape)
                start += p.length
        return [out[id(p)] for p in parts]

    def _finalize(self, var_list) -> None:
        """End of `fit` with `use_ema=True`: the weights become their moving
        averages, gathered whole from every replica's parts (eager, every
        worker)."""
        optimizer = self.optimizer
        if not optimizer.use_ema or not self.parts:
            return
        averages = _compat.moving_averages(optimizer)
        for part, value in zip(self.parts, self._gather_whole(list(zip(averages, self.parts)))):
            part.whole.assign(value)
        local = self._strategy.local_replica_variables
        for part, average in zip(self.parts, averages):
            for piece, mine in zip(local(part.piece), local(average)):
                piece.assign(mine)

    # -- files: whole values (eager, every worker) -------------------------------------

    def _gather_whole(self, pieces) -> list:
        """`[(variable holding this replica's part, its Part), ...]` as whole
        arrays, every replica's parts joined (one collective for all)."""
        first = self._strategy.first_local_replica
        slots = []
        for variable, part in pieces:
            slot = np.zeros((self._strategy.num_replicas, part.length), np.dtype(variable.dtype))
            for i, mine in enumerate(self._strategy.local_replica_values(variable)):
                slot[first + i] = mine
            slots.append(slot)
        return [
            summed.reshape(-1)[: part.size].reshape(part.whole.shape)
            for summed, (_, part) in zip(self._strategy.sync_sum(slots), pieces)
        ]

    def _whole_slots(self) -> dict:
        """`{id(slot): whole value}` for this replica's parts of the
        optimizer's slots, gathered from every replica (one collective)."""
        sharded = [v for v in self.optimizer.variables if self.sharded(v)]
        gathered = self._gather_whole([(v, self._slot_part[id(v)]) for v in sharded])
        return {id(v): value for v, value in zip(sharded, gathered)}

    @contextlib.contextmanager
    def gathered(self):
        """Every worker gathers the whole slots on entry (a collective);
        saves inside the block (on the chief alone, say) write those."""
        self._whole = self._whole_slots()
        try:
            yield
        finally:
            self._whole = None

    def _save(self, saved, store) -> None:
        """`saved.save_own_variables`: its variables, the slots whole."""
        whole = self._whole if self._whole is not None else self._whole_slots()
        for i, variable in enumerate(saved.variables):
            store[str(i)] = (
                whole[id(variable)]
                if self.sharded(variable)
                else np.asarray(keras.ops.convert_to_numpy(variable))
            )

    def _load(self, saved, keras_load, store) -> None:
        """`saved.load_own_variables`: this replica's part of each whole slot."""
        variables = list(saved.variables)
        if len(store.keys()) != len(variables):
            return keras_load(store)  # Keras's own warning, nothing loaded
        for i, variable in enumerate(variables):
            value = np.asarray(store[str(i)])
            part = self._slot_part.get(id(variable))
            if part is None:
                variable.assign(value)
                continue
            if self._loaded is not None:
                self._loaded[id(variable)] = value
            self._assign_parts(variable, value)

    def _assign_parts(self, variable, whole: np.ndarray) -> None:
        """Each local replica's copy of `variable` takes its part of `whole`."""
        part, first = self._slot_part[id(variable)], self._strategy.first_local_replica
        for i, mine in enumerate(self._strategy.local_replica_variables(variable)):
            mine.assign(piece_of_array(whole, part, first + i))

    @contextlib.contextmanager
    def keeping_loaded(self):
        """A load inside the block keeps the whole slots it read, for
        `share_loaded` (outside, a load keeps only this replica's parts)."""
        self._loaded = {}
        yield

    def sharded(self, variable) -> bool:
        """Whether `variable` (an optimizer variable) holds this replica's part."""
        return id(variable) in self._slot_part

    def share_loaded(self, root: int = 0) -> None:
        """After `root` alone loaded a file (in `keeping_loaded`): every
        replica takes its part of the whole slots `root` read (eager, every
        worker)."""
        sharded = [v for v in self.optimizer.variables if self.sharded(v)]
        loaded = self._loaded or {}
        mine = []
        for variable in sharded:
            part = self._slot_part[id(variable)]
            shape, dtype = tuple(part.whole.shape), np.dtype(variable.dtype)
            mine.append(
                loaded[id(variable)]
                if self._strategy.rank == root and id(variable) in loaded
                else np.zeros(shape, dtype)
            )
        for variable, value in zip(sharded, self._strategy.sync_sum(mine)):
            self._assign_parts(variable, value)
        self._loaded = None
