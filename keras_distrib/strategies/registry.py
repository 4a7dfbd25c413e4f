"""Strategies by name: `available()`, `get(name, **options)`, aliases.

Strategy classes register themselves when their module is imported: a
subclass of `Strategy` that sets `name` (and optionally `aliases`,
`description`, `one_per_process`) is added here by `Strategy.__init_subclass__`,
and `keras_distrib.strategies` imports every module of its package. Adding
a strategy is adding one file. A name or alias that is already taken is an
error. An instance always beats a string: `get(strategy_object)` returns it
as is.
"""

from __future__ import annotations

import inspect
import os
from typing import TYPE_CHECKING, Union

from keras_distrib import cluster as cluster_lib

if TYPE_CHECKING:
    from keras_distrib.strategies.base import Strategy

_CLASSES: dict[str, type] = {}
_ALIASES: dict[str, str] = {}
AUTO = "auto"
_AUTO_DESCRIPTION = (
    "parameter_server when a configured cluster (TF_CONFIG, Slurm) has ps tasks, "
    "multi_worker when it has none, horovod under "
    "horovodrun, else mirrored when more than one local device is visible, else single."
)


def register(cls: type) -> None:
    """Adds strategy class `cls` under `cls.name` and `cls.aliases`.

    Raises:
        ValueError: the name or an alias is already registered.
    """
    names = [_key(cls.name), *(_key(a) for a in cls.aliases)]
    for name in names:
        owner = _CLASSES.get(name) or _CLASSES.get(_ALIASES.get(name, ""))
        if owner is not None and owner is not cls or name == AUTO:
            raise ValueError(
                f"Strategy name {name!r} of {cls.__module__}.{cls.__qualname__} is "
                f"already taken{f' by {owner.__qualname__}' if owner else ''}; pick another name."
            )
    _CLASSES[names[0]] = cls
    for alias in names[1:]:
        _ALIASES[alias] = names[0]


def available() -> dict[str, str]:
    """Registered strategy names with one-line descriptions."""
    _load_builtin()
    return {AUTO: _AUTO_DESCRIPTION, **{n: c.description for n, c in _CLASSES.items()}}


def get(strategy: Union[str, "Strategy"] = AUTO, **options) -> "Strategy":
    """Builds the strategy registered as `strategy` with `options`.

    Raises:
        ValueError: unknown name (the message lists the valid ones) or an
            option the strategy does not take.
    """
    import tensorflow as tf

    from keras_distrib.strategies import from_tf
    from keras_distrib.strategies.base import Strategy
    from keras_distrib.strategies.tf_distribute import entered

    scope = entered()
    if scope is None and tf.distribute.has_strategy() and not isinstance(strategy, Strategy):
        # A tf.distribute strategy's scope (the user's): models built there
        # train on it, as Keras's do.
        scope = from_tf.adopt(tf.distribute.get_strategy())
    if scope is not None and not options:
        return _the_entered(scope, strategy)
    if isinstance(strategy, tf.distribute.Strategy):
        if options:
            raise ValueError(
                f"Options {sorted(options)} were given with a tf.distribute strategy object; "
                "pass them to its constructor instead.")
        return from_tf.adopt(strategy)
    if isinstance(strategy, Strategy):
        if options:
            raise ValueError(
                f"Options {sorted(options)} were given with a strategy object; "
                "pass them to the strategy's constructor instead."
            )
        return strategy
    if not isinstance(strategy, str):
        raise TypeError(
            "strategy must be a name from keras_distrib.strategies.available(), "
            f"a keras_distrib Strategy object or a tf.distribute strategy, got "
            f"{type(strategy).__name__}."
        )
    _load_builtin()
    key = _canonical(strategy)
    if key == AUTO:
        if options:
            raise ValueError(
                f"Strategy 'auto' takes no options (got {sorted(options)}); name the "
                "strategy the options are for."
            )
        return get(_auto_name())
    if key not in _CLASSES:
        valid = sorted([AUTO, *_CLASSES, *_ALIASES])
        raise ValueError(f"Unknown strategy {strategy!r}; valid names: {valid}.")
    cls = _CLASSES[key]
    _check_options(key, cls, options)
    if cls.one_per_process:
        return _one_per_process(key, cls, options)
    return cls(**options)


def _the_entered(scope: "Strategy", strategy: Union[str, "Strategy"]) -> "Strategy":
    """Inside a strategy's `scope()` (e.g. `keras.models.load_model` there, as
    TensorFlow's tutorials do) models use that strategy, as Keras's do.
    """
    import tensorflow as tf

    from keras_distrib.strategies import from_tf

    if strategy is scope:
        return scope
    if isinstance(strategy, str) and _canonical(strategy) in (AUTO, scope.name):
        return scope
    if isinstance(strategy, tf.distribute.Strategy) and from_tf.adopt(strategy) is scope:
        return scope
    named = strategy if isinstance(strategy, str) else getattr(strategy, "name", strategy)
    raise ValueError(
        f"Strategy {named!r} was asked for inside the scope of strategy {scope.name!r}; "
        "build the model outside that scope, or leave strategy= out to use the scope's."
    )


def _key(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def _canonical(name: str) -> str:
    """The registered name that `name` (any case, an alias) stands for."""
    key = _key(name)
    return _ALIASES.get(key, key)


# TensorFlow allows one collective runtime per process: later requests for
# such a strategy get the first instance (with the same options).
_STARTED: dict[str, tuple[dict, "Strategy"]] = {}


def started(name: str) -> bool:
    """Whether the one-per-process strategy `name` already runs here."""
    return _canonical(name) in _STARTED


def _one_per_process(key, cls, options):
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


def check_not_model_options(kwargs: dict, strategy: "Strategy") -> None:
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


def _check_options(name: str, cls: type, options: dict) -> None:
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
    import keras_distrib.strategies  # noqa: F401  (imports every strategy module)
