"""Selective attention (Leviathan, Kalman and Matias 2024): values from the paper's
formula by a double loop, causality, the first token never masked (also after left
padding), and the refusal of bidirectional attention. Cached decoding (token by token,
in chunks, left-padded, beam-reordered) is checked with every encoder in
tests/model/test_cache.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from posenc.encoders import build
from posenc.encoders.base import AttnKind
from posenc.model import DecoderLM, EncoderDecoder
from posenc.model.backends import attend

#: The layer cache's buffer of accumulated masks (posenc/encoders/selective.py).
ACC = "selective_acc"  # the cache slot's name (posenc.encoders.selective.ACC)

B, H, T, D = 2, 2, 5, 3


def run(q: Tensor, k: Tensor, v: Tensor, pad: list[int] | None = None) -> Tensor:
    """The scheme through the contract's :func:`attend`, causal, with ``pad[b]`` left
    padding slots in row b (positions of real tokens from 0, padding at 0)."""
    enc = build("selective", d_model=H * D, n_heads=H, n_layers=1)
    hook = enc.for_attention(layer=0, kind=AttnKind.CAUSAL)
    t = q.shape[-2]
    valid = None
    pos = torch.arange(t)[None]
    if pad is not None:
        shifted = torch.arange(t)[None] - torch.tensor(pad)[:, None]
        valid, pos = shifted >= 0, shifted.clamp(min=0)
    ctx = enc.context(pos, pos, AttnKind.CAUSAL)
    return attend(hook, q, k, v, ctx, key_valid=valid, shift=0, p_drop=0.0)


def reference(q: Tensor, k: Tensor, v: Tensor, pad: list[int] | None = None) -> Tensor:
    """The paper's formula, one number at a time: row b's real tokens are ``first ..
    T-1`` (``first = pad[b]``), ``S_kj = relu(z^0_kj)`` for ``first < j < k`` (not the
    first token, not itself, causal), ``F_ij = sum_{k < i} S_kj``, and each head's
    softmax over ``z^h_ij - F_ij`` for ``first <= j <= i``. Padding queries: zeros."""
    b_n, h_n, t, d = q.shape
    out = torch.zeros_like(q)
    for b in range(b_n):
        first = 0 if pad is None else pad[b]

        def z(h: int, i: int, j: int, b: int = b) -> float:
            return float(q[b, h, i] @ k[b, h, j]) / math.sqrt(d)

        for i in range(first, t):
            for h in range(h_n):
                logits = []
                for j in range(first, i + 1):
                    f = sum(
                        max(z(0, m, j), 0.0)
                        for m in range(first, i)
                        if j != first and j != m and j <= m
                    )
                    logits.append(z(h, i, j) - f)
                top = max(logits)
                w = [math.exp(x - top) for x in logits]
                for n, j in enumerate(range(first, i + 1)):
                    out[b, h, i] += w[n] / sum(w) * v[b, h, j]
    return out


def qkv(seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, D, generator=gen, dtype=torch.float64) for _ in range(3))


def test_values_equal_the_papers_formula_by_hand() -> None:
    q, k, v = qkv()
    got, want = run(q, k, v), reference(q, k, v)
    assert (got - want).abs().max() < 1e-12
    # and the mask F matters here: plain causal softmax attention is far off
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    plain = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf")).softmax(-1) @ v
    assert (got - plain).abs().max() > 1e-2


def test_left_padded_rows_equal_the_formula_from_their_first_real_token() -> None:
    q, k, v = qkv(1)
    pad = [2, 0]
    got, want = run(q, k, v, pad), reference(q, k, v, pad)
    assert (got - want).abs().max() < 1e-12
    # row 0 equals its real tokens alone, with no padding
    alone = run(q[:1, :, 2:], k[:1, :, 2:], v[:1, :, 2:])
    assert (got[0, :, 2:] - alone[0]).abs().max() < 1e-12
    assert torch.equal(got[0, :, :2], torch.zeros(H, 2, D, dtype=q.dtype))  # padding rows


def test_nothing_leaks_past_the_causal_mask() -> None:
    q, k, v = qkv(2)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):  # later tokens (as queries, maskers, keys and values) change
        x[:, :, 3:] += torch.randn(B, H, T - 3, D, dtype=x.dtype)
    a, b = run(q, k, v), run(q2, k2, v2)
    assert torch.equal(a[:, :, :3], b[:, :, :3])
    assert not torch.allclose(a[:, :, 3:], b[:, :, 3:])
    # A DecoderLM as a whole (the scheme in every layer): earlier logits unchanged.
    model = DecoderLM(vocab_size=13, encoder="selective", d_model=8, n_heads=2, n_layers=2)
    model = model.double().eval()
    ids = torch.randint(0, 13, (2, 9))
    changed = ids.clone()
    changed[:, 6:] = (ids[:, 6:] + 1) % 13
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[:, :6], model(changed)[:, :6], rtol=0, atol=0)


@pytest.mark.parametrize("pad", [0, 2])
def test_the_first_token_is_never_masked(pad: int) -> None:
    """Head 0's logits on the first real token and the next one are large for every
    query, so every later token would mask both: the first (the paper's <BOS>) keeps
    its logit, ``log p_i0 - log p_ii = z_i0 - z_ii`` exactly (F_i0 = F_ii = 0), while the
    next one loses F_i1 > 0. Values are one-hot per key, so the output is the
    probabilities."""
    t = 6
    u = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, H, t, t, generator=gen, dtype=torch.float64) * 0.3
    k = torch.randn(1, H, t, t, generator=gen, dtype=torch.float64) * 0.3
    q[0, :, :] += 2.0 * u  # every query (and masker) aligned with u ...
    k[0, :, pad : pad + 2] += 2.0 * u  # ... as are the first two real keys
    v = torch.eye(t, dtype=torch.float64).expand(1, H, t, t)
    probs = run(q, k, v, [pad] if pad else None)  # (1, H, T, T)
    z = (q @ k.transpose(-1, -2)) / math.sqrt(t)
    first, second = pad, pad + 1
    for i in range(first + 3, t):  # at least one masker between
        log_p = probs[0, :, i].log()
        torch.testing.assert_close(
            log_p[:, first] - log_p[:, i], z[0, :, i, first] - z[0, :, i, i], rtol=0, atol=1e-12
        )
        f = sum(max(float(z[0, 0, m, second]), 0.0) for m in range(second + 1, i))
        assert f > 1.0
        torch.testing.assert_close(
            log_p[:, second] - log_p[:, i],
            z[0, :, i, second] - z[0, :, i, i] - f,
            rtol=0,
            atol=1e-12,
        )


def test_the_cache_carries_one_row_per_sequence_and_slot() -> None:
    """The per-key state a step carries: ``(B, S)``, batch first (beam reorders)."""
    model = DecoderLM(vocab_size=13, encoder="selective", d_model=8, n_heads=2, n_layers=2).eval()
    with torch.no_grad():
        cache = model.new_cache(10)
        model(torch.randint(0, 13, (3, 4)), cache=cache)
    assert all(layer.buffers[ACC].shape == (3, 10) for layer in cache.layers)


def test_bidirectional_attention_is_refused_with_the_reason() -> None:
    enc = build("selective", d_model=8, n_heads=2, n_layers=1)
    with pytest.raises(ValueError, match="selective is causal only: bidirectional"):
        enc.for_attention(layer=0, kind=AttnKind.BIDIRECTIONAL)
    with pytest.raises(ValueError, match="another encoder for task=mt"):
        EncoderDecoder(src_vocab_size=9, tgt_vocab_size=9, encoder="selective", d_model=8,
                       n_heads=2, n_layers=1)  # fmt: skip
