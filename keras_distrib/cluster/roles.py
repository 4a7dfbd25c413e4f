"""Task types (roles) of a cluster, named as `TF_CONFIG` names them.

* `chief`: the training task that saves, logs and prints (rank 0). At most
  one; `TF_CONFIG` from older Kubeflow TFJob versions calls it `master`.
* `worker`: the other training tasks.
* `ps`: parameter servers; they hold variables and read no data. Only the
  `parameter_server` strategy uses them.
* `evaluator`: a side-car that evaluates checkpoints; not part of training.
"""

from __future__ import annotations

from typing import Iterable

__all__ = [
    "CHIEF",
    "EVALUATOR",
    "PS",
    "TASK_TYPES",
    "TRAINING_TASK_TYPES",
    "WORKER",
]

CHIEF = "chief"
WORKER = "worker"
PS = "ps"
EVALUATOR = "evaluator"

# In TF_CONFIG cluster order: the chief (rank 0), workers, then the rest.
TASK_TYPES = (CHIEF, WORKER, PS, EVALUATOR)
TRAINING_TASK_TYPES = (CHIEF, WORKER)

# What older Kubeflow TFJob versions called the chief; read, never written.
LEGACY_CHIEF = "master"

PS_HINT = (
    "parameter servers are handled by the parameter_server strategy, not by "
    "this one; drop the 'ps' tasks or use strategy='parameter_server'"
)

EVALUATOR_HINT = (
    "which is not a training worker; run side-car evaluation without "
    "keras_distrib's cluster or make this task a 'worker'"
)


def quoted(names: Iterable[str], last: str = "or") -> str:
    """`'a', 'b' or 'c'`, for error messages."""
    names = [repr(n) for n in names]
    if len(names) <= 1:
        return "".join(names)
    return f"{', '.join(names[:-1])} {last} {names[-1]}"
