"""The sweep presets (conf/sweep/): every job of each grid passes the config checks,
and the variants (conf/variant/) the grids are made of."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import pytest
from omegaconf import DictConfig, OmegaConf

from posenc import cli
from posenc.config import validate
from tests.conftest import ENCODER_YAMLS, ROOT, VARIANT_YAMLS, compose_hydra, multirun_config


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "conf" / "sweep").glob("*.yaml")))
def test_sweep_presets(preset: str, tmp_path: Path) -> None:
    """Every job of a preset's grid (first seed) composes and passes the config checks,
    this machine's included, so a preset cannot hold a job that is refused (a causal-only
    scheme in translation, an encoder without a YAML). The arms are encoders, or variants
    (conf/variant/: an encoder, possibly trained on randomized positions). The jobs'
    configs are the sweep check's (:func:`posenc.cli.job_configs`, tested equal to Hydra's
    own composition)."""
    params = OmegaConf.to_container(compose_hydra(f"sweep={preset}").hydra.sweeper.params)
    arm = "encoder" if "encoder" in params else "+variant"
    grid = str(params[arm]).split(",")
    known = ENCODER_YAMLS if arm == "encoder" else VARIANT_YAMLS
    assert len(set(grid)) == len(grid) and set(grid) <= set(known), grid
    first_seed = [f"seed={str(params['seed']).split(',')[0]}"] if "seed" in params else []
    fixed = [*first_seed, f"paths.output_dir={tmp_path}", f"paths.cache_dir={tmp_path}"]
    with multirun_config(f"sweep={preset}", *fixed) as sweep:
        jobs = cli.sweep_jobs(sweep)
        axes = [str(values).split(",") for key, values in params.items() if key != "seed"]
        assert len(jobs) == math.prod(map(len, axes))
        for _, cfg in cli.job_configs(sweep, jobs):
            validate(cast(DictConfig, cfg), copy=False)


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
    "rope_ssmax": ("rope", {}, {"logit_scale": "ssmax"}, "rope_ssmax"),
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
