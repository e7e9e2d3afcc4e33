"""Selective attention (Leviathan et al. 2024): outputs from the paper's formula by
loops, the first token never masked, nothing past the causal mask, the refusal of
bidirectional attention."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from posenc.encoders.base import AttnKind
from posenc.encoders.registry import build

H, D = 2, 3


def _attend(q, k, v, key_valid=None):
    enc = build("selective", d_model=H * D, n_heads=H, n_layers=1)
    hook = enc.for_attention(layer=0, kind=AttnKind.CAUSAL)
    t = q.shape[-2]
    pos = torch.arange(t)[None]
    ctx = replace(
        enc.context(pos, pos, AttnKind.CAUSAL, starts=(0, 0)), shift=0, key_valid=key_valid
    )
    return hook.attend(q, k, v, ctx, p_drop=0.0, cache=None)


def by_loops(q, k, v):
    """One row: F_ij = sum_{j<k<i} relu(z0_kj) (j not the first token), then softmax of
    z_ij - F_ij over j <= i, term by term (float64)."""
    _, h, t, d = q.shape
    z = [
        [[float(q[0, hh, a] @ k[0, hh, b]) / math.sqrt(d) for b in range(t)] for a in range(t)]
        for hh in range(h)
    ]
    out = torch.zeros(1, h, t, v.shape[-1], dtype=torch.float64)
    for hh in range(h):
        for i in range(t):
            logits = []
            for j in range(i + 1):
                f = sum(max(z[0][m][j], 0.0) for m in range(j + 1, i)) if j > 0 else 0.0
                logits.append(z[hh][i][j] - f)
            top = max(logits)
            w = [math.exp(x - top) for x in logits]
            for j in range(i + 1):
                out[0, hh, i] += w[j] / sum(w) * v[0, hh, j]
    return out


def test_outputs_equal_the_papers_formula() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, 6, D, dtype=torch.float64) * 2 for _ in range(3))
    torch.testing.assert_close(_attend(q, k, v), by_loops(q, k, v), rtol=0, atol=1e-12)


def test_the_first_token_is_never_masked() -> None:
    """Head 0's huge logits for key 0 would mask it from every later query; the paper
    keeps <BOS>: key 0's logit reaches the softmax unchanged (and a padded row's first
    real token is kept the same way)."""
    q = torch.zeros(1, H, 5, D, dtype=torch.float64)
    k = torch.zeros(1, H, 5, D, dtype=torch.float64)
    q[..., 0] = 10.0
    k[:, :, 0, 0] = 10.0  # every token's head-0 logit for key 0 is 100 / sqrt(3)
    v = torch.eye(5, dtype=torch.float64)[None, None].expand(1, H, 5, 5)
    out = _attend(q, k, v)
    assert (out[0, :, 1:, 0] > 0.99).all()  # key 0 still takes (nearly) all the weight
    padded_q = torch.cat([torch.zeros(1, H, 2, D, dtype=torch.float64), q], 2)
    padded_k = torch.cat([torch.zeros(1, H, 2, D, dtype=torch.float64), k], 2)
    padded_v = torch.cat([torch.zeros(1, H, 2, 5, dtype=torch.float64), v], 2)
    valid = torch.tensor([[False, False, True, True, True, True, True]])
    torch.testing.assert_close(_attend(padded_q, padded_k, padded_v, valid)[:, :, 2:], out)


def test_nothing_leaks_past_the_causal_mask() -> None:
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, H, 7, D, dtype=torch.float64) for _ in range(3))
    base = _attend(q, k, v)
    k2, v2, q2 = k.clone(), v.clone(), q.clone()
    k2[:, :, 4:] += 1.0
    v2[:, :, 4:] += 1.0
    q2[:, :, 4:] += 1.0
    torch.testing.assert_close(_attend(q2, k2, v2)[:, :, :4], base[:, :, :4], rtol=0, atol=0)


def test_bidirectional_attention_is_refused() -> None:
    enc = build("selective", d_model=H * D, n_heads=H, n_layers=1)
    with pytest.raises(ValueError, match="selective is causal only"):
        enc.for_attention(layer=0, kind=AttnKind.BIDIRECTIONAL)
