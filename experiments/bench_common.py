"""Shared pieces of ``experiments/bench.py``: interleaved timing, result rows, tables.

Every number the benchmark reports is a ratio against a baseline measured in the
same process and the same rounds. The machine is shared and noisy, so absolute
times drift by tens of percent over a minute; a ratio of two measurements taken
seconds apart, with the order rotated each round, drifts far less.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


def sync(device: torch.device) -> None:
    """Wait for queued kernels, so a clock read after it covers the work before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_call_seconds(fn: Callable[[], object], number: int, device: torch.device) -> float:
    """Mean seconds per call over ``number`` back-to-back calls of ``fn``."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / number


@dataclass(frozen=True)
class Goal:
    """A target on a ratio: ``ratio >= value`` (speed) or ``ratio <= value`` (memory)."""

    op: str
    value: float

    def met(self, ratio: float | None) -> bool | None:
        if ratio is None:
            return None
        return ratio >= self.value if self.op == ">=" else ratio <= self.value

    def __str__(self) -> str:
        return f"{self.op} {self.value:g}x"


@dataclass
class Row:
    """One line of a section's table, with the raw per-round numbers behind it.

    Attributes:
        what: What was measured.
        median: Median absolute value over rounds (seconds, or MiB for memory).
        ratio: Median of the per-round ratios against the baseline.
        goal: Target on ``ratio``, or None for baselines and informational rows.
        note: Free text shown next to ``what`` (e.g. why a row was skipped).
        raw: Per-round values and ratios, written to the JSON as they are.
    """

    what: str
    median: float | None
    ratio: float | None
    goal: Goal | None = None
    note: str = ""
    raw: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "median": self.median,
            "ratio": self.ratio,
            "goal": None if self.goal is None else str(self.goal),
            "met": None if self.goal is None else self.goal.met(self.ratio),
            "note": self.note,
            "raw": self.raw,
        }


def interleaved(
    measure: dict[str, Callable[[], float]],
    *,
    baseline: str,
    rounds: int,
    warmup: int = 1,
    before_round: Callable[[], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Measure every candidate once per round, in an order rotated each round.

    Each ``measure[name]()`` runs a block of work and returns seconds per unit
    (per call, per step). The ratio of a round is ``baseline / candidate`` time,
    i.e. the candidate's speed relative to the baseline (> 1 is faster).

    Args:
        measure: Name -> measuring closure; must contain ``baseline``.
        baseline: Name of the baseline.
        rounds: Measured rounds (after ``warmup`` unrecorded ones).
        warmup: Rounds run first and thrown away (caches, allocator, lazy init).
        before_round: Called before each round, e.g. to draw fresh inputs, so that
            no candidate's ratio hangs on where one set of inputs happens to lie in
            memory.

    Returns:
        Name -> ``{"times_s", "ratios", "median_s", "ratio", "ratio_min", "ratio_max"}``.
    """
    names = list(measure)
    for _ in range(warmup):
        for name in names:
            measure[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        if before_round is not None:
            before_round()
        # Rotate and alternate direction so no candidate always runs right after
        # the same neighbour (turbo/thermal state and cache contents carry over).
        k = r % len(names)
        order = names[k:] + names[:k]
        for name in order if r % 2 == 0 else order[::-1]:
            times[name].append(measure[name]())
    out = {}
    for name in names:
        ratios = [b / t for b, t in zip(times[baseline], times[name], strict=True)]
        out[name] = summarise(times[name], ratios)
    return out


def summarise(values: list[float], ratios: list[float]) -> dict[str, Any]:
    """Medians and the spread of the ratios, plus the raw lists."""
    return {
        "times_s": values,
        "ratios": ratios,
        "median_s": statistics.median(values),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def markdown_table(rows: list[Row], *, value_name: str, fmt: Callable[[float | None], str]) -> str:
    """Columns: what, median (time or memory), ratio vs baseline [min, max], goal, met?"""
    lines = [
        f"| what | median {value_name} | ratio vs baseline [min, max] | goal | met? |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        what = f"{row.what} ({row.note})" if row.note else row.what
        if row.ratio is None:
            ratio = "-"
        else:
            spread = row.raw.get("ratio_min"), row.raw.get("ratio_max")
            ratio = f"{row.ratio:.3f}"
            if None not in spread and len(row.raw.get("ratios", [])) > 1:
                ratio += f" [{spread[0]:.2f}, {spread[1]:.2f}]"
        met = row.goal.met(row.ratio) if row.goal else None
        mark = {True: "yes", False: "**no**", None: "-"}[met]
        goal = str(row.goal) if row.goal else "-"
        lines.append(f"| {what} | {fmt(row.median)} | {ratio} | {goal} | {mark} |")
    return "\n".join(lines)
