"""What a finished run prints to the terminal: its main numbers as a small table, where
its results are, and how to look at them; what a sweep prints when it ends or stops."""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from posenc.eval.lengths import parse_metric
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


def lm_rows(metrics: dict[str, float], split: str = "test") -> tuple[dict, list[str]]:
    """``{ppl, ppl_sw, ppl+yarn, ...: {length: value}}`` and the lengths, in order."""
    rows: dict[str, dict[str, float]] = {}
    for name, value in metrics.items():
        where, kind, extension, length = parse_metric(name)
        if where == split and length.isdigit():
            rows.setdefault(kind + (f"+{extension}" if extension else ""), {})[length] = value
    lengths = sorted({k for r in rows.values() for k in r}, key=int)
    # The plain protocols first, then each context-extension method's, then passkey accuracy.
    order = sorted(rows, key=lambda r: (r == "passkey", r.partition("+")[2], r))
    return {r: rows[r] for r in order}, lengths


def summary(result: dict[str, Any], run_dir: Path) -> str:
    """The lines a run prints when it ends (``metrics.json``'s contents, shortened)."""
    m = result["metrics"]
    head = f"posenc: {result['encoder']} on {result['task']}, seed {result['seed']}"
    lines = []
    if result["task"] == "lm":
        splits = [parse_metric(k)[0] for k in m if parse_metric(k)[3].isdigit()]
        split = "test" if "test" in splits else (splits[0] if splits else "test")
        rows, lengths = lm_rows(m, split)
        passkey = "; passkey: retrieval accuracy" if "passkey" in rows else ""
        lines.append(
            f"{head}: {split} perplexity by evaluation length (trained at "
            f"{result['seq_len']}; ppl: non-overlapping windows, ppl_sw: sliding{passkey})"
        )
        lines += _table(rows, lengths, "length")
    elif result["task"] == "algo":
        lo, hi = result["train_lengths"]
        kinds = result.get("table_metrics", ["seq_acc", "acc"])  # older results: these two
        what = "accuracy" if set(kinds) <= {"seq_acc", "acc"} else "metrics"
        lines.append(
            f"posenc: {result['encoder']} on {result['problem']} ({result['shape']}), "
            f"seed {result['seed']}: test {what} (%) by instance size "
            f"({result['size_means']}; trained on {lo}..{hi})"
        )
        rows = {k: {b: m.get(f"test/{k}@{b}", math.nan) for b in result["buckets"]} for k in kinds}
        lines += _table(rows, result["buckets"], "size")
    else:
        lines.append(f"{head}: {result.get('eval_split', 'test')} scores")
        split = result.get("eval_split", "test")
        overall = {k: m[f"{split}/{k}"] for k in ("bleu", "chrf") if f"{split}/{k}" in m}
        lines.append(
            "  "
            + "  ".join(
                f"{k.upper() if k == 'bleu' else 'chrF'} {_fmt(v)}" for k, v in overall.items()
            )
        )
        buckets: dict[str, dict[str, float]] = {}
        for name, value in m.items():
            where, kind, _, bucket = parse_metric(name)
            if where == split and kind in ("bleu", "chrf") and bucket:
                buckets.setdefault(kind, {})[bucket] = value
        if buckets:
            columns = list(next(iter(buckets.values())))
            lines.append("  by source length (tokens):")
            lines += _table(buckets, columns, "bucket")
    val = [f"{k} {_fmt(v)}" for k, v in m.items() if k.startswith("val/") and "@" not in k]
    if val:
        lines.append("  last validation: " + ", ".join(val))
    learned = describe(result)
    if learned:
        lines.append(f"  {learned}")
    lines += [
        f"run directory: {run_dir}",
        f"all numbers:   {run_dir / 'metrics.json'}",
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


def _write_failure(job_dir: Path) -> str | None:
    """What a failed write was (``"no space left on device"``), from the job's
    ``error.json``, or None."""
    try:
        found = json.loads((job_dir / "error.json").read_text()).get("write_failure")
    except (OSError, ValueError, AttributeError):
        return None
    return str(found).partition(": ")[0] if found else None


class SweepSummary(Callback):
    """Hydra callback (``hydra.callbacks`` in ``conf/config.yaml``): when a multirun ends,
    say how many jobs finished or failed and print the command that makes its report; jobs
    that failed because a file could not be written (a full disk) are counted by cause,
    with the command that continues the sweep once that is mended."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        root = Path(str(config.hydra.sweep.dir))
        jobs = (
            [d for d in root.iterdir() if d.is_dir() and d.name != "report"]
            if root.is_dir()
            else []
        )
        done = sum((d / "metrics.json").exists() for d in jobs)
        failed = [
            d for d in jobs if (d / "error.json").exists() and not (d / "metrics.json").exists()
        ]
        print(
            f"sweep finished: {done} of {len(jobs)} jobs have results, {len(failed)} failed "
            f"(error.json), in {root}\nreport: python -m posenc.report {root}",
            flush=True,
        )
        causes = Counter(c for c in map(_write_failure, failed) if c)
        for cause, n in causes.items():
            print(
                f"{n} of the failed jobs could not write their files: {cause}. Make room (or "
                f"fix the folder), then continue the sweep with:\n  "
                f"{sweep_resume_command(root, sys.argv)}",
                flush=True,
            )
