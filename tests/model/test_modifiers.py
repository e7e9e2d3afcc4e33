"""The attention modifiers (``model.qk_norm``, ``model.logit_scale``, ``model.sinks``):
numbers worked out by hand, every backend against them, and nothing changed when off."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from posenc.encoders import build
from posenc.encoders.base import AttentionPositional, AttnKind
from posenc.model import DecoderLM, EncoderDecoder
from posenc.model.attention import Attention
from posenc.model.backends import attend
from posenc.model.modifiers import (
    QK_NORM_EPS,
    SSMAX_INIT,
    HeadRMSNorm,
    LogitModifiers,
    Modifiers,
    key_counts,
)

BACKENDS = ("auto", "explicit", "flex")
OPTIONS = {"qk_norm": True, "logit_scale": "ssmax", "sinks": True}


@pytest.fixture(autouse=True)
def _quiet_eager_flex() -> None:
    warnings.filterwarnings("ignore", message=".*flex_attention.*")


def _probs(name: str, mods: LogitModifiers, q, k, *, causal: bool = True, key_valid=None):
    """Each backend's attention probabilities ``(B, H, T, S)`` for ``q`` and ``k``: the
    output for values that are the identity (value j is the j-th unit vector)."""
    b, h, t, _ = q.shape
    s = k.shape[-2]
    enc = build(name, d_model=h * q.shape[-1], n_heads=h, n_layers=1)
    kind = AttnKind.CAUSAL if causal else AttnKind.BIDIRECTIONAL
    pos = torch.arange(s)[None]
    ctx = enc.context(pos[:, s - t :], pos, kind, starts=(s - t, 0), bound=s)
    hooks = enc.for_attention(layer=0, kind=kind)
    v = torch.eye(s, dtype=q.dtype).expand(b, h, s, s)
    return hooks, {
        backend: attend(
            hooks,
            q,
            k,
            v,
            ctx,
            key_valid=key_valid,
            shift=s - t,
            p_drop=0.0,
            backend=backend,
            mods=mods,
        )  # fmt: skip
        for backend in BACKENDS
    }


def test_options_off_leave_the_model_bit_identical() -> None:
    """Each option given as off builds the model the options' absence builds: the same
    parameters and bit-identical outputs, for both model shapes."""
    off = {"qk_norm": False, "logit_scale": "none", "sinks": False}
    sizes = {"d_model": 16, "n_heads": 2, "n_layers": 1}
    ids = torch.randint(0, 11, (2, 9))
    for make, run in (
        (lambda **kw: DecoderLM(vocab_size=11, encoder="rope", **sizes, **kw), lambda m: m(ids)),
        (
            lambda **kw: EncoderDecoder(
                src_vocab_size=11, tgt_vocab_size=11, encoder="alibi", **sizes, **kw
            ).eval(),
            lambda m: m(ids, ids[:, :5]),
        ),
    ):
        torch.manual_seed(0)
        absent = make()
        torch.manual_seed(0)
        given = make(**off)
        assert absent.state_dict().keys() == given.state_dict().keys()
        assert torch.equal(run(absent), run(given))


def test_head_rms_norm_by_hand() -> None:
    """``[3, 4]`` with scales ``[2, 0.5]``: mean square 12.5, so ``[6, 2] / sqrt(12.5 +
    eps)``; each head and row on its own."""
    norm = HeadRMSNorm(2)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([2.0, 0.5]))
    x = torch.tensor([[3.0, 4.0], [1.0, -1.0]], dtype=torch.float64).view(1, 2, 1, 2)
    rms = math.sqrt(12.5 + QK_NORM_EPS), math.sqrt(1.0 + QK_NORM_EPS)
    want = [[6 / rms[0], 2 / rms[0]], [2 / rms[1], -0.5 / rms[1]]]
    want = torch.tensor(want, dtype=torch.float64).view(1, 2, 1, 2)
    torch.testing.assert_close(norm(x), want, rtol=1e-15, atol=0)


class _Recorder(AttentionPositional):
    """The hooks of ``inner``, recording the q and k the positional transform gets."""

    def __init__(self, inner: AttentionPositional) -> None:
        super().__init__()
        self.inner, self.seen = inner, []

    def transform_qk(self, q, k, ctx):
        self.seen.append((q, k))
        return self.inner.transform_qk(q, k, ctx)


def test_qk_norm_comes_before_the_positional_transform() -> None:
    """With ``qk_norm`` the q and k that RoPE rotates are RMS-normalised per head (unit
    mean square with unit scales); without it they are the projections'."""
    enc = build("rope", d_model=32, n_heads=4, n_layers=1)
    x = torch.randn(2, 6, 32) * 3
    ctx = enc.context(torch.arange(6)[None], torch.arange(6)[None], AttnKind.CAUSAL)
    for qk_norm in (True, False):
        pos = _Recorder(enc.for_attention(layer=0, kind=AttnKind.CAUSAL))
        attn = Attention(
            d_model=32, n_heads=4, dropout=0.0, pos=pos, modifiers=Modifiers(qk_norm=qk_norm)
        )
        attn(x, ctx)
        (q, k), want_q = pos.seen[0], attn._heads(x, attn.q_proj)
        if qk_norm:
            ones = torch.ones(2, 4, 6)
            torch.testing.assert_close(q.square().mean(-1), ones, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(k.square().mean(-1), ones, rtol=1e-4, atol=1e-4)
            want_q = want_q * torch.rsqrt(want_q.square().mean(-1, keepdim=True) + QK_NORM_EPS)
        torch.testing.assert_close(q, want_q)


def test_key_counts() -> None:
    """Keys each query sees: causal, after a cache (a tensor shift), with left padding,
    and bidirectional with key padding."""
    assert key_counts(3, 3, shift=0, key_valid=None, device="cpu").tolist() == [[1, 2, 3]]
    slot = torch.tensor(5)  # a cached step: queries in slots 5 and 6 of 8
    assert key_counts(2, 8, shift=slot, key_valid=None, device="cpu").tolist() == [[6, 7]]
    valid = torch.tensor([[False, False, True, True, True], [True] * 5])  # row 0: 2 pads
    got = key_counts(3, 5, shift=2, key_valid=valid, device="cpu")
    assert got.tolist() == [[1, 2, 3], [3, 4, 5]]
    got = key_counts(3, 5, shift=None, key_valid=valid, device="cpu")
    assert got.tolist() == [[3], [5]]
    assert key_counts(3, 5, shift=None, key_valid=None, device="cpu").tolist() == [[5]]


def _qk(t: int = 3, d: int = 4, h: int = 2):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, h, t, d, generator=gen, dtype=torch.float64)
    return q, torch.randn(1, h, t, d, generator=gen, dtype=torch.float64)


def test_ssmax_logits_are_s_log_n_times_the_scaled_score() -> None:
    """Three tokens, causal: query i's logits are ``s log(i + 1) q_i . k_j / sqrt(D)``,
    with s per head (so query 0, seeing one key, still puts all of it there); every
    backend gives the softmax of exactly these."""
    mods = LogitModifiers(2, logit_scale="ssmax", sinks=False).double()
    assert mods.s is not None and mods.s.tolist() == pytest.approx([SSMAX_INIT] * 2)
    with torch.no_grad():
        mods.s.copy_(torch.tensor([0.7, 1.3], dtype=torch.float64))
    q, k = _qk()
    _, got = _probs("none", mods, q, k)
    logits = torch.full((1, 2, 3, 3), float("-inf"), dtype=torch.float64)
    for h, s in enumerate((0.7, 1.3)):
        for i in range(3):
            for j in range(i + 1):
                logits[0, h, i, j] = s * math.log(i + 1) * float(q[0, h, i] @ k[0, h, j]) / 2
    want = logits.softmax(-1)
    assert want[0, :, 0, 0].tolist() == [1.0, 1.0]
    for backend, probs in got.items():
        torch.testing.assert_close(probs, want, rtol=1e-12, atol=1e-12, msg=backend)


def test_logit_scale_multiplies_the_score_terms_too() -> None:
    """SSMax scales the whole input of the softmax: with ALiBi, ``log(n) (q.k / sqrt(D)
    + bias)`` (``log_length``, s = 1), on every backend; bidirectional with key padding,
    n is the number of valid keys."""
    mods = LogitModifiers(2, logit_scale="log_length", sinks=False)
    q, k = _qk(t=4)
    for causal, valid in ((True, None), (False, torch.tensor([[True, True, True, False]]))):
        hooks, got = _probs("alibi", mods, q, k, causal=causal, key_valid=valid)
        enc = build("alibi", d_model=8, n_heads=2, n_layers=1)
        kind = AttnKind.CAUSAL if causal else AttnKind.BIDIRECTIONAL
        ctx = enc.context(torch.arange(4)[None], torch.arange(4)[None], kind, starts=(0, 0))
        bias = hooks.score_bias(q, k, ctx).double()
        assert bias.abs().max() > 0.1  # a term to scale
        n = torch.arange(1, 5.0, dtype=torch.float64) if causal else torch.tensor([3.0] * 4)
        logits = n.log()[:, None] * (q @ k.transpose(-1, -2) / 2 + bias)
        if causal:
            logits = logits.masked_fill(torch.ones(4, 4).triu(1).bool(), float("-inf"))
        else:
            logits = logits.masked_fill(~valid[:, None, None], float("-inf"))
        for backend, probs in got.items():
            torch.testing.assert_close(probs, logits.softmax(-1), msg=f"{backend} {causal}")


def test_sinks_take_probability_mass_and_add_no_value() -> None:
    """A sink logit per head joins each softmax: the keys' probabilities of query i sum
    to ``1 - exp(sink) / (sum_j exp(z_ij) + exp(sink))``, worked out here in float64 from
    the logits; SDPA and the explicit softmax (a zero key and value) and FlexAttention
    (``out * sigmoid(lse - sink)``) all give it."""
    mods = LogitModifiers(2, logit_scale="none", sinks=True).double()
    assert mods.sink is not None and mods.sink.tolist() == [0.0, 0.0]
    with torch.no_grad():
        mods.sink.copy_(torch.tensor([0.5, -1.0], dtype=torch.float64))
    q, k = _qk()
    _, got = _probs("none", mods, q, k)
    z = (q @ k.transpose(-1, -2) / 2).masked_fill(torch.ones(3, 3).triu(1).bool(), -math.inf)
    sink = torch.tensor([0.5, -1.0], dtype=torch.float64)[None, :, None]
    mass = sink.exp() / (z.exp().sum(-1) + sink.exp())  # (1, H, T): the sink's share
    assert mass.min() > 0.02
    want = z.exp() / (z.exp().sum(-1, keepdim=True) + sink[..., None].exp())
    for backend, probs in got.items():
        torch.testing.assert_close(probs.sum(-1), 1 - mass, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(probs, want, rtol=1e-12, atol=1e-12, msg=backend)


def test_modifiers_learn() -> None:
    """Gradients reach SSMax's s, the sinks and the norms' scales (the explicit path that
    trains on a CPU)."""
    model = DecoderLM(vocab_size=11, encoder="alibi", d_model=16, n_heads=2, n_layers=1, **OPTIONS)
    model(torch.randint(0, 11, (2, 9))).square().mean().backward()
    attn = model.stack.layers[0].self_attn
    assert attn.logits is not None and attn.q_norm is not None and attn.k_norm is not None
    for p in (attn.logits.s, attn.logits.sink, attn.q_norm.weight, attn.k_norm.weight):
        assert p is not None and p.grad is not None and p.grad.abs().sum() > 0


def test_schemes_that_own_their_attention_refuse_the_logit_options(tmp_path) -> None:
    """One line before training; QK-norm applies to them as to any scheme."""
    from posenc.config import ConfigError, validate
    from posenc.train import train
    from tests.conftest import compose_run

    with pytest.raises(ConfigError) as err:
        train(compose_run(tmp_path, "encoder=stickbreak", "model.sinks=true"))
    assert str(err.value).splitlines()[1:] == [
        "  model.sinks=true: the StickBreaking encoder computes its own attention weights, not "
        "the softmax and mask these options change; drop the option or choose another encoder"
    ]
    with pytest.raises(ConfigError) as err:
        train(compose_run(tmp_path, "model.logit_scale=ssmaxx"))
    assert str(err.value).splitlines()[1:] == [
        "  model.logit_scale='ssmaxx': did you mean 'ssmax'? allowed none, log_length, ssmax"
    ]
    validate(compose_run(tmp_path, "encoder=selective", "model.qk_norm=true"))
    with pytest.raises(ValueError, match="logit_scale=log_length: the Selective encoder"):
        DecoderLM(vocab_size=11, encoder="selective", logit_scale="log_length")
