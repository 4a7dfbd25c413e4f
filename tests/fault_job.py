"""What tests/workers/faults.py leaves in its `--out` directory, read back:
each rank's final state and each attempt's record (for the fault tests of
tests/distributed: test_faults.py on one host, test_network_faults.py
across hosts, and the launches that end as one process); the job's data
and optimizers, which the script and `traced` share; and the job's math in
the test's own process, traced (`traced`), whose bounds the runs must end
within. No TensorFlow on import."""

import collections
import os

import numpy as np

FAULTS = "tests/workers/faults.py"
SAMPLES, BATCH, EPOCHS = 240, 30, 3  # tests/workers/faults.py's, by default
STEPS = EPOCHS * SAMPLES // BATCH  # 24
SEED = 3  # keras.utils.set_random_seed's, before the model is built


def data():
    """The job's arrays (x, y)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int32") + (x[:, 2] > 0.5).astype("int32")
    return x, y


def optimizer(name):
    """The job's optimizer (`--optimizer`: "adam" or "sgd"), on a decaying
    learning rate."""
    import keras

    if name == "adam":
        return keras.optimizers.Adam(
            keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=5, decay_rate=0.7)
        )
    return keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=5, decay_rate=0.7)
    )


def build(strategy):
    """The job's model, 8 -> Dense(16, relu) -> Dense(3), under `strategy`
    (its weights drawn from Keras's seed: set `SEED` first)."""
    import keras

    import keras_distrib as kd

    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    return kd.DistributedModel(inputs, keras.layers.Dense(3)(hidden), strategy=strategy)


def compile_job(model, name):
    """Compiles `model` as the job does, with optimizer `name`."""
    import keras

    model.compile(
        optimizer=optimizer(name),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


def optimizer_of(script_flags) -> str:
    """The optimizer the job's `script_flags` name (Adam by default)."""
    flags = list(script_flags)
    return flags[flags.index("--optimizer") + 1] if "--optimizer" in flags else "adam"


def traced(name="adam"):
    """The job's math in this process with optimizer `name`: its model as
    `build` makes it for tests/workers/faults.py, seeded alike, under "single" (the same
    shuffled batches as the job's, whatever its number of workers), trained
    and traced (`float_bounds.Trace`, its batches' rows unknown to it).
    Returns the `float_bounds.Reference`: a run of the job (another number of
    workers, a restart from a backup) adds in other orders and ends within
    its bounds."""
    import keras

    from float_bounds import Reference, Trace

    keras.utils.set_random_seed(SEED)
    x, y = data()
    model = build("single")
    compile_job(model, name)
    trace = Trace(x, y, BATCH, model.loss, shuffled=True)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=True, verbose=0, callbacks=[trace])
    return Reference(model, trace, STEPS // EPOCHS)


# One line of a worker's attempts-rank<r>.txt.
Attempt = collections.namedtuple("Attempt", "number pid started shm_dir")


def results(out, n):
    """[(iterations, weights)] of ranks 0..n-1."""
    finals = []
    for rank in range(n):
        with np.load(os.path.join(out, f"rank{rank}.npz")) as f:
            finals.append((int(f["iterations"]), [f[k] for k in f.files if k != "iterations"]))
    return finals


def attempts(out, n):
    """{rank: [Attempt, ...]} from the workers' own records."""
    found = {}
    for rank in range(n):
        with open(os.path.join(out, f"attempts-rank{rank}.txt")) as f:
            found[rank] = [
                Attempt(int(a), int(p), float(t), d) for a, p, t, d in (line.split() for line in f)
            ]
    return found


def assert_equal_to(finals, reference, traced, context=None):
    """Every rank took all STEPS steps and ends as `reference`'s rank 0 (an
    uninterrupted run): both within the bounds of float32's rounding of the
    job's math in other orders around `traced`'s (a `traced()` reference of
    the job's optimizer; tests/float_bounds.py), so no further apart than
    twice them."""
    from float_bounds import assert_within

    want, bounds = traced.model.get_weights(), traced.weights
    for i, (got, value, bound) in enumerate(zip(reference[0][1], want, bounds, strict=True)):
        assert_within(got, value, bound, f"{context}: uninterrupted run, weight {i}")
    for rank, (iterations, weights) in enumerate(finals):
        assert iterations == STEPS, (context, rank, iterations)
        for i, (got, value, bound) in enumerate(zip(weights, want, bounds, strict=True)):
            assert_within(got, value, bound, f"{context}: rank {rank}, weight {i}")
