"""What the sweep report reads and computes, shared by :mod:`posenc.report` (tables) and
:mod:`posenc.report_plots` (figures): a finished run, a job without results, one
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


@dataclass
class Run:
    """One finished job: its directory and the contents of its ``metrics.json``."""

    dir: Path
    data: dict[str, Any]

    @property
    def task(self) -> str:
        """``lm``, ``mt``, or ``algo_<problem>`` (``..._encdec`` for the encoder-decoder):
        each algorithmic problem is a table of its own."""
        task = str(self.data.get("task", "?"))
        if task == "algo":
            shape = "_encdec" if self.data.get("shape") == "encdec" else ""
            return f"algo_{self.data.get('problem', '?')}{shape}"
        return task

    @property
    def encoder(self) -> str:
        return str(self.data.get("encoder", "?"))


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
    """Statistics of one metric over the runs of one (task, encoder) group."""

    task: str
    encoder: str
    metric: str
    mean: float | None
    std: float | None
    n: int
    skipped: int
    cost: dict[str, float | None] = field(default_factory=dict)


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
    absolute schemes, the relative ones, then those relative only below a threshold;
    by name within each group (from the classes' declarations, so a new scheme has its
    place without an edit here)."""
    from posenc import encoders  # torch: only when a report sorts encoders

    def group(name: str) -> int:
        cls = encoders.get(name)
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


def summarize(values: Iterable[Any]) -> tuple[float | None, float | None, int, int]:
    """``(mean, sample std (n-1), n, skipped)``: NaN, inf and null count as skipped.

    The std is None when fewer than two finite values exist.
    """
    finite, skipped = [], 0
    for v in values:
        x = as_float(v)
        if x is not None and math.isfinite(x):
            finite.append(x)
        else:
            skipped += 1
    mean = statistics.fmean(finite) if finite else None
    std = statistics.stdev(finite) if len(finite) > 1 else None
    return mean, std, len(finite), skipped
