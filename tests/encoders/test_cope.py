"""CoPE, contextual position encoding (Golovneva et al. 2024): the counted positions and
the interpolated position logits from the paper's formulas, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from posenc.encoders import build
from posenc.encoders import cope as cope_mod
from posenc.encoders.base import AttnKind
from posenc.encoders.cope import cope_term

H, D = 2, 3


def _by_hand(q, k, table, scale, limit):
    """The paper's formulas term by term: gates, counts, interpolation (float64)."""
    b, h, t, _ = q.shape
    s = k.shape[-2]
    out = torch.zeros(b, h, t, s, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(t):
                gate = [
                    1 / (1 + math.exp(-float(q[bi, hi, i] @ k[bi, hi, u]) * scale))
                    for u in range(s)
                ]
                for j in range(i + 1):
                    p = min(sum(gate[j : i + 1]), limit)
                    lo, hi_ = math.floor(p), math.ceil(p)
                    e_lo = float(q[bi, hi, i] @ table[:, lo])
                    e_hi = float(q[bi, hi, i] @ table[:, hi_])
                    out[bi, hi, i, j] = ((p - lo) * e_hi + (1 - (p - lo)) * e_lo) * scale
    return out


@pytest.mark.parametrize("limit", [8, 2])  # 2: counts clamp
def test_position_logits_from_the_formula(limit: int) -> None:
    torch.manual_seed(0)
    t = 5
    q = torch.randn(2, H, t, D, dtype=torch.float64) * 2
    k = torch.randn(2, H, t, D, dtype=torch.float64) * 2
    table = torch.randn(D, limit + 1, dtype=torch.float64)
    visible = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    got = cope_term(q, k, table, visible, D**-0.5)
    want = _by_hand(q, k, table, D**-0.5, limit)
    keep = visible.expand_as(got)
    torch.testing.assert_close(got[keep], want[keep], rtol=0, atol=1e-12)


@pytest.mark.parametrize("grad", [True, False])
def test_query_blocks_give_the_whole_term(grad: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """In blocks of 3 queries (recomputed in the backward pass when training) the term,
    and the gradients of queries, keys and table, equal the term built at once."""
    torch.manual_seed(2)
    t, limit = 8, 5
    q = torch.randn(2, H, t, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, H, t, D, dtype=torch.float64, requires_grad=True)
    table = torch.randn(D, limit + 1, dtype=torch.float64, requires_grad=True)
    visible = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    weights = torch.randn(2, H, t, t, dtype=torch.float64)
    results = []
    for block in (t, 3):
        monkeypatch.setattr(cope_mod, "COPE_BLOCK", block)
        with torch.set_grad_enabled(grad):
            term = cope_term(q, k, table, visible, D**-0.5)
        grads = torch.autograd.grad((term * weights).sum(), (q, k, table)) if grad else ()
        results.append((term.detach(), *grads))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_a_masked_key_counts_nothing() -> None:
    """A padding key between j and the query adds no gate to p_ij."""
    torch.manual_seed(1)
    q = torch.randn(1, 1, 4, D, dtype=torch.float64)
    k = torch.randn(1, 1, 4, D, dtype=torch.float64)
    table = torch.randn(D, 9, dtype=torch.float64)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]
    pad = causal & torch.tensor([True, False, True, True])  # key 1 is padding
    with_pad = cope_term(q, k, table, pad, D**-0.5)
    alone = cope_term(q[..., :, :], k[:, :, [0, 2, 3]], table, causal[..., [0, 2, 3]], D**-0.5)
    torch.testing.assert_close(with_pad[..., [0, 2, 3]][..., 2:, :], alone[..., 2:, :])


def test_gradient_reaches_gates_queries_and_table() -> None:
    enc = build("cope", d_model=H * D * 2, n_heads=H, n_layers=1, count_limit=6)
    hook = enc.for_attention(layer=0, kind=AttnKind.CAUSAL)
    torch.nn.init.normal_(hook.table)
    q = torch.randn(1, H, 4, 2 * D, requires_grad=True)
    k = torch.randn(1, H, 4, 2 * D, requires_grad=True)
    pos = torch.arange(4)[None]
    ctx = enc.context(pos, pos, AttnKind.CAUSAL, starts=(0, 0))
    from dataclasses import replace

    ctx = replace(ctx, shift=0)
    hook.score_bias(q, k, ctx).sum().backward()
    assert q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0 and hook.table.grad.abs().sum() > 0


def test_bad_count_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="count_limit must be a positive integer"):
        build("cope", d_model=8, n_heads=2, n_layers=1, count_limit=0)
