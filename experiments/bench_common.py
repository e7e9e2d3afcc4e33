"""Shared pieces of ``experiments/bench.py``: interleaved timing, result rows, tables.

Every number the benchmark reports is a ratio against a baseline measured in the
same process and the same rounds. The machine is shared and noisy, so absolute
times drift by tens of percent over a minute; a ratio of two measurements taken
seconds apart, with the order rotated each round, drifts far less.
"""

from __future__ import annotations

import json
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


class RowList(list):
    """A section's rows, each handed to ``on_row`` as it is appended (``bench.py`` prints
    it and rewrites its ``--json``), so a section stopped by a time limit keeps them."""

    def __init__(self, on_row: Callable[[Row], None] | None) -> None:
        super().__init__()
        self.on_row = on_row

    def append(self, row: Row) -> None:
        super().append(row)
        if self.on_row is not None:
            self.on_row(row)


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
    lines += [row_line(row, fmt) for row in rows]
    return "\n".join(lines)


def row_line(row: Row, fmt: Callable[[float | None], str] = fmt_seconds) -> str:
    """One row of :func:`markdown_table`."""
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
    return f"| {what} | {fmt(row.median)} | {ratio} | {goal} | {mark} |"


def parse_goal(text: str | None) -> Goal | None:
    """The inverse of ``str(Goal)``: ``">= 0.6x"`` -> ``Goal(">=", 0.6)``."""
    if text is None:
        return None
    op, value = text.split()
    return Goal(op, float(value.rstrip("x")))


def pool_runs(reports: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rows of several ``--json`` reports of the same benchmark, side by side.

    For each section in every report, and each row in all of them (matched by
    ``what``, in the first report's order): the per-run ratios, their median, and
    the median, min and max of all per-round ratios pooled, with the goal judged on
    the pooled median. A run's machine load moves all its rounds together, so the
    pooled median weighs every round once where a single run's median can flip.

    Raises:
        ValueError: fewer than two reports, reports with no section in common, or a
            section run with different configurations (sizes, dtypes) in different reports.
    """
    if len(reports) < 2:
        raise ValueError(f"pooling needs at least two --json reports, got {len(reports)}")
    names = [n for n in reports[0]["sections"] if all(n in r["sections"] for r in reports)]
    if not names:
        raise ValueError("the reports have no section in common")
    pooled: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        configs = {json.dumps(r["sections"][name].get("config"), sort_keys=True) for r in reports}
        if len(configs) > 1:
            raise ValueError(
                f"section {name!r} was run with different configurations ({len(configs)}): "
                "pool runs of one command (for example, not --quick with a full run)"
            )
        by_run = [{row["what"]: row for row in r["sections"][name]["rows"]} for r in reports]
        rows = []
        for what in by_run[0]:
            runs = [b.get(what) for b in by_run]
            if any(r is None or r["ratio"] is None for r in runs):
                continue  # missing from a run (other sizes or encoders) or skipped
            ratios = [x for r in runs for x in r["raw"].get("ratios") or [r["ratio"]]]
            goal = parse_goal(runs[0]["goal"])
            median = statistics.median(ratios)
            rows.append(
                {
                    "what": what,
                    "runs": [r["ratio"] for r in runs],
                    "median_of_runs": statistics.median(r["ratio"] for r in runs),
                    "pooled": median,
                    "pooled_min": min(ratios),
                    "pooled_max": max(ratios),
                    "rounds": len(ratios),
                    "goal": None if goal is None else str(goal),
                    "met": None if goal is None else goal.met(median),
                }
            )
        pooled[name] = rows
    return pooled


def pooled_table(rows: list[dict[str, Any]]) -> str:
    """Markdown for one section of :func:`pool_runs`."""
    lines = [
        "| what | ratio per run | median of runs | pooled rounds: median [min, max] (n) "
        "| goal | met? (pooled) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        runs = ", ".join(f"{x:.2f}" for x in r["runs"])
        spread = f"{r['pooled']:.3f} [{r['pooled_min']:.2f}, {r['pooled_max']:.2f}] ({r['rounds']})"
        mark = {True: "yes", False: "**no**", None: "-"}[r["met"]]
        goal = r["goal"] or "-"
        median = f"{r['median_of_runs']:.3f}"
        lines.append(f"| {r['what']} | {runs} | {median} | {spread} | {goal} | {mark} |")
    return "\n".join(lines)
