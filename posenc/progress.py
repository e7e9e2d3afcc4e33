"""How long-running work reports its progress: the ``h:mm:ss`` of every progress line
(training's, passkey evaluation's, the report's)."""

from __future__ import annotations


def clock(seconds: float) -> str:
    """``h:mm:ss``."""
    minutes, s = divmod(int(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h}:{m:02d}:{s:02d}"
