"""Positional encoders. ``available()`` lists them; each lives in its own module of
this package, which registers itself on import (every module here is imported)."""

import importlib
import pkgutil

from posenc.encoders.base import AttentionContext, AttentionPositional, AttnKind, PositionalEncoder
from posenc.encoders.registry import available, build, get, register

__all__ = [
    "AttentionContext",
    "AttentionPositional",
    "AttnKind",
    "PositionalEncoder",
    "available",
    "build",
    "get",
    "register",
]

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name not in ("base", "registry", "offsets", "softmax"):
        importlib.import_module(f"{__name__}.{_mod.name}")
