"""What `DistributedModel` is made of, and what it runs around the user's
`fit`, `evaluate` and `predict`, beside the strategy.

The model's mixins, one concern each (the model's classes themselves are
defined in `keras_distrib.model`); they reach the model's strategy through
the `Strategy` interface only, and share one `StepState`
(`step_state`, with `TrainerPart`, their common base):

* `adoption`: what the model trains with (layers, metrics, optimizers),
  made the strategy's;
* `replica_step`: the per-replica math of `train_step` and `test_step`;
* `gradient_reduction`: the step's one cross-replica reduction;
* `entry_points`: `fit`, `evaluate` and `predict` around Keras's loop;
* `outside_scopes`: their methods run outside the caller's tf.distribute
  scope; `from_model`: the wrapped model's check, compile and optimizer state.

Around the model's calls:

* `step_call`: the one compiled function Keras's loop calls per step;
* `fit_checks`: cheap checks that turn silent failures into one-line errors;
* `fit_state`: what one `fit` call keeps, and the `Resumable` protocol;
* `chief_only`: one progress bar and one set of files across workers;
* `saving`: atomic writes of `.keras` and `.weights.h5` files.

What the model and the strategies both do to gradients and optimizers
lives below the strategies, in `keras_distrib.arithmetic`.
"""
