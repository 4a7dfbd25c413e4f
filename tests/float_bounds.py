"""How far apart two float32 computations of the same math may end: the
tolerances of the tests that compare them, derived, not measured.

Two runs a test compares (a model on two replicas against one device, a
model split over devices against whole, one CPU against another) compute
the same math with other kernels: a batch split over replicas, a matmul
kernel chosen by the number of rows, by the CPU's vector width or by the
library (oneDNN or Eigen), a reduction done in a collective. What such
kernels change is the order in which they add. float32 rounds every result
to within EPS/2 of it, relatively (EPS = `np.finfo(np.float32).eps`,
2**-23); a sum of n terms added in any order is within (n - 1) * EPS/2 *
sum|terms| of the exact sum, so two orders differ by at most
n * EPS * sum|terms| (`reordered_sum`). Elementwise + - * / and sqrt are
correctly rounded, so they give the same result wherever their inputs are
the same; functions such as exp, tanh or log are within a few units in the
last place (counted here as 4 terms each).

The helpers turn that into bounds, first order in EPS, on what the tests
compare:

* a forward pass (`outputs_apart`, `losses_apart`, `accuracy_apart`): a dot
  product of k terms computed in any order is the exact dot product with
  every weight moved by at most k * EPS/2 of itself (backward error); two
  orders, by k * EPS. So two runs' outputs differ by at most
  sum_w |dy/dw| * (k_w * EPS * |w| + |w - w'|), with |dy/dw| from the
  Jacobian and |w - w'| the weights' own bound, if they differ;
* a gradient (`Trace`, `gradient_terms`, `gradient_errors`): the mean over
  a batch of the rows' gradients, each of which passes through the sums of
  every layer (forward and backward); two runs' gradients differ by at most
  terms * EPS * mean_rows |row gradient| (the largest of the weight's
  layer), with `terms` the batch's rows plus the sums along the way;
* the weights after training (`sgd_steps_apart`, `adam_steps_apart`,
  `optimizer_steps_apart`): each step's gradient difference moves the
  weights by what the optimizer makes of it (SGD: the learning rate times
  it; Adam: a fraction of the learning rate). A difference in the weights
  also changes the next gradients, by the loss's curvature times it; a
  step with learning rate times curvature within (0, 2) does not make it
  grow, which training that converges implies, so the steps' new
  differences add up. Each value's update rounds besides
  (`rounded_steps`).

`Reference` puts them together for a test: a reference run, traced, and the
bounds on another run's weights, logs, `evaluate` and `predict`;
`assert_within` compares with a bound per element.
"""

from __future__ import annotations

import contextlib
import math

import keras
import numpy as np
import tensorflow as tf

EPS = float(np.finfo(np.float32).eps)
# A function such as exp, tanh or log: within a few units in the last place.
FUNCTION_TERMS = 4
# The operations of an optimizer's update of one value (Adam's: 8 with its
# bias corrections), each rounding its result.
UPDATE_TERMS = 8


def reordered_sum(terms: int, magnitude, dtype: str = "float32"):
    """The most two float32 sums of the same `terms` numbers, of absolute
    values adding up to `magnitude`, differ when added in other orders:
    each is within (terms - 1) * EPS/2 * magnitude of the exact sum (of
    another `dtype`: its own eps for EPS). So also the most one sum is from
    the exact sum, or from one in float64."""
    return terms * (EPS if dtype == "float32" else float(_finfo(dtype).eps)) * magnitude


def compression_terms(dtype: str) -> float:
    """A gradient all-reduce in `dtype` ("float16" or "bfloat16", as
    `DistributedOptimizer(compression=...)` sends them), as terms of
    `gradient_errors`: each replica's gradient of its rows' loss sum is
    rounded to `dtype`, and so is the sum of those, each within eps/2 of
    the sum of its rows' |gradients| (eps the dtype's): eps / EPS terms in
    all. A value too small for the dtype's normal numbers rounds to within
    half its smallest step instead, absolutely: `compression_floor`."""
    return float(_finfo(dtype).eps) / EPS


def compression_floor(dtype: str, rows: int) -> float:
    """See `compression_terms`: two roundings of half the dtype's smallest
    step each, in the sum over a batch of `rows` rows (the reduced gradient
    is that sum divided by their number), per gradient element."""
    return float(_finfo(dtype).smallest_subnormal) / rows


def _finfo(dtype: str):
    import ml_dtypes  # bfloat16's (TensorFlow's own dependency)

    return ml_dtypes.finfo(getattr(ml_dtypes, dtype) if dtype == "bfloat16" else np.dtype(dtype))


def assert_within(actual, desired, bound, err_msg: str = "") -> None:
    """|actual - desired| <= bound, elementwise (`bound` one number or an
    array for every element: numpy's assert_allclose takes one atol)."""
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    assert actual.shape == desired.shape, (err_msg, actual.shape, desired.shape)
    gap = np.abs(actual - desired)
    bound = np.broadcast_to(np.asarray(bound, np.float64), gap.shape)
    over = ~(gap <= bound)
    if over.any():
        at = np.unravel_index(np.argmax(np.where(over, gap - bound, -np.inf)), gap.shape)
        raise AssertionError(
            f"{err_msg}: {int(over.sum())} of {gap.size} elements further apart than their "
            f"bound; the furthest at {at}: {actual[at]!r} against {desired[at]!r}, "
            f"{gap[at]:.3g} apart, bound {bound[at]:.3g}"
        )


def _kernels(model) -> list:
    return [v for v in model.trainable_weights if len(v.shape) >= 2]


def fan_in_terms(model) -> int:
    """The terms of the longest dot product of `model`'s layers, with its
    bias and the function after it: the relative error, in EPS, of the
    weights that give a forward pass's rounding (see the module doc)."""
    return max(math.prod(v.shape[:-1]) for v in _kernels(model)) + 1 + FUNCTION_TERMS


def gradient_terms(model, rows: int) -> int:
    """The terms a gradient element of `model` adds, on a batch of `rows`:
    the rows' gradients, for each kernel its dot products forward (fan-in,
    the bias, the function after it) and backward (fan-out), and for each
    BatchNormalization layer the sums over the rows it adds in training
    (two forward, two backward) and its inverse square root (see
    `moving_statistics_apart`'s notes)."""
    return (
        rows
        + sum(math.prod(v.shape[:-1]) + 1 + FUNCTION_TERMS + v.shape[-1] for v in _kernels(model))
        + len(_batch_norms(model)) * (4 * rows + FUNCTION_TERMS)
    )


# -- what a reference run computes, row by row ------------------------------------------


def _per_row(loss, loss_weights=None):
    """`loss` (a Keras loss, its name, a function, or a dict or list of
    them for a model's outputs, weighed by `loss_weights`) as a function of
    (y, outputs) giving one value per row."""
    if isinstance(loss, dict):
        weights = loss_weights or {}
        parts = {name: _per_row(part) for name, part in loss.items()}
        return lambda y, outputs: tf.add_n(
            [
                weights.get(name, 1.0) * _row_means(part(y[name], outputs[name]))
                for name, part in parts.items()
            ]
        )
    if isinstance(loss, (list, tuple)):
        weights = loss_weights or [1.0] * len(loss)
        parts = [_per_row(part) for part in loss]
        return lambda y, outputs: tf.add_n(
            [w * _row_means(part(t, o)) for w, part, t, o in zip(weights, parts, y, outputs)]
        )
    if isinstance(loss, keras.losses.Loss):
        return loss.__class__.from_config({**loss.get_config(), "reduction": None})
    function = keras.losses.get(loss) if isinstance(loss, str) else loss

    def rows(y, outputs):
        values = function(y, outputs)
        if values.shape.rank == 0:  # a function reducing the batch: row by row
            values = tf.map_fn(
                lambda row: function(row[0][None], row[1][None]),
                (y, outputs),
                fn_output_signature=values.dtype,
            )
        return values

    return rows


def _row_means(values):
    """A loss's values per row: the mean over each row's elements."""
    values = tf.cast(values, tf.float32)
    return tf.reduce_mean(tf.reshape(values, [tf.shape(values)[0], -1]), axis=1)


def _loss_of(model):
    """(the loss `model` was compiled with, its loss weights)."""
    compiled = getattr(model, "_compile_loss", None)
    return model.loss, getattr(compiled, "_user_loss_weights", None)


def _jacobian(tape, values, model) -> list:
    """The Jacobian of `values` for `model`'s trainable weights: vectorized,
    or one row at a time where the model has a loop (an RNN) pfor cannot
    vectorize."""
    try:
        return tape.jacobian(values, model.trainable_weights)
    except (ValueError, TypeError, NotImplementedError):
        return tape.jacobian(values, model.trainable_weights, experimental_use_pfor=False)


def _zeros_for_none(gradients, values, model) -> list:
    """Jacobians of per-row `values`, with zeros for the weights they miss."""
    return [
        tf.zeros(tf.concat([tf.shape(values), tf.shape(w)], 0)) if g is None else g
        for g, w in zip(gradients, model.trainable_weights)
    ]


class Rows:
    """Row by row, at `model`'s weights: the loss (`loss` as compiled, its
    layer losses added to every row) and its gradient, and with `outputs`
    the outputs (flattened) and their gradients; each gradient an array
    per trainable weight, rows first. `training` as in a training or a test
    step. Leaves the model's other variables (statistics, seeds) as they
    were.

    A model of several outputs: each output's own loss too (`parts`). A
    custom step whose optimizers each minimize their own loss (a GAN's
    discriminator and generator): `phases`, {name: (function(model, x, y)
    -> each row's loss, the variables it updates)}; each weight's gradient
    is then its phase's, and each phase is a part (one that updates none
    is only logged).
    """

    def __init__(self, model, loss, training=True, outputs=False, loss_weights=None, phases=None):
        self.model, self.training, self.outputs, self.phases = (
            model,
            training,
            outputs,
            phases or {},
        )
        self.per_row = None if phases else _per_row(loss, loss_weights)
        self.parts = (
            {name: _per_row(part) for name, part in loss.items()}
            if isinstance(loss, dict) and not phases
            else {}
        )
        self._function = tf.function(self._rows, reduce_retracing=True)

    def _rows(self, x, y, sample_weight, real):
        model = self.model
        with tf.GradientTape(persistent=True) as tape:
            outputs = model(x, training=self.training) if self.outputs or not self.phases else None
            parts = {
                name: _row_means(part(y[name], outputs[name])) * sample_weight
                for name, part in self.parts.items()
            }
            parts.update(
                {
                    name: _row_means(fn(model, x, y)) * sample_weight
                    for name, (fn, _) in self.phases.items()
                }
            )
            if self.phases:  # the loss: the phases' that update variables
                values = tf.add_n(
                    [parts[name] for name, (_, variables) in self.phases.items() if variables]
                )
            else:
                values = _row_means(self.per_row(y, outputs)) * sample_weight
                if model.losses:
                    values += real * tf.add_n([tf.cast(v, tf.float32) for v in model.losses])
        if not self.phases:
            found_gradients = _zeros_for_none(_jacobian(tape, values, model), values, model)
        found = {
            "losses": values,
            "outputs": outputs if outputs is not None else values,
            "parts": {
                name: {
                    "losses": v,
                    "gradients": _zeros_for_none(_jacobian(tape, v, model), v, model),
                }
                for name, v in parts.items()
            },
        }
        if self.phases:  # each weight's gradient: its phase's
            updates = {
                id(v): name for name, (_, variables) in self.phases.items() for v in variables
            }
            found["gradients"] = [
                found["parts"][updates[id(w)]]["gradients"][i]
                if id(w) in updates
                else tf.zeros(tf.concat([tf.shape(values), tf.shape(w)], 0))
                for i, w in enumerate(model.trainable_weights)
            ]
        else:
            found["gradients"] = found_gradients
        if self.outputs:
            found["output_gradients"] = [
                _zeros_for_none(_jacobian(tape, o, model), o, model)
                for o in keras.tree.flatten(outputs)
            ]
        return found

    def __call__(self, x, y, sample_weight=None, real=None) -> dict:
        """`real`: 1 for the rows, 0 for padding (whose `sample_weight` is 0)."""
        kept = [np.asarray(v) for v in self.model.non_trainable_variables]
        count = _count(x)
        ones = np.ones(count, "float32")
        found = self._function(
            x,
            y,
            tf.constant(ones if sample_weight is None else sample_weight),
            tf.constant(ones if real is None else real),
        )
        for variable, value in zip(self.model.non_trainable_variables, kept):
            variable.assign(value)
        return keras.tree.map_structure(lambda t: np.asarray(t, np.float64), found)


def _tensors(x):
    """`x` (arrays, tensors, strings) as tensors: Keras takes no mix of both."""
    return keras.tree.map_structure(
        lambda a: (
            a if isinstance(a, (tf.RaggedTensor, tf.SparseTensor)) else tf.convert_to_tensor(a)
        ),
        x,
    )


def _mean_rounding(steps: int) -> float:
    """The rounding of an accuracy logged as a mean (of 0s and 1s, at most
    1) over `steps` steps: its sums (whole numbers, or steps' means, each
    rounding once) and the division, relative to 1."""
    return reordered_sum(steps + 2, 1.0)


def _count(x) -> int:
    """The number of rows of `x` (arrays or tensors, ragged and sparse ones too)."""
    first = keras.tree.flatten(x)[0]
    if isinstance(first, tf.RaggedTensor):
        return int(first.nrows())
    return int(first.shape[0])


def _take(values, rows):
    """The `rows` of an array or tensor (ragged and sparse ones too)."""
    if values is None:
        return None
    if isinstance(values, tf.SparseTensor):
        return tf.sparse.from_dense(tf.gather(tf.sparse.to_dense(values), rows))
    if isinstance(values, tf.RaggedTensor):
        return tf.gather(values, rows)
    return np.asarray(values)[rows]


class Trace(keras.callbacks.Callback):
    """Records what each step of the model's `fit` starts from: its weights,
    the batch's mean gradient (`gradients`), the means over the batch's rows
    of each row's |gradient| (`magnitudes`) and |loss| (`losses`), and with
    `outputs` each row's outputs and their |gradients|.

    As a callback: for `fit` over arrays in order (`shuffle=False`, one step
    per execution) with `batch_size`; `loss` as compiled (see `Rows`).
    `shuffled` (the rows of each step unknown): each step's `magnitudes`
    are the largest over all the rows instead, and no `gradients`. A custom
    step's `phases`: {name: (function(model, x, y) -> each row's loss,
    function(model) -> the variables it updates, function(model) -> its
    optimizer)} (see `Rows`). Else (`model` given), `record` each step before it runs.
    Also records Adam's `velocities` after each step.
    """

    def __init__(
        self,
        x=None,
        y=None,
        batch_size=None,
        loss=None,
        sample_weight=None,
        outputs=False,
        model=None,
        shuffled=False,
        phases=None,
    ):
        super().__init__()
        self.shuffled, self.phases = shuffled, phases
        if model is not None:
            self.set_model(model)
            loss = model.loss if loss is None else loss
        self.x, self.y, self.sample_weight = x, y, sample_weight
        self.batch_size, self.loss, self.with_outputs = batch_size, loss, outputs
        self.weights, self.gradients, self.magnitudes, self.losses = [], [], [], []
        self.rows, self.outputs, self.output_magnitudes, self.labels = [], [], [], []
        self.rounding = []  # each step's loss's own rounding (`_loss_rounding`)
        self.end = None  # the weights after the last step
        self.optimizer_start = None  # the optimizer's variables before the first
        self.velocities = []  # Adam's, after each step
        self.parts = {}  # "<output>_loss": its magnitudes, losses, rounding per step
        self._rows = None

    def on_train_end(self, logs=None):
        self.end = [np.asarray(v, np.float64) for v in self.model.trainable_weights]

    def _batch(self, batch):
        """The rows of step `batch` of an epoch, padded to `batch_size` (one
        shape: one trace) with rows weighing 0; their weights; their count."""
        start = batch * self.batch_size
        rows = np.arange(start, start + self.batch_size)
        count = int(np.sum(rows < _count(self.x)))
        rows = np.where(rows < start + count, rows, start)
        weight = np.ones(self.batch_size, "float32")
        weight[count:] = 0.0
        if self.sample_weight is not None:
            weight *= np.asarray(self.sample_weight, "float32")[rows]
        return rows, weight, count

    @property
    def optimizers(self) -> list:
        """The optimizers that train the model (a phase's each)."""
        if self.phases:
            return [optimizer(self.model) for _, _, optimizer in self.phases.values()]
        return [self.model.optimizer]

    def on_train_batch_end(self, batch, logs=None):
        velocities = []  # Adam's, of each trainable weight
        for weight in self.model.trainable_weights:
            for optimizer in self.optimizers:
                slots = getattr(optimizer, "_velocities", None)
                try:
                    velocities.append(
                        np.asarray(slots[optimizer._get_variable_index(weight)], np.float64)
                    )
                    break
                except (TypeError, KeyError, ValueError):
                    continue
            else:
                return
        self.velocities.append(velocities)

    def on_train_batch_begin(self, batch, logs=None):
        if self.shuffled:
            self._every_row()
            return
        rows, weight, count = self._batch(batch)
        self.record(
            keras.tree.map_structure(lambda a: _take(a, rows), self.x),
            keras.tree.map_structure(lambda a: _take(a, rows), self.y),
            weight,
            count,
        )

    def _every_row(self):
        """A step of unknown rows: the largest |gradient| over all rows."""
        if self._rows is None:
            self._rows = Rows(self.model, self.loss, loss_weights=_loss_of(self.model)[1])
            self.optimizer_start = [np.asarray(v) for v in self.model.optimizer.variables]
            self.gradients = None
        found = self._rows(self.x, self.y, self.sample_weight)
        self.weights.append([np.asarray(v, np.float64) for v in self.model.trainable_weights])
        self.magnitudes.append([np.abs(g).max(axis=0) for g in found["gradients"]])
        self.losses.append(float(np.abs(found["losses"]).max()))
        self.rows.append(self.batch_size)
        self.end = [np.asarray(v, np.float64) for v in self.model.trainable_weights]

    def record(self, x, y, sample_weight=None, count=None):
        """Records a step on (`x`, `y`) about to start: for a `fit`, the
        callback does; a test calling `train_on_batch` calls it before."""
        if self._rows is None:
            phases = {
                name: (loss, variables(self.model))
                for name, (loss, variables, _) in (self.phases or {}).items()
            }
            self._rows = Rows(
                self.model,
                self.loss,
                outputs=self.with_outputs,
                loss_weights=_loss_of(self.model)[1],
                phases=phases,
            )
            self.optimizer_start = [np.asarray(v) for v in self.model.optimizer.variables]
        count = _count(x) if count is None else count
        real = None if sample_weight is None else (sample_weight > 0).astype("float32")
        found = self._rows(x, y, sample_weight, real)
        self.weights.append([np.asarray(v, np.float64) for v in self.model.trainable_weights])
        self.gradients.append([g.sum(axis=0) / count for g in found["gradients"]])
        self.magnitudes.append([np.abs(g).sum(axis=0) / count for g in found["gradients"]])
        self.losses.append(float(np.abs(found["losses"]).sum() / count))
        self.rounding.append(
            _loss_rounding(count, found["losses"][:count], _flat_rows(found["outputs"])[:count])
        )
        self.rows.append(count)
        flat = _flat_rows(found["outputs"])[:count]
        for name, part in found["parts"].items():  # each output's loss (`Rows`)
            kept = self.parts.setdefault(
                f"{name}_loss", {"magnitudes": [], "losses": [], "rounding": []}
            )
            kept["magnitudes"].append([np.abs(g).sum(axis=0) / count for g in part["gradients"]])
            kept["losses"].append(float(np.abs(part["losses"]).sum() / count))
            kept["rounding"].append(_loss_rounding(count, part["losses"][:count], flat))
        if self.with_outputs:
            self.labels.append(None if y is None or isinstance(y, dict) else np.asarray(y)[:count])
            self.outputs.append([o[:count] for o in keras.tree.flatten(found["outputs"])])
            self.output_magnitudes.append(
                [[np.abs(g[:count]) for g in output] for output in found["output_gradients"]]
            )
        self.end = [np.asarray(v, np.float64) for v in self.model.trainable_weights]


# -- the weights after training -------------------------------------------------------------


def gradient_errors(trace: Trace, terms: float, floor: float = 0.0) -> list:
    """Per step, per weight: how far two runs' gradients may differ there,
    `reordered_sum(terms, magnitude)`, with the magnitude the largest mean
    over rows of |row gradient| of the weight's layer (`_layers`): a sum
    inside the backward pass may cancel for one weight (an attention key's
    bias, whose gradient is 0 as softmax ignores a shift; a unit whose
    classes' terms cancel), and its rounding is then of the size of the
    terms the layer adds, not of the weight's own gradient; but in a table
    rows are looked up in, a row no input looks up has none (`_tables`).
    `floor`: an absolute error every gradient element may have besides (see
    `compression_floor`)."""
    groups, tables = _layers(trace.model), _tables(trace.model)
    found = []
    for step in trace.magnitudes:
        largest = {}
        for group, m in zip(groups, step):
            largest[group] = max(largest.get(group, 0.0), float(np.max(m, initial=0.0)))
        found.append(
            [
                reordered_sum(
                    terms, _looked_up(m) * largest[g] if table else np.full(m.shape, largest[g])
                )
                + floor
                for g, m, table in zip(groups, step, tables)
            ]
        )
    return found


def _tables(model) -> list:
    """For each trainable weight of `model`, whether it is a table rows are
    looked up in (an Embedding's): a row no input looks up has a gradient
    of exactly 0 in any run (no term adds to it)."""
    embeddings = {
        id(v)
        for layer in model._flatten_layers(include_self=False)
        if isinstance(layer, keras.layers.Embedding)
        for v in layer.trainable_weights
    }
    return [id(v) in embeddings for v in model.trainable_weights]


def _looked_up(magnitude) -> np.ndarray:
    """1 for the rows of a table (first axis) some row of the batch looked
    up (a gradient term there), 0 for the others, broadcast to its shape."""
    rows = np.any(magnitude != 0, axis=tuple(range(1, magnitude.ndim)), keepdims=True)
    return np.broadcast_to(rows.astype(np.float64), magnitude.shape)


def _layers(model) -> list:
    """For each trainable weight of `model`, its layer (its path but the last part)."""
    return [v.path.rpartition("/")[0] for v in model.trainable_weights]


def sgd_steps_apart(
    trace: Trace, learning_rate, terms: float, momentum: float = 0.0, floor: float = 0.0
) -> list:
    """Per step, a bound on each trainable weight after it, for SGD
    (`learning_rate`: one value, or one per step). Each step's gradient
    difference moves the weights by the learning rate times it, and with
    momentum m by m, m**2, ... of that in the steps after: 1 / (1 - m) in
    all. The update rounds its result too (see `rounded_steps`)."""
    rates = np.broadcast_to(np.asarray(learning_rate, np.float64), (len(trace.magnitudes),))
    apart, steps = [np.zeros_like(w) for w in trace.weights[0]], []
    for rate, errors, rounded in zip(
        rates, gradient_errors(trace, terms, floor), rounded_steps([*trace.weights, trace.end])
    ):
        apart = [a + rate * e / (1.0 - momentum) for a, e in zip(apart, errors)]
        steps.append([a + r for a, r in zip(apart, rounded)])
    return steps


def rounded_steps(trajectory: list) -> list:
    """Per step of `trajectory` (the values before the first step, then
    after each), what rounding adds up to by then, per value, once the two
    runs' inputs differ: each step's result may round to the other
    neighbour (EPS * |value|), and so may the result of each of the up to
    `UPDATE_TERMS` operations of its update (EPS * |change| each)."""
    total, steps = [np.zeros_like(v) for v in trajectory[0]], []
    for previous, values in zip(trajectory, trajectory[1:]):
        total = [
            t + EPS * (np.abs(v) + UPDATE_TERMS * np.abs(v - p))
            for t, v, p in zip(total, values, previous)
        ]
        steps.append(total)
    return steps


def _variable(value, dtype, path=None):
    """A Keras variable of `value`, at `path` (as the weight it copies: an
    optimizer may choose by path)."""
    if path is None:
        return keras.Variable(value, dtype=dtype)
    scopes, _, name = path.rpartition("/")
    with contextlib.ExitStack() as stack:
        for scope in filter(None, scopes.split("/")):
            stack.enter_context(keras.name_scope(scope))
        return keras.Variable(value, dtype=dtype, name=name)


class _Replay:
    """The optimizer `make_optimizer()` makes, applying a sequence of
    gradients to float64 copies of the weights (with their constraints), as
    often as asked, from the same start."""

    def __init__(
        self,
        make_optimizer,
        initial,
        constraints,
        optimizer_start=None,
        dtype="float64",
        paths=None,
    ):
        self.variables = [
            _variable(w, dtype, path) for w, path in zip(initial, paths or [None] * len(initial))
        ]
        self.dtype = dtype
        for variable, constraint in zip(self.variables, constraints):
            variable.constraint = constraint
        self.initial = [np.asarray(w, np.float64) for w in initial]
        self.optimizer = make_optimizer()
        self.optimizer.build(self.variables)
        self.start = [np.asarray(v) for v in self.optimizer.variables]
        if optimizer_start and len(optimizer_start) == len(self.start):
            # Where the reference's optimizer started (built: a fit builds it first).
            self.start = [
                np.asarray(v, s.dtype).reshape(s.shape)
                for v, s in zip(optimizer_start, self.start, strict=True)
            ]
        # A loss-scale optimizer divides by its scale (a power of 2: exact).
        self.scale = float(np.asarray(getattr(self.optimizer, "dynamic_scale", 1.0)))
        self.step = tf.function(self._step)

    def _step(self, gradients):
        self.optimizer.apply([g * self.scale for g in gradients], self.variables)

    def values(self, finalize=False) -> list:
        """The weights, then the optimizer's variables, as they are now
        (`finalize`: the weights' moving averages in their place, where it
        keeps them, as `fit` leaves them at its end)."""
        held = [np.asarray(v, np.float64) for v in self.variables]
        if finalize and self.optimizer.use_ema:
            self.optimizer.finalize_variable_values(self.variables)
        values = [np.asarray(v, np.float64) for v in [*self.variables, *self.optimizer.variables]]
        for variable, value in zip(self.variables, held):
            variable.assign(value)
        return values

    def __call__(self, gradients) -> list:
        """The values after each step of applying `gradients` (each with
        the steps first), from the start."""
        for variable, value in zip(
            [*self.variables, *self.optimizer.variables], [*self.initial, *self.start]
        ):
            variable.assign(value)
        steps = []
        count = len(gradients[0])
        for step in range(count):
            self.step([tf.constant(g[step], self.dtype) for g in gradients])
            steps.append(self.values(finalize=step == count - 1))
        return steps


def optimizer_steps_apart(
    make_optimizer, trace: Trace, terms: float, constraints=None, floor: float = 0.0
) -> list:
    """Per step, (bounds on the trainable weights, bounds on the optimizer's
    variables) after it, for training with the optimizer `make_optimizer()`
    makes, whatever it is.

    First order in EPS, a value after step t differs by at most
    sum_k |d value / d g_k| * e_k over the steps k <= t, with e_k step k's
    gradient bound (`gradient_errors`). Each term is measured by replaying
    the optimizer (Keras's own, on float64 copies of the weights, with
    their `constraints`) over the reference run's gradients (`trace`), with
    step k's moved by +e_k and by -e_k: the larger change of each value (in
    float32 for an optimizer that computes only in float32, whose rounding
    then adds to the changes). An elementwise optimizer's values each depend
    on their own gradients only, so one replay per step and sign measures
    every value at once. The updates' own rounding comes on top
    (`rounded_steps`).

    For Adam (update lr * m / (sqrt(v) + eps), with m and v moving averages
    of g and g**2 whose weights a_k, b_k each sum to 1 after the bias
    correction) this comes to: a gradient error e moves m by at most e and
    sqrt(v), a weighted 2-norm of the gradients, by at most e too, so the
    update by at most lr * (1 + |m| / sqrt(v)) * e / (sqrt(v) + eps), where
    |m| / sqrt(v) <= sqrt(sum_k a_k**2 / b_k) (Cauchy-Schwarz), 1 to 3 for
    Keras's betas. Adam divides the gradient's error by the gradient's own
    size: each step's bound is a fraction of the learning rate, about
    lr * (rows + sums) * EPS times the ratio of the rows' mean |gradient|
    to sqrt(v), and larger only where the rows' gradients cancel (where
    Adam's step follows rounding in any case). An optimizer that takes a
    sign (Lion) moves by a whole step where the error can flip it, and the
    same elsewhere.
    """
    gradients = [
        np.stack([step[i] for step in trace.gradients]) for i in range(len(trace.gradients[0]))
    ]
    constraints = constraints or [None] * len(gradients)
    paths = [v.path for v in trace.model.trainable_weights]
    try:
        replay = _Replay(
            make_optimizer, trace.weights[0], constraints, trace.optimizer_start, paths=paths
        )
        start = replay.values()
        base = replay(gradients)
    except TypeError:  # an optimizer of float32 only (Muon): its own rounding adds
        replay = _Replay(
            make_optimizer, trace.weights[0], constraints, trace.optimizer_start, "float32", paths
        )
        start = replay.values()
        base = replay(gradients)
    apart = rounded_steps([start, *base])
    for step, step_errors in enumerate(gradient_errors(trace, terms, floor)):
        changes = None
        for sign in (1.0, -1.0):
            moved = [g.copy() for g in gradients]
            for g, e in zip(moved, step_errors):
                g[step] += sign * e
            worst = [[np.abs(v - b) for v, b in zip(*pair)] for pair in zip(replay(moved), base)]
            changes = (
                worst
                if changes is None
                else [[np.maximum(a, b) for a, b in zip(*pair)] for pair in zip(changes, worst)]
            )
        apart = [[a + c for a, c in zip(*pair)] for pair in zip(apart, changes)]
    count = len(gradients)
    return [(values[:count], values[count:]) for values in apart]


def adam_steps_apart(trace: Trace, optimizer, terms: float, floor: float = 0.0) -> list:
    """Per step, a bound on each trainable weight after it, for Keras's Adam
    (`optimizer`: the reference's), from the gradients' bounds and the
    reference's velocities alone (for a trace that does not know each
    step's rows, so cannot replay them: see `optimizer_steps_apart`).

    Adam's step t moves a weight by lr * m / (s + eps_t): m = sum_k a_k g_k
    and s = sqrt(sum_k b_k g_k**2) averages of the gradients so far with
    weights a_k = (1 - b1) b1**(t-k) / (1 - b1**t) and b_k likewise with b2,
    each summing to 1 (the bias correction), and eps_t = eps / sqrt(1 - b2**t)
    (Keras's form). With every gradient so far within E of the other run's
    (the largest of their bounds), m moves by at most E, and s, a weighted
    2-norm, by at most E too; |m| <= C_t * s, C_t = sqrt(sum_k a_k**2 / b_k)
    (Cauchy-Schwarz). So the step moves by at most
    lr * (1 + C_t) * E / (s + eps_t - E), and by at most 2 * lr * C_t
    whatever the gradients (each run's step is at most lr * C_t). s is the
    reference's own; the steps' bounds add up (see the module doc).
    """
    assert (
        type(optimizer).__name__ == "Adam"
        and not optimizer.amsgrad
        and not any(
            getattr(optimizer, k, None)
            for k in ("clipnorm", "clipvalue", "global_clipnorm", "use_ema")
        )
    ), f"not Keras's plain Adam: {optimizer}"
    assert len(trace.velocities) == len(trace.magnitudes), "no velocity for some step"
    beta_1, beta_2 = float(optimizer.beta_1), float(optimizer.beta_2)
    epsilon = float(optimizer.epsilon)
    start = int(np.asarray(optimizer.iterations)) - len(trace.magnitudes)
    total, largest, steps = None, None, []
    for i, (rate, errors, velocities, rounded) in enumerate(
        zip(
            _rates(optimizer, len(trace.magnitudes)),
            gradient_errors(trace, terms, floor),
            trace.velocities,
            rounded_steps([*trace.weights, trace.end]),
        )
    ):
        t = start + i + 1
        k = np.arange(t - 1, -1, -1)  # t - k for k = 1 .. t
        a = (1 - beta_1) * beta_1**k / (1 - beta_1**t)
        b = (1 - beta_2) * beta_2**k / (1 - beta_2**t)
        reach = math.sqrt(float(np.sum(a * a / b)))
        largest = errors if largest is None else [np.maximum(m, e) for m, e in zip(largest, errors)]
        moved = []
        for v, e in zip(velocities, largest):
            room = np.sqrt(v / (1 - beta_2**t)) + epsilon / math.sqrt(1 - beta_2**t) - e
            apart = np.where(room > 0, (1 + reach) * e / np.maximum(room, 1e-300), np.inf)
            moved.append(rate * np.minimum(apart, 2 * reach))
        total = moved if total is None else [a + m for a, m in zip(total, moved)]
        steps.append([a + r for a, r in zip(total, rounded)])
    return steps


# -- forward passes -------------------------------------------------------------------------


def _moved(model, weights_apart, terms) -> list:
    """Per trainable weight of `model`: how far the other run's weight may
    be from it in effect, its own bound (`weights_apart`, or 0) plus the
    rounding of the dot products it enters (`terms` * EPS of itself, see
    the module doc; `fan_in_terms` by default)."""
    terms = fan_in_terms(model) if terms is None else terms
    weights = [np.asarray(w, np.float64) for w in model.trainable_weights]
    weights_apart = weights_apart or [0.0] * len(weights)
    return [reordered_sum(terms, np.abs(w)) + d for w, d in zip(weights, weights_apart)]


def _through(gradients: list, moved: list):
    """sum over the weights of |gradient| * `moved`, for each row (and
    output): `gradients` one array per weight, rows (and outputs) first."""
    return sum(np.tensordot(np.abs(g), m, axes=m.ndim) for g, m in zip(gradients, moved))


def outputs_apart(model, x, weights_apart=None, terms=None) -> np.ndarray:
    """For each of `model`'s outputs on `x` (a test step's): how far another
    run's may be, computing in other orders (`terms`, see `_moved`) with
    weights within `weights_apart` of `model`'s: sum_w |dy/dw| * moved_w,
    plus the rounding of the last operation (an activation: a function)."""
    moved = _moved(model, weights_apart, terms)
    with tf.GradientTape(persistent=True) as tape:
        outputs = model(_tensors(x), training=False)
        flat = keras.tree.flatten(outputs)
        # A large model: one output element at a time (its whole Jacobian
        # would not fit in memory).
        large = _large(model, flat)
        scalars = [tf.unstack(tf.reshape(o, [-1])) for o in flat] if large else None
    found = []
    for i, output in enumerate(flat):
        if large:
            apart = np.reshape(
                [
                    _through(_gradients(tape, scalar, model, one=True), moved)[0]
                    for scalar in scalars[i]
                ],
                output.shape,
            )
        else:
            apart = _through(_gradients(tape, output, model), moved)
        found.append(apart + reordered_sum(FUNCTION_TERMS, np.abs(np.asarray(output, np.float64))))
    return keras.tree.pack_sequence_as(outputs, found)


def _gradients(tape, output, model, one=False) -> list:
    """The Jacobian of `output` for `model`'s trainable weights, one array
    per weight, `output`'s shape first (`one`: of one element, as (1, ...))."""
    weights = model.trainable_weights
    if one:
        gradients = [
            None if g is None else np.asarray(g, np.float64)[None]
            for g in tape.gradient(output, weights)
        ]
        shape = (1,)
    else:
        try:
            gradients = tape.jacobian(output, weights)
        except (ValueError, TypeError, NotImplementedError):  # not vectorizable (a loop)
            gradients = tape.jacobian(output, weights, experimental_use_pfor=False)
        gradients = [None if g is None else np.asarray(g, np.float64) for g in gradients]
        shape = tuple(output.shape)
    return [
        np.zeros(shape + tuple(w.shape)) if g is None else g for g, w in zip(gradients, weights)
    ]


def _large(model, outputs) -> bool:
    """Whether the Jacobian of `outputs` for `model`'s weights is large (10**7 elements)."""
    weights = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    return weights * sum(int(np.prod(o.shape)) for o in outputs) > 10**7


def _flat_rows(outputs) -> np.ndarray:
    """A model's outputs (one array, or several) as one array of rows."""
    return np.concatenate(
        [np.reshape(o, (len(o), -1)) for o in keras.tree.flatten(outputs)], axis=1
    )


def _loss_rounding(rows: int, losses, outputs):
    """The rounding of a mean loss over `rows` rows itself: the sum over the
    rows, and each row's loss from its outputs (a log of a sum of exps over
    the classes, relative to the largest output)."""
    classes = int(np.prod(outputs.shape[1:]))
    largest = np.abs(outputs).reshape(len(outputs), -1).max(axis=1)
    return reordered_sum(rows + classes + 2 * FUNCTION_TERMS, np.mean(np.abs(losses) + largest))


def losses_apart(model, x, y, loss, outputs_bound, weights_apart=None, terms=None) -> float:
    """How far another run's mean loss over (`x`, `y`) may be (a test step's,
    `loss` as compiled), its outputs within `outputs_bound` of `model`'s
    (`outputs_apart`) and its weights within `weights_apart`: each row's
    loss moves by at most sum over its outputs of |d loss / d output| times
    their bound; layer losses by sum_w |d loss / dw| * moved_w; the loss
    rounds too (`_loss_rounding`)."""
    per_row = _per_row(loss)
    x = _tensors(x)
    outputs = tf.convert_to_tensor(model(x, training=False))
    with tf.GradientTape() as tape:
        tape.watch(outputs)
        values = tf.cast(per_row(y, outputs), tf.float32)
        values = tf.reduce_mean(tf.reshape(values, [tf.shape(values)[0], -1]), axis=1)
        total = tf.reduce_sum(values)
    slopes = np.abs(np.asarray(tape.gradient(total, outputs), np.float64))
    rows = np.sum(
        slopes.reshape(len(slopes), -1) * np.reshape(outputs_bound, (len(slopes), -1)), axis=1
    )
    found = float(np.mean(rows))
    if model.losses:
        with tf.GradientTape() as tape:
            model(x, training=False)
            layer = tf.add_n(model.losses)
        gradients = [
            np.zeros((1, *w.shape)) if g is None else np.asarray(g)[None]
            for g, w in zip(tape.gradient(layer, model.trainable_weights), model.trainable_weights)
        ]
        found += float(_through(gradients, _moved(model, weights_apart, terms))[0])
    return found + _loss_rounding(len(rows), np.asarray(values), np.asarray(outputs))


def accuracy_apart(outputs, outputs_apart, labels=None) -> float:
    """How far another run's count of right predictions, as a share of the
    rows, may be, its outputs within `outputs_apart` of `outputs` (rows
    first): the share of rows whose prediction another run could make
    otherwise, those whose largest output is within both bounds of another
    (one output: of the 0.5 threshold). Elsewhere both runs count the same
    rows. With `labels` (for any top-k accuracy): those whose true class's
    output is within both bounds of another's, where its rank can change.
    (The logged mean rounds besides: `_mean_rounding`.)"""
    outputs, apart = np.asarray(outputs, np.float64), np.asarray(outputs_apart, np.float64)
    if labels is not None:
        true = np.asarray(labels).reshape(-1, 1).astype(int)
        gap = np.abs(outputs - np.take_along_axis(outputs, true, -1))
        reach = apart + np.take_along_axis(apart, true, -1)
        np.put_along_axis(gap, true, np.inf, -1)
        return float(np.mean(np.any(gap <= reach, axis=-1)))
    if outputs.shape[-1] == 1:
        return float(np.mean(np.abs(outputs[..., 0] - 0.5) <= apart[..., 0]))
    top = np.argmax(outputs, axis=-1)[..., None]
    gap = np.take_along_axis(outputs, top, -1) - outputs
    reach = np.take_along_axis(apart, top, -1) + apart
    np.put_along_axis(gap, top, np.inf, -1)
    return float(np.mean(np.any(gap <= reach, axis=-1)))


def _output_of(trace: Trace, key: str) -> int:
    """Which of the model's outputs (flattened) a log `key` is of: the one
    it names (`<output>_accuracy`), or the only one."""
    names = sorted(trace.model.output_names) if len(trace.outputs[0]) > 1 else []
    for i, name in enumerate(names):
        if key.startswith(f"{name}_"):
            return i
    assert len(trace.outputs[0]) == 1, f"which output's is {key}?"
    return 0


def history_apart(
    trace: Trace, weights_steps: list, steps_per_epoch: int, terms=None, key: str = "loss"
) -> list:
    """Per epoch, how far another run's log `key` may be: a loss (`loss`,
    an output's or a phase's `<name>_loss`) or, with a `Trace` of outputs,
    an accuracy (a top-k one: `top` in its name). Each step's loss differs by at most
    sum_w mean_rows |d loss / dw| * moved_w at the weights the step starts
    from (`weights_steps`: the bounds after each step, as `sgd_steps_apart`
    gives them), plus its own rounding; its accuracy by `accuracy_apart` of
    its outputs' bounds (sum_w |d output / dw| * moved_w). The epoch's log
    is the mean over its steps, weighed by their rows, and rounds once per
    step."""
    terms = fan_in_terms(trace.model) if terms is None else terms
    accuracy, top_k = "acc" in key or "top" in key, "top" in key
    kept = (
        trace.parts[key]
        if key in trace.parts
        else {"magnitudes": trace.magnitudes, "losses": trace.losses, "rounding": trace.rounding}
    )
    output = _output_of(trace, key) if accuracy else None
    found = []
    for first in range(0, len(trace.rows), steps_per_epoch):
        steps = range(first, min(first + steps_per_epoch, len(trace.rows)))
        bounds = []
        for step in steps:
            moved = [reordered_sum(terms, np.abs(w)) for w in trace.weights[step]]
            if step:
                moved = [m + b for m, b in zip(moved, weights_steps[step - 1])]
            if accuracy:
                apart = _through(trace.output_magnitudes[step][output], moved)
                bounds.append(
                    accuracy_apart(
                        trace.outputs[step][output], apart, trace.labels[step] if top_k else None
                    )
                )
            else:
                bounds.append(
                    sum(float(np.sum(m * a)) for m, a in zip(moved, kept["magnitudes"][step]))
                    + kept["rounding"][step]
                )
        rows = np.asarray([trace.rows[s] for s in steps], np.float64)
        rounding = (
            _mean_rounding(len(rows))
            if accuracy
            else reordered_sum(len(rows), float(np.mean([kept["losses"][s] for s in steps])))
        )
        found.append(float(np.dot(rows, bounds) / rows.sum()) + rounding)
    return found


# -- a reference run and the bounds on another's --------------------------------------------


def _is_plain_sgd(optimizer) -> bool:
    """SGD (any rate or schedule) that neither clips nor decays nor averages."""
    return isinstance(optimizer, keras.optimizers.SGD) and not any(
        getattr(optimizer, k, None)
        for k in ("clipnorm", "clipvalue", "global_clipnorm", "use_ema", "weight_decay")
    )


def _settings(optimizer) -> dict:
    """An optimizer's configuration but its name."""
    return {k: v for k, v in optimizer.get_config().items() if k != "name"}


def _rates(optimizer, steps: int) -> list:
    """The learning rates of the last `steps` steps of `optimizer`."""
    schedule = getattr(optimizer, "_learning_rate", None)
    if not isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        return [float(np.asarray(optimizer.learning_rate))] * steps
    done = int(np.asarray(optimizer.iterations))
    return [float(np.asarray(schedule(step))) for step in range(done - steps, done)]


def _copy_maker(optimizer):
    """A function making fresh copies of `optimizer` (its class and config)."""
    serialized = keras.optimizers.serialize(optimizer)
    return lambda: keras.optimizers.deserialize(serialized)


class Reference:
    """The reference run of a test, traced (`Trace`), and the bounds on how
    far another run of the same math may end from it (`weights`, `history`,
    `evaluate`, `predict`). `Reference.fit` makes one with `model.fit`.

    `model` is compiled (a loss, and SGD or any other optimizer: see
    `sgd_steps_apart` and `optimizer_steps_apart`, which replays a copy of
    it, or what `make_optimizer()` makes); `terms` defaults to
    `gradient_terms(model, rows of the largest step)`. SGD that accumulates
    gradients over k steps (`DistributedOptimizer(backward_passes_per_step=k)`)
    applies lr / k to each: counted as lr, within the bound.
    """

    def __init__(
        self,
        model,
        trace: Trace,
        steps_per_epoch: int = 1,
        terms=None,
        logs=None,
        slots=False,
        floor=0.0,
        make_optimizer=None,
    ):
        self.model, self.trace, self.logs, self._predicted = model, trace, logs, None
        self.steps_per_epoch, self.slots = steps_per_epoch, None
        optimizers = trace.optimizers  # one, or a custom step's several alike
        optimizer = optimizers[0]
        assert len(optimizers) == 1 or all(
            type(o) is type(optimizer) and _settings(o) == _settings(optimizer) for o in optimizers
        ), "optimizers of other kinds: no bound here"
        terms = gradient_terms(model, max(trace.rows)) if terms is None else terms
        if _is_plain_sgd(optimizer) and not slots:
            self.steps = sgd_steps_apart(
                trace,
                _rates(optimizer, len(trace.magnitudes)),
                terms,
                float(optimizer.momentum),
                floor,
            )
        elif trace.gradients is None or len(optimizers) > 1:  # no replay
            self.steps = adam_steps_apart(trace, optimizer, terms, floor)
        else:  # `slots`: the bounds on the optimizer's variables too
            steps = optimizer_steps_apart(
                make_optimizer or _copy_maker(optimizer),
                trace,
                terms,
                [v.constraint for v in model.trainable_weights],
                floor,
            )
            self.steps, self.slots = [w for w, _ in steps], steps[-1][1]

    @classmethod
    def fit(
        cls,
        model,
        x,
        y,
        batch_size,
        epochs=1,
        terms=None,
        sample_weight=None,
        slots=False,
        floor=0.0,
        make_optimizer=None,
        outputs=None,
        phases=None,
        **fit,
    ):
        """`model.fit(x, y, ...)` in order (`fit`: its other arguments),
        traced (`outputs`: each step's outputs too, for the accuracy's
        bounds; by default where `model` was compiled with metrics)."""
        if outputs is None:
            outputs = not phases and getattr(model, "_compile_metrics", None) is not None
        trace = Trace(x, y, batch_size, model.loss, sample_weight, outputs=outputs, phases=phases)
        logs = model.fit(
            x,
            y,
            batch_size=batch_size,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            sample_weight=sample_weight,
            callbacks=[trace, *fit.pop("callbacks", [])],
            **fit,
        ).history
        steps_per_epoch = -(-_count(x) // batch_size)
        return cls(model, trace, steps_per_epoch, terms, logs, slots, floor, make_optimizer)

    @property
    def trainable(self) -> list:
        """The bounds on the trainable weights after training."""
        return self.steps[-1]

    def after(self, step: int) -> tuple:
        """`(weights, bounds)` of the trainable weights after `step` steps
        (1 to all): the reference's, and how far another run's may be."""
        weights = self.trace.weights[step] if step < len(self.trace.weights) else self.trace.end
        return weights, self.steps[step - 1]

    def taking(self, other: "Reference", which) -> "Reference":
        """This reference with `other`'s bounds (a `Reference` of the same
        trace, counting other terms) on the trainable weights `which(variable)`
        is true of, at every step."""
        variables = self.model.trainable_weights
        self.steps = [
            [o if which(v) else s for v, s, o in zip(variables, mine, theirs)]
            for mine, theirs in zip(self.steps, other.steps)
        ]
        return self

    def compressed(self, compression: str) -> "Reference":
        """The bounds of a run of this reference's math whose gradients were
        all-reduced in `compression` ("fp16" or "bf16",
        `DistributedOptimizer(compression=...)`): each gradient's float32
        rounding (`gradient_terms`) plus the roundings to the compressed
        dtype (`compression_terms`), and the absolute floor of its smallest
        step in the sum over a step's rows (`compression_floor`, of the
        step with the fewest rows, where it is largest). Made from the
        trace: nothing is run again."""
        dtype = {"fp16": "float16", "bf16": "bfloat16"}[compression]
        trace = self.trace
        return Reference(
            self.model,
            trace,
            self.steps_per_epoch,
            terms=gradient_terms(self.model, max(trace.rows)) + compression_terms(dtype),
            logs=self.logs,
            floor=compression_floor(dtype, min(trace.rows)),
        )

    @property
    def weights(self) -> list:
        """The bounds on `model.get_weights()` after training (trainable
        weights only: a model with others has no bound for them here)."""
        return aligned(self.model, self.trainable)

    def validation(self, x, y, batch_size=None) -> dict:
        """Per epoch, how far another run's validation logs on (`x`, `y`)
        may be (`val_loss`, `val_accuracy`, ...): `evaluate_apart` at the
        weights each epoch ends with."""
        ends = range(self.steps_per_epoch, len(self.steps) + 1, self.steps_per_epoch)
        kept = [np.asarray(v) for v in self.model.trainable_weights]
        found = {}
        for end in ends:
            weights, apart = self.after(end)
            for variable, value in zip(self.model.trainable_weights, weights):
                variable.assign(value.astype(variable.dtype))
            bounds = evaluate_apart(self.model, x, y, batch_size, apart, named=True)
            for name, bound in bounds.items():
                found.setdefault(f"val_{name}", []).append(bound)
        for variable, value in zip(self.model.trainable_weights, kept):
            variable.assign(value)
        return found

    def history(self, steps_per_epoch=None) -> dict:
        """Per key of the history (`loss`, an output's or a phase's
        `<name>_loss`, an accuracy), per epoch (of `steps_per_epoch` steps:
        1 for `train_on_batch`'s logs)."""
        steps_per_epoch = steps_per_epoch or self.steps_per_epoch
        keys = self.logs or {"loss": None, "accuracy": None}
        return {
            key: history_apart(self.trace, self.steps, steps_per_epoch, key=key)
            for key in keys
            if key == "loss" or key in self.trace.parts or "acc" in key or "top" in key
        }

    def evaluate(self, x, y, batch_size=None) -> list:
        """For each of `model.evaluate`'s results (see `evaluate_apart`)."""
        return evaluate_apart(self.model, x, y, batch_size, self.trainable, self.predict(x))

    def predict(self, x) -> np.ndarray:
        """For each of `model.predict`'s outputs."""
        if self._predicted is None or self._predicted[0] is not x:
            self._predicted = (x, outputs_apart(self.model, x, self.trainable))
        return self._predicted[1]


def evaluate_apart(
    model, x, y, batch_size=None, weights_apart=None, outputs_bound=None, named=False
):
    """For each of `model.evaluate(x, y, batch_size)`'s results, how far
    another run's may be, computing in other orders with weights within
    `weights_apart` (`outputs_bound`: `outputs_apart`'s, if known): the loss
    (`losses_apart`; for a model of several outputs, and each output's
    loss, from the rows' gradients as in `history_apart`), plus the mean
    over the batches' means, weighed by their rows (one more sum); an
    accuracy (`accuracy_apart`). `named`: as a dict of evaluate's names."""
    logs = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    loss, loss_weights = _loss_of(model)
    several = isinstance(loss, dict)
    unknown = [
        k for k in logs if k != "loss" and "acc" not in k and not (several and k.endswith("_loss"))
    ]
    assert not unknown, f"no bound for {unknown}"
    bounds = {}
    if several:
        found = Rows(model, loss, training=False, loss_weights=loss_weights)(x, y)
        moved, flat = _moved(model, weights_apart, None), _flat_rows(found["outputs"])
        for key, part in [("loss", found), *((f"{n}_loss", p) for n, p in found["parts"].items())]:
            bounds[key] = float(np.mean(_through(part["gradients"], moved))) + _loss_rounding(
                len(flat), part["losses"], flat
            )
    else:
        if outputs_bound is None:
            outputs_bound = outputs_apart(model, x, weights_apart)
        bounds["loss"] = losses_apart(model, x, y, loss, outputs_bound, weights_apart)
        batches = -(-_count(x) // (batch_size or 32))
        accuracy = accuracy_apart(
            np.asarray(model(_tensors(x), training=False)), outputs_bound
        ) + _mean_rounding(batches)
        bounds.update({key: accuracy for key in logs if "acc" in key})
    batches = -(-_count(x) // (batch_size or 32))
    for key in bounds:
        if key.endswith("loss"):
            bounds[key] += reordered_sum(batches, abs(logs[key]))
    if named:
        return {key: bounds[key] for key in logs}
    # In the order of evaluate's list (Keras's own ordering of its logs).
    return model._flatten_metrics_in_order({key: bounds[key] for key in logs})


def aligned(model, trainable_bounds: list, others=None) -> list:
    """`trainable_bounds` (one per trainable weight) in the order of
    `model.get_weights()`; the weights not trained get `others` (a bound,
    the same for all, a test saying why; or {id(variable): bound}), else
    none may be there."""
    by_variable = {id(v): b for v, b in zip(model.trainable_weights, trainable_bounds)}
    if isinstance(others, dict):
        by_variable.update(others)
        others = None
    missing = [v.path for v in model.weights if id(v) not in by_variable]
    assert others is not None or not missing, f"no bound for the weights not trained: {missing}"
    return [by_variable.get(id(v), others) for v in model.weights]


# -- BatchNormalization's moving statistics -------------------------------------------------
#
# BatchNormalization in training normalizes each feature of a batch of n
# rows with the batch's mean and variance: sums over the rows, forward (the
# mean; the mean of the squares, or of the squared differences from the
# mean) and backward (the input's gradient adds over the rows the output's
# gradient and its product with the normalized input). Each is a sum of n
# terms, which another order adds to within n * EPS of their magnitudes
# (`float_bounds.reordered_sum`), and the inverse square root of the
# variance is a function (`FUNCTION_TERMS`).
#
# Its moving statistics follow each step: moving = momentum * moving +
# (1 - momentum) * statistic. Another run's statistic of a feature differs
# by what its input h (the rows reaching the layer) differs, first order,
# plus the rounding of its sums:
#
# * the mean: by mean_rows |dh| + (n + 1) * EPS * mean_rows |h| (the sum
#   and the division);
# * the variance, sum_rows (h - mean)**2 / n (whose derivative for a row's
#   h is 2 * (h - mean) / n, the mean's own change cancelling): by
#   2 * mean_rows |h - mean| * |dh| + (n + 3) * EPS * (mean_rows h**2 +
#   mean**2), which covers E[h**2] - mean**2 (the synchronized layer's
#   form, cancelling down from E[h**2]) as well as the mean of the squared
#   differences;
#
# with |dh| the bound `float_bounds.outputs_apart` gives the layer's input,
# at the weights the step starts from and within their own bounds then. The
# moving value's update then moves another run's by momentum times its
# difference so far plus (1 - momentum) times the statistic's, and its
# three operations (two products, a sum) each round their result (EPS of
# it: one may round up where the other rounds down).


def _batch_norms(model) -> list:
    return [
        layer
        for layer in model._flatten_layers(include_self=False)
        if isinstance(layer, keras.layers.BatchNormalization)
    ]


def moving_statistics_apart(reference, x, batch_size: int) -> dict:
    """{id(variable): bound} for the moving mean and variance of every
    BatchNormalization layer of `reference.model` (a functional model,
    trained from its statistics' initial values by `reference`'s `fit`
    on `x` in order, batches of `batch_size`; no layer before one that
    computes otherwise in training, as dropout or another such layer):
    how far another run's may end from the reference's (see the notes
    above). Leaves the model's variables as they were."""
    model, trace = reference.model, reference.trace
    kept = [np.asarray(v) for v in model.variables]
    positions = {id(v): i for i, v in enumerate(model.trainable_weights)}
    found = {}
    for layer in _batch_norms(model):
        reaching = keras.Model(model.input, layer.input)
        momentum = float(layer.momentum)
        shape = tuple(layer.moving_mean.shape)
        moving = {
            "mean": np.asarray(layer.moving_mean_initializer(shape), np.float64),
            "variance": np.asarray(layer.moving_variance_initializer(shape), np.float64),
        }
        apart = {key: np.zeros(shape) for key in moving}
        for step, weights in enumerate(trace.weights[: len(trace.rows)]):
            for variable, value in zip(model.trainable_weights, weights):
                variable.assign(value.astype(variable.dtype))
            start = (step % reference.steps_per_epoch) * batch_size
            rows = x[start : start + batch_size]
            n = len(rows)
            bounds = reference.steps[step - 1] if step else None
            weights_apart = (
                None
                if bounds is None
                else [bounds[positions[id(v)]] for v in reaching.trainable_weights]
            )
            # Statistics per feature (the last axis), over the rows and
            # every other axis (an image's pixels): `n` values each.
            h = np.asarray(reaching(rows, training=False), np.float64)
            dh = (
                np.reshape(outputs_apart(reaching, rows, weights_apart), h.shape)
                if reaching.trainable_weights
                else np.zeros(h.shape)  # the model's inputs: the same in both runs
            )
            h, dh = h.reshape(-1, h.shape[-1]), dh.reshape(-1, h.shape[-1])
            n = len(h)
            mean = h.mean(axis=0)
            statistic = {
                "mean": (mean, dh.mean(axis=0) + reordered_sum(n + 1, np.abs(h).mean(axis=0))),
                "variance": (
                    h.var(axis=0),
                    2 * np.mean(np.abs(h - mean) * dh, axis=0)
                    + reordered_sum(n + 3, np.mean(h * h, axis=0) + mean**2),
                ),
            }
            for key, (value, value_apart) in statistic.items():
                kept_part, new_part = momentum * moving[key], (1.0 - momentum) * value
                moving[key] = kept_part + new_part
                apart[key] = (
                    momentum * apart[key]
                    + (1.0 - momentum) * value_apart
                    + EPS * (np.abs(kept_part) + np.abs(new_part) + np.abs(moving[key]))
                )
        found[id(layer.moving_mean)] = apart["mean"].reshape(shape)
        found[id(layer.moving_variance)] = apart["variance"].reshape(shape)
    for variable, value in zip(model.variables, kept):
        variable.assign(value)
    return found
