"""Effective length of the algorithmic tasks, after RULER (Hsieh et al. 2024): per
scheme, the longest tested length up to which its accuracy stays at or above a threshold.

A run's effective length is the largest tested length ``L`` such that its accuracy is at
least the threshold at ``L`` *and at every shorter tested length* (RULER's "the longest
length at which the model stays above the threshold": a length that passes after a
shorter one failed does not count). Lengths are the instance sizes a run was tested at
(``by_size`` of ``metrics.json``), the accuracy is ``acc`` (the % of answer tokens, or of
labels, right: for ``mqar``, of the queries answered right). A run that fails already at
its shortest tested length has effective length 0.

Over seeds, a scheme's effective length is the mean with its 95% interval
(:func:`~posenc.report.stats.ci95`) and the spread ``min..max``; runs that did not learn
the task at their training length (:mod:`posenc.training.gate`) are left out, and a scheme
none of whose runs learned it is reported as not learned, never ranked.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from posenc.report.stats import BEST, TIE, ci95, rank
from posenc.results import AlgoRecord
from posenc.runs import NOT_LEARNED, Run

#: The default threshold, in percent (RULER's 90% of its baseline's score, here of the
#: answers).
THRESHOLD = 90.0
#: The metric of ``by_size`` the effective length reads.
METRIC = "acc"


def check(threshold: float) -> None:
    """Refuse a threshold that is not a percentage.

    Raises:
        ValueError: Not in (0, 100] (NaN included), naming the value and the fix.
    """
    if not 0 < threshold <= 100:
        raise ValueError(
            f"--threshold {threshold:g}: an accuracy in percent, above 0 and at most 100; "
            f"give one such as --threshold {THRESHOLD:g}"
        )


def effective_length(accuracy: Mapping[int, float | None], threshold: float) -> int | None:
    """The largest tested length up to which ``accuracy`` stays at or above ``threshold``.

    Args:
        accuracy: Length -> accuracy in percent; None or NaN: a length not tested (left
            out, as if absent).
        threshold: Percent.

    Returns:
        The effective length; 0 when the shortest tested length already fails; None when
        no length was tested.
    """
    tested = {n: v for n, v in accuracy.items() if v is not None and math.isfinite(v)}
    if not tested:
        return None
    longest = 0
    for n in sorted(tested):
        if tested[n] < threshold:
            break
        longest = n
    return longest


def accuracy_by_length(record: AlgoRecord) -> dict[int, float]:
    """A run's :data:`METRIC` at each size it has a finite value at from some instances
    (a size no instance was tested at, ``count`` 0, is not a tested length)."""
    out = {}
    for n, row in record.by_size.items():
        value = row.get(METRIC)
        if row.get("count", 1) and value is not None and math.isfinite(value):
            out[n] = value
    return out


@dataclass
class Effective:
    """A scheme's effective length over its runs.

    Attributes:
        encoder: The scheme.
        runs: Its runs in the table.
        lengths: The effective length of each run that counts (learned, or no verdict).
        not_learned: Runs left out because they did not learn the task.
        longest: The longest length any of its runs was tested at.
        mark: Standing against the best mean (:mod:`posenc.report.stats`), "" unranked.
    """

    encoder: str
    runs: int
    lengths: list[int]
    not_learned: int
    longest: int | None
    mark: str = ""

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.lengths) if self.lengths else None

    @property
    def ci(self) -> float | None:
        return ci95([float(n) for n in self.lengths])


def effective_lengths(
    task_groups: Mapping[str, Sequence[Run]], threshold: float = THRESHOLD
) -> list[Effective]:
    """Per scheme of one table, its effective length over seeds, marked against the
    best (schemes without a run that counts are not ranked). Empty for a table without
    algorithmic runs tested by size."""
    out = []
    for encoder, rs in task_groups.items():
        records = [(r, r.record) for r in rs if isinstance(r.record, AlgoRecord)]
        if not any(rec.by_size for _, rec in records):
            continue
        counted = [rec for r, rec in records if r.learned != NOT_LEARNED]
        found = (effective_length(accuracy_by_length(rec), threshold) for rec in counted)
        lengths = [n for n in found if n is not None]
        tested = [n for _, rec in records for n in accuracy_by_length(rec)]
        out.append(
            Effective(
                encoder, len(rs), lengths, len(records) - len(counted), max(tested, default=None)
            )
        )
    marks = rank({e.encoder: [float(n) for n in e.lengths] for e in out}, lower=False)
    for e in out:
        e.mark = marks[e.encoder].mark if e.encoder in marks else ""
    return out


def _cell(e: Effective) -> tuple[str, str]:
    """The mean ± CI cell (bold for the best and its ties) and the ``min..max`` cell."""
    if not e.lengths:
        return ("not learned", "") if e.not_learned else ("", "")
    mean = f"{e.mean:.4g}" + ("" if e.ci is None else f" ± {e.ci:.2g}")
    if e.mark in (BEST, TIE):
        mean = f"**{mean}**"
    left = f" ({e.not_learned} not learned, left out)" if e.not_learned else ""
    return mean + left, f"{min(e.lengths)}..{max(e.lengths)}"


#: The columns of :func:`table_body`.
HEADER = ("encoder", "n", "effective length", "min..max over seeds", "longest tested")


def caption(threshold: float) -> str:
    """What the effective-length table shows."""
    return (
        f"Effective length at {threshold:g}% `{METRIC}`: the longest tested length up to "
        f"which accuracy stays at or above {threshold:g}% at every length (0: below it "
        f"already at the shortest); mean ± 95% CI over seeds, bold: the best and its ties "
        f"(`--threshold` sets the threshold):"
    )


def table_body(
    task_groups: Mapping[str, Sequence[Run]], threshold: float = THRESHOLD
) -> list[list[str]]:
    """One row per scheme (:data:`HEADER`); none for a task without effective lengths."""
    body = []
    for e in effective_lengths(task_groups, threshold):
        mean, spread = _cell(e)
        longest = "" if e.longest is None else str(e.longest)
        body.append([e.encoder, str(len(e.lengths)), mean, spread, longest])
    return body


#: The columns of ``effective_length.csv``.
CSV_FIELDS = (
    "task",
    "encoder",
    "threshold",
    "n",
    "mean",
    "ci95",
    "min",
    "max",
    "not_learned",
    "longest_tested",
    "mark",
    "per_run",
)


def _csv_row(task: str, e: Effective, threshold: float) -> list[object]:
    """One row of :data:`CSV_FIELDS`."""
    low, high = min(e.lengths, default=None), max(e.lengths, default=None)
    per_run = " ".join(map(str, e.lengths))
    counts = [len(e.lengths), e.mean, e.ci, low, high, e.not_learned, e.longest]
    return [task, e.encoder, threshold, *counts, e.mark, per_run]


def write_csv(
    path: Path, tables: Mapping[str, Mapping[str, Sequence[Run]]], threshold: float
) -> bool:
    """``effective_length.csv``: a row per task and scheme (``per_run``: the effective
    length of each run that counts, space-separated; blank where none does).

    Args:
        path: Where.
        tables: Task -> encoder -> runs.
        threshold: Percent.

    Returns:
        Whether any task had effective lengths (no file otherwise).
    """
    rows = [
        _csv_row(task, e, threshold)
        for task, groups in tables.items()
        for e in effective_lengths(groups, threshold)
    ]
    if not rows:
        return False
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        w.writerows([["" if v is None else v for v in row] for row in rows])
    return True
