"""Strategies by name: `available()`, `create(name, **options)`, aliases.

Strategy classes register themselves when their module is imported: a
subclass of `Strategy` that sets `name` (and optionally `aliases`,
`description`, `one_per_process`) is added to the table of names
(`keras_distrib.strategies.names`) by `Strategy.__init_subclass__`.
The built-in ones are imported when first asked for, from `BUILTIN` (name
-> module): asking for `"mirrored"` imports the mirrored strategy's module
only, and this module imports no strategy (so nothing under
`keras_distrib.strategies` imports back up through it). Adding a built-in
strategy is adding its module and one line in `BUILTIN`; a user's own
strategy registers itself by subclassing. A name or alias that is already
taken is an error.

What `strategy=` may also be (a Strategy object, a tf.distribute strategy,
"auto" inside a strategy's scope) is resolved above this, in
`keras_distrib.strategies.resolve`.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import TYPE_CHECKING, Any

from keras_distrib import cluster as cluster_lib
from keras_distrib.strategies.names import _ALIASES, _CLASSES
from keras_distrib.strategies.names import AUTO as AUTO  # re-exported
from keras_distrib.strategies.names import canonical as canonical  # re-exported
from keras_distrib.strategies.names import register as register  # re-exported

if TYPE_CHECKING:  # for annotations only: at run time this module imports no strategy
    from keras_distrib.strategies.base import Strategy

# Built-in strategies: registered name -> the module that defines the class.
BUILTIN = {
    "single": "keras_distrib.strategies.single",
    "mirrored": "keras_distrib.strategies.mirrored",
    "central_storage": "keras_distrib.strategies.central_storage",
    "multi_worker": "keras_distrib.strategies.multi_worker",
    "horovod": "keras_distrib.strategies.horovod",
    "parameter_server": "keras_distrib.strategies.parameter_server.strategy",
    "tpu": "keras_distrib.strategies.tpu",
    "pipeline": "keras_distrib.strategies.pipeline.strategy",
    "tensor_parallel": "keras_distrib.strategies.tensor_parallel.strategy",
}

_AUTO_DESCRIPTION = (
    "parameter_server when a configured cluster (TF_CONFIG, Slurm) has ps tasks, "
    "multi_worker when it has none, horovod under "
    "horovodrun, else mirrored when more than one local device is visible, else single."
)


def available() -> dict[str, str]:
    """Registered strategy names with one-line descriptions."""
    _load_builtin()
    return {AUTO: _AUTO_DESCRIPTION, **{n: c.description for n, c in _CLASSES.items()}}


def create(name: str, **options: Any) -> Strategy:
    """Builds the strategy registered as `name` (any case, an alias, or
    `"auto"`) with `options`.

    Raises:
        ValueError: unknown name (the message lists the valid ones) or an
            option the strategy does not take.
    """
    key = canonical(name)
    if key == AUTO:
        if options:
            raise ValueError(
                f"Strategy 'auto' takes no options (got {sorted(options)}); name the "
                "strategy the options are for."
            )
        return create(_auto_name())
    cls = strategy_class(name)
    _check_options(key, cls, options)
    if cls.capabilities.one_per_process:
        return _one_per_process(key, cls, options)
    return cls(**options)


def strategy_class(name: str) -> type[Strategy]:
    """The class registered as `name` (any case, an alias), importing its
    module when it is a built-in one not imported yet.

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    key = canonical(name)
    if key not in _CLASSES:
        if key in BUILTIN:
            importlib.import_module(BUILTIN[key])
        else:
            _load_builtin()  # perhaps an alias of a built-in strategy not imported yet
            key = canonical(name)
    if key not in _CLASSES:
        valid = sorted([AUTO, *_CLASSES, *_ALIASES])
        raise ValueError(f"Unknown strategy {name!r}; valid names: {valid}.")
    return _CLASSES[key]


# TensorFlow allows one collective runtime per process: later requests for
# such a strategy get the first instance (with the same options).
_STARTED: dict[str, tuple[dict[str, Any], Strategy]] = {}


def started(name: str) -> bool:
    """Whether the one-per-process strategy `name` already runs here."""
    return canonical(name) in _STARTED


def _one_per_process(key: str, cls: type[Strategy], options: dict[str, Any]) -> Strategy:
    if key in _STARTED:
        started_options, strategy = _STARTED[key]
        if options and options != started_options:
            raise ValueError(
                f"Strategy {key!r} already runs in this process with options "
                f"{started_options}; one per process: reuse it or pass no options."
            )
        return strategy
    strategy = cls(**options)
    _STARTED[key] = (options, strategy)
    return strategy


def check_not_model_options(kwargs: dict[str, Any], strategy: Strategy) -> None:
    """Rejects strategy options passed to the model constructor.

    Keras's Functional model ignores keyword arguments it does not know, so
    `DistributedModel(inputs, outputs, strategy="mirrored", devices=[...])`
    would silently train on the default devices.
    """
    _load_builtin()
    options = {p for cls in _CLASSES.values() for p in inspect.signature(cls).parameters}
    misplaced = sorted(set(kwargs) & options)
    if misplaced:
        names = ", ".join(f"{k}=" for k in misplaced)
        raise ValueError(
            f"{names} {'is an option' if len(misplaced) == 1 else 'are options'} of the "
            f"strategy, not of the model; pass strategy=keras_distrib.strategies.get("
            f"{strategy.name!r}, {misplaced[0]}=...) instead."
        )


def _check_options(name: str, cls: type[Strategy], options: dict[str, Any]) -> None:
    params = inspect.signature(cls).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise ValueError(
            f"Strategy {name!r} does not take option(s) {unknown}; "
            f"its options are {sorted(params)}."
        )


# Variables horovodrun (Gloo) and MPI launchers set in every rank.
_HOROVOD_ENV = ("HOROVOD_RANK", "HOROVOD_SIZE")


def _auto_name() -> str:
    info = cluster_lib.resolve()
    if info is not None:
        return "parameter_server" if info.has_ps else "multi_worker"
    if all(v in os.environ for v in _HOROVOD_ENV) and int(os.environ["HOROVOD_SIZE"]) > 1:
        return "horovod"
    from keras_distrib import devices as devices_lib

    return "mirrored" if len(devices_lib.local_devices()) > 1 else "single"


def _load_builtin() -> None:
    for module in BUILTIN.values():
        importlib.import_module(module)
