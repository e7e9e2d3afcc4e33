"""Compare the runs of a sweep: ``python -m posenc.report <sweep or outputs dir> [--out DIR]``.

Reads every ``metrics.json`` and ``error.json`` below the directory and writes, into
``--out`` (default ``<dir>/report/``): ``report.md``, ``report.csv`` (one row per task x
encoder x metric: mean, sample std, n, skipped, and the compute columns), PNG figures, and
the same figures in TensorBoard (``<out>/tb``). A partial sweep is reported as it stands:
failed runs (``error.json``) and job directories without results are listed, never fatal.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from posenc.report_rows import (
    Failure,
    Row,
    Run,
    as_float,
    encoder_key,
    metric_key,
    split_extension,
    summarize,
)

#: Compute columns: averaged over a group's runs so comparisons can be compute-matched.
COST_KEYS = ("n_params", "tokens_per_s", "peak_memory_mb", "train_time_s")
CSV_FIELDS = ("task", "encoder", "metric", "mean", "std", "n", "skipped", *COST_KEYS)


# ----------------------------------------------------------------------------- collecting
def _job_dirs(root: Path, exclude: Path | None) -> list[Path]:
    """Directories holding a result file, or a Hydra job record (``.hydra/``)."""
    found = {p.parent for name in ("metrics.json", "error.json") for p in root.rglob(name)}
    found |= {p.parent.parent for p in root.rglob("overrides.yaml") if p.parent.name == ".hydra"}

    def keep(d: Path) -> bool:
        if exclude is not None and d.is_relative_to(exclude):
            return False
        return not any(part.startswith(".") for part in d.relative_to(root).parts)

    return sorted(d for d in found if keep(d))


def _hydra_record(d: Path) -> dict[str, Any]:
    """task, encoder and seed from a job's ``.hydra/`` files (empty if unreadable)."""
    from omegaconf import DictConfig, OmegaConf

    try:
        choices = OmegaConf.load(d / ".hydra" / "hydra.yaml").hydra.runtime.choices
        seed = cast(DictConfig, OmegaConf.load(d / ".hydra" / "config.yaml")).get("seed")
        return {"task": choices.get("task", "?"), "encoder": choices.get("encoder", "?"),
                "seed": seed}
    except Exception:  # any damage: the directory is still listed, just unlabelled
        return {}


def _last_log_line(d: Path) -> str:
    """How far a job without results got: the last line of its ``run.log``."""
    try:
        lines = (d / "run.log").read_text(errors="replace").strip().splitlines()
    except OSError:
        return "it wrote no run.log"
    return f"last log line: {lines[-1].strip()[:300]}" if lines else "its run.log is empty"


def _one_line(error: str) -> str:
    """An error message on one table line: its lines joined (a config error's first line
    is only a header), at most 500 characters."""
    text = " ".join(line.strip() for line in error.strip().splitlines() if line.strip())
    return text if len(text) <= 500 else text[:499] + "…"


def collect(root: Path, exclude: Path | None = None) -> tuple[list[Run], list[Failure]]:
    """Finished runs and failures below ``root``.

    A directory with ``metrics.json`` is a finished run, even if an ``error.json`` from an
    earlier attempt lies next to it (the job was re-run and succeeded).

    Args:
        root: A sweep directory, a single run, or a whole ``outputs/`` tree.
        exclude: A directory to skip (the report's own output).

    Returns:
        ``(runs, failures)`` in directory order.
    """
    runs: list[Run] = []
    failures: list[Failure] = []
    for d in _job_dirs(root, exclude):
        metrics, error = d / "metrics.json", d / "error.json"
        source = metrics if metrics.exists() else error if error.exists() else None
        if source is None:
            failures.append(Failure(
                d, "missing", "no metrics.json and no error.json: killed (e.g. by the OOM "
                f"killer), or still running; {_last_log_line(d)}", **_hydra_record(d)))
            continue
        try:
            data = json.loads(source.read_text())
            if not isinstance(data, dict) or not isinstance(data.get("metrics", {}), dict):
                raise ValueError("not a posenc result (expected an object with 'metrics')")
            # A skipped length is NaN or null; anything else that is not a number is a
            # malformed result, never a "skipped" cell.
            bad = {k: v for k, v in data.get("metrics", {}).items()
                   if v is not None and as_float(v) is None}
            if bad and source is metrics:
                name, value = next(iter(bad.items()))
                more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
                raise ValueError(f"metric {name!r} is {value!r}, not a number{more}")
        except (OSError, ValueError) as err:
            failures.append(Failure(d, "unreadable", f"{source.name}: {err}", **_hydra_record(d)))
            continue
        if source is metrics:
            runs.append(Run(d, data))
        else:
            failures.append(Failure(
                d, "failed", f"{data.get('error_type', 'Error')}: {data.get('message', '')}",
                task=str(data.get("task", "?")), encoder=str(data.get("encoder", "?")),
                seed=data.get("seed")))
    return runs, failures


def groups(runs: Sequence[Run]) -> dict[tuple[str, str], list[Run]]:
    """Runs by (task, encoder), tasks alphabetically and encoders in display order."""
    out: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for r in runs:
        out[(r.task, r.encoder)].append(r)
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0], encoder_key(kv[0][1]))))


def aggregate(runs: Sequence[Run]) -> list[Row]:
    """One :class:`Row` per (task, encoder, metric). A run without the metric at all is
    not counted; one holding NaN (a skipped length) counts under ``skipped``."""
    rows = []
    for (task, encoder), rs in groups(runs).items():
        cost = {k: summarize(r.data.get(k) for r in rs)[0] for k in COST_KEYS}
        names = sorted({m for r in rs for m in r.data.get("metrics", {})}, key=metric_key)
        for name in names:
            present = [r.data["metrics"][name] for r in rs if name in r.data.get("metrics", {})]
            mean, std, n, skipped = summarize(present)
            rows.append(Row(task, encoder, name, mean, std, n, skipped, cost))
    return rows


def config_differences(runs: Sequence[Run]) -> list[str]:
    """Config keys (other than seed and paths) whose values differ within a group: such
    runs are averaged together, so the report says so."""
    notes = []
    for (task, encoder), rs in groups(runs).items():
        flat = [_flatten(r.data.get("config", {})) for r in rs]
        keys = set().union(*flat) if flat else set()
        differ = sorted(
            k for k in keys
            if not k.startswith(("paths.", "seed", "hydra.", "ckpt_path", "eval_only", "resume"))
            and len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flat}) > 1
        )
        if differ:
            notes.append(f"{task}/{encoder}: runs differ in {', '.join(differ[:8])}"
                         + (" ..." if len(differ) > 8 else ""))
    return notes


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out |= _flatten(v, f"{prefix}{k}.")
    return out


# ----------------------------------------------------------------------------- writing
def fmt(x: float | None, digits: int = 4) -> str:
    return "" if x is None else f"{x:.{digits}g}"


def write_csv(rows: Sequence[Row], path: Path) -> None:
    """``report.csv``: full precision; blank where a value does not exist."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in rows:
            cost = ["" if r.cost.get(k) is None else repr(r.cost[k]) for k in COST_KEYS]
            w.writerow([r.task, r.encoder, r.metric, "" if r.mean is None else repr(r.mean),
                        "" if r.std is None else repr(r.std), r.n, r.skipped, *cost])


def _cell(r: Row, n_runs: int) -> str:
    if r.mean is None:
        return f"skipped ({r.skipped})" if r.skipped else ""
    text = fmt(r.mean) + ("" if r.std is None else f" ± {fmt(r.std, 2)}")
    return text + ("" if r.n == n_runs else f" (n={r.n})")


def _table(header: Sequence[str], body: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in body]
    return lines


def _notes(rs: Sequence[Run]) -> list[str]:
    """Protocol descriptions quoted from the runs (LM ``protocols``, MT BLEU settings)."""
    seen: dict[str, str] = {}
    for r in rs:
        for name, doc in (r.data.get("protocols") or {}).items():
            seen.setdefault(name, str(doc))
        for name, doc in (r.data.get("context_extension") or {}).items():
            seen.setdefault(f"+{name}", str(doc))
        for key in ("bleu_signature", "bucket_doc"):
            if r.data.get(key):
                seen.setdefault(key, str(r.data[key]))
    return [f"> **{k}**: {v}  " for k, v in seen.items()]


def markdown(root: Path, runs: Sequence[Run], failures: Sequence[Failure],
             rows: Sequence[Row], figures: Sequence[Path]) -> str:
    """The text of ``report.md``."""
    out = [f"# Sweep report: `{root}`", "",
           f"{len(runs)} finished, {sum(f.status == 'failed' for f in failures)} failed, "
           f"{sum(f.status != 'failed' for f in failures)} missing or unreadable. "
           f"Mean ± sample std (n-1) over seeds; `(n=k)` when fewer runs have a finite value; "
           f"skipped = NaN (a length the encoder cannot run). "
           f"Generated {datetime.now():%Y-%m-%d %H:%M}.", ""]
    by_group = groups(runs)
    for task in sorted({t for t, _ in by_group}):
        task_groups = {e: rs for (t, e), rs in by_group.items() if t == task}
        task_rows = [r for r in rows if r.task == task]
        out += [f"## {task}", "", "Compute (means over runs):", ""]
        out += _table(["encoder", "runs", "params", "tokens/s", "peak MB", "train s"],
                      ([e, len(rs), *(fmt(task_rows_cost(task_rows, e, k), 6) for k in COST_KEYS)]
                       for e, rs in task_groups.items()))
        out += ["", "Test metrics (mean ± std; `rope+yarn`: the same runs evaluated with "
                "a RoPE context-extension method):", ""]
        out += _test_table(task_groups, task_rows)
        out += ["", *_notes([r for rs in task_groups.values() for r in rs]), ""]
        out += ["<details><summary>All metrics</summary>", ""]
        out += _table(["encoder", "metric", "mean", "std", "n", "skipped"],
                      ([r.encoder, r.metric, fmt(r.mean, 6), fmt(r.std, 4), r.n, r.skipped]
                       for r in task_rows))
        out += ["", "</details>", ""]
        out += [f"![{p.stem}]({p.name})" for p in figures if p.name.startswith(f"{task}_")]
        out += [""]
    tasks = {t for t, _ in by_group}
    loose = [p for p in figures if not any(p.name.startswith(f"{t}_") for t in tasks)]
    if loose:
        out += ["## Overview", "", *[f"![{p.stem}]({p.name})" for p in loose], ""]
    differ = config_differences(runs)
    if differ:
        out += ["## Warning: mixed configs averaged together", "", *[f"- {d}" for d in differ], ""]
    if failures:
        out += ["## Failed and missing runs", ""]
        out += _table(["run", "status", "task", "encoder", "seed", "error"],
                      ([_rel(f.dir, root), f.status, f.task, f.encoder,
                        "" if f.seed is None else f.seed,
                        _one_line(f.error)]
                       for f in failures))
        out += [""]
    if not runs and not failures:
        out += [f"No metrics.json or error.json found below `{root}`.", ""]
    return "\n".join(out)


def _test_table(task_groups: dict[str, list[Run]], task_rows: Sequence[Row]) -> list[str]:
    """Encoders as rows, test metrics as columns; each context-extension method of an
    encoder is a row of its own (``rope+yarn``) under the plain metric's column."""
    cells: dict[tuple[str, str], Row] = {}
    extensions: dict[str, set[str]] = {}
    for r in task_rows:
        if r.metric.startswith("test/"):
            plain, ext = split_extension(r.metric)
            if ext and r.n == 0:
                continue  # a method the encoder lacks (all skipped): no row of blanks
            cells[f"{r.encoder}+{ext}" if ext else r.encoder, plain] = r
            extensions.setdefault(r.encoder, set()).add(ext)
    metrics = sorted({m for _, m in cells}, key=metric_key)
    body = []
    for e, rs in task_groups.items():
        for ext in sorted(extensions.get(e, {""})):
            label = f"{e}+{ext}" if ext else e
            body.append([label, *(_cell(cells[label, m], len(rs)) if (label, m) in cells
                                  else "" for m in metrics)])
    return _table(["encoder", *metrics], body)


def task_rows_cost(rows: Sequence[Row], encoder: str, key: str) -> float | None:
    return next((r.cost.get(key) for r in rows if r.encoder == encoder), None)


def _rel(d: Path, root: Path) -> str:
    return str(d.relative_to(root)) if d != root else "."


@dataclass
class Report:
    """What :func:`build_report` found and wrote."""

    runs: list[Run]
    failures: list[Failure]
    rows: list[Row]
    files: list[Path]


def build_report(root: Path, out: Path | None = None, tensorboard: bool = True) -> Report:
    """Collect, aggregate and write the report.

    Args:
        root: Directory to search (recursively).
        out: Output directory; default ``<root>/report``.
        tensorboard: Also write the figures to ``<out>/tb``.

    Returns:
        The runs, failures, rows and the files written.

    Raises:
        FileNotFoundError: ``root`` is not a directory.
    """
    from posenc import report_plots

    root = Path(root).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory; pass a sweep dir or outputs/")
    out = (Path(out) if out is not None else root / "report").resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs, failures = collect(root, exclude=out if out.is_relative_to(root) else None)
    rows = aggregate(runs)
    figures = report_plots.figures(runs, groups(runs), rows)
    writer = report_plots.summary_writer(out / "tb") if tensorboard else None
    pngs = report_plots.save(figures, out, writer)
    text = markdown(root, runs, failures, rows, pngs)
    (out / "report.md").write_text(text)
    write_csv(rows, out / "report.csv")
    if writer is not None:
        writer.add_text("report/summary", text, 0)  # TensorBoard renders the markdown
        writer.close()
    return Report(runs, failures, rows, [out / "report.md", out / "report.csv", *pngs])


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m posenc.report", description=__doc__)
    parser.add_argument("dir", type=Path, help="sweep directory or outputs/ (searched recursively)")
    parser.add_argument("--out", type=Path, default=None, help="output dir (default <dir>/report)")
    parser.add_argument("--no-tensorboard", action="store_true", help="skip <out>/tb")
    args = parser.parse_args(argv)
    out = args.out if args.out is not None else args.dir / "report"
    try:
        if args.dir.is_dir():  # (a missing sweep directory is build_report's message)
            out.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=out):
                pass
    except OSError as err:
        print(f"error: --out {out}: cannot create or write this folder "
              f"({err.strerror or err}); give another --out", file=sys.stderr)
        return 2
    try:
        rep = build_report(args.dir, args.out, tensorboard=not args.no_tensorboard)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    status = Counter(f.status for f in rep.failures)
    print(f"{len(rep.runs)} runs, {dict(status) or 'no failures'}; wrote "
          + ", ".join(str(p) for p in rep.files))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
