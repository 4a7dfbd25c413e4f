"""Strategies by name: `available()`, `get(name, **options)`, aliases.

An instance always beats a string: `get(strategy_object)` returns it as is.
"""

from __future__ import annotations

import inspect
from typing import Callable, Union

from keras_distrib import cluster as cluster_lib
from keras_distrib import devices as devices_lib
from keras_distrib.strategies.base import Strategy
from keras_distrib.strategies.mirrored import Mirrored
from keras_distrib.strategies.multi_worker import MultiWorker
from keras_distrib.strategies.single import SingleDevice

_FACTORIES: dict[str, Callable[..., Strategy]] = {}
_DESCRIPTIONS: dict[str, str] = {}
_ALIASES: dict[str, str] = {}


def register(
    name: str, factory: Callable[..., Strategy], description: str, aliases=()
) -> None:
    """Adds a strategy factory under `name` (and `aliases`)."""
    _FACTORIES[name] = factory
    _DESCRIPTIONS[name] = description
    for alias in aliases:
        _ALIASES[alias] = name


def available() -> dict[str, str]:
    """Registered strategy names with one-line descriptions."""
    return dict(_DESCRIPTIONS)


def get(strategy: Union[str, Strategy] = "auto", **options) -> Strategy:
    """Builds the strategy registered as `strategy` with `options`.

    Raises:
        ValueError: unknown name (the message lists the valid ones) or an
            option the strategy does not take.
    """
    if isinstance(strategy, Strategy):
        if options:
            raise ValueError(
                f"Options {sorted(options)} were given with a strategy object; "
                "pass them to the strategy's constructor instead."
            )
        return strategy
    if not isinstance(strategy, str):
        raise TypeError(
            "strategy must be a name from keras_distrib.strategies.available() "
            f"or a keras_distrib Strategy object, got {type(strategy).__name__}."
        )
    key = strategy.strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in _FACTORIES:
        valid = sorted([*_FACTORIES, *_ALIASES])
        raise ValueError(f"Unknown strategy {strategy!r}; valid names: {valid}.")
    factory = _FACTORIES[key]
    _check_options(key, factory, options)
    if key in _ONE_PER_PROCESS:
        return _one_per_process(key, factory, options)
    return factory(**options)


# TensorFlow allows one collective runtime per process: later requests for
# such a strategy get the first instance (with the same options).
_ONE_PER_PROCESS = {"multi_worker", "horovod"}
_STARTED: dict[str, tuple[dict, Strategy]] = {}


def _one_per_process(key, factory, options):
    if key in _STARTED:
        started_options, strategy = _STARTED[key]
        if options and options != started_options:
            raise ValueError(
                f"Strategy {key!r} already runs in this process with options "
                f"{started_options}; one per process: reuse it or pass no options."
            )
        return strategy
    strategy = factory(**options)
    _STARTED[key] = (options, strategy)
    return strategy


def _check_options(name: str, factory: Callable, options: dict) -> None:
    params = inspect.signature(factory).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise ValueError(
            f"Strategy {name!r} does not take option(s) {unknown}; "
            f"its options are {sorted(params)}."
        )


def _auto() -> Strategy:
    """Multi-worker when a cluster is configured (TF_CONFIG, Slurm); else
    mirrored over all local devices when there are several; else single."""
    if cluster_lib.resolve() is not None:
        return get("multi_worker")
    if len(devices_lib.local_devices()) > 1:
        return get("mirrored")
    return get("single")


register(SingleDevice.name, SingleDevice, SingleDevice.description,
         aliases=("one_device", "default"))
register(Mirrored.name, Mirrored, Mirrored.description,
         aliases=("mirror", "data_parallel"))
def _horovod(**options) -> Strategy:
    """Imported on demand: Horovod is an optional extra."""
    from keras_distrib.strategies.horovod import Horovod

    return Horovod(**options)


register("horovod", _horovod,
         "Data parallelism over Horovod collectives (Gloo on CPU, NCCL on GPU, MPI).",
         aliases=("hvd",))
register(MultiWorker.name, MultiWorker, MultiWorker.description,
         aliases=("multi_worker_mirrored", "multiworker"))
register("auto", _auto,
         "Multi-worker when a cluster is configured, else mirrored when more than "
         "one local device is visible, else single.")
