"""Workers that do not do the same thing, for tests/distributed/test_faults.py.

Run by `keras-distrib launch -n 2`. Rank 1 departs from rank 0 in each of
`--cases`, in turn; each must end in a one-line error, on both ranks,
naming what differed instead of hanging. Every case prints `case NAME:
ErrorType: message` (or `case NAME: done`) and the next runs (the checks
fail on every worker alike, so the workers stay in step); the last case's
error ends the job:

* `fit_vs_evaluate`: rank 0 calls fit, rank 1 evaluate;
* `batch_size`: rank 1 fits with another batch size;
* `data_length`: rank 1 fits on fewer samples;
* `early_exit`: rank 1 exits 0 before rank 0's second fit;
* `changed_weights`: rank 1 changes its weights after the model is built
  (without `BroadcastInitialWeights`): `fit` refuses to start;
* `wider_layer`: rank 1 builds its functional model with a wider hidden
  layer (TensorFlow's broadcast would fail with "Shape mismatch");
* `extra_layer`: rank 1's functional model has one more layer, of shapes
  rank 0 also has (the broadcast would wait for it until the timeout);
* `wider_subclass`: `wider_layer` for a subclassed model, built by `fit`;
* `learning_rate`: rank 1 compiles with another learning rate (training
  would go on with worker 0's optimizer, silently).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import keras_distrib as kd  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
CASES = [
    "fit_vs_evaluate",
    "batch_size",
    "data_length",
    "early_exit",
    "changed_weights",
    "wider_layer",
    "extra_layer",
    "wider_subclass",
    "learning_rate",
]
flags.DEFINE_list("cases", None, "How rank 1 departs, case after case (of CASES).")
flags.register_validator(
    "cases", lambda cases: set(cases) <= set(CASES), f"--cases must be among {CASES}"
)


class Net(kd.DistributedModel):
    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(width)
        self.out = keras.layers.Dense(2)

    def call(self, x):
        return self.out(self.hidden(x))


def build(case, odd, strategy):
    """The model rank 0 (`odd` False) or rank 1 builds for `case`."""
    if case == "wider_subclass":
        return Net(5 if odd else 4, strategy=strategy)
    inputs = keras.Input((8,))
    hidden = inputs
    if case == "wider_layer":
        hidden = keras.layers.Dense(5 if odd else 4)(hidden)
    if case == "extra_layer":
        for _ in range(2 if odd else 1):
            hidden = keras.layers.Dense(8)(hidden)
    return kd.DistributedModel(inputs, keras.layers.Dense(2)(hidden), strategy=strategy)


def run_case(case, strategy, x, y):
    """Rank 1 departs from rank 0 as `case` says (see the module doc)."""
    odd = strategy.rank == 1
    model = build(case, odd, strategy)
    rate = 0.05 if odd and case == "learning_rate" else 0.01  # SGD's default
    model.compile(
        optimizer=keras.optimizers.SGD(rate), loss=keras.losses.SparseCategoricalCrossentropy(True)
    )
    fit = dict(batch_size=32, epochs=1, verbose=0)
    if case == "fit_vs_evaluate":
        (model.evaluate if odd else model.fit)(x, y, batch_size=32, verbose=0)
    elif case == "batch_size":
        model.fit(x, y, **dict(fit, batch_size=16 if odd else 32))
    elif case == "data_length":
        n = 96 if odd else 128
        model.fit(x[:n], y[:n], **fit)
    elif case == "early_exit":
        model.fit(x, y, **fit)
        if not odd:
            model.fit(x, y, **fit)
    elif case == "changed_weights":
        if odd:
            model.layers[-1].kernel.assign(np.ones((8, 2), "float32"))
        model.fit(x, y, **fit)
    else:  # the models differ
        model.fit(x, y, **fit)


def main(argv):
    del argv
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    strategy = kd.strategies.get("multi_worker")
    for i, case in enumerate(FLAGS.cases):
        try:
            run_case(case, strategy, x, y)
        except Exception as error:  # noqa: BLE001 - reported, then the next case
            print(f"case {case}: {type(error).__name__}: {error}", flush=True)
            if i == len(FLAGS.cases) - 1:
                raise  # the job ends with the last case's error
        else:
            print(f"case {case}: done", flush=True)
    print(f"rank {strategy.rank} done")


if __name__ == "__main__":
    flags.mark_flag_as_required("cases")
    app.run(main)
