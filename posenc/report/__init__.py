"""Compare the runs of a sweep: ``python -m posenc.report <sweep or outputs dir>... [--out DIR]``.

Reads every ``metrics.json`` and ``error.json`` below the directories and writes, into
``--out`` (default ``<dir>/report/``): ``report.md``, ``report.csv`` (one row per task x
encoder x metric: mean, sample std, 95% CI, n, skipped, runs left out as not learned, the
mark against the column's best and its p-value, and the compute columns), PNG figures, the
same figures in TensorBoard (``<out>/tb``), ``effective_length.csv`` for algorithmic tasks
(:mod:`posenc.report.effective`, at ``--threshold``), and ``tuned_lr.yaml`` when the runs
hold a learning-rate grid (:mod:`posenc.report.tune`). A partial sweep is reported as it stands:
failed runs (``error.json``) and job directories without results are listed, never fatal.

Statistics (:mod:`posenc.report.stats`): intervals by Student's t over seeds, Welch's
t-test against each column's best; columns past the training length count only runs that
learned their task (:mod:`posenc.training.gate`). Runs of several learning rates are never
averaged together: same lr, tuned lr and each rate of a grid get tables of their own.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from posenc import plots, results
from posenc.report import effective, suite
from posenc.report.stats import BEST, TIE, ci95, lower_is_better, rank
from posenc.report.tune import Grid, arm_note, assign_arms, grid_table, grids, write_tuned
from posenc.results import COST_KEYS, LMRecord, MetricName, MTRecord
from posenc.runs import (
    LEARNED,
    NO_GATE,
    NOT_LEARNED,
    UNKNOWN,
    Failure,
    Row,
    Run,
    encoder_key,
    finite_values,
    infinite,
    summarize,
)
from posenc.runs import (
    metric_key as metric_key,  # the sort key of metric names, for callers of the report
)

CSV_FIELDS = (
    "task",
    "encoder",
    "metric",
    "mean",
    "std",
    "ci95",
    "n",
    "skipped",
    "dropped_not_learned",
    "learned",
    "mark",
    "p_vs_best",
    *COST_KEYS,
)


# ----------------------------------------------------------------------------- collecting
def _files(root: Path, names: tuple[str, ...]) -> Iterator[Path]:
    """The files called one of ``names`` under ``root``, linked folders followed (a
    folder of links to chosen runs reports on those runs), each real folder read once."""
    seen: set[str] = set()
    for folder, subfolders, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:  # a link back up the tree, or a second link to one folder
            subfolders.clear()
            continue
        seen.add(real)
        yield from (Path(folder) / f for f in files if f in names)


def _job_dirs(root: Path, exclude: Path | None) -> list[Path]:
    """Directories holding a result file, or a Hydra job record (``.hydra/``)."""
    found: set[Path] = set()
    for p in _files(root, ("metrics.json", "error.json", "overrides.yaml")):
        if p.name != "overrides.yaml":
            found.add(p.parent)
        elif p.parent.name == ".hydra":
            found.add(p.parent.parent)

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
        return {
            "task": choices.get("task", "?"),
            "encoder": choices.get("encoder", "?"),
            "seed": seed,
        }
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
            failures.append(
                Failure(
                    d,
                    "missing",
                    "no metrics.json and no error.json: killed (e.g. by the OOM "
                    f"killer), or still running; {_last_log_line(d)}",
                    **_hydra_record(d),
                )
            )
            continue
        try:
            if source is metrics:
                runs.append(Run(d, results.read(metrics)))
            else:
                failures.append(_failed(d, error))
        except (OSError, ValueError) as err:  # a RecordError is a ValueError too
            failures.append(Failure(d, "unreadable", f"{source.name}: {err}", **_hydra_record(d)))
    return runs, failures


def _failed(d: Path, error: Path) -> Failure:
    """A job that recorded its failure in ``error.json`` (:func:`posenc.cli` writes it).

    Raises:
        ValueError: Not JSON, or not an object.
    """
    data = json.loads(error.read_text())
    if not isinstance(data, dict):
        raise ValueError("not a posenc result (expected an object with 'metrics')")
    return Failure(
        d,
        "failed",
        f"{data.get('error_type', 'Error')}: {data.get('message', '')}",
        task=str(data.get("task", "?")),
        encoder=str(data.get("encoder", "?")),
        seed=data.get("seed"),
    )


def groups(runs: Sequence[Run]) -> dict[tuple[str, str], list[Run]]:
    """Runs by (task, encoder), tasks alphabetically and encoders in display order."""
    out: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for r in runs:
        out[(r.task, r.encoder)].append(r)
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0], encoder_key(kv[0][1]))))


def tables(by_group: dict[tuple[str, str], list[Run]]) -> dict[str, dict[str, list[Run]]]:
    """:func:`groups` as task -> encoder -> runs, in the same order."""
    out: dict[str, dict[str, list[Run]]] = defaultdict(dict)
    for (task, encoder), rs in by_group.items():
        out[task][encoder] = rs
    return dict(out)


def aggregate(runs: Sequence[Run]) -> list[Row]:
    """One :class:`Row` per (task, encoder, metric), marked against its column's best
    (:func:`mark_rows`). A run without the metric at all is not counted; one holding NaN
    (a skipped length) counts under ``skipped``; one that did not learn its task is left
    out of metrics past the training length (``dropped``)."""
    rows = []
    for (task, encoder), rs in groups(runs).items():
        cost = {k: summarize(r.record.costs()[k] for r in rs)[0] for k in COST_KEYS}
        names = sorted({m for r in rs for m in r.record.metrics}, key=MetricName.sort_key)
        for name in names:
            having = [r for r in rs if name in r.record.metrics]
            present = [r.record.metrics[name] for r in having if r.counts(name)]
            mean, std, n, skipped = summarize(present)
            values, _ = finite_values(present)
            overflowed = infinite(present)
            rows.append(
                Row(
                    task,
                    encoder,
                    name,
                    mean,
                    std,
                    n,
                    skipped - overflowed,
                    cost,
                    values,
                    ci95(values),
                    dropped=len(having) - len(present),
                    not_finite=overflowed,
                )
            )
    mark_rows(rows)
    return rows


def mark_rows(rows: Sequence[Row]) -> None:
    """Per task and column, mark each row against the best mean (:func:`posenc.report.stats.rank`).
    A context-extension row (``test/ppl+yarn@L``) competes in its plain metric's column,
    as the table shows it."""
    columns: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for r in rows:
        columns[r.task, r.metric.plain].append(r)
    for (_, metric), column in columns.items():
        marks = rank({str(i): r.values for i, r in enumerate(column)}, lower_is_better(metric))
        for i, r in enumerate(column):
            found = marks.get(str(i))
            r.mark, r.p = (found.mark, found.p) if found else ("", None)


def learned_counts(rs: Sequence[Run]) -> Counter[str]:
    """How many of a group's runs stand where at the learnability gate."""
    return Counter(r.learned for r in rs)


def learned_cell(rs: Sequence[Run]) -> str:
    """``k/n`` runs that learned; unknown ones (results from before the gate) said so;
    "" when no run has a gate."""
    c = learned_counts(rs)
    if c[NO_GATE] == len(rs):
        return ""
    if c[UNKNOWN] == len(rs):
        return "unknown"
    text = f"{c[LEARNED]}/{len(rs)}"
    return text + (f" ({c[UNKNOWN]} unknown)" if c[UNKNOWN] else "")


def steps_cell(rs: Sequence[Run]) -> str:
    """Where each run met its gate, in seed order: its step, ``-`` where it did not, ``?``
    where its standing is unknown; "" when no run's standing is known."""
    if all(r.learned in (UNKNOWN, NO_GATE) for r in rs):
        return ""
    ordered = sorted(rs, key=lambda r: (r.record.seed is None, r.record.seed or 0))
    marks = {NOT_LEARNED: "-", UNKNOWN: "?", NO_GATE: "?"}
    return ", ".join(marks.get(r.learned, str(r.record.learned_step)) for r in ordered)


def config_differences(runs: Sequence[Run]) -> list[str]:
    """Config keys (other than seed and paths) whose values differ within a group: such
    runs are averaged together, so the report says so."""
    notes = []
    for (task, encoder), rs in groups(runs).items():
        flat = [_flatten(r.record.config) for r in rs]
        keys = set().union(*flat) if flat else set()
        differ = sorted(
            k
            for k in keys
            if not k.startswith(("paths.", "seed", "hydra.", "ckpt_path", "eval_only", "resume"))
            and len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flat}) > 1
        )
        if differ:
            notes.append(
                f"{task}/{encoder}: runs differ in {', '.join(differ[:8])}"
                + (" ..." if len(differ) > 8 else "")
            )
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


def _num(x: float | None) -> str:
    return "" if x is None else repr(x)


def write_csv(rows: Sequence[Row], path: Path, learned: dict[tuple[str, str], str]) -> None:
    """``report.csv``: full precision; blank where a value does not exist.

    Args:
        rows: The aggregated rows.
        path: Where.
        learned: ``(task, encoder)`` -> :func:`learned_cell`.
    """
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in rows:
            cost = [_num(r.cost.get(k)) for k in COST_KEYS]
            w.writerow(
                [
                    r.task,
                    r.encoder,
                    r.metric,
                    _num(r.mean),
                    _num(r.std),
                    _num(r.ci95),
                    r.n,
                    r.skipped,
                    r.dropped,
                    learned.get((r.task, r.encoder), ""),
                    r.mark,
                    _num(r.p),
                    *cost,
                ]
            )


def _cell(r: Row, n_runs: int, one_run_each: bool = False) -> str:
    """``12 ± 5`` (mean ± 95% CI half-width), bold for the best and its ties, ``(n=k)``
    where fewer than all runs count; why a cell is empty. ``one_run_each``: every scheme
    of the table has one run, which its caption says once, not every cell."""
    if r.mean is None:
        why = [f"skipped ({r.skipped})"] if r.skipped else []
        why += [f"not finite ({r.not_finite})"] if r.not_finite else []
        why += [f"not learned ({r.dropped} left out)"] if r.dropped else []
        return "; ".join(why)
    text = fmt(r.mean) + ("" if r.ci95 is None else f" ± {fmt(r.ci95, 2)}")
    if r.mark in (BEST, TIE):
        text = f"**{text}**"
    if r.n == 1:
        return text if one_run_each else text + " (n=1, no CI)"
    return text + ("" if r.n == n_runs else f" (n={r.n})")


STATS_NOTE = (
    "> Mean ± 95% confidence interval of the mean (Student's t over seeds, n − 1 degrees of "
    "freedom); `(n=k)`: only k runs count there; n = 1: no interval and no test. **Bold**: "
    "the column's best mean and every scheme not significantly different from it (Welch's "
    "t-test, two-sided, Holm-corrected over the column, p ≥ 0.05): ties, not a ranking."
)
STEPS_NOTE = (
    " **at step**: the step at which each run met it, by seed (`-`: it did not; `?`: unknown)."
)
LEARNED_NOTE = (
    "> **learned**: runs (of n) that met the task's learnability gate (`task.learned`) at "
    "their last validation; unknown: results from before the gate.{steps} Columns past the "
    "training length count only runs that learned: runs that did not are left out, so no "
    "table ranks a model that never learned the task (`not learned (k left out)`: no run "
    "that learned has a value there)."
)


def _table(header: Sequence[str], body: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in body]
    return lines


def _notes(rs: Sequence[Run]) -> list[str]:
    """Protocol descriptions quoted from the runs (LM ``protocols``, MT BLEU settings)."""
    seen: dict[str, str] = {}
    for r in rs:
        record = r.record
        if isinstance(record, LMRecord):
            for name, doc in record.protocols.items():
                seen.setdefault(name, str(doc))
            for name, doc in record.context_extension.items():
                seen.setdefault(f"+{name}", str(doc))
        if isinstance(record, MTRecord):
            for key, doc in (
                ("bleu_signature", record.bleu_signature),
                ("bucket_doc", record.bucket_doc),
            ):
                if doc:
                    seen.setdefault(key, str(doc))
    return [f"> **{k}**: {v}  " for k, v in seen.items()]


def markdown(
    roots: Sequence[Path],
    runs: Sequence[Run],
    failures: Sequence[Failure],
    rows: Sequence[Row],
    figures: Sequence[Path],
    lr_grids: Sequence[Grid] = (),
    tuned: Path | None = None,
    threshold: float = effective.THRESHOLD,
    *,
    by_group: dict[tuple[str, str], list[Run]],
    across: suite.Grid,
) -> str:
    """The text of ``report.md`` (``threshold``: of the effective lengths, percent;
    ``by_group`` and ``across``: the runs' :func:`groups` and the grid of
    :func:`suite.grid` over them)."""
    out = [
        f"# Sweep report: {', '.join(f'`{r}`' for r in roots)}",
        "",
        f"{len(runs)} finished, {sum(f.status == 'failed' for f in failures)} failed, "
        f"{sum(f.status != 'failed' for f in failures)} missing or unreadable. "
        f"Tables: mean ± 95% confidence interval over seeds, ties with the best in bold; "
        f"`All metrics`: mean, sample std (n-1), CI, n; skipped = NaN (a length the "
        f"encoder cannot run); not finite = an infinite result, never averaged. "
        f"Generated {datetime.now():%Y-%m-%d %H:%M}.",
        "",
    ]
    tasks = sorted({t for t, _ in by_group})
    for task in tasks:
        task_groups = {e: rs for (t, e), rs in by_group.items() if t == task}
        task_rows = [r for r in rows if r.task == task]
        task_runs = [r for rs in task_groups.values() for r in rs]
        out += [f"## {task}", ""]
        if any(r.lr is not None for r in task_runs):
            out += [arm_note(task_runs), ""]
        out += ["Compute (means over runs):", ""]
        out += _table(
            ["encoder", "runs", "params", "tokens/s", "peak MB", "train s"],
            (
                [e, len(rs), *(fmt(task_rows_cost(task_rows, e, k), 6) for k in COST_KEYS)]
                for e, rs in task_groups.items()
            ),
        )
        gated = any(learned_cell(rs) for rs in task_groups.values())
        stepped = gated and any(steps_cell(rs) for rs in task_groups.values())
        out += ["", *_test_table(task_groups, task_rows, gated, stepped)]
        out += [
            "",
            STATS_NOTE + "  ",
            *([LEARNED_NOTE.format(steps=STEPS_NOTE * stepped) + "  "] if gated else []),
            *_notes(task_runs),
            "",
        ]
        out += position_table(task_groups)
        effective_body = effective.table_body(task_groups, threshold)
        if effective_body:
            out += [effective.caption(threshold), ""]
            out += [*_table(effective.HEADER, effective_body), ""]
        out += ["<details><summary>All metrics</summary>", ""]
        out += _table(
            [
                "encoder",
                "metric",
                "mean",
                "std",
                "ci95",
                "n",
                "skipped",
                "not finite",
                "not learned",
                "mark",
                "p vs best",
            ],
            (
                [
                    r.encoder,
                    r.metric,
                    fmt(r.mean, 6),
                    fmt(r.std, 4),
                    fmt(r.ci95, 4),
                    r.n,
                    r.skipped,
                    r.not_finite,
                    r.dropped,
                    r.mark,
                    fmt(r.p, 3),
                ]
                for r in task_rows
            ),
        )
        out += ["", "</details>", ""]
        out += [f"![{p.stem}]({p.name})" for p in figures if _figure_task(p, tasks) == task]
        out += [""]
    drawn = [p for p in figures if p.stem == suite.FIGURE]
    # (task, arm) per table; a task run only at tuned rates keeps its plain name (arm "")
    # but is no shared-rate table
    arms = {
        task: (r.base_task, r.arm or ("tuned_lr" if r.tuned is not None else ""))
        for (task, _), (r, *_) in by_group.items()
    }
    out += suite.section(across, drawn[0] if drawn else None, arms)
    loose = [p for p in figures if _figure_task(p, tasks) is None and p not in drawn]
    if loose:
        out += ["## Overview", "", *[f"![{p.stem}]({p.name})" for p in loose], ""]
    if lr_grids:
        out += ["## Learning rates", ""]
        for g in lr_grids:
            out += [f"### {g.task}", "", *grid_table(g), ""]
        if tuned is not None:
            out += [
                f"The chosen rates are in `{tuned}`; give them to any sweep with "
                f"`+tuned={tuned.parent}`.",
                "",
            ]
    differ = config_differences(runs)
    if differ:
        out += ["## Warning: mixed configs averaged together", "", *[f"- {d}" for d in differ], ""]
    if failures:
        out += ["## Failed and missing runs", ""]
        out += _table(
            ["run", "status", "task", "encoder", "seed", "error"],
            (
                [
                    _rel(f.dir, roots),
                    f.status,
                    f.task,
                    f.encoder,
                    "" if f.seed is None else f.seed,
                    _one_line(f.error),
                ]
                for f in failures
            ),
        )
        out += [""]
    return "\n".join(out)


def position_bands(length: int) -> list[tuple[int, int]]:
    """Positions ``[0, length)`` in bands that double: ``[0, L/16), [L/16, L/8), ...,
    [L/2, L)`` (empty bands of a short length dropped)."""
    edges = [0, *(length >> k for k in (4, 3, 2, 1)), length]
    return [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]


def position_table(task_groups: dict[str, list[Run]]) -> list[str]:
    """Where the loss at the training length sits: each encoder's test loss by position
    band (mean over its runs of the per-position loss in ``metrics.json``), as the
    difference to the encoder with the lowest loss over all positions, whose own row
    holds its losses. A gap even across positions is not about far context; one that
    grows with position is. Empty for tasks whose runs record no loss by position."""
    curves: dict[str, list[list[float]]] = {}
    for e, rs in task_groups.items():
        for r in rs:
            record = r.record
            if not isinstance(record, LMRecord) or record.seq_len is None:
                continue
            length = record.seq_len
            curve = record.loss_by_position.get(MetricName.of("test", "ppl", length))
            if isinstance(curve, list) and len(curve) == length:
                curves.setdefault(e, []).append([float(x) for x in curve])
    if not curves:
        return []
    # One training length per table (the most common; runs of another are left out).
    length = Counter(len(c) for cs in curves.values() for c in cs).most_common(1)[0][0]
    bands = position_bands(length)
    mean: dict[str, list[float]] = {}
    runs: dict[str, int] = {}
    for e, cs in curves.items():
        same = [c for c in cs if len(c) == length]
        if same:
            mean[e] = [sum(sum(c[a:b]) / (b - a) for c in same) / len(same) for a, b in bands]
            runs[e] = len(same)
    widths = [b - a for a, b in bands]
    best = min(mean, key=lambda e: sum(m * w for m, w in zip(mean[e], widths, strict=True)))
    body = [
        [f"**{e}**" if e == best else e, runs[e]]
        + [
            f"{v:.3f}" if e == best else f"{v - w:+.3f}"
            for v, w in zip(ms, mean[best], strict=True)
        ]
        for e, ms in mean.items()
    ]
    return [
        f"Test loss at the training length ({length}) by position, nats/token: the "
        f"lowest encoder's (bold), the others as their difference to it (mean over runs):",
        "",
        *_table(["encoder", "n", *(f"pos {a}-{b - 1}" for a, b in bands)], body),
        "",
    ]


def _figure_task(path: Path, tasks: Sequence[str]) -> str | None:
    """The table a figure belongs to: the longest task name its file name starts with
    (``algo_sort_encdec_...`` is algo_sort_encdec's, not algo_sort's)."""
    found = [t for t in tasks if path.stem.startswith(f"{t}_")]
    return max(found, key=len) if found else None


def _test_table(
    task_groups: dict[str, list[Run]],
    task_rows: Sequence[Row],
    gated: bool = False,
    steps: bool = False,
) -> list[str]:
    """Encoders as rows, test metrics as columns; each context-extension method of an
    encoder is a row of its own (``rope+yarn``) under the plain metric's column. With a
    learnability gate (``gated``), a ``learned`` column (k of n runs); with ``steps`` (a
    run's standing is known), an ``at step`` column (where each met it, by seed)."""
    cells: dict[tuple[str, MetricName], Row] = {}
    extensions: dict[str, set[str]] = {}
    for r in task_rows:
        if r.metric.split_name == "test":
            plain, ext = r.metric.plain, r.metric.extension
            if ext and r.n == 0 and not r.dropped:
                continue  # a method the encoder lacks (all skipped): no row of blanks
            cells[f"{r.encoder}+{ext}" if ext else r.encoder, plain] = r
            extensions.setdefault(r.encoder, set()).add(ext)
    metrics = sorted({m for _, m in cells}, key=MetricName.sort_key)
    single = all(len(rs) == 1 for rs in task_groups.values())
    body = []
    for e, rs in task_groups.items():
        for ext in sorted(extensions.get(e, {""})):
            label = f"{e}+{ext}" if ext else e
            head = [
                label,
                *([learned_cell(rs)] if gated else []),
                *([steps_cell(rs)] if steps else []),
                len(rs),
            ]
            body.append(
                [
                    *head,
                    *(
                        _cell(cells[label, m], len(rs), single) if (label, m) in cells else ""
                        for m in metrics
                    ),
                ]
            )
    names = ["encoder", *(["learned"] if gated else []), *(["at step"] if steps else []), "n"]
    table = _table([*names, *metrics], body)
    return [_test_caption([str(row[0]) for row in body], single), "", *table]


def _test_caption(labels: Sequence[str], one_run_each: bool) -> str:
    """The test table's caption: it explains only the rows the table has (an
    ``encoder+method`` row, where one is there) and says once that each scheme has a
    single run."""
    ext = next((label for label in labels if "+" in label), None)
    notes = [f"`{ext}`: the same runs evaluated with a RoPE context-extension method"] * bool(ext)
    notes += ["one run per scheme: no confidence intervals and no tests"] * one_run_each
    return f"Test metrics ({'; '.join(notes)}):" if notes else "Test metrics:"


def task_rows_cost(rows: Sequence[Row], encoder: str, key: str) -> float | None:
    return next((r.cost.get(key) for r in rows if r.encoder == encoder), None)


def _rel(d: Path, roots: Sequence[Path]) -> str:
    """``d`` relative to the searched directory that holds it (with several, its name
    first)."""
    for root in roots:
        if d == root:
            return "."
        if d.is_relative_to(root):
            rel = str(d.relative_to(root))
            return rel if len(roots) == 1 else f"{root.name}/{rel}"
    return str(d)


@dataclass
class Report:
    """What :func:`build_report` found and wrote."""

    runs: list[Run]
    failures: list[Failure]
    rows: list[Row]
    files: list[Path]


def build_report(
    root: Path | Sequence[Path],
    out: Path | None = None,
    tensorboard: bool = True,
    threshold: float = effective.THRESHOLD,
) -> Report:
    """Collect, aggregate and write the report.

    Args:
        root: Directory to search (recursively), or several (e.g. a same-lr sweep and the
            same sweep with ``+tuned``: one report with a table for each).
        out: Output directory; default ``<root>/report`` (required with several).
        tensorboard: Also write the figures to ``<out>/tb``.
        threshold: Accuracy in percent of the effective lengths
            (:mod:`posenc.report.effective`).

    Returns:
        The runs, failures, rows and the files written.

    Raises:
        FileNotFoundError: A ``root`` is not a directory, or none holds a run.
        ValueError: Several directories and no ``out``, or a threshold outside (0, 100].
    """
    effective.check(threshold)
    roots = [Path(r).resolve() for r in ([root] if isinstance(root, str | Path) else root)]
    for r in roots:
        if not r.is_dir():
            raise FileNotFoundError(f"{r} is not a directory; pass a sweep dir or outputs/")
    if out is None and len(roots) != 1:
        raise ValueError(f"{len(roots)} directories: say where the report goes with --out DIR")
    out = (Path(out) if out is not None else roots[0] / "report").resolve()
    runs: list[Run] = []
    failures: list[Failure] = []
    seen: set[Path] = set()
    for r in roots:
        found, failed = collect(r, exclude=out if out.is_relative_to(r) else None)
        runs += [x for x in found if x.dir not in seen]  # nested roots: each run once
        failures += [x for x in failed if x.dir not in seen]
        seen |= {x.dir for x in found} | {x.dir for x in failed}
    if not runs and not failures:
        where = ", ".join(map(str, roots))
        raise FileNotFoundError(
            f"no runs under {where}: a run's folder holds metrics.json (or error.json if it "
            "failed), e.g. outputs/lm/rope/<date>_<time>_seed0_<id>; pass a sweep dir or outputs/"
        )
    out.mkdir(parents=True, exist_ok=True)
    assign_arms(runs)  # same lr, tuned lr, or one table per rate of a grid
    rows = aggregate(runs)
    lr_grids = grids(runs, failures)
    tuned = write_tuned(lr_grids, out, roots)
    by_group = groups(runs)
    by_table = tables(by_group)
    across_grid = suite.grid(by_table)
    figures = plots.figures(runs, by_group, rows) | suite.figures(across_grid)
    writer = plots.summary_writer(out / "tb") if tensorboard else None
    pngs = plots.save(figures, out, writer)
    text = markdown(
        roots,
        runs,
        failures,
        rows,
        pngs,
        lr_grids,
        tuned,
        threshold,
        by_group=by_group,
        across=across_grid,
    )
    (out / "report.md").write_text(text)
    write_csv(rows, out / "report.csv", {k: learned_cell(rs) for k, rs in by_group.items()})
    lengths, across = out / "effective_length.csv", out / "suite.csv"
    wrote_lengths = effective.write_csv(lengths, by_table, threshold)
    wrote_suite = suite.write_csv(across, across_grid)
    if writer is not None:
        writer.add_text("report/summary", text, 0)  # TensorBoard renders the markdown
        writer.close()
    files = [out / "report.md", out / "report.csv", *([lengths] if wrote_lengths else [])]
    files += [across] if wrote_suite else []
    files += [*([tuned] if tuned else []), *pngs]
    return Report(runs, failures, rows, files)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m posenc.report", description=__doc__)
    parser.add_argument(
        "dir",
        type=Path,
        nargs="+",
        help="sweep directory or outputs/ (searched recursively); several: "
        "one report over all of them (needs --out)",
    )
    parser.add_argument("--out", type=Path, default=None, help="output dir (default <dir>/report)")
    parser.add_argument("--no-tensorboard", action="store_true", help="skip <out>/tb")
    parser.add_argument(
        "--threshold",
        type=float,
        default=effective.THRESHOLD,
        help="accuracy (percent) of the algorithmic tasks' effective lengths: the longest "
        f"tested length up to which a scheme stays at or above it (default "
        f"{effective.THRESHOLD:g})",
    )
    args = parser.parse_args(argv)
    try:
        effective.check(args.threshold)  # before the report folder is made
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    dirs = args.dir
    out = args.out if args.out is not None else dirs[0] / "report"
    made = not out.exists()  # removed again if the report ends in an error
    try:
        # (a missing sweep directory, or several without --out, is build_report's message)
        if all(d.is_dir() for d in dirs) and (len(dirs) == 1 or args.out is not None):
            out.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=out):
                pass
    except OSError as err:
        print(
            f"error: --out {out}: cannot create or write this folder "
            f"({err.strerror or err}); give another --out",
            file=sys.stderr,
        )
        return 2
    try:
        rep = build_report(
            args.dir, args.out, tensorboard=not args.no_tensorboard, threshold=args.threshold
        )
    except (FileNotFoundError, ValueError) as err:
        if made and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        print(f"error: {err}", file=sys.stderr)
        return 2
    status = Counter(f.status for f in rep.failures)
    others = "".join(f", {n} {what}" for what, n in sorted(status.items()))
    print(
        f"{len(rep.runs) + len(rep.failures)} runs: {len(rep.runs)} with results{others}; "
        f"wrote {wrote(rep.files, not args.no_tensorboard)}"
    )
    return 0


def wrote(files: Sequence[Path], tensorboard: bool) -> str:
    """Where the report went, in one line: ``report.md`` (the first of ``files``) by its
    path, the other files beside it by name, the figures counted."""
    tables = [p.name for p in files[1:] if p.suffix != ".png"]
    figures = sum(p.suffix == ".png" for p in files)
    beside = tables + ([f"{figures} figure{'s' * (figures != 1)} (PNG)"] if figures else [])
    if tensorboard and figures:
        beside[-1] += ", also in tb/ for TensorBoard"
    if not beside:
        return str(files[0])
    listed = ", ".join(beside[:-1]) + (" and " if len(beside) > 1 else "") + beside[-1]
    return f"{files[0]}, and beside it {listed}"
