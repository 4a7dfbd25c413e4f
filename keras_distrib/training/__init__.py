"""What `DistributedModel` runs around the user's `fit`, `evaluate` and
`predict`, beside the strategy:

* `step_call`: the one compiled function Keras's loop calls per step;
* `fit_checks`: cheap checks that turn silent failures into one-line errors;
* `chief_only`: one progress bar and one set of files across workers;
* `saving`: atomic writes of `.keras` and `.weights.h5` files.
"""
