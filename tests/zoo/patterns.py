"""The model zoo: models written the way users write them, after public examples.

Each `Pattern` builds a model the way keras-io examples, TensorFlow
tutorials and Keras's guides write it (our own code, small shapes), with
no keras_distrib in it but the base class or constructor: `build(None)`
is the plain Keras model, `build(strategy)` the same model on
`strategy`. `outcome(strategy)` says what the zoo asserts there:

* `EXACT`: trainable weights equal plain Keras's from the same initial
  weights after the same steps, within the bounds float32's rounding of
  the same math in other orders allows (`float_bounds.Reference` of the
  plain run, and the same for the epoch's logs);
* `AGREES`: the math is not one device's by design (random layers draw
  per replica, BatchNormalization normalizes each replica's or micro-batch's
  rows, as tf.distribute does), or float rounding grows past any useful
  tolerance (the keras.applications models, see `_DEEP_NOTE`), so the run
  trains (finite loss, weights moved) and every replica and worker ends with
  the same weights; for those models the predictions at the initial
  weights must equal plain Keras's (`forward`);
* `refused(label, pattern)`: a one-line error matching `pattern`;
* `SKIPPED`: not run in the zoo, to keep it within minutes: the
  keras.applications models take 6-100 s each to build and trace on the
  CI machine (`pipeline` the longest), so they run where their heads broke
  before (`tensor_parallel`); the zoo's ResNet blocks cover replicated
  BatchNormalization.

The runner (`run_pattern`) is shared by the in-process tests
(tests/zoo/test_zoo.py) and the worker script of the multi-process ones
(tests/workers/keras_features.py, probe `zoo`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional

import keras
import numpy as np
import tensorflow as tf

import keras_distrib as kd
from float_bounds import (
    Reference,
    aligned,
    assert_within,
    moving_statistics_apart,
    outputs_apart,
)

EXACT, AGREES, SKIPPED = "exact", "agrees", "skipped"
IN_PROCESS = ("single", "mirrored", "central_storage", "pipeline", "tensor_parallel")
MULTI_PROCESS = ("multi_worker", "horovod", "parameter_server")


def refused(label: str, pattern: str) -> str:
    """A one-line error matching regular expression `pattern`; `label` is
    what the matrix in docs/zoo.md says."""
    return f"refused[{label}]:{pattern}"


def refusal(outcome: str):
    """`(label, pattern)` of a `refused(...)` outcome, or None."""
    found = re.fullmatch(r"refused\[(.*?)\]:(.*)", outcome, re.DOTALL)
    return None if found is None else (found.group(1), found.group(2))


@dataclasses.dataclass
class Pattern:
    name: str
    what: str  # what the user wrote, for the matrix in docs/zoo.md
    build: Callable[[Optional[str]], keras.Model]
    data: Callable[[], tuple]
    compile: Callable[[keras.Model], None]
    outcomes: dict = dataclasses.field(default_factory=dict)  # strategy -> outcome
    default: str = EXACT
    batch_size: int = 8
    steps: int = 2
    # A custom train_step: what the reference's trace follows instead of a
    # compiled loss, each optimizer's loss row by row (`float_bounds.Trace`'s
    # `phases`, each named for the log `<name>_loss`).
    phases: Optional[dict] = None
    # Its train_step logs values other than the model's metrics: across
    # processes each worker's last batch's, as every per-batch log is (see
    # `Capabilities.exact_batch_logs`), so only its weights are compared there.
    batch_logs: bool = False
    # Its forward pass at the initial weights is compared with plain Keras's
    # too (where the training itself is `AGREES`).
    forward: bool = False

    def outcome(self, strategy: str) -> str:
        if strategy == "parameter_server":
            # Asynchronous: workers apply their steps as they come, so no
            # run equals one device's.
            return self.outcomes.get(strategy, AGREES)
        return self.outcomes.get(strategy, self.default)


def _logits():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _sgd(model, loss=None, **kwargs):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss or _logits(), **kwargs)


def _softmax_sgd(model, **kwargs):
    _sgd(model, loss="sparse_categorical_crossentropy", **kwargs)


def _deep_sgd(model):
    # Deep BatchNormalization stacks on 8 tiny images have gradients in the
    # hundreds, whose float rounding (another summation order) a step of
    # 0.1 would make ~1e-4: a smaller step keeps "exact" at 1e-5.
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="sparse_categorical_crossentropy")


def _adam(model, loss="sparse_categorical_crossentropy", **kwargs):
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss, **kwargs)


def _functional(graph: Callable[[], tuple]) -> Callable[[Optional[str]], keras.Model]:
    """`build` of a Functional model made by `graph()` -> (inputs, outputs)."""

    def build(strategy):
        inputs, outputs = graph()
        if strategy is None:
            return keras.Model(inputs, outputs)
        return kd.DistributedModel(inputs, outputs, strategy=strategy)

    return build


def _from_model(make: Callable[[], keras.Model]) -> Callable[[Optional[str]], keras.Model]:
    """`build` of a plain model wrapped with `DistributedModel.from_model`."""

    def build(strategy):
        model = make()
        return model if strategy is None else kd.DistributedModel.from_model(model, strategy)

    return build


def _classes(n=16, features=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(n, features)).astype("float32"),
        rng.integers(0, classes, n).astype("int32"),
    )


def _images(n=16, size=16, channels=3, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.uniform(size=(n, size, size, channels)).astype("float32"),
        rng.integers(0, classes, n).astype("int32"),
    )


def _app_images():
    return _images(n=8, size=32)


def _tokens(n=16, length=6, vocab=40, classes=2, seed=0, zeros=False):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, vocab, (n, length)).astype("int32")
    if zeros:  # padded sequences: masks
        for i in range(n):
            x[i, rng.integers(2, length) :] = 0
    return x, rng.integers(0, classes, n).astype("int32")


# -- layers and metrics written the common way ------------------------------------------


class Scale(keras.layers.Layer):
    """A user layer: no get_config, no **kwargs; holds a sub-layer, an array
    and a callable."""

    def __init__(self, factor, units):
        super().__init__()
        self.factor = factor
        self.dense = keras.layers.Dense(units)
        self.offset = np.linspace(-1.0, 1.0, units).astype("float32")
        self.squash = lambda t: t / (1.0 + keras.ops.abs(t))

    def call(self, x):
        return self.squash(self.factor * self.dense(x) + self.offset)


class Coverage(keras.metrics.Metric):
    """A user metric: no get_config, no **kwargs."""

    def __init__(self):
        super().__init__(name="coverage")
        self.seen = self.add_variable(shape=(), initializer="zeros", name="seen")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.seen.assign_add(tf.cast(tf.shape(y_pred)[0], "float32"))

    def result(self):
        return self.seen


def _lambda_graph():
    inputs = keras.Input((6,))
    h = keras.layers.Lambda(lambda t: t * 2.0 - 1.0)(inputs)
    h = keras.layers.Dense(8, activation="relu")(h)
    return inputs, keras.layers.Dense(3)(h)


def _user_layer_graph():
    inputs = keras.Input((6,))
    h = Scale(0.5, 8)(inputs)
    return inputs, keras.layers.Dense(3)(h)


# -- models without call: GAN (keras-io "DCGAN"/"Customizing fit" shape) ----------------

LATENT = 4


def _gan_class(base):
    class GAN(base):
        def __init__(self, discriminator, generator, random_latent=True, **kwargs):
            super().__init__(**kwargs)
            self.discriminator = discriminator
            self.generator = generator
            self.random_latent = random_latent
            self.seed_generator = keras.random.SeedGenerator(1337)

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.loss_fn = loss_fn
            self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
            self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

        @property
        def metrics(self):
            return [self.d_loss_tracker, self.g_loss_tracker]

        def _latent(self, real):
            if self.random_latent:
                return keras.random.normal((tf.shape(real)[0], LATENT), seed=self.seed_generator)
            return real[:, :LATENT] * 2.0 - 1.0  # deterministic: exact runs

        def train_step(self, real):
            if isinstance(real, tuple):
                real = real[0]
            batch = tf.shape(real)[0]
            fake = self.generator(self._latent(real))
            combined = tf.concat([fake, real], axis=0)
            labels = tf.concat([tf.ones((batch, 1)), tf.zeros((batch, 1))], axis=0)
            with tf.GradientTape() as tape:
                d_loss = self.loss_fn(labels, self.discriminator(combined))
            grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
            with tf.GradientTape() as tape:
                predictions = self.discriminator(self.generator(self._latent(real)))
                g_loss = self.loss_fn(tf.zeros((batch, 1)), predictions)
            grads = tape.gradient(g_loss, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
            self.d_loss_tracker.update_state(d_loss)
            self.g_loss_tracker.update_state(g_loss)
            return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}

    return GAN


def _gan(random_latent):
    def build(strategy):
        discriminator = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8),
                keras.layers.LeakyReLU(0.2),
                keras.layers.Dense(1),
            ]
        )
        generator = keras.Sequential([keras.Input((LATENT,)), keras.layers.Dense(6)])
        if strategy is None:
            return _gan_class(keras.Model)(discriminator, generator, random_latent)
        return _gan_class(kd.DistributedModel)(
            discriminator, generator, random_latent, strategy=strategy
        )

    return build


def _bce_rows(labels, logits):
    return keras.losses.binary_crossentropy(labels, logits, from_logits=True)


def _gan_d_rows(model, x, y):
    """Each row's part of the discriminator's loss: the mean over the
    batch's fakes and reals is the mean over rows of their two losses' mean."""
    fake = model.discriminator(model.generator(model._latent(x)))
    real = model.discriminator(x)
    return (_bce_rows(tf.ones_like(fake), fake) + _bce_rows(tf.zeros_like(real), real)) / 2


def _gan_g_rows(model, x, y):
    fake = model.discriminator(model.generator(model._latent(x)))
    return _bce_rows(tf.zeros_like(fake), fake)


# The GAN's step as the trace follows it (the latent vectors drawn in the
# step's order: the discriminator's, then the generator's).
_GAN_PHASES = {
    "d": (_gan_d_rows, lambda m: m.discriminator.trainable_weights, lambda m: m.d_optimizer),
    "g": (_gan_g_rows, lambda m: m.generator.trainable_weights, lambda m: m.g_optimizer),
}


def _gan_compile(model):
    model.compile(
        d_optimizer=keras.optimizers.Adam(1e-3),
        g_optimizer=keras.optimizers.Adam(1e-3),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )


# -- VAE (keras-io "Variational AutoEncoder"): no call, sampling layer, trackers ---------


class Sampling(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(keras.ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + keras.ops.exp(0.5 * z_log_var) * epsilon


def _vae_class(base):
    class VAE(base):
        def __init__(self, encoder, decoder, **kwargs):
            super().__init__(**kwargs)
            self.encoder = encoder
            self.decoder = decoder
            self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
            self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

        @property
        def metrics(self):
            return [self.total_loss_tracker, self.kl_loss_tracker]

        def train_step(self, data):
            if isinstance(data, tuple):
                data = data[0]
            with tf.GradientTape() as tape:
                z_mean, z_log_var, z = self.encoder(data)
                reconstruction = self.decoder(z)
                reconstruction_loss = keras.ops.mean(
                    keras.ops.sum(keras.losses.binary_crossentropy(data, reconstruction), axis=1)
                )
                kl_loss = -0.5 * (
                    1 + z_log_var - keras.ops.square(z_mean) - keras.ops.exp(z_log_var)
                )
                kl_loss = keras.ops.mean(keras.ops.sum(kl_loss, axis=1))
                total_loss = reconstruction_loss + kl_loss
            grads = tape.gradient(total_loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            self.total_loss_tracker.update_state(total_loss)
            self.kl_loss_tracker.update_state(kl_loss)
            return {
                "loss": self.total_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result(),
            }

    return VAE


def _vae_rows(model, x):
    """(each row's reconstruction + KL loss, its KL loss) of the VAE's step."""
    z_mean, z_log_var, z = model.encoder(x)
    reconstruction = model.decoder(z)
    rebuilt = keras.ops.sum(keras.losses.binary_crossentropy(x, reconstruction), axis=1)
    kl = keras.ops.sum(
        -0.5 * (1 + z_log_var - keras.ops.square(z_mean) - keras.ops.exp(z_log_var)), axis=1
    )
    return rebuilt + kl, kl


# Its loss trains every weight; its KL part is only logged (`kl_loss`).
_VAE_PHASES = {
    "total": (
        lambda m, x, y: _vae_rows(m, x)[0],
        lambda m: m.trainable_weights,
        lambda m: m.optimizer,
    ),
    "kl": (lambda m, x, y: _vae_rows(m, x)[1], lambda m: [], lambda m: m.optimizer),
}


def _vae(strategy):
    inputs = keras.Input((6, 1))
    h = keras.layers.Flatten()(inputs)
    h = keras.layers.Dense(8, activation="relu")(h)
    z_mean = keras.layers.Dense(2, name="z_mean")(h)
    z_log_var = keras.layers.Dense(2, name="z_log_var")(h)
    encoder = keras.Model(inputs, [z_mean, z_log_var, Sampling()([z_mean, z_log_var])])
    latent = keras.Input((2,))
    decoder = keras.Model(
        latent, keras.layers.Reshape((6, 1))(keras.layers.Dense(6, activation="sigmoid")(latent))
    )
    if strategy is None:
        return _vae_class(keras.Model)(encoder, decoder)
    return _vae_class(kd.DistributedModel)(encoder, decoder, strategy=strategy)


# -- WGAN-GP (keras-io): a nested tape for the gradient penalty -------------------------


def _wgan_class(base):
    class WGAN(base):
        def __init__(self, critic, generator, **kwargs):
            super().__init__(**kwargs)
            self.critic = critic
            self.generator = generator

        def compile(self, c_optimizer, g_optimizer):
            super().compile()
            self.c_optimizer = c_optimizer
            self.g_optimizer = g_optimizer

        def gradient_penalty(self, real, fake):
            # Deterministic interpolation (keras-io draws alpha at random):
            # one number per row, from the row.
            alpha = tf.math.sigmoid(real[:, -1:])
            interpolated = real + alpha * (fake - real)
            with tf.GradientTape() as tape:
                tape.watch(interpolated)
                pred = self.critic(interpolated)
            grads = tape.gradient(pred, [interpolated])[0]
            norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=1) + 1e-12)
            return tf.reduce_mean((norm - 1.0) ** 2)

        def train_step(self, real):
            if isinstance(real, tuple):
                real = real[0]
            latent = real[:, :LATENT]
            with tf.GradientTape() as tape:
                fake = self.generator(latent)
                c_loss = (
                    tf.reduce_mean(self.critic(fake))
                    - tf.reduce_mean(self.critic(real))
                    + 10.0 * self.gradient_penalty(real, fake)
                )
            grads = tape.gradient(c_loss, self.critic.trainable_variables)
            self.c_optimizer.apply_gradients(zip(grads, self.critic.trainable_variables))
            with tf.GradientTape() as tape:
                g_loss = -tf.reduce_mean(self.critic(self.generator(latent)))
            grads = tape.gradient(g_loss, self.generator.trainable_variables)
            self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_variables))
            return {"c_loss": c_loss, "g_loss": g_loss}

    return WGAN


def _wgan_c_rows(model, x, y):
    """Each row's part of the critic's loss, its gradient penalty that of
    its own interpolated row."""
    fake = model.generator(x[:, :LATENT])
    alpha = tf.math.sigmoid(x[:, -1:])
    interpolated = x + alpha * (fake - x)
    with tf.GradientTape() as tape:
        tape.watch(interpolated)
        pred = model.critic(interpolated)
    grads = tape.gradient(pred, interpolated)
    norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=1) + 1e-12)
    return model.critic(fake)[:, 0] - model.critic(x)[:, 0] + 10.0 * (norm - 1.0) ** 2


def _wgan_g_rows(model, x, y):
    return -model.critic(model.generator(x[:, :LATENT]))[:, 0]


_WGAN_PHASES = {
    "c": (_wgan_c_rows, lambda m: m.critic.trainable_variables, lambda m: m.c_optimizer),
    "g": (_wgan_g_rows, lambda m: m.generator.trainable_variables, lambda m: m.g_optimizer),
}


def _wgan(strategy):
    critic = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    )
    generator = keras.Sequential([keras.Input((LATENT,)), keras.layers.Dense(6)])
    if strategy is None:
        return _wgan_class(keras.Model)(critic, generator)
    return _wgan_class(kd.DistributedModel)(critic, generator, strategy=strategy)


def _wgan_compile(model):
    model.compile(c_optimizer=keras.optimizers.SGD(0.01), g_optimizer=keras.optimizers.SGD(0.01))


# -- Siamese / contrastive (keras-io): a shared tower on two inputs ---------------------


def _siamese_graph():
    tower = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(4)]
    )
    left, right = keras.Input((6,)), keras.Input((6,))
    distance = keras.layers.Lambda(
        lambda t: keras.ops.sqrt(
            keras.ops.sum(keras.ops.square(t[0] - t[1]), axis=1, keepdims=True) + 1e-6
        )
    )([tower(left), tower(right)])
    return [left, right], keras.layers.Dense(1, activation="sigmoid")(distance)


def _contrastive_loss(y_true, y_pred, margin=1.0):
    y_true = tf.cast(y_true, y_pred.dtype)
    return keras.ops.mean(
        (1 - y_true) * keras.ops.square(y_pred)
        + y_true * keras.ops.square(keras.ops.maximum(margin - y_pred, 0))
    )


def _pairs():
    rng = np.random.default_rng(0)
    return (
        [rng.normal(size=(16, 6)).astype("float32"), rng.normal(size=(16, 6)).astype("float32")],
        rng.integers(0, 2, (16, 1)).astype("float32"),
    )


# -- code written for tf.distribute ---------------------------------------------------------


def _in_user_scope(strategy):
    """Keras's integration test: the model built in the user's own
    `tf.distribute.MirroredStrategy` scope (`MultiWorkerMirroredStrategy`,
    `ParameterServerStrategy` across processes), `strategy="auto"`."""

    def graph():
        inputs = keras.Input((6,))
        h = keras.layers.Dense(8, activation="relu")(inputs)
        return inputs, keras.layers.Dense(3)(h)

    if strategy is None:
        return keras.Model(*graph())
    if strategy == "mirrored":
        user = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    elif strategy == "multi_worker":  # TF_CONFIG, as the launcher sets it
        user = tf.distribute.MultiWorkerMirroredStrategy()
    elif strategy == "parameter_server":  # on the chief
        user = tf.distribute.ParameterServerStrategy(
            tf.distribute.cluster_resolver.TFConfigClusterResolver()
        )
    else:
        return _functional(graph)(strategy)
    with user.scope():
        return kd.DistributedModel(*graph())


def _softmax_graph():
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    h = keras.layers.Dense(8, activation="tanh")(h)
    return inputs, keras.layers.Dense(4, activation="softmax")(h)


# -- keras.applications (weights=None, small inputs) -------------------------------------


def _application(name, **kwargs):
    def make():
        cls = getattr(keras.applications, name)
        return cls(weights=None, input_shape=(32, 32, 3), classes=3, **kwargs)

    return _from_model(make)


# -- text and sequences -------------------------------------------------------------------


class TransformerBlock(keras.layers.Layer):
    """keras-io "Text classification with Transformer" (no get_config)."""

    def __init__(self, embed_dim, num_heads, ff_dim):
        super().__init__()
        self.att = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [keras.layers.Dense(ff_dim, activation="relu"), keras.layers.Dense(embed_dim)]
        )
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)

    def call(self, inputs):
        out1 = self.layernorm1(inputs + self.att(inputs, inputs))
        return self.layernorm2(out1 + self.ffn(out1))


class TokenAndPositionEmbedding(keras.layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = keras.layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        positions = self.pos_emb(keras.ops.arange(0, keras.ops.shape(x)[-1], 1))
        return self.token_emb(x) + positions


def _transformer_graph():
    inputs = keras.Input((6,))
    h = TokenAndPositionEmbedding(6, 40, 8)(inputs)
    h = TransformerBlock(8, 2, 8)(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return inputs, keras.layers.Dense(2, activation="softmax")(keras.layers.Dense(8, "relu")(h))


_SENTENCES = np.array(
    [
        "the cat sat",
        "a dog ran far",
        "the dog sat down",
        "cats run",
        "a cat and a dog",
        "far down the road",
        "the end",
        "run dog run",
    ]
    * 2
)


def _text_graph():
    vectorize = keras.layers.TextVectorization(max_tokens=20, output_sequence_length=5)
    vectorize.adapt(_SENTENCES)
    inputs = keras.Input((), dtype="string")
    h = keras.layers.Embedding(20, 8)(vectorize(inputs))
    h = keras.layers.GlobalAveragePooling1D()(h)
    return inputs, keras.layers.Dense(2, activation="softmax")(h)


def _text_data():
    return _SENTENCES.astype(object), np.arange(16, dtype="int32") % 2


def _recurrent_graph(cell):
    def graph():
        inputs = keras.Input((6,), dtype="int32")
        h = keras.layers.Embedding(40, 8, mask_zero=True)(inputs)
        h = getattr(keras.layers, cell)(8)(h)
        return inputs, keras.layers.Dense(2, activation="softmax")(h)

    return graph


def _recommender_graph():
    users, items = keras.Input((1,), dtype="int32"), keras.Input((1,), dtype="int32")
    u = keras.layers.Flatten()(keras.layers.Embedding(50, 8)(users))
    v = keras.layers.Flatten()(keras.layers.Embedding(60, 8)(items))
    return [users, items], keras.layers.Dense(1, activation="sigmoid")(
        keras.layers.Dot(axes=1)([u, v])
    )


def _ratings():
    rng = np.random.default_rng(0)
    return (
        [
            rng.integers(0, 50, (16, 1)).astype("int32"),
            rng.integers(0, 60, (16, 1)).astype("int32"),
        ],
        rng.integers(0, 2, (16, 1)).astype("float32"),
    )


# -- vision blocks -----------------------------------------------------------------------


def _resnet_graph(synchronized):
    def graph():
        inputs = keras.Input((8, 8, 3))
        h = keras.layers.Conv2D(8, 3, padding="same")(inputs)
        shortcut = h
        h = keras.layers.BatchNormalization(synchronized=synchronized)(h)
        h = keras.layers.Activation("relu")(h)
        h = keras.layers.Conv2D(8, 3, padding="same")(h)
        h = keras.layers.BatchNormalization(synchronized=synchronized)(h)
        h = keras.layers.Activation("relu")(keras.layers.Add()([h, shortcut]))
        h = keras.layers.GlobalAveragePooling2D()(h)
        return inputs, keras.layers.Dense(3)(h)

    return graph


# -- the other Keras features users combine ----------------------------------------------


def _multi_io_graph():
    a, b = keras.Input((6,), name="a"), keras.Input((4,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(8, activation="relu")(a), b])
    return [a, b], {
        "label": keras.layers.Dense(3, name="label")(h),
        "score": keras.layers.Dense(1, name="score")(h),
    }


def _multi_io_data():
    rng = np.random.default_rng(0)
    return (
        [rng.normal(size=(16, 6)).astype("float32"), rng.normal(size=(16, 4)).astype("float32")],
        {
            "label": rng.integers(0, 3, 16).astype("int32"),
            "score": rng.normal(size=(16, 1)).astype("float32"),
        },
    )


def _multi_io_compile(model):
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss={
            "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "score": "mse",
        },
        loss_weights={"label": 1.0, "score": 0.5},
        metrics={"label": ["accuracy"]},
    )


class ActivityPenalty(keras.layers.Layer):
    def call(self, x):
        self.add_loss(1e-2 * keras.ops.mean(keras.ops.square(x)))
        return x


def _regularized_graph():
    inputs = keras.Input((6,))
    h = keras.layers.Dense(
        8,
        activation="relu",
        kernel_regularizer=keras.regularizers.L2(1e-2),
        activity_regularizer=keras.regularizers.L1(1e-3),
    )(inputs)
    h = ActivityPenalty()(h)
    return inputs, keras.layers.Dense(3)(h)


def _noise_graph():
    inputs = keras.Input((6,))
    h = keras.layers.GaussianNoise(0.1)(inputs)
    h = keras.layers.Dense(8, activation="relu")(h)
    h = keras.layers.Dropout(0.5)(h)
    return inputs, keras.layers.Dense(3)(h)


def _nested_graph():
    inner = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(8, activation="relu"),
        ],
        name="backbone",
    )
    inputs = keras.Input((6,))
    return inputs, keras.layers.Dense(3)(inner(inputs))


def _containers_class(base):
    class Towers(base):
        """Sub-layers in a list and a dict (Keras tracks both)."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.blocks = [keras.layers.Dense(8, activation="relu") for _ in range(2)]
            self.heads = {"logits": keras.layers.Dense(3)}

        def call(self, x):
            for block in self.blocks:
                x = block(x)
            return self.heads["logits"](x)

    return Towers


def _subclassed(make_class):
    def build(strategy):
        model = (
            make_class(keras.Model)()
            if strategy is None
            else make_class(kd.DistributedModel)(strategy=strategy)
        )
        model(np.zeros((1, 6), "float32"))
        return model

    return build


def _guide_step_class(base):
    class GuideStep(base):
        """Keras's guide "Customizing what happens in fit()": compute_loss,
        apply_gradients and the compiled metrics in the user's own step."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(8, activation="relu")
            self.out = keras.layers.Dense(3)

        def call(self, x):
            return self.out(self.hidden(x))

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    return GuideStep


# -- the zoo -------------------------------------------------------------------------------

_SUBCLASSED = refused(
    "subclassed model", r"strategy='pipeline' needs a Functional or Sequential model"
)
_CUSTOM_STEP = refused(
    "custom train_step",
    r"strategy='pipeline' runs its own train step "
    r"and cannot run a custom train_step",
)
# _DEEP_NOTE: a keras.applications model on 8 images of 32x32: its last
# BatchNormalization layers normalize 8 values each, which turns float
# rounding in another summation order (tensor_parallel computes on two
# devices, in an order TensorFlow does not fix from run to run) into up to
# ~1e-2 after one step: no tolerance both holds and means anything. Their
# rows assert `AGREES`, and their forward pass before training must equal
# plain Keras's (a softmax head applied per shard was 0.1 off there).
_BN = {"mirrored": AGREES, "central_storage": AGREES, "pipeline": AGREES}
_APPLICATION = {
    "single": SKIPPED,
    "mirrored": SKIPPED,
    "central_storage": SKIPPED,
    "pipeline": SKIPPED,
}
# Seeded random layers: one device draws what plain Keras draws, replicas
# draw their own (keras_distrib.replica_seeds).
_RANDOM = {
    s: AGREES
    for s in (
        "mirrored",
        "central_storage",
        "pipeline",
        "tensor_parallel",
        "multi_worker",
        "horovod",
    )
}
# Unseeded ones: plain Keras's own draws differ from run to run.
_UNSEEDED = {s: AGREES for s in IN_PROCESS + MULTI_PROCESS}

PATTERNS = [
    Pattern(
        "lambda",
        "`Lambda(lambda t: t * 2.0 - 1.0)` in a Functional model",
        _functional(_lambda_graph),
        _classes,
        _sgd,
    ),
    Pattern(
        "user_layer",
        "a user layer without `get_config`/`**kwargs`, holding a layer, an array and a callable",
        _functional(_user_layer_graph),
        _classes,
        _sgd,
    ),
    Pattern(
        "user_metric",
        "a user metric without `get_config`/`**kwargs` in `compile`",
        _functional(_lambda_graph),
        _classes,
        lambda m: _sgd(m, metrics=[Coverage(), "accuracy"]),
    ),
    Pattern(
        "gan",
        "keras-io GAN: no `call`, two optimizers set in `compile`, two tapes, "
        "latent vectors from the data",
        _gan(False),
        lambda: (_classes()[0],),
        _gan_compile,
        {"pipeline": _CUSTOM_STEP},
        phases=_GAN_PHASES,
    ),
    Pattern(
        "gan_random",
        "keras-io GAN, latent vectors from `keras.random.normal(seed=...)`",
        _gan(True),
        lambda: (_classes()[0],),
        _gan_compile,
        {**_RANDOM, "pipeline": _CUSTOM_STEP},
        phases=_GAN_PHASES,
    ),
    Pattern(
        "vae",
        "keras-io VAE: no `call`, a sampling layer, loss trackers",
        _vae,
        lambda: (np.random.default_rng(0).uniform(size=(16, 6, 1)).astype("float32"),),
        lambda m: m.compile(optimizer=keras.optimizers.Adam(1e-3)),
        {**_RANDOM, "pipeline": _CUSTOM_STEP},
        phases=_VAE_PHASES,
    ),
    Pattern(
        "wgan_gp",
        "keras-io WGAN-GP: a nested tape for the gradient penalty",
        _wgan,
        lambda: (_classes()[0],),
        _wgan_compile,
        {"pipeline": _CUSTOM_STEP},
        batch_logs=True,
        phases=_WGAN_PHASES,
    ),
    Pattern(
        "siamese",
        "keras-io Siamese network: one tower on two inputs, contrastive loss",
        _functional(_siamese_graph),
        _pairs,
        lambda m: m.compile(optimizer=keras.optimizers.SGD(0.1), loss=_contrastive_loss),
    ),
    Pattern(
        "tf_distribute_scope",
        "Keras's tf.distribute test: built in the user's "
        "`MirroredStrategy` scope (across processes: `MultiWorkerMirroredStrategy`, "
        '`ParameterServerStrategy`), `strategy="auto"`',
        _in_user_scope,
        _classes,
        lambda m: _sgd(m, metrics=[keras.metrics.SparseCategoricalAccuracy()]),
    ),
    Pattern(
        "softmax_head",
        '`Dense(4, activation="softmax")` head',
        _functional(_softmax_graph),
        lambda: _classes(classes=4),
        _softmax_sgd,
    ),
    Pattern(
        "mobilenet_v2",
        "`keras.applications.MobileNetV2(weights=None)`",
        _application("MobileNetV2", alpha=0.35),
        _app_images,
        _deep_sgd,
        {**_APPLICATION, "tensor_parallel": AGREES},
        steps=1,
        forward=True,
    ),
    Pattern(
        "efficientnet_b0",
        "`keras.applications.EfficientNetB0(weights=None)`",
        _application("EfficientNetB0"),
        _app_images,
        _deep_sgd,
        {**_UNSEEDED, **_APPLICATION, "tensor_parallel": AGREES},
        steps=1,
        forward=True,
    ),
    Pattern(
        "transformer",
        "keras-io Transformer text classifier (layers without `get_config`)",
        _functional(_transformer_graph),
        lambda: _tokens(vocab=40),
        _softmax_sgd,
    ),
    Pattern(
        "text_vectorization",
        "`TextVectorization` + `Embedding`, Adam",
        _functional(_text_graph),
        _text_data,
        _adam,
    ),
    Pattern(
        "masked_lstm",
        "`Embedding(mask_zero=True)` + `LSTM`",
        _functional(_recurrent_graph("LSTM")),
        lambda: _tokens(zeros=True),
        _softmax_sgd,
    ),
    Pattern(
        "masked_gru",
        "`Embedding(mask_zero=True)` + `GRU`",
        _functional(_recurrent_graph("GRU")),
        lambda: _tokens(zeros=True),
        _softmax_sgd,
    ),
    Pattern(
        "embeddings_adam",
        "two `Embedding`s (a recommender), Adam",
        _functional(_recommender_graph),
        _ratings,
        lambda m: _adam(m, loss="binary_crossentropy"),
    ),
    Pattern(
        "resnet_block",
        "ResNet block with `BatchNormalization`",
        _functional(_resnet_graph(False)),
        lambda: _images(size=8),
        _sgd,
        _BN,
    ),
    Pattern(
        "resnet_block_sync",
        "ResNet block with `BatchNormalization(synchronized=True)`",
        _functional(_resnet_graph(True)),
        lambda: _images(size=8),
        _sgd,
        {"pipeline": AGREES},
    ),
    Pattern(
        "multi_io",
        "two inputs, two outputs, `loss_weights`, per-output metrics",
        _functional(_multi_io_graph),
        _multi_io_data,
        _multi_io_compile,
    ),
    Pattern(
        "regularizers",
        "kernel and activity regularizers, `add_loss`",
        _functional(_regularized_graph),
        _classes,
        lambda m: m.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        ),
    ),
    Pattern(
        "dropout_noise",
        "`GaussianNoise` and `Dropout`",
        _functional(_noise_graph),
        _classes,
        _sgd,
        _UNSEEDED,
    ),
    Pattern(
        "nested_model",
        "a Sequential model used as a layer",
        _functional(_nested_graph),
        _classes,
        _sgd,
    ),
    Pattern(
        "containers",
        "subclassed model with sub-layers in a list and a dict",
        _subclassed(_containers_class),
        _classes,
        lambda m: _sgd(m, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
        {"pipeline": _SUBCLASSED},
    ),
    Pattern(
        "guide_train_step",
        "the Keras guide's custom `train_step`",
        _subclassed(_guide_step_class),
        _classes,
        lambda m: _sgd(m, metrics=["accuracy"]),
        {"pipeline": _CUSTOM_STEP},
        batch_logs=True,
    ),
]

BY_NAME = {p.name: p for p in PATTERNS}


# -- running one pattern -----------------------------------------------------------------------


class _InitialWeights(keras.callbacks.Callback):
    """Records the weights training starts from (after any broadcast)."""

    def on_train_begin(self, logs=None):
        self.weights = self.model.get_weights()


def _batches(pattern: Pattern, data):
    """(x, y, batch size) of the pattern's `steps` steps."""
    x = data[0]
    y = data[1] if len(data) > 1 else None
    n = len(keras.tree.flatten(x)[0])
    batch = min(pattern.batch_size, n) if pattern.steps > 1 else n
    rows = batch * pattern.steps
    x = keras.tree.map_structure(lambda a: a[:rows], x)
    y = None if y is None else keras.tree.map_structure(lambda a: a[:rows], y)
    return x, y, batch


def train(pattern: Pattern, model, data, callbacks=()) -> dict:
    pattern.compile(model)
    x, y, batch = _batches(pattern, data)
    history = model.fit(
        x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=list(callbacks)
    )
    return {k: float(v[-1]) for k, v in history.history.items()}


def reference(pattern: Pattern, initial=None, strategies=IN_PROCESS):
    """(initial weights, weights after training, logs, bounds) of the plain
    Keras model, from `initial` weights if given. Trained only where some
    outcome among `strategies` is `EXACT` (weights and logs None
    otherwise: building the model gives the initial weights). `bounds`:
    {"weights": one per weight, "logs": {key: one}}, how far another run
    of the same math may end from them (`float_bounds.Reference`; the
    moving statistics' by `moving_statistics_apart`)."""
    model = pattern.build(None)
    if initial is not None:
        model.set_weights(initial)
    initial = model.get_weights()
    if pattern.forward:
        x = pattern.data()[0]
        _FORWARD[pattern.name] = (model.predict(x, verbose=0), outputs_apart(model, x))
    if all(pattern.outcome(s) != EXACT for s in strategies):
        return initial, None, None, None
    x, y, batch = _batches(pattern, pattern.data())
    pattern.compile(model)
    traced = Reference.fit(model, x, y, batch, phases=pattern.phases)
    logs = {k: float(v[-1]) for k, v in traced.logs.items()}
    others = moving_statistics_apart(traced, x, batch)
    # A step's own logs (`batch_logs`): the last step's bound.
    history = traced.history(1 if pattern.batch_logs else None)
    bounds = {
        "weights": aligned(model, traced.trainable, others),
        "logs": {k: v[-1] for k, v in history.items()},
    }
    return initial, model.get_weights(), logs, bounds


# Pattern name -> plain Keras's predictions at the initial weights and how
# far another computation's may be (`forward`).
_FORWARD: dict = {}


def run_pattern(pattern: Pattern, strategy: str, initial=None) -> dict:
    """Trains `pattern` on `strategy` (from `initial` weights if given): the
    weights it started from and ended with, its logs, whether its replicas
    agree; or the one-line error that refused it."""
    start = _InitialWeights()
    try:
        model = pattern.build(strategy)
        if initial is not None:
            model.set_weights(initial)
        predictions = model.predict(pattern.data()[0], verbose=0) if pattern.forward else None
        logs = train(pattern, model, pattern.data(), callbacks=[start])
    except Exception as error:  # noqa: BLE001 (the zoo records refusals)
        return {"error": f"{type(error).__name__}: {error}"}
    replicas_agree = all(
        all(np.array_equal(values[0], other) for other in values[1:])
        for values in (model.strategy.local_replica_values(v) for v in model.trainable_variables)
    )
    return {
        "initial": start.weights,
        "weights": model.get_weights(),
        "logs": logs,
        "replicas_agree": replicas_agree,
        "predictions": predictions,
    }


def _check_exact(pattern, strategy, expected_weights, result, expected_logs, bounds) -> None:
    """`EXACT`: the weights and logs within their bounds of plain Keras's
    (`bounds`); a log with no bound (a metric counting rows) equal."""
    where = f"{pattern.name} under {strategy}"
    for i, (a, b, bound) in enumerate(
        zip(expected_weights, result["weights"], bounds["weights"], strict=True)
    ):
        assert_within(b, a, bound, f"{where}: weight {i}")
    if expected_logs is None:
        return
    assert set(result["logs"]) == set(expected_logs), (result["logs"], expected_logs)
    for key, value in expected_logs.items():
        if key in bounds["logs"]:
            assert_within(result["logs"][key], value, bounds["logs"][key], f"{where}: {key}")
        else:
            assert result["logs"][key] == value, (where, key, result["logs"][key], value)


def check(
    pattern: Pattern,
    strategy: str,
    initial,
    expected_weights,
    result,
    expected_logs=None,
    bounds=None,
) -> str:
    """Asserts `result` is `pattern.outcome(strategy)`; returns the outcome.
    `EXACT` also compares the epoch's logs with plain Keras's, if given,
    each within its bound (`reference`'s `bounds`)."""
    outcome = pattern.outcome(strategy)
    if outcome == SKIPPED:
        return outcome
    if refusal(outcome):
        assert "error" in result, f"{pattern.name} under {strategy} trained; expected a refusal"
        message = result["error"]
        assert "\n" not in message.strip(), f"not one line: {message}"
        assert re.search(refusal(outcome)[1], message), message
        return outcome
    assert "error" not in result, f"{pattern.name} under {strategy}: {result['error']}"
    weights = result["weights"]
    assert all(np.all(np.isfinite(w)) for w in weights), "weights not finite"
    assert all(np.all(np.isfinite(v)) for v in result["logs"].values()), result["logs"]
    if outcome == EXACT:
        _check_exact(pattern, strategy, expected_weights, result, expected_logs, bounds)
    else:
        assert result["replicas_agree"], f"{pattern.name} under {strategy}: replicas differ"
        if pattern.forward and result.get("predictions") is not None:
            assert_within(
                result["predictions"],
                *_FORWARD[pattern.name],
                f"{pattern.name} under {strategy}: predictions",
            )
        moved = any(not np.array_equal(a, b) for a, b in zip(initial, weights))
        assert moved, f"{pattern.name} under {strategy}: no weight moved"
    return outcome
