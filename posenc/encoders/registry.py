"""Name -> class registry of positional encoders (one module file per scheme)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from posenc.encoders.base import PositionalEncoder

_REGISTRY: dict[str, type[PositionalEncoder]] = {}
E = TypeVar("E", bound=type[PositionalEncoder])


def register(name: str) -> Callable[[E], E]:
    """Class decorator that makes a scheme available under ``name``."""

    def deco(cls: E) -> E:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"encoder name {name!r} is already taken by {_REGISTRY[name]}")
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return deco


def available() -> list[str]:
    """Names of all registered positional encoders, sorted."""
    return sorted(_REGISTRY)


def get(name: str) -> type[PositionalEncoder]:
    """The encoder class registered as ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown encoder {name!r}; available: {', '.join(available())}") from None


def build(name: str, **kwargs: Any) -> PositionalEncoder:
    """Instantiate encoder ``name`` (kwargs: d_model, n_heads, n_layers, scheme options)."""
    return get(name)(**kwargs)
