"""Keras's own tests (keras_suite.FILES) on DistributedModel, strategy="single"."""

import keras_suite

keras_suite.expose_all(globals(), "single")
