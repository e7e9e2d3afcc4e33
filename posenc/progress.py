"""How long-running work reports its progress: the ``h:mm:ss`` of every progress line
(training's, passkey evaluation's, the report's)."""

from __future__ import annotations

import time
from collections.abc import Callable


def clock(seconds: float) -> str:
    """``h:mm:ss``."""
    minutes, s = divmod(int(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h}:{m:02d}:{s:02d}"


def ticker(
    total: int, unit: str, say: Callable[[str], None], every: float = 10.0, last: bool = True
) -> Callable[[int], None]:
    """A callback of the count done that says ``done/total <unit>, elapsed .., ETA ..`` at
    most every ``every`` seconds, and (``last``) once more when the count reaches
    ``total``."""
    t0 = said = time.perf_counter()

    def tick(done: int) -> None:
        nonlocal said
        now = time.perf_counter()
        if (now - said >= every and done < total) or (last and done == total):
            said = now
            eta = (now - t0) / done * (total - done)
            say(f"{done}/{total} {unit}, elapsed {clock(now - t0)}, ETA {clock(eta)}")

    return tick
