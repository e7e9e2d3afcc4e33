"""encoder=mix: schemes per layer and per group of heads. A mix of one scheme is that
scheme bit for bit; each layer (each group of heads) attends as its scheme alone; the
refusals are one line each, before training. Cached decoding of mixes is checked with
every other scheme's in tests/model/test_cache.py, the contract in test_conformance.py."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra.utils import instantiate

from posenc.config import ConfigError, validate
from posenc.encoders import get
from posenc.encoders.base import AttnKind
from posenc.encoders.mix import HeadSplit, Mix, mixable
from posenc.model import DecoderLM, EncoderDecoder
from tests.conftest import compose_config, compose_run, identity_attention, run_py, run_self

SIZES = dict(d_model=32, n_heads=4, n_layers=2)


def _lm(encoder: Any, seed: int = 3) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(vocab_size=23, encoder=encoder, **SIZES)


def _outputs_and_grads(model: DecoderLM, ids: torch.Tensor) -> tuple[torch.Tensor, list]:
    out = model(ids)
    out.square().mean().backward()
    return out, [p.grad for p in model.parameters()]


@pytest.mark.parametrize(
    ("name", "mix"),
    [
        ("rope", {"layers": ["rope"]}),
        ("t5", {"layers": ["t5", "t5"]}),  # equal entries: one member, its table shared
        ("fox", {"layers": ["fox"]}),  # per-layer parameters and gates from the tokens
        ("t5", {"layers": None, "heads": ["t5"]}),
    ],
    ids=["rope", "t5", "fox", "heads_t5"],
)
def test_a_mix_of_one_scheme_is_that_scheme_bit_for_bit(name: str, mix: dict) -> None:
    alone, mixed = _lm(get(name)), _lm(functools.partial(Mix, **mix))
    for (_, a), (_, b) in zip(alone.named_parameters(), mixed.named_parameters(), strict=True):
        assert torch.equal(a, b)  # the same initialisation, parameter for parameter
    ids = torch.randint(0, 23, (2, 11))
    out_a, grads_a = _outputs_and_grads(alone.train(), ids)
    out_b, grads_b = _outputs_and_grads(mixed.train(), ids)
    assert torch.equal(out_a, out_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


@pytest.mark.parametrize("kind", [AttnKind.CAUSAL, AttnKind.BIDIRECTIONAL])
def test_each_layer_attends_as_its_scheme(kind: AttnKind) -> None:
    """layers=[t5, rope, none] over 4 layers: layers 0 and 3 are T5's (one table), 1
    RoPE's, 2 NoPE's, each on the mix's own context."""
    mix = Mix(**{**SIZES, "n_layers": 4}, layers=["t5", "rope", "none"])
    for p in mix.parameters():  # a T5 table that counts
        torch.nn.init.normal_(p)
    t5 = get("t5")(**{**SIZES, "n_layers": 4})
    t5.load_state_dict(mix.schemes[0].state_dict())
    alone = {0: t5, 1: get("rope")(**SIZES), 2: get("none")(**SIZES), 3: t5}
    x, pos = torch.randn(2, 9, 32), torch.arange(9)[None]
    outs = {}
    with torch.no_grad():
        for layer, enc in alone.items():
            got = run_self(identity_attention(mix, kind, layer), mix, x, pos, kind)
            want = run_self(identity_attention(enc, kind, layer), enc, x, pos, kind)
            assert torch.equal(got, want), layer
            outs[layer] = got
    assert not torch.allclose(outs[0], outs[1]) and not torch.allclose(outs[1], outs[2])


@pytest.mark.parametrize("schemes", [["rope", "t5"], ["shaw", "deberta"], ["alibi", "none"]])
def test_each_group_of_heads_attends_as_its_scheme_on_those_heads(schemes: list[str]) -> None:
    """heads=[a, b]: heads 0-1 attend as scheme a alone in a 2-head layer of width 16,
    heads 2-3 as b (score terms, Shaw's value term, DeBERTa's own content scale)."""
    mix = Mix(**SIZES, layers=None, heads=schemes)
    for p in mix.parameters():
        torch.nn.init.normal_(p)
    attn = identity_attention(mix, AttnKind.CAUSAL)
    assert isinstance(attn.pos, HeadSplit)
    for p in attn.pos.parameters():
        torch.nn.init.normal_(p)
    x, pos = torch.randn(2, 9, 32), torch.arange(9)[None]
    with torch.no_grad():
        got = run_self(attn, mix, x, pos, AttnKind.CAUSAL)
        for g, name in enumerate(schemes):
            enc = get(name)(d_model=16, n_heads=2, n_layers=2)
            enc.load_state_dict(mix.schemes[g].state_dict())
            alone = identity_attention(enc, AttnKind.CAUSAL)
            alone.pos.load_state_dict(attn.pos.groups[g].state_dict())
            part = x[..., 16 * g : 16 * (g + 1)]
            want = run_self(alone, enc, part, pos, AttnKind.CAUSAL)
            torch.testing.assert_close(got[..., 16 * g : 16 * (g + 1)], want)


def test_two_schemes_of_one_kind_keep_their_own_tables() -> None:
    """RoPE at two bases name their tables alike: each layer reads its own."""
    mix = Mix(**SIZES, layers=["rope", {"name": "rope", "base": 100.0}])
    assert [m.name for m in mix.schemes] == ["rope", "rope"]
    x, pos = torch.randn(1, 9, 32), torch.arange(9)[None]
    with torch.no_grad():
        for layer, base in ((0, 10000.0), (1, 100.0)):
            enc = get("rope")(**SIZES, base=base)
            got = run_self(
                identity_attention(mix, AttnKind.CAUSAL, layer), mix, x, pos, AttnKind.CAUSAL
            )
            want = run_self(identity_attention(enc, AttnKind.CAUSAL), enc, x, pos, AttnKind.CAUSAL)
            assert torch.equal(got, want)


def test_a_mix_declares_what_its_members_are() -> None:
    assert Mix(**SIZES, layers=["rope", "none"]).relative
    assert not Mix(**SIZES, layers=["none"]).uses_positions
    assert Mix(**SIZES, layers=["rope", "fox"]).causal_only
    assert Mix(
        **SIZES,
        layers=[
            "rope",
            {"name": "rope", "scaling": "dynamic_ntk", "scaling_factor": 2.0, "original_length": 8},
        ],
    ).pass_dependent
    assert not Mix(**SIZES, layers=["rope", "alibi"]).pass_dependent


ALLOWED = ", ".join(mixable())


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"layers": ["rope", "rpoe"]},
            f"encoder.layers[1]='rpoe': unknown scheme; did you mean 'rope'? allowed: {ALLOWED}",
        ),
        (
            {"layers": []},
            "encoder.layers=[]: must list at least one scheme, e.g. encoder.layers=[rope,none]",
        ),
        (
            {"layers": ["rope", "learned"]},
            "encoder.layers[1]='learned': adds to the token embeddings, once per stack, not per "
            "layer or head, so it cannot be mixed; use it alone (encoder=learned) or pick from "
            + ALLOWED,
        ),
        (
            {"layers": ["mix"]},
            "encoder.layers[0]='mix': a mix cannot hold a mix; list its schemes instead",
        ),
        (
            {"layers": [{"name": "rope", "bse": 1.0}]},
            "encoder.layers[0].bse: rope has no option 'bse'; allowed: base, layout, fraction, "
            "scaling, scaling_factor, original_length, yarn_alpha, yarn_beta, yarn_ramp, "
            "yarn_temper, p, low_freq_factor, high_freq_factor, long_factor, short_factor, "
            "attention_factor",
        ),
        (
            {"layers": [{"base": 1.0}]},
            "encoder.layers[0]={'base': 1.0}: a mapping names its scheme, e.g. "
            "{name: rope, base: 1000000}",
        ),
        (
            {"layers": ["none", "rope", {"name": "rope", "base": -1}]},
            "encoder.layers[2]: rope: base must be > 1, got -1",
        ),
        (
            {"layers": None, "heads": ["rope", "none", "alibi"]},
            "encoder.heads lists 3 schemes but model.n_heads=4: the heads split into equal "
            "groups, so list a number of schemes that divides 4",
        ),
        (
            {"layers": None, "heads": ["rope", "fox"]},
            "encoder.heads[1]='fox': computes from the tokens (its own per-layer state or "
            "attention), so it cannot share a layer's heads; mix it per layer with "
            "encoder.layers=[...]",
        ),
        (
            {"layers": ["rope"], "heads": ["rope", "none"]},
            "encoder=mix: set one of encoder.layers=[...] (a scheme per layer) and "
            "encoder.heads=[...] (a scheme per group of heads), not both (got "
            "layers=['rope'], heads=['rope', 'none'])",
        ),
    ],
    ids=[
        "unknown",
        "empty",
        "absolute",
        "nested",
        "option",
        "no_name",
        "value",
        "heads",
        "tokens",
        "both",
    ],
)
def test_refusals_are_one_line(settings: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        Mix(**SIZES, **settings)
    assert str(err.value) == message


def test_a_causal_only_scheme_cannot_be_in_a_translation_encoder() -> None:
    factory = functools.partial(Mix, layers=["rope", "fox"])
    message = (
        "encoder=mix holds fox, which is causal only, so it cannot be in an encoder stack "
        "(bidirectional self-attention, task=mt or an encoder-decoder); drop fox from the "
        "mix or run task=lm"
    )
    with pytest.raises(ValueError) as err:
        EncoderDecoder(src_vocab_size=9, tgt_vocab_size=9, encoder=factory, **SIZES)
    assert str(err.value) == message
    DecoderLM(vocab_size=9, encoder=factory, **SIZES)  # a decoder-only model takes it


def test_the_config_composes_from_the_command_line(tmp_path: Path) -> None:
    cfg = compose_run(
        tmp_path,
        "encoder=mix",
        "model.n_layers=4",
        "encoder.layers=[rope,{name:rope,base:1000000}]",
    )
    validate(cfg, machine=False)
    mix = instantiate(cfg.encoder)(d_model=16, n_heads=4, n_layers=4)
    assert [m.base for m in mix.schemes] == [10000.0, 1000000.0]
    assert mix.slot_member == [0, 1]
    cfg = compose_run(tmp_path, "encoder=mix", "encoder.heads=[rope,none]")
    validate(cfg, machine=False)
    assert isinstance(
        instantiate(cfg.encoder)(**SIZES).for_attention(layer=0, kind=AttnKind.CAUSAL), HeadSplit
    )


def test_the_default_mix_is_rope_with_nope_every_fourth_layer(tmp_path: Path) -> None:
    cfg = compose_run(tmp_path, "encoder=mix")
    mix = instantiate(cfg.encoder)(d_model=16, n_heads=4, n_layers=6)
    assert mix.names == ["rope", "none"] and mix.slot_member == [0, 0, 0, 1]


def test_a_bad_mix_is_refused_before_training(tmp_path: Path) -> None:
    cfg = compose_config(tmp_path, "task=mt", "encoder=mix", "encoder.layers=[rope,fox]")
    with pytest.raises(ConfigError) as err:
        validate(cfg, machine=False)
    assert err.value.problems == [
        "encoder: encoder=mix holds fox, which is causal only, so it cannot be in an encoder "
        "stack (bidirectional self-attention, task=mt or an encoder-decoder); drop fox from "
        "the mix or run task=lm"
    ]
    done = run_py(tmp_path, "encoder=mix", "encoder.layers=[rope,rpoe]")
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith(
            f"encoder: encoder.layers[1]='rpoe': unknown scheme; did you mean 'rope'? "
            f"allowed: {ALLOWED}"
        )
    )
    assert not [p for p in (tmp_path / "outputs" / "lm").rglob("*") if p.is_file()]


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (
            ["encoder.layers=[rope,{name:fox,rope:maybe}]"],
            "encoder.layers[1].rope='maybe': must be true or false",
        ),
        (
            # the scheme of layer 1, not only layer 0's, is asked whether it can take it
            ["encoder.layers=[rope,selective]", "model.logit_scale=ssmax"],
            "model.logit_scale=ssmax: the Selective encoder computes its own attention "
            "weights, not the softmax and mask these options change; drop the option or "
            "choose another encoder",
        ),
    ],
    ids=["entry_boolean", "later_layer_modifier"],
)
def test_what_an_entry_cannot_take_is_refused_in_the_config_check(
    tmp_path: Path, overrides: list[str], problem: str
) -> None:
    cfg = compose_config(tmp_path, "encoder=mix", *overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, machine=False)
    assert err.value.problems == [problem]
