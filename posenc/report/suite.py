"""The algorithmic tasks of one report side by side: a suite's score per task and scheme,
and what training on randomized positions changes.

A run's *score past training* is the mean, over the tested sizes above its largest
training size, of its accuracy at each size (``acc`` of ``by_size``: the % of answer tokens
right), every size weighted alike: the score of Delétang et al. 2023 (mean accuracy over
test lengths 41..500 after training on 1..40), at whatever sizes the runs were trained and
tested. Per task and scheme it is the mean over the seeds that learned the task at their
training sizes (:mod:`posenc.training.gate`); a scheme none of whose runs learned a task
has no score there ("not learned"), never a low one.

Means over tasks compare schemes only over the same tasks: the summary gives each
scheme's mean over the tasks *every* scheme of the table learned, and the lead of the
scheme with the highest mean over each other one there, with its 95% interval over those
tasks and a paired t-test, Holm-corrected over the schemes. For each scheme ``X``
whose runs ``X_rand`` trained on randomized positions (Ruoss et al. 2023) are in the
report too, the change is ``X_rand - X`` over the tasks both learned, with its 95%
interval over those tasks (Student's t): the quantity behind Ruoss et al.'s "+12.0% on
average over the 15 tasks".

Tables of one task at different learning-rate arms (``_same_lr``, ``_tuned_lr``,
``_lr0.001``) are one task, never two: the means, leads and randomized-positions changes
are taken within an arm (the shared-rate tasks together, the tuned ones together), and
each scheme's change from its shared rate to its tuned one (``tuned_lr - same_lr``) has a
table of its own.
"""

from __future__ import annotations

import csv
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from posenc.plots import score_grid_figure
from posenc.report.effective import accuracy_by_length
from posenc.report.stats import ALPHA, ci95, holm, paired_p
from posenc.results import AlgoRecord
from posenc.runs import NOT_LEARNED, Run

#: The label suffix of runs trained on randomized positions (:func:`posenc.schema.result_name`).
RAND = "_rand"
#: With at least this many algorithmic tasks the section sets them side by side (the
#: per-scheme means over the common tasks and the heat map); with one it gives that task's
#: scores alone.
MIN_TASKS = 2
#: The file stem of the section's figure.
FIGURE = "suite_score"


def score(record: AlgoRecord) -> float | None:
    """The run's mean accuracy over its tested sizes above the largest training size
    (each size alike); None when it was tested at none."""
    hi = record.train_lengths[-1] if record.train_lengths else None
    past = [v for n, v in accuracy_by_length(record).items() if hi is not None and n > hi]
    return statistics.fmean(past) if past else None


@dataclass
class Cell:
    """One task x scheme: the scores of the runs that count (learned, or no verdict) and
    how many runs there were."""

    scores: list[float]
    runs: int

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.scores) if self.scores else None

    @property
    def half(self) -> float | None:
        """The 95% interval's half-width over the seeds counted (None below two)."""
        return ci95(self.scores)


def _learned(c: Cell | None) -> bool:
    return c is not None and bool(c.scores)


def _mean(c: Cell | None) -> float:
    """The mean of a cell known to have scores."""
    assert c is not None and c.mean is not None
    return c.mean


#: Task -> scheme -> its cell.
Grid = dict[str, dict[str, Cell]]


def grid(tables: Mapping[str, Mapping[str, Sequence[Run]]]) -> Grid:
    """The cells of every algorithmic task with runs tested past training (empty when there
    is none)."""
    out: Grid = {}
    for task, by_encoder in tables.items():
        row, tested = {}, False
        for encoder, rs in by_encoder.items():
            scored = [(r, score(r.record)) for r in rs if isinstance(r.record, AlgoRecord)]
            if not scored:
                continue
            tested |= any(s is not None for _, s in scored)
            counted = [s for r, s in scored if s is not None and r.learned != NOT_LEARNED]
            row[encoder] = Cell(counted, len(scored))
        if tested:
            out[task] = row
    return out


def encoders(g: Grid) -> list[str]:
    """The schemes of the grid in the order the report's tables give them, except that
    each randomized-positions scheme ``X_rand`` whose ``X`` is there comes last, in the
    order of the ``X``s."""
    seen: dict[str, None] = {}
    for row in g.values():
        seen.update(dict.fromkeys(row))
    paired = [e + RAND for e in seen if e + RAND in seen]
    return [e for e in seen if e not in paired] + paired


def common_tasks(g: Grid, names: Sequence[str]) -> list[str]:
    """The tasks every scheme of ``names`` learned (in at least one seed)."""
    return [t for t, row in g.items() if all(_learned(row.get(e)) for e in names)]


@dataclass
class Change:
    """``X_rand - X`` over the tasks both learned."""

    encoder: str
    diffs: list[float]
    tasks: list[str]


def changes(g: Grid) -> list[Change]:
    """Each scheme with a randomized partner in the grid, and its change."""
    names = encoders(g)
    out = []
    for plain in [e for e in names if e + RAND in names]:
        rand = plain + RAND
        both = common_tasks(g, [plain, rand])
        diffs = [_mean(g[t][rand]) - _mean(g[t][plain]) for t in both]
        out.append(Change(plain, diffs, both))
    return out


#: The arms whose tables hold each scheme at one rate shared by all ("": a task whose runs
#: all share one rate) and at its own tuned rate (:func:`posenc.report.tune.assign_arms`).
SHARED, TUNED = ("", "same_lr"), "tuned_lr"


def _arm_text(arm: str) -> str:
    """``one rate shared by every scheme``, ``lr 0.001``: an arm as the section names it."""
    named = {"same_lr": "one rate shared by every scheme", TUNED: "each scheme's tuned rate"}
    return named.get(arm, arm.replace("lr", "lr ", 1))


def arm_groups(g: Grid, arms: Mapping[str, tuple[str, str]]) -> dict[str, list[str]]:
    """The grid's tables by learning-rate arm (``arms``: table -> (task, arm)), the
    shared-rate ones under ``same_lr``: tables whose means and leads may be taken together."""
    out: dict[str, list[str]] = {}
    for t in g:
        arm = arms.get(t, ("", ""))[1]
        out.setdefault("same_lr" if arm in SHARED else arm, []).append(t)
    return out


def tuned_changes(g: Grid, arms: Mapping[str, tuple[str, str]]) -> list[Change]:
    """Each scheme's change from the shared rate to its tuned one, ``tuned_lr - same_lr``,
    over the tasks with both tables where it learned at both; empty without such a task."""
    pairs: dict[str, dict[str, str]] = {}
    for t in g:
        task, arm = arms.get(t, ("", ""))
        if arm in ("same_lr", TUNED):
            pairs.setdefault(task, {})[arm] = t
    both = [(p["same_lr"], p[TUNED]) for p in pairs.values() if len(p) == 2]
    out = []
    for e in encoders(g) if both else []:
        learned = [(s, t) for s, t in both if _learned(g[s].get(e)) and _learned(g[t].get(e))]
        diffs = [_mean(g[t][e]) - _mean(g[s][e]) for s, t in learned]
        out.append(Change(e, diffs, [arms[t][0] for _, t in learned]))
    return out


def _change_table(head: str, moved: Sequence[Change]) -> list[str]:
    """A change table: per scheme the tasks counted, the mean change with its 95% interval
    over them, and how many tasks moved up and down."""
    out = ["", head, "", "| scheme | tasks both learned | change | better | worse |"]
    out.append("|---|---|---|---|---|")
    for c in moved:
        out.append(
            f"| {c.encoder} | {len(c.tasks)} | {_pm(c.diffs)} | "
            f"{sum(d > 0 for d in c.diffs)} | {sum(d < 0 for d in c.diffs)} |"
        )
    return out


def _counted(c: Cell | None) -> str:
    """``k/n`` when only k (one or more) of the cell's n runs count, else ""."""
    if c is None or not c.scores or len(c.scores) == c.runs:
        return ""
    return f"{len(c.scores)}/{c.runs}"


def figures(g: Grid) -> dict[str, Figure]:
    """The section's figure by file stem (:data:`FIGURE`; none for an empty grid): the
    table's cells as a heat map, tasks by schemes, each cell its mean score and ``k/n``
    where only k of n runs learned; a task no run of a scheme learned is grey. None for
    fewer than :data:`MIN_TASKS` tasks (one task's cells are its table's one row)."""
    if len(g) < MIN_TASKS:
        return {}
    names = encoders(g)
    cells = [[row.get(e) for e in names] for row in g.values()]
    scores = [[_mean(c) if _learned(c) else None for c in row] for row in cells]
    notes = [[_counted(c) for c in row] for row in cells]
    fig = score_grid_figure(
        [t.removeprefix("algo_") for t in g],
        names,
        scores,
        notes,
        "Score past training (% of answer tokens): mean over the seeds that learned; "
        "k/n: k of n learned; grey: none did",
    )
    return {FIGURE: fig}


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:.1f}"


def _cell(c: Cell | None) -> str:
    """A task x scheme cell: the score, ``± half`` its 95% interval over two or more seeds,
    and ``(k/n)`` when only k of its n runs learned."""
    if c is None:
        return ""
    if not c.scores:
        return "not learned"
    half = "" if c.half is None else f" ± {c.half:.1f}"
    counted = _counted(c)
    return _pct(c.mean) + half + (f" ({counted})" if counted else "")


def _pm(values: Sequence[float]) -> str:
    if not values:
        return "no task"
    half = ci95(values)
    mean = statistics.fmean(values)
    return f"{mean:+.1f}" + ("" if half is None else f" ± {half:.1f}")


def _why_not_common(row: Mapping[str, Cell], names: Sequence[str]) -> str:
    """``selective: not learned; fox: not run``: the schemes that keep a task out of the
    common tasks."""
    return "; ".join(
        f"{e}: {'not run' if row.get(e) is None else 'not learned'}"
        for e in names
        if not _learned(row.get(e))
    )


@dataclass
class Leads:
    """The schemes over their common tasks: each one's mean there, the scheme with the
    highest (``best``: the first in order on a tie; None without a common task or with one
    scheme), and, for each other scheme, the per-task differences (best minus it) and the
    Holm-adjusted p of their paired t-test (None below two tasks)."""

    common: list[str]
    means: dict[str, float]
    best: str | None
    diffs: dict[str, list[float]]
    p: dict[str, float | None]


def leads(g: Grid, names: Sequence[str]) -> Leads:
    """:class:`Leads` of ``names`` over the tasks all of them learned; Holm's correction is
    taken over every scheme the best is tested against."""
    common = common_tasks(g, names)
    if not common:
        return Leads(common, {}, None, {}, {})
    means = {e: statistics.fmean(_mean(g[t][e]) for t in common) for e in names}
    if len(names) < 2:
        return Leads(common, means, None, {}, {})
    best = max(names, key=lambda e: means[e])
    diffs = {e: [_mean(g[t][best]) - _mean(g[t][e]) for t in common] for e in names if e != best}
    raw = {e: paired_p(d) for e, d in diffs.items()}
    adjusted = holm({e: p for e, p in raw.items() if p is not None})
    return Leads(common, means, best, diffs, {e: adjusted.get(e) for e in diffs})


def _p_text(p: float | None) -> str:
    """``0.043 (lead)``, ``0.052 (tie)``: the verdict beside the rounded p, which can read
    0.050 for a p just under the threshold; ``untested`` for None."""
    if p is None:
        return "untested"
    return f"{p:.3f} ({'lead' if p < ALPHA else 'tie'})"


def _per_scheme(g: Grid, names: Sequence[str], arm: str = "") -> list[str]:
    """The per-scheme table of the section: the tasks each scheme learned and its runs
    counted, its mean over the common tasks, and the best scheme's lead over it there
    (``arm``: the learning-rate arm its tables share, named in the text when given)."""
    found = leads(g, names)
    common, best = found.common, found.best
    n = len(common)
    text = (
        (f"At {_arm_text(arm)} (tables `{arm}`). " if arm else "")
        + f"Per scheme: the tasks it learned (of {len(g)}), its runs counted (those that "
        f"learned, of its runs), and its mean score over the {n} "
        f"{'task' if n == 1 else 'tasks'} every scheme here learned"
        + (f" ({', '.join(common)})" if common else "")
        + "."
    )
    left_out = {t: _why_not_common(row, names) for t, row in g.items() if t not in common}
    if left_out:
        text += " Not common: " + ", ".join(f"{t} ({why})" for t, why in left_out.items()) + "."
    if best is not None:
        text += (
            f" `{best}` has the highest mean there. Its lead over a scheme is the mean of the "
            "per-task differences of their scores, with its 95% interval over those tasks "
            "(not corrected for the number of schemes). p is the paired t-test's p-value, "
            "Holm-corrected over the schemes: a lead where p < "
            f"{ALPHA}, a tie otherwise, untested below two tasks. The best is picked from the "
            "same scores, so the tests favour it a little."
        )
    out = ["", text, ""]
    if best is None:
        out += ["| scheme | tasks learned | runs counted | mean over the common tasks |"]
        out += ["|---|---|---|---|"]
    else:
        out += [
            "| scheme | tasks learned | runs counted | mean over the common tasks | "
            f"lead of `{best}` (points) | p (paired t, Holm) |",
            "|---|---|---|---|---|---|",
        ]
    for e in names:
        cells = [c for row in g.values() if (c := row.get(e)) is not None]
        runs = f"{sum(len(c.scores) for c in cells)}/{sum(c.runs for c in cells)}"
        head = f"| {e} | {sum(_learned(c) for c in cells)} | {runs} | "
        mean = _pct(found.means[e]) if common else "no common task"
        if best is None:
            out.append(f"{head}{mean} |")
        elif e == best:
            out.append(f"{head}{mean} | best | |")
        else:
            out.append(f"{head}{mean} | {_pm(found.diffs[e])} | {_p_text(found.p[e])} |")
    return out


def section(
    g: Grid, figure: Path | None = None, arms: Mapping[str, tuple[str, str]] | None = None
) -> list[str]:
    """The markdown of the section (empty for an empty grid), with ``figure`` (the
    written :func:`figures`) under its table; ``arms``: each table's (task, learning-rate
    arm), so that means and leads stay within an arm (:func:`arm_groups`)."""
    if not g:
        return []
    arms = arms or {}
    names = encoders(g)
    side_by_side = len(g) >= MIN_TASKS
    out = [
        "## Across the tasks" if side_by_side else "## Score past training",
        "",
        "Score past training: a run's mean accuracy (`acc`, % of answer tokens) over the "
        "tested sizes above its largest training size, every size alike (Delétang et al. "
        "2023's score); per task and scheme the mean over the seeds that learned the task, "
        "± its 95% interval over them where two or more did, and `(k/n)` where k of n "
        "did (`not learned`: none did; never a score).",
        "",
        "| task | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for task, row in g.items():
        out.append(f"| {task} | " + " | ".join(_cell(row.get(e)) for e in names) + " |")
    if figure is not None:
        out += ["", f"![{figure.stem}]({figure.name})"]
    grouped = arm_groups(g, arms)
    for arm, tables in grouped.items():
        if len(tables) >= MIN_TASKS:
            label = arm if len(grouped) > 1 else ""
            out += _per_scheme({t: g[t] for t in tables}, names, label)
    for arm, tables in grouped.items():
        moved = changes({t: g[t] for t in tables})
        if moved:
            head = (
                "Randomized positions (Ruoss et al. 2023): `X_rand - X`, score points, mean "
                "over the tasks both learned with its 95% interval over those tasks; better "
                "and worse count the tasks"
                + (f"; at {_arm_text(arm)} (tables `{arm}`)." if len(grouped) > 1 else ".")
            )
            out += _change_table(head, moved)
    tuned = tuned_changes(g, arms)
    if tuned:
        head = (
            "Tuned rates: `tuned_lr - same_lr`, each scheme's score at its tuned rate "
            "minus its score at the rate shared by every scheme, score points, mean over "
            "the tasks where it learned at both with its 95% interval over those tasks; "
            "better and worse count the tasks."
        )
        out += _change_table(head, tuned)
    return [*out, ""]


def write_csv(path: Path, g: Grid) -> bool:
    """``suite.csv``: one row per task x scheme (score mean, its 95% interval's half-width
    over the seeds counted, the seeds counted, the runs), in full precision as
    ``report.csv`` (a rounded ``44.5`` could be the figure's 44 or 45); False (nothing
    written) for an empty grid."""
    if not g:
        return False
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["task", "encoder", "score_past_training", "ci95", "runs_counted", "runs"])
        for task, row in g.items():
            for e, c in row.items():
                mean, half = ("" if x is None else repr(x) for x in (c.mean, c.half))
                w.writerow([task, e, mean, half, len(c.scores), c.runs])
    return True
