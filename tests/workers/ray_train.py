"""The training function Ray Train's `TensorflowTrainer` runs on each of its
workers (tests/distributed/test_ray.py), written as a Ray user writes it.

Ray sets `TF_CONFIG` in every worker before calling it, so `import
keras_distrib` here starts the worker's collective runtime, and
`strategy="multi_worker"` trains across Ray's workers. Each worker writes
its final weights to `config["out"]/rank<r>.npz`.
"""

import os


def train_loop_per_worker(config):
    import keras
    import numpy as np

    import keras_distrib as kd

    rng = np.random.default_rng(0)
    x = rng.normal(size=(203, 8)).astype("float32")
    y = rng.integers(0, 3, size=203).astype("int32")
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = kd.DistributedModel(inputs, keras.layers.Dense(3)(hidden), strategy="multi_worker")
    model.set_weights([np.array(w, "float32") for w in config["initial"]])
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    np.savez(
        os.path.join(config["out"], f"rank{model.strategy.rank}.npz"),
        *model.get_weights(),
        iterations=int(model.optimizer.iterations.numpy()),
    )
