"""The table of strategy names: which class each registered name and alias
stands for. `Strategy.__init_subclass__` adds every subclass that sets
`name` (`register`); `keras_distrib.strategies.registry` looks names up in
it and makes strategies. This module imports nothing of the package, so
the interface can register its subclasses without importing the registry
(which imports the interface).
"""

from __future__ import annotations

from typing import Any

# Registered name -> the strategy class; alias -> registered name.
_CLASSES: dict[str, type[Any]] = {}
_ALIASES: dict[str, str] = {}
AUTO = "auto"


def register(cls: type[Any]) -> None:
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


def _key(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def canonical(name: str) -> str:
    """The registered name that `name` (any case, an alias) stands for."""
    key = _key(name)
    return _ALIASES.get(key, key)
