"""The optimizer-sharding cases, shared by the worker that trains them
sharded (tests/workers/optimizer_sharding.py) and the test that trains
them with plain Keras (tests/distributed/test_optimizer_sharding_two_workers.py).
"""

import keras
import numpy as np

BATCH, EPOCHS = 30, 2  # 203 samples: 7 steps per epoch


def _adamw_decay():
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


# Every optimizer whose update is elementwise, with Keras's clipping,
# weight decay, schedules and moving averages between them.
CASES = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw_decay": _adamw_decay,
    "sgd_momentum_clipnorm": lambda: keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=0.05),
    "rmsprop_global_clipnorm": lambda: keras.optimizers.RMSprop(0.01, global_clipnorm=0.1),
    "nadam_clipvalue": lambda: keras.optimizers.Nadam(0.01, clipvalue=0.01),
    "adamax_schedule": lambda: keras.optimizers.Adamax(
        keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=3, decay_rate=0.5)
    ),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01),
    "lion": lambda: keras.optimizers.Lion(0.001),
    "adam_ema": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9),
    # Loss scaling (as mixed_float16 compiles it): the inner optimizer is sharded.
    "adam_loss_scale": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01)),
}
# A model with an Embedding, whose gradient is sparse (`tf.IndexedSlices`):
# Adam adds the squares of duplicate rows, SGD leaves the rows not in the
# batch as they are, and clipnorm takes the norm of the rows.
EMBEDDING = {
    "embedding_adam": lambda: keras.optimizers.Adam(0.01),
    "embedding_sgd_clipnorm": lambda: keras.optimizers.SGD(0.1, clipnorm=0.05),
}
CASES.update(EMBEDDING)


def graph(case=None):
    """Inputs and outputs of the case's model: a constrained kernel among
    them, or for the `EMBEDDING` cases a table of 13 x 5 (each of 2
    workers' parts ends or starts in the middle of a row)."""
    if case in EMBEDDING:
        inputs = keras.Input((8,), dtype="int32")
        embedded = keras.layers.Flatten()(keras.layers.Embedding(13, 5)(inputs))
        return inputs, keras.layers.Dense(3)(embedded)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(
        16, activation="relu", kernel_constraint=keras.constraints.MaxNorm(1.0)
    )(inputs)
    return inputs, keras.layers.Dense(3)(keras.layers.Dense(7, activation="tanh")(hidden))


def inputs(case, x):
    """The case's model's input from the features `x`: ids for an Embedding."""
    return (np.abs(x) * 4).astype("int32") % 13 if case in EMBEDDING else x


def compile_kwargs(case):
    return dict(
        optimizer=CASES[case](), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )


def plain_run(case, initial, x, y, bounds=False):
    """(weights, optimizer variables) of plain Keras on one device; with
    `bounds`, also their bounds (a `float_bounds.Reference`'s `weights` and
    `slots`): how far a run of the same math in other orders of sums may
    end from them."""
    model = keras.Model(*graph(case))
    model.set_weights(initial)
    model.compile(**compile_kwargs(case))
    if bounds:
        from float_bounds import Reference  # traces each step: only where asked

        reference = Reference.fit(model, inputs(case, x), y, BATCH, EPOCHS, slots=True)
        return (
            model.get_weights(),
            [np.asarray(v) for v in model.optimizer.variables],
            (reference.weights, reference.slots),
        )
    model.fit(inputs(case, x), y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model.get_weights(), [np.asarray(v) for v in model.optimizer.variables]


def plain_optimizer_shapes(case) -> list:
    """The variables of the case's optimizer built unsharded on the model."""
    model = keras.Model(*graph(case))
    optimizer = CASES[case]()
    optimizer.build(model.trainable_variables)
    return list(optimizer.variables)
