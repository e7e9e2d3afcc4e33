"""What the sweep report reads and computes, shared by :mod:`posenc.report` (tables) and
:mod:`posenc.plots` (figures): a finished run, a job without results, one
aggregated row, and the sort keys of metric and encoder names."""

from __future__ import annotations

import functools
import math
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_KIND_ORDER = {
    "ppl": 0,
    "ppl_sw": 1,
    "passkey": 2,
    "bleu": 0,
    "chrf": 1,
    "seq_acc": 0,
    "acc": 1,
    "loss": 2,
}


#: A run's standing at the learnability gate (``learned`` in ``metrics.json``).
LEARNED, NOT_LEARNED, NO_GATE, UNKNOWN = "learned", "not learned", "no gate", "unknown"


def task_key(task: str, problem: Any = None, shape: Any = None) -> str:
    """``lm``, ``mt``, or ``algo_<problem>`` (``..._encdec`` for the encoder-decoder): each
    algorithmic problem is a table of its own, and a tuned learning rate is per table."""
    if task == "algo":
        name = "?" if problem is None else problem
        return f"algo_{name}_encdec" if shape == "encdec" else f"algo_{name}"
    return task


def _start(where: str) -> int | None:
    """The first number of ``128`` or ``len5-8`` / ``len25+`` (None if it has none)."""
    found = re.search(r"\d+", where)
    return int(found.group()) if found else None


@dataclass
class Run:
    """One finished job: its directory and the contents of its ``metrics.json``.

    Attributes:
        arm: Which learning-rate arm of its task the run belongs to (``same_lr``,
            ``tuned_lr``, ``lr0.001``; set by the report when a task has several, else "").
    """

    dir: Path
    data: dict[str, Any]
    arm: str = ""

    @property
    def base_task(self) -> str:
        """:func:`task_key` of the run."""
        return task_key(
            str(self.data.get("task", "?")), self.data.get("problem"), self.data.get("shape")
        )

    @property
    def task(self) -> str:
        """The report table the run is in: :attr:`base_task`, with ``_<arm>`` when its
        task has runs of several learning-rate arms (``lm_tuned_lr``)."""
        return f"{self.base_task}_{self.arm}" if self.arm else self.base_task

    @property
    def encoder(self) -> str:
        return str(self.data.get("encoder", "?"))

    @property
    def config(self) -> dict[str, Any]:
        config = self.data.get("config")
        return config if isinstance(config, dict) else {}

    @property
    def lr(self) -> float | None:
        """The peak learning rate it trained with (``task.optim.lr``)."""
        optim = (self.config.get("task") or {}).get("optim") or {}
        return as_float(optim.get("lr"))

    @property
    def tuned(self) -> dict[str, Any] | None:
        """Where its learning rate came from when tuned (``+tuned=...``), else None."""
        tuned = self.config.get("tuned")
        return tuned if isinstance(tuned, dict) else None

    @property
    def learned(self) -> str:
        """:data:`LEARNED` or :data:`NOT_LEARNED` at its gate, :data:`NO_GATE`, or
        :data:`UNKNOWN` (a ``metrics.json`` from before the gate, or no validation)."""
        if "learned" not in self.data:
            return UNKNOWN
        if not self.data.get("gate"):
            return NO_GATE
        value = self.data["learned"]
        return UNKNOWN if value is None else LEARNED if value else NOT_LEARNED

    def beyond_training(self, metric: str) -> bool:
        """Whether ``metric`` is measured past the training length: an LM length over
        ``seq_len``, an algorithmic size bucket starting past the largest trained size, a
        translation bucket starting past ``max_train_src_len``."""
        where = metric.partition("@")[2]
        start = _start(where) if where else None
        if start is None:
            return False
        task = self.data.get("task")
        if task == "lm":
            limit = self.data.get("seq_len")
        elif task == "algo":
            trained = self.data.get("train_lengths") or [None, None]
            limit = trained[-1]
        elif task == "mt":
            limit = self.data.get("max_train_src_len")
        else:
            limit = None
        return isinstance(limit, int) and start > limit

    def counts(self, metric: str) -> bool:
        """Whether its value of ``metric`` enters the report: not when the run did not
        learn its task and the metric lies past the training length."""
        return not (self.learned == NOT_LEARNED and self.beyond_training(metric))


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
    metric: str
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
def split_extension(name: str) -> tuple[str, str]:
    """``test/ppl+yarn@64`` -> ``("test/ppl@64", "yarn")``: the metric without its RoPE
    context-extension method, and the method (``""`` for a plain metric)."""
    head, at, where = name.partition("@")
    head, _, extension = head.partition("+")
    return f"{head}{at}{where}", extension


def metric_key(name: str) -> tuple[Any, ...]:
    """Sort key: test before val, then kind (ppl, ppl_sw / bleu, chrf), then context-extension
    method (plain first), then numeric length or bucket start, overall (no ``@``) first:
    ``test/ppl@128`` < ``test/ppl@1024`` < ``test/ppl+yarn@128``."""
    plain, extension = split_extension(name)
    split, _, rest = plain.partition("/")
    kind, _, where = rest.partition("@")
    num = re.search(r"\d+", where)
    return (
        {"test": 0, "val": 1}.get(split, 2),
        split,
        _KIND_ORDER.get(kind, 9),
        kind,
        extension,
        int(num.group()) if num else -1,
        where,
    )


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
