"""Stick-breaking attention: values by hand from the paper's products, weights that never
exceed the stick nor reach a key past the causal mask or padding, the refusal of
bidirectional attention."""

from __future__ import annotations

import math

import pytest
import torch

from posenc.encoders.base import AttnKind
from posenc.encoders.registry import build
from posenc.encoders.stickbreak import stickbreak_weights
from posenc.model import DecoderLM, EncoderDecoder
from posenc.model.backends import attend
from tests.conftest import heads, identity_attention, merge

SIZES = dict(d_model=8, n_heads=2, n_layers=1)
#: The leftover stick to the query's own value, the form the formula tests below check.
VALUE = dict(SIZES, remainder="value")


def loop_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend_current: bool
) -> torch.Tensor:
    """``(T, D)`` outputs of one head, from the formula with products and loops:
    ``A_ij = beta_ij prod_{j<k<i} (1 - beta_ik)`` over the breaking keys (``j < i``, or
    ``j <= i`` when the query attends to itself), ``o_i = sum_j A_ij v_j + (1 - sum_j
    A_ij) v_i``."""
    t, d = q.shape
    out = torch.zeros_like(v)
    for i in range(t):
        last = i if attend_current else i - 1  # the nearest key that breaks the stick
        beta = [1.0 / (1.0 + math.exp(-float(q[i] @ k[j]) / math.sqrt(d))) for j in range(t)]
        total = 0.0
        for j in range(last + 1):
            a = beta[j]
            for m in range(j + 1, last + 1):
                a *= 1.0 - beta[m]
            out[i] += a * v[j]
            total += a
        out[i] += (1.0 - total) * v[i]
    return out


@pytest.mark.parametrize("attend_current", [False, True])
def test_values_equal_the_papers_products(attend_current: bool) -> None:
    """T = 4, one head, float64: the layer (identity projections, so its heads are q, k
    and v) equals the loop over the formula."""
    enc = build(
        "stickbreak",
        d_model=4,
        n_heads=1,
        n_layers=1,
        attend_current=attend_current,
        remainder="value",
    )
    attn = identity_attention(enc, AttnKind.CAUSAL).double()
    x = torch.randn(1, 4, 4, dtype=torch.float64) * 2.0  # logits of both signs, |z| ~ 2
    pos = torch.arange(4)[None]
    with torch.no_grad():
        got = attn(x, enc.context(pos, pos, AttnKind.CAUSAL))
    want = loop_reference(x[0], x[0], x[0], attend_current)
    torch.testing.assert_close(got[0], want, rtol=1e-12, atol=1e-12)
    # attend_current changes the result: the option is not a no-op
    other = loop_reference(x[0], x[0], x[0], not attend_current)
    assert not torch.allclose(got[0], other, atol=1e-6)


def test_first_query_takes_its_own_value() -> None:
    """With ``remainder=value`` the first query has no key before it: the whole stick is
    left, and its output is its own value (the reference's remainder term), not zeros or
    NaN."""
    enc = build("stickbreak", **VALUE)
    attn = identity_attention(enc, AttnKind.CAUSAL)
    x = torch.randn(2, 5, 8)
    pos = torch.arange(5)[None]
    with torch.no_grad():
        out = attn(x, enc.context(pos, pos, AttnKind.CAUSAL))
    torch.testing.assert_close(out[:, 0], x[:, 0])


def test_weights_stay_within_the_stick_and_the_mask() -> None:
    """Every row's weights sum to at most 1, and keys that do not break the stick
    (future, padding, the query itself) get exactly 0, with large logits of both signs."""
    t = 7
    z = torch.randn(2, 3, t, t) * 30.0
    causal = torch.ones(t, t, dtype=torch.bool).tril(-1)[None, None]
    valid = torch.ones(2, t, dtype=torch.bool)
    valid[1, :3] = False  # row 1 left-padded by 3
    breaks = causal & valid[:, None, None, :]
    a = stickbreak_weights(z, breaks)
    assert torch.isfinite(a).all()
    assert (a.sum(-1) <= 1.0 + 1e-6).all()
    assert (a[~breaks.expand_as(a)] == 0.0).all()
    # rows with no breaking key (the first query, padded ones) are all zeros
    assert (a[0, :, 0] == 0.0).all() and (a[1, :, :4] == 0.0).all()


def test_nothing_leaks_past_the_causal_mask_or_padding() -> None:
    """Changing later tokens leaves earlier outputs exactly as they were, and so does
    changing the left padding of a row (with a key padding mask)."""
    model = DecoderLM(vocab_size=30, encoder="stickbreak", dropout=0.0, **SIZES).eval()
    ids = torch.randint(0, 30, (2, 10))
    later = ids.clone()
    later[:, 6:] = (ids[:, 6:] + 1) % 30
    with torch.no_grad():
        a, b = model(ids), model(later)
    assert torch.equal(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])
    # the attention layer alone, on padded keys: padding changes nothing on real tokens
    enc = build("stickbreak", **SIZES)
    attn = identity_attention(enc, AttnKind.CAUSAL)
    x = torch.randn(1, 6, 8)
    other = x.clone()
    other[:, :2] = torch.randn(1, 2, 8)
    valid = torch.arange(6)[None] >= 2
    pos = torch.arange(6)[None]
    with torch.no_grad():
        ctx = enc.context(pos, pos, AttnKind.CAUSAL)
        p, r = attn(x, ctx, key_valid=valid), attn(other, ctx, key_valid=valid)
        alone = attn(x[:, 2:], enc.context(pos[:, :4], pos[:, :4], AttnKind.CAUSAL))
    assert torch.equal(p[:, 2:], r[:, 2:])
    torch.testing.assert_close(p[:, 2:], alone)


def test_dropout_acts_on_the_weights_not_on_the_remainder() -> None:
    """Dropout changes the output and keeps it finite; it drops weights ``A`` only, the
    remainder being taken before it: with ``p_drop = 1`` every ``A_ij`` is dropped and
    query i outputs ``(1 - sum_j A_ij) v_i`` (``remainder=value``)."""
    enc = build("stickbreak", **VALUE)
    hook = enc.for_attention(layer=0, kind=AttnKind.CAUSAL)
    x = torch.randn(1, 6, 8)
    q = heads(x, 2)  # (1, 2, 6, 4)
    pos = torch.arange(6)[None]
    ctx = enc.context(pos, pos, AttnKind.CAUSAL)
    plain = attend(hook, q, q, q, ctx, key_valid=None, shift=0, p_drop=0.0)
    dropped = attend(hook, q, q, q, ctx, key_valid=None, shift=0, p_drop=0.5)
    assert torch.isfinite(merge(dropped)).all()
    assert not torch.allclose(plain, dropped)
    all_dropped = attend(hook, q, q, q, ctx, key_valid=None, shift=0, p_drop=1.0)
    z = q @ q.transpose(-1, -2) / 2.0  # D = 4
    a = stickbreak_weights(z, torch.ones(6, 6, dtype=torch.bool).tril(-1)[None, None])
    torch.testing.assert_close(all_dropped, (1.0 - a.sum(-1, keepdim=True)) * q)


def test_bidirectional_attention_is_refused_with_the_reason() -> None:
    enc = build("stickbreak", **SIZES)
    with pytest.raises(ValueError, match="stickbreak is causal only.*walking back"):
        enc.for_attention(layer=0, kind=AttnKind.BIDIRECTIONAL)
    with pytest.raises(ValueError, match="causal only"):
        EncoderDecoder(src_vocab_size=20, tgt_vocab_size=20, encoder="stickbreak", **SIZES)


def authors_sb_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    head_bias: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
) -> torch.Tensor:
    """``(T, C)`` output before the output projection of the authors' model layer (IBM
    dolomite-engine, ``SBAttention``: ``sb_attn``, then ``+ rem * head_bias``, then
    ``GroupNorm(H, C)``), written out for ``q, k, v (H, T, D)`` one query at a time in
    float64, as its decoding path computes a row: logits over the keys before the query,
    ``log A_j = logsigmoid(z_j) + sum_{k > j} logsigmoid(-z_k)``; then each head's D
    channels normalised with mean and biased variance, eps 1e-5, scale and shift per
    channel."""
    n_heads, t, d = q.shape
    rows = []
    for i in range(t):
        u = torch.zeros(n_heads, d, dtype=torch.float64)
        for h in range(n_heads):
            z = [float(q[h, i] @ k[h, j]) / math.sqrt(d) for j in range(i)]
            log_keep = [math.log(1.0 - 1.0 / (1.0 + math.exp(-zj))) for zj in z]
            att = [
                math.exp(math.log(1.0 / (1.0 + math.exp(-z[j]))) + sum(log_keep[j + 1 :]))
                for j in range(i)
            ]
            for j in range(i):
                u[h] += att[j] * v[h, j]
            u[h] += (1.0 - sum(att)) * head_bias[h]
        mean = u.mean(-1, keepdim=True)
        var = ((u - mean) ** 2).mean(-1, keepdim=True)
        normed = (u - mean) / torch.sqrt(var + 1e-5)
        rows.append(normed.flatten() * weight + bias)  # channels in head order
    return torch.stack(rows)


def test_head_bias_equals_the_authors_model_layer() -> None:
    """The default remainder, float64, T = 5, two heads of 3: the layer (identity
    projections) equals the authors' layer written out, to 1e-12, with a learned head
    bias and norm scale and shift away from their start; ``value`` differs from it."""
    torch.manual_seed(5)
    enc = build("stickbreak", d_model=6, n_heads=2, n_layers=1)
    attn = identity_attention(enc, AttnKind.CAUSAL).double()
    with torch.no_grad():
        for p in (attn.pos.head_bias, attn.pos.norm.weight, attn.pos.norm.bias):
            p.copy_(torch.randn_like(p))
    x = torch.randn(1, 5, 6, dtype=torch.float64) * 2.0
    pos = torch.arange(5)[None]
    with torch.no_grad():
        got = attn(x, enc.context(pos, pos, AttnKind.CAUSAL))
    qkv = heads(x, 2)[0]  # (H, T, D)
    norm = attn.pos.norm
    want = authors_sb_layer(qkv, qkv, qkv, attn.pos.head_bias, norm.weight, norm.bias)
    torch.testing.assert_close(got[0], want.detach(), rtol=1e-12, atol=1e-12)
    old = identity_attention(
        build("stickbreak", d_model=6, n_heads=2, n_layers=1, remainder="value"), AttnKind.CAUSAL
    ).double()
    with torch.no_grad():
        assert not torch.allclose(got, old(x, enc.context(pos, pos, AttnKind.CAUSAL)), atol=1e-3)


def test_head_bias_starts_as_the_authors_and_learns() -> None:
    """b_h = 0, norm scale 1 and shift 0 after the model's initialisation; all three
    get gradients."""
    model = DecoderLM(vocab_size=30, encoder="stickbreak", **SIZES)
    hook = model.stack.layers[0].self_attn.pos
    assert torch.equal(hook.head_bias, torch.zeros(2, 4))
    assert torch.equal(hook.norm.weight, torch.ones(8)) and torch.equal(
        hook.norm.bias, torch.zeros(8)
    )
    model(torch.randint(0, 30, (2, 9))).logsumexp(-1).mean().backward()
    for p in (hook.head_bias, hook.norm.weight, hook.norm.bias):
        assert p.grad is not None and p.grad.abs().sum() > 0


@pytest.mark.parametrize("remainder", ["head_bias", "value"])
def test_cached_decoding_equals_the_full_pass(remainder: str) -> None:
    from tests.model.test_cache import TOL, L, N, _cached_and_full, lm

    model = lm("stickbreak", {"remainder": remainder})
    ids = torch.randint(0, 17, (2, N))
    with torch.no_grad():  # a prefill, single steps and uneven chunks
        got, want = _cached_and_full(model, ids, [L, 1, 1, 3, L + 2, N - 2 * L - 7])
    assert (got - want).abs().max() <= TOL


def test_a_bad_remainder_is_refused_in_one_line(tmp_path) -> None:
    from posenc.config import ConfigError
    from posenc.train import train
    from tests.conftest import compose_run

    with pytest.raises(ConfigError) as err:
        train(compose_run(tmp_path, "encoder=stickbreak", "encoder.remainder=foo"))
    line = (
        "encoder: stickbreak: unknown remainder 'foo'; allowed: head_bias, value (head_bias is "
        "the authors' model layer, value the query's own value)"
    )
    assert str(err.value).splitlines()[1:] == [f"  {line}"]
    assert not (tmp_path / "run").exists()
