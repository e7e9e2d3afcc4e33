"""The sweep presets (conf/sweep/): every job of each grid passes the config checks,
and the variants (conf/variant/) the grids are made of."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf

from posenc.config import validate
from tests.conftest import ENCODER_YAMLS, ROOT, VARIANT_YAMLS, compose_hydra


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "conf" / "sweep").glob("*.yaml")))
def test_sweep_presets(preset: str, tmp_path: Path) -> None:
    """Every job of a preset's grid (first seed) composes and passes the config checks,
    so a preset cannot hold a job that is refused (a causal-only scheme in translation,
    an encoder without a YAML). The arms are encoders, or variants (conf/variant/: an
    encoder, possibly trained on randomized positions)."""
    params = OmegaConf.to_container(compose_hydra(f"sweep={preset}").hydra.sweeper.params)
    arm = "encoder" if "encoder" in params else "+variant"
    grid = str(params[arm]).split(",")
    known = ENCODER_YAMLS if arm == "encoder" else VARIANT_YAMLS
    assert len(set(grid)) == len(grid) and set(grid) <= set(known), grid
    axes = {key: str(values).split(",") for key, values in params.items() if key != "seed"}
    first_seed = [f"seed={str(params['seed']).split(',')[0]}"] if "seed" in params else []
    fixed = [*first_seed, f"paths.output_dir={tmp_path}", f"paths.cache_dir={tmp_path}"]
    jobs = [
        [f"{key}={value}" for key, value in zip(axes, values, strict=True)]
        for values in itertools.product(*axes.values())
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for cfg in job_configs([f"sweep={preset}"], jobs, fixed):
            validate(cfg)
        # the shortcut's config is compose()'s (the last job's here: one compose more)
        last = compose("config", overrides=[f"sweep={preset}", *jobs[-1], *fixed])
        assert OmegaConf.to_yaml(cfg) == OmegaConf.to_yaml(last)


def job_configs(head: list[str], jobs: list[list[str]], tail: list[str]) -> Iterator[DictConfig]:
    """``compose("config", overrides=[*head, *job, *tail])`` for each job, composing once
    per distinct choice of config groups (chomsky's 300 jobs have 10): Hydra builds the
    defaults list from the group overrides alone and applies the others (``key=value``)
    to the composed config afterwards, as done here to a copy of it, with Hydra's own
    function (the configs are equal, checked for every job of every preset when this was
    written). Hydra must be initialized."""
    repo = GlobalHydra.instance().config_loader().repository

    def is_group(o: Override) -> bool:  # Hydra's own test (defaults_list.Overrides)
        return repo.group_exists(o.key_or_group) and not isinstance(o.value(), dict)

    parse = OverridesParser.create().parse_overrides
    composed: dict[tuple[str, ...], DictConfig] = {}
    for job in jobs:
        parsed = parse(job)
        groups = tuple(o.input_line for o in parsed if is_group(o))
        values = [o for o in parsed if not is_group(o)]
        if groups not in composed:
            composed[groups] = compose("config", overrides=[*head, *groups, *tail])
        cfg = copy.deepcopy(composed[groups])
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        yield cfg


#: Variants that set an encoder option (name: encoder, the options it sets).
#: Variants that set options: name -> (encoder, its options, model options, label).
OPTION_VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any], str | None]] = {
    "stickbreak_value": ("stickbreak", {"remainder": "value"}, {}, None),
    "rope_nope4": ("mix", {"layers": ["rope", "rope", "rope", "none"]}, {}, "rope_nope4"),
    "nope_rope4": ("mix", {"layers": ["none", "none", "none", "rope"]}, {}, "nope_rope4"),
    "rope_none_heads": ("mix", {"heads": ["rope", "none"]}, {}, "rope_none_heads"),
    "prope75": ("rope", {"p": 0.75}, {}, "prope75"),
    "rope_qknorm": ("rope", {}, {"qk_norm": True}, "rope_qknorm"),
    "none_ssmax": ("none", {}, {"logit_scale": "ssmax"}, "none_ssmax"),
    "rope_sinks": ("rope", {}, {"sinks": True}, "rope_sinks"),
    "alibi_dape": ("dape", {"base": "alibi"}, {}, "alibi_dape"),
    "kerple_dape": ("dape", {"base": "kerple"}, {}, "kerple_dape"),
}


def test_every_encoder_is_a_variant_and_rand_variants_randomize() -> None:
    """conf/variant/<encoder>.yaml selects that encoder and nothing else; <e>_rand.yaml
    selects e and trains it on randomized positions; an option variant selects its
    encoder with those options and model options (a plain variant leaves both at their
    defaults) and names its label, which a plain variant leaves unset."""
    assert set(ENCODER_YAMLS) <= set(VARIANT_YAMLS)
    model = compose_hydra().model
    for name in VARIANT_YAMLS:
        cfg = compose_hydra(f"+variant={name}")
        default = (name.removesuffix("_rand"), {}, {}, None)
        base, options, model_options, label = OPTION_VARIANTS.get(name, default)
        assert cfg.hydra.runtime.choices.encoder == base
        assert (cfg.model.random_positions is not None) == name.endswith("_rand"), name
        plain = compose_hydra(f"encoder={base}").encoder
        assert {k: cfg.encoder[k] for k in options} == options, name
        assert {k: v for k, v in cfg.encoder.items() if k not in options} == {
            k: v for k, v in plain.items() if k not in options
        }, name
        mine = {k: v for k, v in cfg.model.items() if k != "random_positions"}
        assert mine == {
            k: model_options.get(k, v) for k, v in model.items() if k != "random_positions"
        }, name
        assert cfg.label == label, name
    assert compose_hydra("+variant=stickbreak").encoder.remainder == "head_bias"


@pytest.mark.parametrize("preset", ["mt_length", "algo_content"])
def test_a_presets_task_takes_the_task_keys_of_the_command_line(preset: str) -> None:
    """A preset of one task selects it for the whole sweep, so the command line may set
    that task's keys (``sweep=mt_length tokenizer.vocab_size=400`` was refused as a key
    not in the LM task's config)."""
    overrides = {
        "mt_length": ["tokenizer.vocab_size=400", "task.max_len=64"],
        "algo_content": ["task.test_per_size=8"],
    }[preset]
    cfg = compose_hydra(f"sweep={preset}", *overrides)
    for o in overrides:
        key, _, value = o.partition("=")
        assert str(OmegaConf.select(cfg, key)) == value
