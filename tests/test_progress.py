"""The progress lines of long work (passkey evaluation, generation): at most every few
seconds, with the count, the time and the time left."""

from __future__ import annotations

import pytest

from posenc import progress


def test_a_ticker_speaks_at_most_every_interval_and_once_at_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ticks = iter(range(0, 100, 4))  # the clock moves 4 s at each read
    monkeypatch.setattr(progress.time, "perf_counter", lambda: float(next(ticks)))
    said: list[str] = []
    tick = progress.ticker(5, "instances", said.append, every=10.0)
    for done in range(1, 6):
        tick(done)
    # reads at 4, 8, 12 (12 s since the start: said), 16, 20 (the last count: said)
    assert said == [
        "3/5 instances, elapsed 0:00:12, ETA 0:00:08",
        "5/5 instances, elapsed 0:00:20, ETA 0:00:00",
    ]
