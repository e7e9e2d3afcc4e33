"""Learning rates tuned alike for every scheme: the file the report writes from a sweep with
a learning-rate grid (``tuned_lr.yaml``), and ``+tuned=<report dir>``, which gives each
run its scheme's rate from it.

The report (:mod:`posenc.report.tune`) picks, per task and encoder, the grid rate with the
best mean validation metric at the training length (never a length beyond it) and writes
it here. A run given ``+tuned=<dir or file>`` sets ``task.optim.lr`` to its encoder's rate
before its config is checked and records where it came from in ``tuned`` (the report
then shows it under "tuned lr")::

    python run.py -m sweep=lr_tune                         # the grid
    python -m posenc.report outputs/multirun/<lr_tune dir> # -> <dir>/report/tuned_lr.yaml
    python run.py -m sweep=lm_extrapolation +tuned=outputs/multirun/<lr_tune dir>/report

``+tuned`` (a key the composed config lacks, added by the command) rather than a config
group: the rates live in a file a sweep produced, not in ``conf/``, and one key names it.

The file records, per scheme, the rates its choice was made from (``chosen_from``) and the
rates whose runs failed (``failed``). A choice made while a rate of its grid failed may
not be the best rate at all, so ``+tuned`` refuses it unless ``+tuned_allow_partial=true``.
Files written before that record load with a note and count as complete.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from posenc.errors import ConfigError
from posenc.results import task_key
from posenc.schema import result_name

log = logging.getLogger(__name__)

#: The file name in a report directory, and its format tag.
FILE = "tuned_lr.yaml"
FORMAT = "posenc-tuned-lr/1"
REMAKE = "make one with python -m posenc.report <dir of a sweep with an lr grid, sweep=lr_tune>"


def locate(source: str) -> Path:
    """The tuned-lr file that ``+tuned=<source>`` names: a report directory holding
    :data:`FILE`, or the file itself.

    Raises:
        ConfigError: Nothing there, or a directory without the file.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / FILE).is_file():
            raise ConfigError(f"tuned={source}: no {FILE} in that directory; {REMAKE}")
        return (path / FILE).resolve()
    if not path.is_file():
        raise ConfigError(
            f"tuned={source}: no such file or directory; give the report directory that "
            f"holds {FILE}, or the file itself ({REMAKE})"
        )
    return path.resolve()


@dataclass
class TunedRates:
    """A tuned-lr file's contents.

    Attributes:
        rates: ``{task: {encoder: lr}}``.
        failed: ``{task: {encoder: [rates whose runs failed]}}``; a task is missing when
            its entry predates this record (its completeness is unknown).
        chosen_from: ``{task: {encoder: [rates with a result]}}`` (same caveat).
    """

    rates: dict[str, dict[str, float]]
    failed: dict[str, dict[str, list[float]]]
    chosen_from: dict[str, dict[str, list[float]]]


def load(path: Path) -> TunedRates:
    """The rates of a tuned-lr file, and per scheme the rates that failed.

    Raises:
        ConfigError: Unreadable, or not a file :func:`write` made.
    """

    def bad(why: str) -> ConfigError:
        return ConfigError(f"tuned={path}: not a posenc tuned-lr file ({why}); {REMAKE}")

    try:
        data = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as err:  # any read or YAML error: the file is not what we wrote
        raise bad(f"unreadable: {' '.join(str(err).split())[:200]}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise bad(f"expected format: {FORMAT}")
    tasks = data.get("tasks")
    if not isinstance(tasks, dict) or not tasks:
        raise bad("no tasks")
    out = TunedRates({}, {}, {})
    for task, entry in tasks.items():
        rates = entry.get("lr") if isinstance(entry, dict) else None
        if not isinstance(rates, dict) or not rates:
            raise bad(f"tasks.{task}.lr is not a mapping of encoder to learning rate")
        for encoder, lr in rates.items():
            if not _is_rate(lr):
                raise bad(f"tasks.{task}.lr.{encoder}={lr!r} is not a positive number")
        out.rates[str(task)] = {str(e): float(lr) for e, lr in rates.items()}
        for name, into in (("failed", out.failed), ("chosen_from", out.chosen_from)):
            if name in entry:
                into[str(task)] = _rate_lists(entry[name], f"tasks.{task}.{name}", bad)
    return out


def _is_rate(lr: object) -> bool:
    return isinstance(lr, int | float) and not isinstance(lr, bool) and math.isfinite(lr) and lr > 0


def _rate_lists(
    node: object, where: str, bad: Callable[[str], ConfigError]
) -> dict[str, list[float]]:
    """``{encoder: [rates]}`` of a ``failed`` or ``chosen_from`` entry."""
    if not isinstance(node, dict):
        raise bad(f"{where} is not a mapping of encoder to a list of learning rates")
    out = {}
    for encoder, rates in node.items():
        if not isinstance(rates, list) or not all(_is_rate(lr) for lr in rates):
            raise bad(f"{where}.{encoder}={rates!r} is not a list of positive numbers")
        out[str(encoder)] = [float(lr) for lr in rates]
    return out


def write(path: Path, tasks: dict[str, dict[str, Any]], sweep: Path | Sequence[Path]) -> None:
    """Write a tuned-lr file.

    Args:
        path: Where (``<report dir>/tuned_lr.yaml``).
        tasks: Per task: ``criterion`` (text), ``grid`` (the rates tried), ``lr``
            (encoder -> chosen rate), ``at_edge`` (encoders whose rate is the grid's
            smallest or largest), ``tied`` (encoder -> the rates that tied with its
            choice), ``chosen_from`` and ``failed`` (encoder -> the rates with a result,
            and those whose runs failed).
        sweep: The directory (or directories) the runs came from.
    """
    head = (
        "# Learning rates tuned alike for every scheme: per task and encoder, the rate of\n"
        "# the grid with the best mean validation metric at the training length.\n"
        "# tied: per scheme, rates whose metric tied (losses <= 1e-6 count as equal); the\n"
        "# one whose runs met the learnability gate first chose, then the grid's inner one.\n"
        "# failed: per scheme, rates whose runs failed (the choice is from the rest; +tuned\n"
        "# refuses such a choice unless +tuned_allow_partial=true).\n"
        "# Written by python -m posenc.report; used by python run.py ... +tuned=<its dir>\n"
    )
    where = [str(sweep)] if isinstance(sweep, Path) else [str(s) for s in sweep]
    body = OmegaConf.create({"format": FORMAT, "sweeps": where, "tasks": tasks})
    path.write_text(head + OmegaConf.to_yaml(body), encoding="utf-8")


def run_key(cfg: DictConfig) -> tuple[str, str]:
    """The task and encoder names a run has in reports (and in the tuned-lr file)."""
    t = cfg.task
    return task_key(str(t.name), t.get("problem"), t.get("shape")), result_name(cfg)


def apply(cfg: DictConfig, given: Collection[str] = ()) -> None:
    """With ``tuned`` set to a directory or file: set ``task.optim.lr`` to this run's
    tuned rate and replace ``tuned`` by the record ``{file, task, encoder, lr}``. A
    ``tuned`` that is already such a record (a resumed run's) is checked against the lr.
    ``given``: the keys the command line set; a learning rate among them and ``+tuned``
    contradict each other (one of the two would be ignored), so they are refused.

    Raises:
        ConfigError: One line: both a learning rate and ``+tuned`` given, no file, a
            malformed one, no rate for this task or encoder, or a rate chosen while some
            of its grid failed (:func:`check_complete`).
    """
    source = cfg.get("tuned")
    if source is None:
        return
    if OmegaConf.is_dict(source):
        if source.get("lr") != cfg.task.optim.lr:
            raise ConfigError(
                f"tuned.lr={source.get('lr')!r} but task.optim.lr={cfg.task.optim.lr!r}; "
                f"give +tuned=<report dir> (not a record) to take the tuned rate"
            )
        return
    if "task.optim.lr" in given:
        raise ConfigError(
            f"tuned={source} and task.optim.lr={cfg.task.optim.lr} both set the learning "
            f"rate; drop task.optim.lr to train each scheme at its tuned rate, or drop "
            f"+tuned to train at {cfg.task.optim.lr}"
        )
    path = locate(str(source))
    found = load(path)
    rates = found.rates
    task, encoder = run_key(cfg)
    if task not in rates:
        raise ConfigError(
            f"tuned={source}: no tuned learning rates for task {task} (the file has "
            f"{', '.join(rates)}); tune it first, or drop +tuned"
        )
    if encoder not in rates[task]:
        raise ConfigError(
            f"tuned={source}: no tuned learning rate for encoder {encoder!r} on task {task} "
            f"(tuned: {', '.join(rates[task])}); add it to the tuning sweep and rerun its "
            f"report, or drop +tuned"
        )
    lr = rates[task][encoder]
    check_complete(cfg, str(source), path, found, task, encoder)
    cfg.task.optim.lr = lr
    cfg.tuned = {"file": str(path), "task": task, "encoder": encoder, "lr": lr}


#: Files whose missing record of failed rates was noted already (once per process).
_NOTED: set[Path] = set()


def check_complete(
    cfg: DictConfig, source: str, path: Path, found: TunedRates, task: str, encoder: str
) -> None:
    """Refuse a rate chosen from an incomplete grid (some of the scheme's runs failed)
    unless ``tuned_allow_partial`` is true; a file from before the record of failures
    is taken as complete, with a one-line note.

    Raises:
        ConfigError: The choice is partial and not allowed, or ``tuned_allow_partial`` is
            not a boolean.
    """
    allow = cfg.get("tuned_allow_partial", False)
    if not isinstance(allow, bool):
        raise ConfigError(
            f"tuned_allow_partial={allow!r}: must be true or false (true: take a rate chosen "
            f"from an incomplete grid)"
        )
    if task not in found.failed:
        if path not in _NOTED:
            _NOTED.add(path)
            log.warning(
                "%s predates the record of failed rates: its choices are taken as made "
                "from complete grids (python -m posenc.report on the sweep rewrites it)",
                path,
            )
        return
    failed = found.failed[task].get(encoder, [])
    if not failed:
        return
    lr = found.rates[task][encoder]
    rest = found.chosen_from.get(task, {}).get(encoder, [lr])
    what = (
        f"tuned={source}: {encoder}'s rate {lr:g} on task {task} was chosen from an "
        f"incomplete grid (only {', '.join(f'{r:g}' for r in rest)} have results; runs at "
        f"{', '.join(f'{r:g}' for r in failed)} failed)"
    )
    if not allow:
        raise ConfigError(
            f"{what}; rerun the failed jobs and the report, or add +tuned_allow_partial=true "
            f"to take it anyway"
        )
    log.warning("%s; taken anyway (tuned_allow_partial=true)", what)


def check_argument(args: list[str]) -> str | None:
    """``run.py``'s check of a ``+tuned=...`` argument before a sweep starts: the file
    exists and is well formed (whether it has each job's encoder:
    :class:`posenc.cli.SweepCheck`, before the first job starts).

    Returns:
        The problem, or None.
    """
    for arg in args:
        key, eq, value = arg.partition("=")
        if eq and key.lstrip("+~") == "tuned" and value not in ("", "null"):
            try:
                load(locate(value))
            except ConfigError as err:
                return str(err)
    return None
