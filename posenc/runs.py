"""What the sweep report reads and computes, shared by :mod:`posenc.report` (tables) and
:mod:`posenc.plots` (figures): a finished run, a job without results, one
aggregated row, and the sort keys of metric and encoder names."""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posenc.results import MetricName, Record

#: A run's standing at the learnability gate (``learned`` in ``metrics.json``).
LEARNED, NOT_LEARNED, NO_GATE, UNKNOWN = "learned", "not learned", "no gate", "unknown"


@dataclass
class Run:
    """One finished job: its directory and its record (:mod:`posenc.results`).

    Attributes:
        arm: Which learning-rate arm of its task the run belongs to (``same_lr``,
            ``tuned_lr``, ``lr0.001``; set by the report when a task has several, else "").
    """

    dir: Path
    record: Record
    arm: str = ""

    @property
    def base_task(self) -> str:
        """:func:`~posenc.results.task_key` of the run."""
        return self.record.table

    @property
    def task(self) -> str:
        """The report table the run is in: :attr:`base_task`, with ``_<arm>`` when its
        task has runs of several learning-rate arms (``lm_tuned_lr``)."""
        return f"{self.base_task}_{self.arm}" if self.arm else self.base_task

    @property
    def encoder(self) -> str:
        return str(self.record.encoder)

    @property
    def lr(self) -> float | None:
        """The peak learning rate it trained with (``task.optim.lr``)."""
        return self.record.lr

    @property
    def tuned(self) -> dict[str, Any] | None:
        """Where its learning rate came from when tuned (``+tuned=...``), else None."""
        return self.record.tuned

    @property
    def learned(self) -> str:
        """:data:`LEARNED` or :data:`NOT_LEARNED` at its gate, :data:`NO_GATE`, or
        :data:`UNKNOWN` (a ``metrics.json`` from before the gate, or no validation)."""
        record = self.record
        if not record.gate_recorded:
            return UNKNOWN
        if record.gate is None:
            return NO_GATE
        value = record.learned
        return UNKNOWN if value is None else LEARNED if value else NOT_LEARNED

    def counts(self, metric: MetricName) -> bool:
        """Whether its value of ``metric`` enters the report: not when the run did not
        learn its task and the metric lies past the training length."""
        return not (self.learned == NOT_LEARNED and self.record.beyond_training(metric))


@dataclass
class Failure:
    """A job without results: ``failed`` (error.json), ``missing`` or ``unreadable``."""

    dir: Path
    status: str
    error: str
    task: str = "?"
    encoder: str = "?"
    seed: Any = None


@dataclass
class Row:
    """Statistics of one metric over the runs of one (task, encoder) group.

    Attributes:
        n: Runs with a finite value that count (see :meth:`Run.counts`).
        skipped: Runs holding NaN there (a length the encoder cannot run).
        not_finite: Runs holding an infinite value there (a result that overflowed: never
            averaged, and never called skipped).
        values: Those n finite values.
        ci95: Half-width of the 95% confidence interval of the mean (None for n < 2).
        dropped: Runs left out because they did not learn the task (past training only).
        mark: Standing in its column (:mod:`posenc.report.stats`: best, tie, worse,
            untested), and p: Holm-adjusted p-value against the best.
    """

    task: str
    encoder: str
    metric: MetricName
    mean: float | None
    std: float | None
    n: int
    skipped: int
    cost: dict[str, float | None] = field(default_factory=dict)
    values: list[float] = field(default_factory=list)
    ci95: float | None = None
    dropped: int = 0
    mark: str = ""
    p: float | None = None
    not_finite: int = 0


# ----------------------------------------------------------------------------- sort keys
def metric_key(name: str) -> tuple[Any, ...]:
    """Sort key of a metric name (:meth:`posenc.results.MetricName.sort_key`)."""
    return MetricName(name).sort_key()


@functools.cache
def encoder_order() -> tuple[str, ...]:
    """Every registered encoder in display order: the baseline without positions, the
    absolute schemes, the relative ones, those relative only below a threshold, then
    the data-dependent ones (positions from the content); by name within each group
    (from the classes' declarations, so a new scheme has its place without an edit
    here)."""
    from posenc import encoders  # torch: only when a report sorts encoders

    def group(name: str) -> int:
        cls = encoders.get(name)
        if cls.data_dependent:
            return 4
        if not cls.uses_positions:
            return 0
        if cls.relative_below:
            return 3
        return 2 if cls.relative else 1

    return tuple(sorted(encoders.available(), key=lambda name: (group(name), name)))


def encoder_key(name: str) -> tuple[int, str]:
    """Sort key of an encoder name: :func:`encoder_order`, unregistered names after it."""
    order = encoder_order()
    return (order.index(name) if name in order else len(order), name)


# ----------------------------------------------------------------------------- statistics
def as_float(value: Any) -> float | None:
    """A number as float; None for null, strings and other non-numbers."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def finite_values(values: Iterable[Any]) -> tuple[list[float], int]:
    """The finite numbers among ``values``, and how many others (NaN, inf, null) there were."""
    finite, skipped = [], 0
    for v in values:
        x = as_float(v)
        if x is not None and math.isfinite(x):
            finite.append(x)
        else:
            skipped += 1
    return finite, skipped


def infinite(values: Iterable[Any]) -> int:
    """How many of ``values`` are infinite (an overflowed result, not a skipped length)."""
    return sum(1 for v in values if (x := as_float(v)) is not None and math.isinf(x))


def summarize(values: Iterable[Any]) -> tuple[float | None, float | None, int, int]:
    """``(mean, sample std (n-1), n, skipped)``: NaN, inf and null count as skipped.

    The std is None when fewer than two finite values exist.
    """
    finite, skipped = finite_values(values)
    mean = statistics.fmean(finite) if finite else None
    std = statistics.stdev(finite) if len(finite) > 1 else None
    return mean, std, len(finite), skipped
