"""``run.py``'s command line checked before Hydra starts and before torch is imported
(a typo is answered in a second), where Hydra would answer with a traceback or a
multi-line message without the fix, or would silently do something else: a config group
option that does not exist (:func:`unknown_options`), a launcher whose plugin is not
installed (:func:`missing_launcher`), ``resume=true`` without the folder to resume
(:func:`resume_without_folder`) and a key the composed config lacks
(:func:`misspelled_keys`). Each returns its problems as lines for ``run.py`` to print (one
line each, exit status 2); anything it cannot parse is left to Hydra. Also the resolvers
and the schema every composition needs (:func:`register_resolvers`).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import secrets
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob, OverrideType
from hydra.errors import ConfigCompositionException, HydraException
from omegaconf import DictConfig, OmegaConf

from posenc import schema
from posenc.data.algo_problems import problem_default

#: The launcher options of ``conf/hydra/launcher``: the Hydra plugin each needs and the
#: ``pip install`` extra (``pyproject.toml``) that brings it.
LAUNCHER_PLUGINS = {
    "local_parallel": ("hydra_plugins.hydra_joblib_launcher", "joblib"),
    "slurm": ("hydra_plugins.hydra_submitit_launcher", "slurm"),
}


def _parsed(overrides: list[str]) -> list[Any]:
    """Hydra's parse of the overrides (none of ``hydra.*``), each that it can parse."""
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
    try:
        return _compose(config_dir, [o for o in overrides if not o.startswith("hydra")])
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


#: This process's run-directory suffix: runs started in the same second (a shell loop, a
#: scheduler array) get directories of their own.
RUN_ID = f"{os.getpid() % 0x10000:04x}{secrets.token_hex(2)}"


def register_resolvers() -> None:
    """``${posenc_uid:}`` and ``${posenc_preset:...}`` in ``conf/config.yaml``'s run and
    sweep directories; ``${posenc_problem:<key>}`` in ``conf/task/algo.yaml``: the chosen
    ``task.problem``'s own default of a key, so ``task.problem=count`` alone brings
    counting's sizes (a value given on the command line or in a preset replaces it);
    and the schema ``conf/`` extends (:func:`posenc.schema.register`)."""
    schema.register()
    if not OmegaConf.has_resolver("posenc_problem"):
        OmegaConf.register_new_resolver(
            "posenc_problem",
            lambda key, _root_: problem_default(_root_.task.get("problem"), key),
        )
    if not OmegaConf.has_resolver("posenc_uid"):
        OmegaConf.register_new_resolver("posenc_uid", lambda: RUN_ID, use_cache=True)
    if not OmegaConf.has_resolver("posenc_preset"):
        # A preset's name and "_" (experiment=baby_gpt: baby_gpt_2026-...); "" for none.
        OmegaConf.register_new_resolver(
            "posenc_preset", lambda name=None: f"{name}_" if name not in (None, "None") else ""
        )


def misspelled_keys(overrides: list[str], config_dir: Path) -> list[str]:
    """Overrides that set a key the composed config lacks, each with the nearest existing
    key: Hydra would refuse them with "not in struct" and no suggestion. And ``+key=value``
    for a key the config has (Hydra refuses it over three lines).

    The config is composed with the command's group choices (a sweep's first value of
    each, then a sweep preset's own first values); anything this check cannot parse is
    left to Hydra.

    Args:
        overrides: The command line's overrides (``model.d_modle=3``).
        config_dir: The ``conf/`` folder.

    Returns:
        One message per misspelled key (empty if none).
    """
    try:
        parsed = OverridesParser.create().parse_overrides(
            [o for o in overrides if not o.startswith(("hydra/", "hydra."))]
        )
    except Exception:
        return []
    groups = {p.name for p in config_dir.iterdir() if p.is_dir()}
    choices: list[str] = []
    swept: dict[str, str] = {}  # group -> its sweep as written: experiment=algo_mqar,algo_copy
    for o in parsed:  # a group chosen (encoder=rope) or added (+variant=fox)
        if o.key_or_group in groups and o.type in (OverrideType.CHANGE, OverrideType.ADD):
            try:
                value = next(iter(o.sweep_iterator())) if o.is_sweep_override() else o.value()
            except HydraException:  # glob(...) of a group lists it through Hydra's loader
                continue
            plus = "+" if o.type is OverrideType.ADD else ""
            choices.append(f"{plus}{o.key_or_group}={value}")
            if o.is_sweep_override():
                swept[o.key_or_group] = o.input_line or o.key_or_group
    try:
        cfg = _compose(config_dir, choices)
        # A sweep preset's own grid (hydra.sweeper.params, e.g. sweep=mt_length sets
        # task=mt): its first value of each group the command line leaves open.
        given = {c.lstrip("+").partition("=")[0] for c in choices}
        params = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
        more = [
            f"{k}={str(v).split(',')[0].strip()}"
            for k, v in params.items()
            if k.lstrip("+") in groups and k.lstrip("+") not in given
        ]
        if more:
            cfg = _compose(config_dir, [*choices, *more])
    except ConfigCompositionException as err:  # a key the schema lacks, in a file
        return composition_problems(err, config_dir, choices)
    except Exception:
        return []
    found = []
    for o in parsed:
        key = o.key_or_group
        if o.type is OverrideType.ADD and key not in groups:
            if OmegaConf.select(cfg, key, default=schema.UNKNOWN) is not schema.UNKNOWN:
                found.append(
                    f"+{key}: {key} is already in the config; set it without the +: "
                    f"{(o.input_line or key).lstrip('+')}"
                )
            continue
        if o.type is not OverrideType.CHANGE or key in groups:
            continue
        if "." not in key:  # a top-level key or a config group (encoder=, task=, ...)
            top = {str(k) for k in cfg.keys()}  # noqa: SIM118 (see below)
            if key not in top:
                close = difflib.get_close_matches(key, sorted(groups | top), n=1)
                hint = f"did you mean {close[0]}?" if close else "see python run.py --help"
                found.append(f"{key}: no such key or config group; {hint}")
            continue
        # the deepest group of the key the config has (task.eval.multipliers under task=mt:
        # task); keys(), not `in`: a DictConfig says a `???` (MISSING) key is not in it.
        parts, depth = key.split("."), 1
        while depth < len(parts) - 1 and parts[depth] in _keys(cfg, parts[:depth]):
            depth += 1
        parent, leaf = ".".join(parts[:depth]), parts[depth]
        node = OmegaConf.select(cfg, parent)
        if node is None and parts[depth - 1] in _keys(cfg, parts[: depth - 1]):
            value = (o.input_line or "").partition("=")[2]
            found.append(
                f"{key}: {parent} is null here (off), so it has no {leaf}; give the whole "
                f"group, e.g. {parent}={{{leaf}: {value}, ...}} with each of its keys"
            )
            continue
        if not OmegaConf.is_dict(node) or leaf in node.keys():  # noqa: SIM118
            continue
        keys = sorted(str(k) for k in node)
        close = difflib.get_close_matches(leaf, keys, n=1)
        hint = f"did you mean {parent}.{close[0]}?" if close else f"{parent} has {', '.join(keys)}"
        found.append(f"{key}: no such key; {hint}")
    if found or not swept:
        return found
    return _outside_the_shared_config(parsed, config_dir, choices, swept, cfg)


def _outside_the_shared_config(
    parsed: list[Any], config_dir: Path, choices: list[str], swept: dict[str, str], cfg: DictConfig
) -> list[str]:
    """Keys a sweep's jobs have but its shared config lacks. Hydra composes a multirun's
    shared config without its swept groups (``experiment=algo_mqar,algo_copy``) and
    applies every other override there first, so a key that only the swept choice brings
    (``task.train_lengths``, which ``experiment=algo_*`` brings by choosing ``task=algo``)
    fails before any job, with Hydra's "Could not override" and a wrong fix."""
    try:
        shared = _compose(
            config_dir, [c for c in choices if c.lstrip("+").partition("=")[0] not in swept]
        )
    except Exception:
        return []
    found = []
    for o in parsed:
        parts = o.key_or_group.split(".")
        if o.type is not OverrideType.CHANGE or len(parts) < 2:
            continue
        if parts[-1] in _keys(shared, parts[:-1]) or parts[-1] not in _keys(cfg, parts[:-1]):
            continue
        group, chosen = parts[0], OmegaConf.select(cfg, f"hydra.runtime.choices.{parts[0]}")
        was = OmegaConf.select(shared, f"hydra.runtime.choices.{group}")
        if chosen is None or chosen == was:
            continue
        fix = (
            f"sweep {group} only over choices that all have it, or run {group}={chosen} alone"
            if group in swept
            else f"add {group}={chosen} to the command"
        )
        sweeps = " ".join(swept.values())
        found.append(
            f"{o.key_or_group}: Hydra sets it on the config the sweep's jobs share, before "
            f"the swept {sweeps} chooses {group}={chosen}; there {group} is {was}, "
            f"which has no {parts[-1]}; {fix}"
        )
    return found


def _keys(cfg: DictConfig, path: list[str]) -> list[str]:
    """The keys of the group at ``path`` (none if it is not a group)."""
    node = OmegaConf.select(cfg, ".".join(path))
    return [str(k) for k in node.keys()] if OmegaConf.is_dict(node) else []  # noqa: SIM118


def _compose(config_dir: Path, overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True)


def composition_problems(
    err: ConfigCompositionException, config_dir: Path, overrides: list[str]
) -> list[str]:
    """One line for a config file that sets a key its group's schema lacks (Hydra says
    so over several lines, without the fix); nothing for another error (Hydra says it)."""
    # Hydra keeps the error's words only: "In '<file>': ConfigKeyError ... full_key: <key>"
    found = re.match(r"In '([^']+)': ConfigKeyError", str(err))
    full_key = re.search(r"full_key: (\S+)", str(err))
    if not found or not full_key:
        return []
    key = full_key.group(1)
    source = config_dir / f"{found.group(1)}.yaml"
    loaded = OmegaConf.load(source) if source.is_file() else OmegaConf.create()
    value = OmegaConf.select(loaded, key, default=schema.UNKNOWN)  # a `# @package _global_` file
    if value is schema.UNKNOWN:
        value = OmegaConf.select(loaded, key.partition(".")[2], default=schema.UNKNOWN)
    # the config without that file's key names the group's keys and the task
    cfg = _compose(config_dir, [o for o in overrides if o.startswith("task=")])
    return [f"{schema.unknown_key(cfg, key, value)} (in conf/{found.group(1)}.yaml)"]
