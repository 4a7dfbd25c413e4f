"""Transports by name: `create(name, **options)`, `transport_class(name)`, `names()`.

`BUILTIN` maps each name to the module and class of its transport (a
`keras_distrib.collectives.transport.Transport`); a module is imported when
its name is first asked for, so naming the registry imports neither
TensorFlow nor an optional library (Horovod). Adding a transport is its
module and one line here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for annotations only: this module imports no transport
    from keras_distrib.collectives.transport import Transport

# Registered name -> "module:Class" of its transport.
BUILTIN = {
    "one_process": "keras_distrib.collectives.one_process:OneProcess",
    "tensorflow": "keras_distrib.collectives.tf_collectives:TFCollectives",
    "shm": "keras_distrib.collectives.shared_memory:SharedMemory",
    "tcp": "keras_distrib.collectives.tcp_collectives:TcpCollectives",
    "hierarchical": "keras_distrib.collectives.hierarchical_collectives:HierarchicalCollectives",
    "horovod": "keras_distrib.collectives.horovod_collectives:HorovodCollectives",
    "gloo": "keras_distrib.collectives.gloo_collectives:GlooCollectives",
}


def names() -> list[str]:
    """The registered transports' names, sorted."""
    return sorted(BUILTIN)


def transport_class(name: str) -> type[Transport]:
    """The transport class registered as `name` (its module imported now).

    Raises:
        ValueError: no transport has that name (one line, naming those there are).
    """
    where = BUILTIN.get(name) if isinstance(name, str) else None
    if where is None:
        raise ValueError(f"Unknown transport {name!r}; use one of {names()}.")
    module, _, cls = where.partition(":")
    found: type[Transport] = getattr(importlib.import_module(module), cls)
    return found


def create(name: str, **options: Any) -> Transport:
    """The transport registered as `name`, made with `options` (its
    constructor's arguments)."""
    return transport_class(name)(**options)
