"""Statistics of the sweep report over seeds: 95% confidence intervals of a mean (Student's
t), which schemes differ significantly from a column's best (Welch's t-test, Holm's
correction over the column) and, across tasks, from the best scheme (a paired t-test over
the tasks), from :mod:`scipy.stats`.

Seeds are few (often 3), so intervals are wide and most differences are ties; the report
says which, instead of ranking rows whose runs overlap.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scipy import stats

#: Two-sided level of the intervals and tests.
ALPHA = 0.05
#: Metric kinds where a lower value is better (perplexities, losses); all others: higher.
LOWER_IS_BETTER = ("ppl", "ppl_sw", "loss", "nll")

#: Marks of a cell in its column.
BEST, TIE, WORSE, UNTESTED = "best", "tie", "worse", "untested"


def ci95(values: Sequence[float]) -> float | None:
    """Half-width of the 95% confidence interval of the mean: ``t(0.975, n-1) * s / sqrt(n)``
    with ``s`` the sample std (n-1). None for n < 2 (no interval from one value)."""
    n = len(values)
    if n < 2:
        return None
    return float(stats.t.ppf(1 - ALPHA / 2, n - 1)) * statistics.stdev(values) / math.sqrt(n)


def welch_p(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Two-sided p-value of Welch's t-test (unequal variances) that ``a`` and ``b`` have the
    same mean; None when either has fewer than two values.

    Both without spread (e.g. 100% accuracy in every seed) leave the test undefined: equal
    means are then a tie (p = 1) and different ones a sure difference (p = 0).
    """
    if len(a) < 2 or len(b) < 2:
        return None
    flat_a, flat_b = _no_spread(a), _no_spread(b)
    if flat_a and flat_b:
        return 1.0 if math.isclose(statistics.fmean(a), statistics.fmean(b)) else 0.0
    # One side without spread: Welch's t is then the other side's one-sample t against that
    # value, with n - 1 degrees of freedom (scipy's two-sample test warns of "catastrophic
    # cancellation" on a sample that varies by float rounding only).
    if flat_a or flat_b:
        sample, value = (b, statistics.fmean(a)) if flat_a else (a, statistics.fmean(b))
        return float(stats.ttest_1samp(sample, value).pvalue)
    return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def paired_p(differences: Sequence[float]) -> float | None:
    """Two-sided p-value of the paired t-test that the mean of ``differences`` (one per
    pair, e.g. per task) is 0; None for fewer than two. Differences without spread make
    the test undefined: all 0 is a tie (p = 1), any other value a sure difference (p = 0),
    as :func:`welch_p` treats two samples without spread."""
    if len(differences) < 2:
        return None
    if _no_spread(differences):
        return 1.0 if math.isclose(statistics.fmean(differences), 0.0, abs_tol=1e-9) else 0.0
    return float(stats.ttest_1samp(differences, 0.0).pvalue)


def _no_spread(values: Sequence[float]) -> bool:
    """The values are equal up to float rounding (an accuracy of 100 in every seed, an
    effective length of 128 from an interpolation)."""
    mean = statistics.fmean(values)
    return max(abs(v - mean) for v in values) <= 1e-9 * max(1.0, abs(mean))


def holm(pvalues: Mapping[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment of ``m`` p-values (controls the chance of any false
    "differs" in the family): the i-th smallest becomes ``max_{j<=i} min(1, (m-j+1) p_(j))``.
    """
    order = sorted(pvalues, key=lambda k: pvalues[k])
    m, running, out = len(order), 0.0, {}
    for i, key in enumerate(order):
        running = max(running, min(1.0, (m - i) * pvalues[key]))
        out[key] = running
    return out


def lower_is_better(metric: str) -> bool:
    """``test/ppl@128``, ``test/ppl+yarn@128``, ``val/loss``: lower is better."""
    kind = metric.partition("/")[2].partition("@")[0].partition("+")[0]
    return kind in LOWER_IS_BETTER


@dataclass(frozen=True)
class Mark:
    """A cell's standing in its column.

    Attributes:
        mark: :data:`BEST`, :data:`TIE` (not significantly different from the best),
            :data:`WORSE` (significantly different), or :data:`UNTESTED` (n < 2 here or for
            the best).
        p: Holm-adjusted p-value of Welch's test against the best (None: best or untested).
    """

    mark: str
    p: float | None = None


def rank(cells: Mapping[str, Sequence[float]], lower: bool) -> dict[str, Mark]:
    """Mark every cell of a column against the one with the best mean.

    Args:
        cells: Label -> the finite values over seeds (cells without values are left out).
        lower: Lower is better (see :func:`lower_is_better`).

    Returns:
        Label -> :class:`Mark`, for each cell with at least one value.
    """
    means = {k: statistics.fmean(v) for k, v in cells.items() if v}
    if not means:
        return {}
    best = (min if lower else max)(means, key=lambda k: means[k])
    raw = {k: welch_p(cells[best], cells[k]) for k in means if k != best}
    adjusted = holm({k: p for k, p in raw.items() if p is not None})
    out = {best: Mark(BEST)}
    for k, p in raw.items():
        if p is None:
            out[k] = Mark(UNTESTED)
        else:
            out[k] = Mark(TIE if adjusted[k] >= ALPHA else WORSE, adjusted[k])
    return out
