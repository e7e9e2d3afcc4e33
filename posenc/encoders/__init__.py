"""Positional encoders. ``available()`` lists them; each lives in its own module."""

from posenc.encoders import deberta, learned, none, rope, shaw, sinusoidal, xl  # noqa: F401
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
