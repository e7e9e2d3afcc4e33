"""What a finished run prints to the terminal: its main numbers as a small table, where
its results are, and how to look at them; what a sweep prints when it ends or stops."""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from posenc.results import FILE, AlgoRecord, LMRecord, MetricName, Metrics, MTRecord, Record
from posenc.training.gate import describe
from posenc.training.rundir import checkpoints_in


def _fmt(value: float) -> str:
    """A number for the table: "-" for NaN (a length not run), "inf" as itself (a result
    that overflowed is a result, not a gap)."""
    if math.isnan(value):
        return "-"
    if math.isinf(value):
        return str(value)
    return f"{value:.2f}" if abs(value) < 1000 else f"{value:.0f}"


def _table(rows: dict[str, dict[str, float]], columns: list[str], corner: str) -> list[str]:
    width = max([len(corner), *(len(r) for r in rows)])
    cells = [max(7, len(c)) for c in columns]
    out = [
        "  "
        + corner.ljust(width)
        + "".join(c.rjust(w + 2) for c, w in zip(columns, cells, strict=True))
    ]
    for name, row in rows.items():
        out.append(
            "  "
            + name.ljust(width)
            + "".join(
                _fmt(row.get(c, math.nan)).rjust(w + 2) for c, w in zip(columns, cells, strict=True)
            )
        )
    return out


def lm_rows(metrics: Metrics, split: str = "test") -> tuple[dict, list[str]]:
    """``{ppl, ppl_sw, ppl+yarn, ...: {length: value}}`` and the lengths, in order."""
    rows: dict[str, dict[str, float]] = {}
    for name, value in metrics.items():
        if name.split_name == split and name.length is not None:
            label = name.kind + (f"+{name.extension}" if name.extension else "")
            rows.setdefault(label, {})[name.where] = _value(value)
    lengths = sorted({k for r in rows.values() for k in r}, key=int)
    # The plain protocols first, then each context-extension method's, then passkey accuracy.
    order = sorted(rows, key=lambda r: (r == "passkey", r.partition("+")[2], r))
    return {r: rows[r] for r in order}, lengths


def _value(value: float | None) -> float:
    """A metric's value for the table (null shows as a length not run)."""
    return math.nan if value is None else value


def _lm_lines(record: LMRecord) -> list[str]:
    """Perplexity (and passkey accuracy) by evaluation length."""
    m = record.metrics
    splits = [k.split_name for k in m if k.length is not None]
    split = "test" if "test" in splits else (splits[0] if splits else "test")
    rows, lengths = lm_rows(m, split)
    retrieval = any(k.kind == "passkey" and k.split_name == split and k.length for k in m)
    passkey = "; passkey: retrieval accuracy" if retrieval else ""
    head = f"posenc: {record.encoder} on {record.task}, seed {record.seed}"
    return [
        f"{head}: {split} perplexity by evaluation length (trained at "
        f"{record.seq_len}; ppl: non-overlapping windows, ppl_sw: sliding{passkey})",
        *_table(rows, lengths, "length"),
    ]


def _algo_lines(record: AlgoRecord) -> list[str]:
    """The problem's metrics by size bucket."""
    lo, hi = record.train_lengths
    kinds = record.table_metrics
    what = "accuracy" if set(kinds) <= {"seq_acc", "acc"} else "metrics"
    rows = {
        k: {
            b: _value(record.metrics.get(record.bucket_metric(k, b), math.nan))
            for b in record.buckets
        }
        for k in kinds
    }
    return [
        f"posenc: {record.encoder} on {record.problem} ({record.shape}), "
        f"seed {record.seed}: test {what} (%) by instance size "
        f"({record.size_means}; trained on {lo}..{hi})",
        *_table(rows, record.buckets, "size"),
    ]


def _mt_lines(record: Record) -> list[str]:
    """BLEU and chrF overall and by source-length bucket (a record of another task: its
    test scores, if any)."""
    split = record.eval_split if isinstance(record, MTRecord) else "test"
    m = record.metrics
    head = f"posenc: {record.encoder} on {record.task}, seed {record.seed}"
    lines = [f"{head}: {split} scores"]
    overall = {
        k: _value(m[name]) for k in ("bleu", "chrf") if (name := MetricName.of(split, k)) in m
    }
    lines.append(
        "  "
        + "  ".join(f"{k.upper() if k == 'bleu' else 'chrF'} {_fmt(v)}" for k, v in overall.items())
    )
    buckets: dict[str, dict[str, float]] = {}
    for name, value in m.items():
        if name.split_name == split and name.kind in ("bleu", "chrf") and name.where:
            buckets.setdefault(name.kind, {})[name.where] = _value(value)
    if buckets:
        columns = list(next(iter(buckets.values())))
        lines.append("  by source length (tokens):")
        lines += _table(buckets, columns, "bucket")
    return lines


def summary(record: Record, run_dir: Path, shown: Mapping[str, Path] | None = None) -> str:
    """The lines a run prints when it ends (``metrics.json``'s contents, shortened), with
    the other files its task wrote that ``shown`` names (label -> path)."""
    if isinstance(record, LMRecord):
        lines = _lm_lines(record)
    elif isinstance(record, AlgoRecord):
        lines = _algo_lines(record)
    else:
        lines = _mt_lines(record)
    val = [f"{k} {_fmt(_value(v))}" for k, v in record.validation().items()]
    if val:
        lines.append("  last validation: " + ", ".join(val))
    learned = describe(record)
    if learned:
        lines.append(f"  {learned}")
    lines += [
        f"run directory: {run_dir}",
        f"all numbers:   {run_dir / FILE}",
        *(f"{label + ':':<15}{path}" for label, path in (shown or {}).items()),
        *checkpoint_lines(run_dir / "checkpoints"),
        f"curves:        tensorboard --logdir {run_dir / 'tb'}",
    ]
    return "\n".join(lines)


def checkpoint_lines(folder: Path) -> list[str]:
    """Which checkpoints the run left (none for an evaluation): a run shorter than its
    validation interval has ``last.ckpt`` but no ``best.ckpt``, which commands that name
    ``best.ckpt`` must be told."""
    found = checkpoints_in(folder)
    if not found:
        return []
    names = ", ".join(p.name for p in found)
    line = f"checkpoints:   {folder}: {names}"
    if not (folder / "best.ckpt").exists():
        line += " (no best.ckpt: no validation ran during training; use last.ckpt)"
    return [line]


def sweep_resume_command(sweep_dir: Path, argv: list[str]) -> str:
    """The command that continues a stopped sweep: the same overrides in the same sweep
    directory with ``resume=true`` (finished jobs are skipped, stopped ones continue from
    their ``last.ckpt``, jobs that never started run).

    Args:
        sweep_dir: The sweep's directory.
        argv: The sweep's command line (``sys.argv``).
    """
    args = [a for a in argv[1:] if not a.startswith(("hydra.sweep.dir=", "resume="))]
    return " ".join(["python", argv[0], *args, f"hydra.sweep.dir={sweep_dir}", "resume=true"])


def _error(job_dir: Path) -> dict[str, Any]:
    """A failed job's ``error.json`` (empty when unreadable)."""
    try:
        found = json.loads((job_dir / "error.json").read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


#: Distinct causes of failure a sweep's summary prints (the rest are counted), and the
#: characters it shows of each (a bug's message may quote a whole tensor).
CAUSES_SHOWN = 3
LONGEST = 1000


def sweep_lines(root: Path, argv: list[str]) -> list[str]:
    """What a sweep prints when it ends: how many jobs have results and how many failed;
    the failures grouped by cause (a job that could not write its files by what went
    wrong, any other by its error's message, each with one job's ``error.json``), and the
    command that reruns the failed jobs once the cause is mended; the report's command
    when there is something to report.

    Args:
        root: The sweep's directory.
        argv: The sweep's command line (``sys.argv``).
    """
    jobs = [d for d in root.iterdir() if d.is_dir() and d.name != "report"] if root.is_dir() else []
    done = sum((d / "metrics.json").exists() for d in jobs)
    failed = [d for d in jobs if (d / "error.json").exists() and not (d / "metrics.json").exists()]
    out = [
        f"sweep finished: {done} of {len(jobs)} jobs have results, {len(failed)} failed "
        f"(error.json), in {root}"
    ]
    if done:
        out.append(f"report: python -m posenc.report {root}")
    writes: Counter[str] = Counter()
    others: dict[str, list[Path]] = {}
    for job in sorted(failed):
        error = _error(job)
        if error.get("write_failure"):
            writes[str(error["write_failure"]).partition(": ")[0]] += 1
        else:
            cause = (
                f"{error.get('error_type', 'unreadable error.json')}: {error.get('message', '')}"
            )
            cause = " ".join(cause.split())
            cause = cause if len(cause) <= LONGEST else cause[: LONGEST - 3] + "..."
            others.setdefault(cause, []).append(job)
    resume = sweep_resume_command(root, argv)
    for cause, n in writes.items():
        out.append(
            f"{n} of the failed jobs could not write their files: {cause}. Make room (or "
            f"fix the folder), then continue the sweep with:\n  {resume}"
        )
    ranked = sorted(others.items(), key=lambda kv: -len(kv[1]))
    for cause, where in ranked[:CAUSES_SHOWN]:
        out.append(f"{len(where)} failed with {cause} (e.g. {where[0] / 'error.json'})")
    if len(ranked) > CAUSES_SHOWN:
        rest = sum(len(w) for _, w in ranked[CAUSES_SHOWN:])
        causes = len(ranked) - CAUSES_SHOWN
        out.append(
            f"{rest} more failed, {causes} other cause{'s' * (causes > 1)} (their error.json)"
        )
    if others:
        out.append(f"once mended, rerun the failed jobs (the others are kept) with:\n  {resume}")
    return out


class SweepSummary(Callback):
    """Hydra callback (``hydra.callbacks`` in ``conf/config.yaml``): when a multirun ends,
    print :func:`sweep_lines`."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        print("\n".join(sweep_lines(Path(str(config.hydra.sweep.dir)), sys.argv)), flush=True)
