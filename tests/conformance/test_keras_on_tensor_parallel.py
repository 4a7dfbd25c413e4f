"""Keras's own tests (keras_suite.FILES) on DistributedModel, strategy="tensor_parallel"."""

import keras_suite

keras_suite.expose_all(globals(), "tensor_parallel")
