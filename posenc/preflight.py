"""``run.py``'s command line checked before Hydra starts, where Hydra would answer with a
traceback or a multi-line message without the fix, or would silently do something else:
a config group option that does not exist (:func:`unknown_options`), a launcher whose
plugin is not installed (:func:`missing_launcher`), and ``resume=true`` without the
folder to resume (:func:`resume_without_folder`). Each returns its problems as lines for
``run.py`` to print (one line each, exit status 2); anything it cannot parse is left to
Hydra.
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path
from typing import Any

#: The launcher options of ``conf/hydra/launcher``: the Hydra plugin each needs and the
#: ``pip install`` extra (``pyproject.toml``) that brings it.
LAUNCHER_PLUGINS = {
    "local_parallel": ("hydra_plugins.hydra_joblib_launcher", "joblib"),
    "slurm": ("hydra_plugins.hydra_submitit_launcher", "slurm"),
}


def _parsed(overrides: list[str]) -> list[Any]:
    """Hydra's parse of the overrides (none of ``hydra.*``), each that it can parse."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, out = OverridesParser.create(), []
    for o in overrides:
        if "=" in o and not o.startswith(("hydra.", "-")):  # not --cfg's value (job)
            try:
                out += parser.parse_overrides([o])
            except Exception:  # Hydra says why itself
                continue
    return out


def _choices(override: Any) -> list[str]:
    """The option names an override of a group asks for (each value of a sweep); none
    for a ``glob(...)``, a deletion or ``null``."""
    from hydra.core.override_parser.types import Glob, OverrideType

    if override.type is OverrideType.DEL or isinstance(override.value(), Glob):
        return []
    values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
    return [str(v) for v in values if v is not None]


def group_options(config_dir: Path, group: str) -> list[str]:
    """The options of a config group: its YAML files, as ``group=<name>`` names them."""
    folder = config_dir / group
    return sorted(str(p.relative_to(folder).with_suffix("")) for p in folder.rglob("*.yaml"))


def search_dirs(overrides: list[str]) -> list[Path] | None:
    """The config folders ``hydra.searchpath=[file://...]`` adds (their options count
    too); None when it names one that cannot be listed here (``pkg://``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    found: list[Path] = []
    for o in overrides:
        if not o.startswith(("hydra.searchpath=", "+hydra.searchpath=", "++hydra.searchpath=")):
            continue
        try:
            value = OverridesParser.create().parse_overrides([o])[0].value()
        except Exception:  # Hydra says why itself
            return None
        for entry in value if isinstance(value, list) else [value]:
            if not str(entry).startswith("file://"):
                return None
            found.append(Path(str(entry).removeprefix("file://")))
    return found


#: ``hydra/launcher`` options Hydra itself brings (``basic``) or a plugin does, beside the
#: files of ``conf/hydra/launcher``.
HYDRA_LAUNCHERS = ("basic", "joblib", "submitit_local", "submitit_slurm")


def unknown_options(overrides: list[str], config_dir: Path) -> list[str]:
    """``encoder=rpoe``: an option that no file of its group holds, with the nearest one
    (Hydra says "Could not find" over several lines of search path, without one).

    Args:
        overrides: The command line's overrides.
        config_dir: The ``conf/`` folder.

    Returns:
        One line per unknown option (empty if none).
    """
    extra = search_dirs(overrides)
    if extra is None:
        return []  # Hydra checks what it can find
    dirs = [config_dir, *(d for d in extra if d.is_dir())]
    groups = {p.name for d in dirs for p in d.iterdir() if p.is_dir() and p.name != "hydra"}
    found = []
    for o in _parsed(overrides):
        if o.key_or_group not in (*groups, "hydra/launcher"):
            continue
        options = sorted({n for d in dirs for n in group_options(d, o.key_or_group)})
        if o.key_or_group == "hydra/launcher":
            options = sorted({*options, *HYDRA_LAUNCHERS})
        for value in _choices(o):
            if value in options:
                continue
            close = difflib.get_close_matches(value, options, n=1)
            hint = f"did you mean {o.key_or_group}={close[0]}? " if close else ""
            found.append(
                f"{o.key_or_group}={value}: no such option; {hint}allowed: {', '.join(options)}"
            )
    return found


def missing_launcher(overrides: list[str]) -> list[str]:
    """``hydra/launcher=local_parallel`` (or ``slurm``) without its Hydra plugin: the
    ``pip install`` that brings it (Hydra says only "Could not load")."""
    found = []
    for arg in overrides:
        key, _, value = arg.partition("=")
        if key.lstrip("+") != "hydra/launcher" or value not in LAUNCHER_PLUGINS:
            continue
        module, extra = LAUNCHER_PLUGINS[value]
        if importlib.util.find_spec(module.partition(".")[0]) is None or (
            importlib.util.find_spec(module) is None
        ):
            found.append(
                f"hydra/launcher={value} needs its Hydra plugin ({module}), which is not "
                f'installed: pip install -e ".[{extra}]" in the repository'
            )
    return found


#: Hydra's flags that print (a config, help, information) instead of running a job.
PRINT_ONLY_FLAGS = ("--cfg", "-c", "--info", "--help", "-h", "--hydra-help")


def prints_only(args: list[str]) -> bool:
    """Whether the command line only prints (``--cfg job``, ``--help``, ``--info=config``)."""
    return any(a.partition("=")[0] in PRINT_ONLY_FLAGS for a in args)


def resume_without_folder(
    args: list[str], config_dir: Path, outputs: Path = Path("outputs")
) -> list[str]:
    """``resume=true`` without the folder to resume (``hydra.run.dir``, or
    ``hydra.sweep.dir`` for a sweep) would start afresh in a new folder: refuse, naming
    the newest folder of this command's kind that could be resumed. A command that only
    prints (:data:`PRINT_ONLY_FLAGS`) starts nothing, so nothing is refused.

    Args:
        args: The command line (``-m`` included).
        config_dir: The ``conf/`` folder.
        outputs: Where run folders are made (``conf/config.yaml``: ``outputs/`` below
            the working directory).
    """
    if prints_only(args):
        return []
    given = dict(a.lstrip("+").partition("=")[::2] for a in args if "=" in a)
    if given.get("resume", "").lower() != "true" or given.get("ckpt_path", "null") != "null":
        return []  # a ckpt_path names what to continue from
    if "-m" in args or "--multirun" in args:
        if "hydra.sweep.dir" in given:
            return []
        return [_sweep_hint(outputs / "multirun", given.get("sweep"))]
    if "hydra.run.dir" in given:
        return []
    cfg = _composed([a for a in args if "=" in a and not a.startswith("-")], config_dir)
    if cfg is None:
        return []
    return [_run_hint(outputs, cfg)]


def _composed(overrides: list[str], config_dir: Path) -> Any:
    """The config (with Hydra's) the overrides make; None if it cannot be composed."""
    from hydra import compose, initialize_config_dir

    choices = [o for o in overrides if not o.startswith("hydra")]
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            return compose("config", overrides=choices, return_hydra_config=True)
    except Exception:  # Hydra will say what is wrong when it runs
        return None


def _newest(folders: list[Path]) -> Path | None:
    """The most recently written of ``folders`` (by their newest file's time)."""

    def written(d: Path) -> float:
        return max((p.stat().st_mtime for p in d.rglob("*") if p.is_file()), default=0.0)

    return max(folders, key=written) if folders else None


def _run_hint(outputs: Path, cfg: Any) -> str:
    """The refusal of a single run's ``resume=true``: the newest run folder of its task,
    encoder, preset and seed that holds a checkpoint to continue, if any."""
    choices = cfg.hydra.runtime.choices
    preset = f"{choices.experiment}_" if choices.get("experiment") else ""
    where = outputs / str(cfg.task.name) / str(choices.encoder)
    # <preset_>YYYY-MM-DD_HH-MM-SS_seed<seed>_<id>, as hydra.run.dir in conf/config.yaml
    candidates = [
        d.parent.parent
        for d in where.glob(f"{preset}[0-9]*_seed{cfg.seed}_*/checkpoints/last.ckpt")
    ]
    newest = _newest(candidates)
    what = (
        f"task={cfg.task.name} encoder={choices.encoder} "
        f"{f'experiment={choices.experiment} ' if preset else ''}seed={cfg.seed}"
    )
    if newest is None:
        return (
            f"resume=true needs the run's folder (hydra.run.dir=<run dir>), or it starts a new "
            f"run in a new folder; no run of {what} with a last.ckpt is under {where}: give "
            f"hydra.run.dir, or drop resume=true to start afresh"
        )
    more = f"; the newest of {len(candidates)} such runs" if len(candidates) > 1 else ""
    return (
        f"resume=true needs the run's folder, or it starts a new run in a new folder: add "
        f"hydra.run.dir={newest} (the run of {what} with a last.ckpt{more})"
    )


def _sweep_hint(multirun: Path, sweep: str | None) -> str:
    """The refusal of a sweep's ``resume=true``: its newest sweep folder, if any."""
    preset = f"{sweep}_" if sweep not in (None, "null") else ""
    newest = _newest([d for d in multirun.glob(f"{preset}[0-9]*") if d.is_dir()])
    if newest is None:
        return (
            f"resume=true needs the sweep's folder (hydra.sweep.dir=<sweep dir>), or it starts "
            f"a new sweep in a new folder; none is under {multirun}: give hydra.sweep.dir, or "
            f"drop resume=true"
        )
    return (
        f"resume=true needs the sweep's folder, or it starts a new sweep in a new folder: "
        f"add hydra.sweep.dir={newest} (the newest {preset.rstrip('_') or 'sweep'} "
        f"under {multirun})"
    )
