"""Every encoder in conf/encoder/*.yaml honours the contract: registry, shift
invariance of relative schemes, causality, cross-attention, forward/backward."""

from __future__ import annotations

import re

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from posenc import encoders
from posenc.config import ConfigError, validate
from posenc.encoders.base import AttentionPositional, AttnKind, CausalOnly
from posenc.model import DecoderLM, EncoderDecoder
from posenc.model.attention import Attention
from tests.conftest import (
    ABSOLUTE,
    BIDIRECTIONAL_YAMLS,
    CAUSAL_ONLY,
    ENCODER_YAMLS,
    ROOT,
    compose_run,
    identity_attention,
    run_self,
)

SIZES = dict(d_model=32, n_heads=4, n_layers=2)


def factory(name: str):
    """The encoder factory exactly as Hydra builds it from the YAML."""
    return instantiate(OmegaConf.load(ROOT / "conf" / "encoder" / f"{name}.yaml"))


def test_registry_lists_exactly_the_yaml_encoders() -> None:
    assert encoders.available() == ENCODER_YAMLS


@pytest.mark.parametrize("name", ENCODER_YAMLS)
def test_yaml_builds_the_registered_class(name: str) -> None:
    enc = factory(name)(**SIZES)
    assert type(enc) is encoders.get(name)


@pytest.mark.parametrize("name", ENCODER_YAMLS)
def test_declared_kind_is_coherent(name: str) -> None:
    """The class attributes the tests group encoders by do not contradict each other,
    and a declared threshold names a real parameter (the shift test spares it)."""
    enc = factory(name)(**SIZES)
    assert not (enc.relative and enc.relative_below), "relative, or relative below a bound"
    if not enc.uses_positions:
        assert not (enc.relative or enc.relative_below), "a scheme without positions"
    if enc.relative_below:
        names = [n.rsplit(".", 1)[-1] for n, _ in enc.named_parameters()]
        assert enc.relative_below in names, f"{name}: no parameter {enc.relative_below!r}"


def test_unknown_encoder_names_the_choices() -> None:
    names = ", ".join(encoders.available())
    with pytest.raises(ValueError, match=f"unknown encoder 'alibii'; available: {names}"):
        encoders.get("alibii")


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            ["encoder=rope", "encoder.layout=interleave"],
            "rope: unknown layout 'interleave'; did you mean 'interleaved'? "
            "allowed: interleaved, half",
        ),
        (
            ["encoder=fox", "encoder.bias_init=spred"],
            "fox: unknown bias_init 'spred'; did you mean 'spread'? allowed: zero, spread",
        ),
        (
            ["encoder=rope", "encoder.scaling=yarm"],
            "rope: unknown scaling 'yarm'; did you mean 'yarn'? allowed: none, linear",
        ),
        (["encoder=kerple", "encoder.form=xyz"], "kerple: unknown form 'xyz'; allowed: log, power"),
    ],
)
def test_an_encoder_option_outside_its_choices_gets_the_nearest(
    tmp_path, overrides: list[str], line: str
) -> None:
    """The encoders' own choices answer a near miss as the config's keys do."""
    with pytest.raises(ConfigError) as err:
        validate(compose_run(tmp_path, *overrides))
    assert str(err.value).splitlines()[1].startswith(f"  encoder: {line}"), str(err.value)


@pytest.mark.parametrize("name", ENCODER_YAMLS)
@pytest.mark.parametrize("kind", [AttnKind.CAUSAL, AttnKind.BIDIRECTIONAL])
def test_shift_invariance(name: str, kind: AttnKind) -> None:
    """Relative schemes: same output when all positions move by the same offset.
    Absolute schemes: the output changes."""
    enc = factory(name)(**SIZES)
    if enc.causal_only and kind is AttnKind.BIDIRECTIONAL:
        with pytest.raises(ValueError, match="causal"):
            enc.for_attention(layer=0, kind=kind)
        return
    for n, p in enc.named_parameters():  # make every positional parameter count
        if enc.relative_below and n.rsplit(".", 1)[-1] == enc.relative_below:
            continue  # keep a threshold such as FIRE's L (512) above every position used
        torch.nn.init.normal_(p)
    attn = identity_attention(enc, kind)
    x = torch.randn(2, 9, SIZES["d_model"])
    pos = torch.arange(9)[None]
    with torch.no_grad():
        a = run_self(attn, enc, x, pos, kind)
        b = run_self(attn, enc, x, pos + 37, kind)
    if name in ABSOLUTE:
        assert not torch.allclose(a, b, atol=1e-3)
    else:  # relative (below its threshold), or no positions at all
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ENCODER_YAMLS)
def test_positions_matter(name: str) -> None:
    """A scheme that silently ignored positions would pass shift invariance; one that
    declares it ignores them (NoPE) must not see a reordering of positions."""
    enc = factory(name)(**SIZES)
    for p in enc.parameters():
        torch.nn.init.normal_(p)
    kind = AttnKind.CAUSAL if enc.causal_only else AttnKind.BIDIRECTIONAL
    attn = identity_attention(enc, kind)
    x = torch.randn(1, 6, SIZES["d_model"])
    pos = torch.arange(6)[None]
    # The same tokens, told other (increasing, for causal-only schemes) positions.
    perm = torch.tensor([[0, 2, 3, 7, 8, 9]] if enc.causal_only else [[0, 2, 1, 5, 3, 4]])
    with torch.no_grad():
        a = run_self(attn, enc, x, pos, kind)
        b = run_self(attn, enc, x, perm, kind)
    assert torch.allclose(a, b, atol=1e-3) != enc.uses_positions


@pytest.mark.parametrize("name", ENCODER_YAMLS)
def test_lm_is_causal(name: str) -> None:
    model = DecoderLM(vocab_size=40, encoder=factory(name), **SIZES).eval()
    ids = torch.randint(0, 40, (2, 12))
    changed = ids.clone()
    changed[:, 7:] = torch.randint(0, 40, (2, 5))
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("name", CAUSAL_ONLY)
def test_causal_only_schemes_refuse_a_translation_encoder(name: str) -> None:
    """One refusal for every causal-only scheme, from the contract: the scheme, its own
    reason and the way out; in the stack, in a shared pass and in the per-layer hooks.
    Cross-attention gets no positional hooks."""
    enc = factory(name)(**SIZES)
    assert isinstance(enc, CausalOnly)
    refusal = (
        f"^{name} is causal only: bidirectional \\(encoder\\) self-attention was requested, "
        f"but {re.escape(enc.causal_reason)}\\. Use encoder={name} with task=lm or task=algo "
        f"\\(decoder-only\\), or {re.escape(enc.causal_instead)}\\.$"
    )
    with pytest.raises(ValueError, match=refusal):
        EncoderDecoder(src_vocab_size=40, tgt_vocab_size=40, encoder=factory(name), **SIZES)
    pos = torch.arange(4)[None]
    with pytest.raises(ValueError, match=refusal):
        enc.context(pos, pos, AttnKind.BIDIRECTIONAL, starts=(0, 0))
    with pytest.raises(ValueError, match=refusal):
        enc.for_attention(layer=0, kind=AttnKind.BIDIRECTIONAL)
    assert type(enc.for_attention(layer=0, kind=AttnKind.CROSS)) is AttentionPositional


@pytest.mark.parametrize("name", BIDIRECTIONAL_YAMLS)
def test_seq2seq_encoder_bidirectional_decoder_causal(name: str) -> None:
    model = EncoderDecoder(
        src_vocab_size=40, tgt_vocab_size=40, encoder=factory(name), dropout=0.0, **SIZES
    ).eval()
    src, tgt = torch.randint(0, 40, (2, 8)), torch.randint(0, 40, (2, 10))
    src2 = src.clone()
    src2[:, -1] = (src[:, -1] + 1) % 40
    tgt2 = tgt.clone()
    tgt2[:, 6:] = (tgt[:, 6:] + 1) % 40
    with torch.no_grad():
        m, m2 = model.encode(src), model.encode(src2)
        # The last source token reaches the first encoder position: bidirectional.
        assert not torch.allclose(m[:, 0], m2[:, 0])
        a, b = model.decode(tgt, m), model.decode(tgt2, m)
    torch.testing.assert_close(a[:, :6], b[:, :6])  # causal decoder


@pytest.mark.parametrize("name", BIDIRECTIONAL_YAMLS)
def test_source_padding_is_invisible(name: str) -> None:
    model = EncoderDecoder(
        src_vocab_size=40, tgt_vocab_size=40, encoder=factory(name), dropout=0.0, **SIZES
    ).eval()
    src, tgt = torch.randint(4, 40, (1, 6)), torch.randint(4, 40, (1, 5))
    padded = torch.cat([src, torch.zeros(1, 3, dtype=torch.long)], 1)
    valid = torch.arange(9)[None] < 6
    with torch.no_grad():
        a = model(src, tgt)
        b = model(padded, tgt, valid)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ENCODER_YAMLS)
def test_cross_attention_hooks_are_plain(name: str) -> None:
    """Documented behaviour: no scheme acts inside cross-attention (absolute ones
    act on the embeddings; relative distances between two sequences mean nothing)."""
    enc = factory(name)(**SIZES)
    hook = enc.for_attention(layer=0, kind=AttnKind.CROSS)
    assert type(hook) is AttentionPositional
    assert not list(hook.parameters())


@pytest.mark.parametrize("name", ENCODER_YAMLS)
def test_forward_backward_both_stacks(name: str) -> None:
    lm = DecoderLM(vocab_size=40, encoder=factory(name), **SIZES)
    ids = torch.randint(0, 40, (2, 10))
    loss = lm(ids).logsumexp(-1).mean()
    models = [lm]
    if name not in CAUSAL_ONLY:
        mt = EncoderDecoder(src_vocab_size=40, tgt_vocab_size=40, encoder=factory(name), **SIZES)
        loss = loss + mt(ids, ids[:, :7]).logsumexp(-1).mean()
        models.append(mt)
    loss.backward()
    for model in models:
        for n, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), n
        positional = [
            (n, p) for n, p in model.named_parameters() if ".encoder." in n or ".pos." in n
        ]
        for n, p in positional:  # every positional parameter learns
            assert p.grad.abs().sum() > 0, n


def test_heads_that_do_not_divide_the_width_are_refused_in_one_wording() -> None:
    """The model's classes built directly (a run's config is refused earlier): the
    encoder, one attention module and a whole model say the same thing."""
    message = "n_heads=3 must divide d_model=16; pick a divisor of 16"
    builds = [
        lambda: encoders.build("rope", d_model=16, n_heads=3, n_layers=1),
        lambda: Attention(d_model=16, n_heads=3, dropout=0.0, pos=AttentionPositional()),
        lambda: DecoderLM(vocab_size=8, encoder="rope", n_layers=1, d_model=16, n_heads=3),
    ]
    for build in builds:
        with pytest.raises(ValueError, match=re.escape(message)):
            build()
