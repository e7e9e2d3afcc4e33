"""Learning rates in the sweep report: which runs share a rate ("same lr"), which took a
tuned one ("tuned lr"), and, for a sweep with a grid of rates, which rate each scheme does
best with on validation at the training length (written to ``tuned_lr.yaml``,
:mod:`posenc.tuned`).

Only validation metrics at the training length choose: ``val/loss`` (the language model's
and the algorithmic tasks' teacher-forced loss on the validation split at the training
length or sizes); ``val/bleu`` for translation; among rates that tie, the step at which
the runs met the learnability gate (validation at the training length too). No test metric
and no length beyond the training one ever enters the choice.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posenc.report.stats import ci95
from posenc.results import MetricName, task_key
from posenc.runs import Failure, Run, encoder_key, finite_values

#: Per task (its name in metrics.json): the validation metric that chooses a rate, and
#: whether lower is better. MT's BLEU of the validation sentences when logged, else loss.
VAL_LOSS, VAL_BLEU = MetricName.of("val", "loss"), MetricName.of("val", "bleu")
CRITERIA: dict[str, list[tuple[MetricName, bool]]] = {
    "lm": [(VAL_LOSS, True)],
    "algo": [(VAL_LOSS, True)],
    "mt": [(VAL_BLEU, False), (VAL_LOSS, True)],
}
#: Mean losses at or below this are equal: near zero, float32 resolves a token's loss only
#: in steps of log(1 + 2**-23) ~ 1.2e-7, so under 1e-6 a loss says "every token right" and
#: no more (a task the models fit perfectly at the training length, e.g. reversing a string).
LOSS_FLOOR = 1e-6


def lr_text(lr: float | None) -> str:
    """``0.001``, ``0.0003``: a rate as the config shows it."""
    return "?" if lr is None else f"{lr:g}"


def assign_arms(runs: Sequence[Run]) -> None:
    """Set each run's :attr:`Run.arm` so that no report table mixes learning rates.

    Per task: runs with ``+tuned`` form ``tuned_lr``; the others one arm per rate
    (``lr0.001``), or ``same_lr`` when they all share one. A task with one arm only keeps
    its plain name (no suffix), as before tuning existed.
    """
    by_task: dict[str, list[Run]] = {}
    for r in runs:
        by_task.setdefault(r.base_task, []).append(r)
    for rs in by_task.values():
        rates = {r.lr for r in rs if r.tuned is None}
        tuned = any(r.tuned is not None for r in rs)
        if len(rates) + tuned <= 1:
            for r in rs:
                r.arm = ""
            continue
        for r in rs:
            if r.tuned is not None:
                r.arm = "tuned_lr"
            elif len(rates) == 1:
                r.arm = "same_lr"
            else:
                r.arm = f"lr{lr_text(r.lr)}"


def arm_note(runs: Sequence[Run]) -> str:
    """One line saying which learning rates a table's runs used."""
    tuned = [r for r in runs if r.tuned is not None]
    if tuned:
        chosen = {r.encoder: lr_text(r.lr) for r in tuned}
        files = sorted({str(r.tuned.get("file")) for r in tuned if r.tuned})
        order = sorted(chosen.items(), key=lambda kv: encoder_key(kv[0]))
        shown = ", ".join(f"{e} {lr}" for e, lr in order)
        return f"Tuned lr: each scheme's own rate ({shown}), from {', '.join(files)}."
    same = sorted({lr_text(r.lr) for r in runs})
    return f"Same lr: task.optim.lr = {', '.join(same)} for every scheme."


@dataclass
class GridCell:
    """One encoder at one rate of the grid: the criterion's values over seeds, and how
    many of its runs left none (failed, killed, or a criterion that is not finite)."""

    values: list[float]
    failed: int = 0
    #: The step at which each run met the learnability gate (None: no gate, or never met).
    learned_steps: list[int | None] = field(default_factory=list)
    #: Whether each run met the gate at its last validation (None: no gate, or unknown).
    learned: list[bool | None] = field(default_factory=list)

    @property
    def none_learned(self) -> bool:
        """Whether it has runs under a gate and not one of them learned."""
        return bool(self.learned) and all(v is False for v in self.learned)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def learned_at(self) -> float:
        """The mean step at which its runs met the gate (inf unless every run met it)."""
        steps = self.learned_steps
        if not steps or any(s is None for s in steps):
            return math.inf
        return statistics.fmean(s for s in steps if s is not None)


@dataclass
class Grid:
    """The learning-rate grid of one task: criterion, rates, cells and choices."""

    task: str
    metric: MetricName
    lower: bool
    rates: list[float]
    cells: dict[str, dict[float, GridCell]]
    chosen: dict[str, float]
    #: Per encoder, the rates that tied on the criterion with its choice (more than one).
    tied: dict[str, list[float]] = field(default_factory=dict)
    #: The training steps of its runs (where recorded), and how many of them the
    #: learnability gate ended early (``task.learned.stop``, once they learned).
    steps: list[int] = field(default_factory=list)
    stopped: int = 0
    #: How its jobs named their scheme (``encoder`` or ``+variant``), for the widening hint.
    arm_key: str = "encoder"

    def failed(self, encoder: str) -> list[float]:
        """The rates at which some run of ``encoder`` failed."""
        return [lr for lr, c in sorted(self.cells.get(encoder, {}).items()) if c.failed]

    def chosen_from(self, encoder: str) -> list[float]:
        """The rates of ``encoder`` with a result: those its choice was made from."""
        return [lr for lr, c in sorted(self.cells.get(encoder, {}).items()) if c.values]

    def incomplete(self) -> list[str]:
        """Encoders with a choice made while some of their runs failed."""
        return [e for e in self.chosen if self.failed(e)]

    def rates_of(self, encoder: str) -> list[float]:
        """The rates ``encoder`` ran at (with a result or failed): its own grid, which a
        wider grid for other encoders does not widen."""
        return sorted(self.cells.get(encoder, {}))

    def at_edge(self) -> list[str]:
        """Encoders whose chosen rate is the smallest or largest of their own grid: a wider
        grid might do better for them."""
        out = []
        for e, lr in self.chosen.items():
            own = self.rates_of(e)
            if len(own) > 1 and lr in (own[0], own[-1]):
                out.append(e)
        return out

    def beyond_edges(self, rates: Sequence[float] | None = None) -> dict[float, float]:
        """The next rate past each end of the grid (or of ``rates``), one grid step on (its
        rates are geometric: 3e-4, 1e-3, 3e-3 -> 1e-4 below, 1e-2 above): ``{end: beyond}``."""
        r = sorted(self.rates if rates is None else rates)
        if len(r) < 2:
            return {}
        up, down = r[-1] ** 2 / r[-2], r[0] ** 2 / r[1]  # the last step once more
        if len(r) > 2 and math.isclose(r[-1] / r[-3], 10, rel_tol=0.1):
            up = r[-2] * 10  # steps alternating within a decade (3e-4, 1e-3, 3e-3)
        if len(r) > 2 and math.isclose(r[2] / r[0], 10, rel_tol=0.1):
            down = r[1] / 10
        return {r[0]: float(f"{down:.3g}"), r[-1]: float(f"{up:.3g}")}


def grids(runs: Sequence[Run], failures: Sequence[Failure] = ()) -> list[Grid]:
    """The learning-rate grid of each task whose untuned runs of some encoder used more
    than one rate (e.g. ``sweep=lr_tune``), with each encoder's choice: the rate with the
    best mean criterion over its runs (:func:`choose`). ``failures`` (jobs without results)
    count as failed runs at their rate (:func:`failure_point`)."""
    lost = [p for p in map(failure_point, failures) if p is not None]
    by_task: dict[str, list[Run]] = {}
    for r in runs:
        if r.tuned is None and r.lr is not None:
            by_task.setdefault(r.base_task, []).append(r)
    out = []
    for task, rs in sorted(by_task.items()):
        per_encoder: dict[str, set[float]] = {}
        for r in rs:
            per_encoder.setdefault(r.encoder, set()).add(r.lr)  # type: ignore[arg-type]
        for where, encoder, lr in lost:
            if where == task:
                per_encoder.setdefault(encoder, set()).add(lr)
        if all(len(v) < 2 for v in per_encoder.values()):
            continue
        metric, lower = _criterion(rs)
        cells: dict[str, dict[float, GridCell]] = {}
        for r in rs:
            values, not_finite = finite_values([r.record.metrics.get(metric)])
            cell = cells.setdefault(r.encoder, {}).setdefault(r.lr, GridCell([]))  # type: ignore[arg-type]
            cell.values += values
            cell.failed += not_finite
            cell.learned_steps.append(r.record.learned_step)
            cell.learned.append(r.record.learned)
        for where, encoder, lr in lost:
            if where == task:
                cells.setdefault(encoder, {}).setdefault(lr, GridCell([])).failed += 1
        cells = dict(sorted(cells.items(), key=lambda kv: encoder_key(kv[0])))
        rates = sorted({lr for by_rate in cells.values() for lr in by_rate})
        chosen, tied = {}, {}
        for encoder, by_rate in cells.items():
            choice = choose(by_rate, lower)
            if choice is not None:
                chosen[encoder], ties = choice
                if len(ties) > 1:
                    tied[encoder] = ties
        steps = [r.record.train_steps for r in rs if r.record.train_steps is not None]
        stopped = sum(_gate_stopped(r, max(steps, default=0)) for r in rs)
        key = "+variant" if any(map(_given_variant, rs)) else "encoder"
        out.append(Grid(task, metric, lower, rates, cells, chosen, tied, steps, stopped, key))
    return out


def _given_variant(run: Run) -> bool:
    """Whether the job chose its scheme with ``+variant=`` (its ``.hydra/overrides.yaml``),
    as the sweep presets' arms do: a wider grid names the schemes the same way."""
    try:
        given = (run.dir / ".hydra" / "overrides.yaml").read_text()
    except OSError:
        return False
    return any(
        line.lstrip("- ").startswith(("+variant=", "variant=")) for line in given.splitlines()
    )


def choose(by_rate: dict[float, GridCell], lower: bool) -> tuple[float, list[float]] | None:
    """One encoder's rate and the rates that tied with it: the best mean criterion, where
    losses at or below :data:`LOSS_FLOOR` are equal; among tied rates, the one whose runs
    met the learnability gate earliest (mean step), then the one farthest from the ends of
    the encoder's own grid (so a tie at equal steps never asks for a wider grid), then the
    smaller. None: no rate has a result."""
    scored = {lr: c.mean for lr, c in by_rate.items() if c.mean is not None}
    if not scored:
        return None
    level = {lr: max(m, LOSS_FLOOR) if lower else -m for lr, m in scored.items()}
    best = min(level.values())
    ties = sorted(lr for lr, v in level.items() if v == best)

    rates = sorted(by_rate)  # its own grid, failed rates included

    def inner(lr: float) -> int:
        i = rates.index(lr)
        return min(i, len(rates) - 1 - i)

    pick = min(ties, key=lambda lr: (by_rate[lr].learned_at, -inner(lr), lr))
    return pick, ties


def _gate_stopped(run: Run, longest: int) -> bool:
    """Whether the learnability gate ended ``run`` before ``longest`` steps (the most any
    run of its grid trained)."""
    rec = run.record
    gate, steps = rec.gate, rec.train_steps
    return bool(gate and gate.stop and rec.learned_step is not None and steps and steps < longest)


def failure_point(failure: Failure) -> tuple[str, str, float] | None:
    """``(task table, encoder, lr)`` of a job that left no result, from its job record
    (``.hydra/config.yaml``), else from the overrides in its ``error.json``; None for a
    job with ``+tuned`` (not part of a grid) or one that cannot be placed."""
    from omegaconf import OmegaConf

    try:
        cfg: Any = OmegaConf.to_container(OmegaConf.load(failure.dir / ".hydra" / "config.yaml"))
    except Exception:  # no record (refused before it was written) or a damaged one
        cfg = _config_from_overrides(failure)
    if not isinstance(cfg, dict) or cfg.get("tuned") is not None:
        return None
    task = cfg.get("task") or {}
    lr = ((task.get("optim") or {}) if isinstance(task, dict) else {}).get("lr")
    name = task.get("name") if isinstance(task, dict) else None
    if name is None or isinstance(lr, bool) or not isinstance(lr, int | float):
        return None
    encoder = failure.encoder
    if (cfg.get("model") or {}).get("random_positions"):
        encoder += "_rand"  # as posenc.schema.result_name names it
    return task_key(str(name), task.get("problem"), task.get("shape")), encoder, float(lr)


def _config_from_overrides(failure: Failure) -> dict[str, Any] | None:
    """The little of a failed job's config its ``error.json`` overrides say: ``tuned``,
    ``task.name`` (its task choice), ``task.optim.lr``, ``task.problem``, ``task.shape``
    and ``model.random_positions``."""
    import json

    from omegaconf import OmegaConf

    try:
        overrides = json.loads((failure.dir / "error.json").read_text()).get("overrides") or []
        given = dict(str(o).lstrip("+~").partition("=")[::2] for o in overrides)
        cfg = OmegaConf.from_dotlist(
            [f"{k}={v}" for k, v in given.items() if k.startswith(("task.", "model.", "tuned"))]
        )
        out = OmegaConf.to_container(cfg)
    except Exception:  # unreadable: the failure stays listed, just not at a rate
        return None
    assert isinstance(out, dict)
    out.setdefault("task", {})["name"] = failure.task
    return {str(k): v for k, v in out.items()}


def _criterion(runs: Sequence[Run]) -> tuple[MetricName, bool]:
    """The first criterion of the task's list that every run logged."""
    options = CRITERIA.get(runs[0].record.task, [(VAL_LOSS, True)])
    for metric, lower in options:
        if all(metric in r.record.metrics for r in runs):
            return metric, lower
    return options[-1]


def grid_table(grid: Grid) -> list[str]:
    """Markdown: encoders by rates, the criterion's mean ± 95% CI (n), the choice in bold."""
    direction = "lowest" if grid.lower else "highest"
    lines = [
        f"Learning-rate grid: {grid.metric} (validation at the training length; {direction} "
        f"mean over seeds chooses; mean ± 95% CI, n):",
        "",
        "| encoder | " + " | ".join(f"lr {lr_text(lr)}" for lr in grid.rates) + " | chosen |",
        "|" + "---|" * (len(grid.rates) + 2),
    ]
    for encoder, by_rate in grid.cells.items():
        row = [encoder]
        for lr in grid.rates:
            cell = by_rate.get(lr)
            if cell is None or cell.mean is None:
                row.append(f"failed ({cell.failed})" if cell and cell.failed else "")
                continue
            half = ci95(cell.values)
            text = f"{cell.mean:.4g}" + ("" if half is None else f" ± {half:.2g}")
            text += f" (n={len(cell.values)}" + (f", {cell.failed} failed" if cell.failed else "")
            if lr in grid.tied.get(encoder, ()):
                at = cell.learned_at
                text += f", tie, gate at {at:.0f}" if math.isfinite(at) else ", tie, gate not met"
            text += ")"
            row.append(f"**{text}**" if grid.chosen.get(encoder) == lr else text)
        partial = " (incomplete grid)" if encoder in grid.chosen and grid.failed(encoder) else ""
        row.append(lr_text(grid.chosen.get(encoder)) + partial)
        lines.append("| " + " | ".join(row) + " |")
    lines += _tie_note(grid) + _incomplete_note(grid) + _steps_note(grid) + _unlearned_note(grid)
    edge = grid.at_edge()
    if edge:
        lines += [
            "",
            f"> Chosen at the edge of the grid: {', '.join(edge)}; a wider grid may suit "
            f"{'it' if len(edge) == 1 else 'them'} better.",
        ]
        wider: dict[float, list[str]] = {}
        for e in edge:  # past the end of each one's own grid
            beyond = grid.beyond_edges(grid.rates_of(e))[grid.chosen[e]]
            wider.setdefault(beyond, []).append(e)
        for beyond, names in sorted(wider.items()):
            lines.append(
                f"> Widen it ({', '.join(names)}): `python run.py -m <the same sweep> "
                f"{grid.arm_key}={','.join(names)} task.optim.lr={lr_text(beyond)}`, then one "
                f"report over both sweep directories."
            )
    return lines


def _tie_note(grid: Grid) -> list[str]:
    """A line naming the encoders whose criterion tied at several rates, and how the tie
    was broken."""
    if not grid.tied:
        return []
    each = "; ".join(f"{e} ({', '.join(map(lr_text, lrs))})" for e, lrs in grid.tied.items())
    floor = f" (losses at or below {LOSS_FLOOR:g} count as equal)" if grid.lower else ""
    return [
        "",
        f"> Tied on {grid.metric}{floor}: {each}. Among tied rates the one whose runs met "
        f"the learnability gate at the earliest step (mean over seeds) chose, then the one "
        f"farthest from the grid's ends, then the smaller.",
    ]


def _unlearned_note(grid: Grid) -> list[str]:
    """A line naming the encoders chosen at a rate where none of their runs learned (met
    the learnability gate at the last validation), and where they did learn if anywhere:
    the choice stands on the criterion alone, and runs at that rate are likely to be left
    out of the report's columns past the training length."""
    each = []
    for e, lr in grid.chosen.items():
        if grid.cells[e][lr].none_learned:
            elsewhere = [r for r, c in sorted(grid.cells[e].items()) if any(c.learned)]
            where = ", ".join(map(lr_text, elsewhere))
            each.append(f"{e} ({f'its runs learned at {where}' if where else 'at no rate'})")
    if not each:
        return []
    return [
        "",
        f"> Chosen at a rate where no run learned (the learnability gate at the last "
        f"validation): {'; '.join(each)}. The choice is the best {grid.metric} all the same; "
        f"runs at it that do not learn are left out of the columns past the training length.",
    ]


def _incomplete_note(grid: Grid) -> list[str]:
    """Lines saying which choices were made while some of the grid failed."""
    names = grid.incomplete()
    if not names:
        return []
    each = "; ".join(f"{e} at {', '.join(lr_text(lr) for lr in grid.failed(e))}" for e in names)
    return [
        "",
        f"> Chosen from an incomplete grid (runs failed: {each}): the best rate may be "
        f"among those. `+tuned` refuses these choices unless `+tuned_allow_partial=true`; "
        f"rerun the failed jobs, then one report over both sweep directories.",
    ]


def _steps_note(grid: Grid) -> list[str]:
    """A line saying the grid's runs trained for different numbers of steps, so their
    criterion was not taken at one point of training."""
    if len(set(grid.steps)) < 2:
        return []
    why = (
        f"; the learnability gate stopped {grid.stopped} of the {len(grid.steps)} once they learned"
        if grid.stopped
        else ""
    )
    return [
        "",
        f"> Its runs trained for different numbers of steps ({min(grid.steps)} to "
        f"{max(grid.steps)}{why}): {grid.metric} was not taken at one point of training, so "
        f"the choice compares unlike runs. For a rate choice, train every run of the grid to "
        f"the same cap (`task.learned.stop=false`).",
    ]


def tuned_file(grids_: Sequence[Grid]) -> dict[str, dict[str, object]]:
    """The ``tasks`` block of ``tuned_lr.yaml`` (:func:`posenc.tuned.write`)."""
    return {
        g.task: {
            "criterion": f"{g.metric} ({'lowest' if g.lower else 'highest'} mean over seeds, "
            f"validation at the training length)",
            "grid": g.rates,
            "lr": dict(g.chosen),
            "at_edge": g.at_edge(),
            "tied": dict(g.tied),
            "chosen_from": {e: g.chosen_from(e) for e in g.chosen},
            "failed": {e: g.failed(e) for e in g.chosen},
        }
        for g in grids_
        if g.chosen
    }


def write_tuned(grids_: Sequence[Grid], out: Path, sweep: Sequence[Path]) -> Path | None:
    """Write ``<out>/tuned_lr.yaml`` when there is a grid (returns its path, else None)."""
    # posenc.tuned checks configs (torch, Lightning): only when a report writes the file,
    # so the report reads run folders without them.
    from posenc.tuned import FILE, write

    tasks = tuned_file(grids_)
    if not tasks:
        return None
    write(out / FILE, tasks, sweep)
    return out / FILE
