"""Keras's own tests (keras_suite.FILES) on DistributedModel, strategy="pipeline"."""

import keras_suite

keras_suite.expose_all(globals(), "pipeline")
