"""A custom train_step (Keras guide "Customizing what happens in fit") under mirrored."""

import keras
import numpy as np
import tensorflow as tf

import keras_distrib as kd
from helpers import CLASSES, FEATURES, make_data


class CustomNet(kd.DistributedModel):
    def __init__(self, **kwargs):
        super().__init__(strategy="mirrored", **kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.logits = keras.layers.Dense(CLASSES)

    def call(self, x):
        return self.logits(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        return {"my_loss": loss, "my_count": tf.shape(x)[0]}


def test_logs_with_keys_that_are_not_metrics():
    x, y = make_data()
    model = CustomNet()
    model(np.zeros((1, FEATURES), "float32"))
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    assert model.strategy.num_replicas == 2
    assert set(history.history) == {"my_loss", "my_count"}
    assert all(np.isfinite(history.history["my_loss"]))
