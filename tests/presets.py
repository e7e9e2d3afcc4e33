"""Every preset of ``conf/`` composed: each task, experiment, sweep (with its grid's first
values) and encoder. ``snapshot()`` records what each gives; ``tests/presets.json`` holds
that record, so a change to where a default lives cannot change what a run gets
(``python -m tests.presets`` rewrites it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf, open_dict

from posenc.preflight import register_resolvers

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
SNAPSHOT = Path(__file__).with_name("presets.json")
#: The groups a job reads, resolved (``paths`` and ``hydra`` need a running Hydra).
GROUPS = ("task", "model", "trainer", "encoder", "tokenizer", "data")


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _sweep_grid(name: str) -> list[str]:
    """``sweep=<name>`` and the first value of each entry of its grid."""
    params = OmegaConf.load(CONF / "sweep" / f"{name}.yaml").get("hydra", {})
    params = OmegaConf.select(OmegaConf.create(params), "sweeper.params") or {}
    first = [f"{k}={str(v).split(',')[0].strip()}" for k, v in params.items()]
    return [f"sweep={name}", *first]


def presets() -> dict[str, list[str]]:
    """Each preset's name and the overrides that choose it."""
    out: dict[str, list[str]] = {}
    for task in ("lm", "mt", "algo"):
        out[f"task={task}"] = [f"task={task}"]
    for enc in _options("encoder"):
        out[f"encoder={enc}"] = [f"encoder={enc}"]
    for name in _options("experiment"):
        # a translation preset that does not choose its task itself: task=mt
        task = ["task=mt"] if name == "mt_train_short" else []
        out[f"experiment={name}"] = [*task, f"experiment={name}"]
    for name in _options("sweep"):
        out[f"sweep={name}"] = _sweep_grid(name)
    return out


def composed(overrides: list[str]) -> DictConfig:
    """The config ``python run.py <overrides>`` composes, without Hydra's own node (inside
    :func:`hydra.initialize_config_dir` of ``conf/``)."""
    cfg = compose("config", overrides=overrides)
    with open_dict(cfg):
        cfg.pop("hydra", None)
    return cfg


def composed_once(overrides: list[str]) -> DictConfig:
    """:func:`composed` outside Hydra (a test's)."""
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return composed(overrides)


def record(cfg: DictConfig) -> dict[str, Any]:
    """What a preset gives: the whole config unresolved, and the job's groups resolved."""
    out: dict[str, Any] = {}
    for group in GROUPS:
        node = cfg.get(group)
        out[group] = OmegaConf.to_container(node, resolve=True) if node is not None else None
    raw = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(raw, dict)
    # unresolved, where it differs: the ${...} a preset writes
    out["raw"] = {k: v for k, v in raw.items() if k not in GROUPS or v != out[k]}
    return out


def snapshot() -> dict[str, Any]:
    """Every preset's record; a preset that cannot be composed records its error."""
    register_resolvers()
    out: dict[str, Any] = {}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for name, overrides in presets().items():
            out[name] = record(composed(overrides))
    return out


if __name__ == "__main__":
    SNAPSHOT.write_text(json.dumps(snapshot(), indent=1, sort_keys=True) + "\n")
