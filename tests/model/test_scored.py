"""scored_attention (attention with a score term and a hand-written backward) against
plain autograd of the textbook formula, and the Attention module's use of it."""

from __future__ import annotations

import pytest
import torch

from posenc.encoders import available, build
from posenc.encoders.base import AttnKind, dense_parts
from posenc.model import backends, scored
from posenc.model.attention import Attention
from posenc.model.scored import scored_attention

B, H, T, S, D = 2, 3, 5, 7, 4


def reference(q, k, v, parts, *, scale, causal_shift=None, key_valid=None, keep=None, p=0.0):
    """softmax(q k^T * scale + sum of parts, masked) @ v by autograd; rows without a
    key get zero probabilities. Returns (out, probs after dropout)."""
    t, s = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-1, -2) * scale
    for term, c0 in parts:
        pad = torch.zeros(*torch.broadcast_shapes(term.shape[:-1], scores.shape[:-1]), s)
        pad = pad.to(term.dtype)
        pad[..., c0 : c0 + term.shape[-1]] = term
        scores = scores + pad
    blocked = torch.zeros(t, s, dtype=torch.bool)
    if causal_shift is not None:
        blocked = torch.arange(s)[None, :] > torch.arange(t)[:, None] + causal_shift
    blocked = blocked.expand(*scores.shape)
    if key_valid is not None:
        blocked = blocked | ~key_valid[:, None, None, :]
    scores = scores.masked_fill(blocked, float("-inf"))
    probs = torch.where(blocked.all(-1, keepdim=True), 0.0, scores.softmax(-1))
    if keep is not None:
        probs = probs * keep / (1 - p)
    return probs @ v, probs


def inputs(dtype=torch.float32):
    q, k, v = (torch.randn(B, H, n, D, dtype=dtype, requires_grad=True) for n in (T, S, S))
    return q, k, v


def check(parts_fn, **kw) -> None:
    """Values and gradients (of q, k, v, every part, and through the probabilities)."""
    q, k, v = inputs()
    leaves = [torch.randn(*shape, requires_grad=True) for shape in parts_fn("shapes")]
    parts = parts_fn(leaves)
    w_out, w_probs = torch.randn(B, H, T, D), torch.randn(B, H, T, S)

    def run(fn):
        out, probs = fn(q, k, v, parts, scale=0.7, **kw)
        loss = (out * w_out).sum() + (probs * w_probs).sum()
        return out, probs, torch.autograd.grad(loss, [q, k, v, *leaves])

    got, want = run(scored_attention), run(reference)
    for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def full(leaves):
    """A (B, H, T, S) term that is not contiguous."""
    return [(B, H, T + 1, S)] if leaves == "shapes" else [(leaves[0][..., 1:, :], 0)]


def broadcast_heads(leaves):
    return [(1, H, T, S)] if leaves == "shapes" else [(leaves[0], 0)]


def broadcast_batch(leaves):
    return [(B, 1, T, S)] if leaves == "shapes" else [(leaves[0], 0)]


def strided(leaves):
    """A (T, S) view of a per-row table with strides (L-1, 1), as the relative schemes pass."""
    if leaves == "shapes":
        return [(B, H, T, S + T)]
    table = leaves[0]
    view = table.as_strided((B, H, T, S), (*table.stride()[:2], S + T - 1, 1), 2)
    return [(view, 0)]


def pieces(leaves):
    """Column parts that overlap and leave columns out, one of them transposed."""
    if leaves == "shapes":
        return [(B, H, T, 4), (1, H, 3, T), (B, 1, T, 2)]
    return [(leaves[0], 1), (leaves[1].transpose(-1, -2), 4), (leaves[2], 2)]


def three_dims(leaves):
    """A (H, T, S) term without the batch dim (broadcast like the README's example)."""
    return [(H, T, S)] if leaves == "shapes" else [(leaves[0], 0)]


def tiles(leaves):
    """Parts that tile the columns (copied in), then one added on top, then a gap."""
    if leaves == "shapes":
        return [(B, H, T, 1), (1, H, T, 3), (B, H, T, 2), (B, H, T, 3)]
    return [
        (leaves[0].expand(B, H, T, 2), 0),
        (leaves[1], 2),
        (leaves[3], 1),
        (leaves[2], 5),
    ]


def tiles_with_gap(leaves):
    if leaves == "shapes":
        return [(B, H, T, 2), (B, 1, T, 2)]
    return [(leaves[0], 0), (leaves[1], 4)]


PARTS = [full, broadcast_heads, broadcast_batch, three_dims, strided, pieces, tiles, tiles_with_gap]


@pytest.mark.parametrize("parts_fn", PARTS)
@pytest.mark.parametrize("causal_shift", [None, 0, 2])
def test_equals_autograd_of_the_formula(parts_fn, causal_shift) -> None:
    check(parts_fn, causal_shift=causal_shift)


def test_no_term_and_padded_keys() -> None:
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[1, 4:] = False
    check(lambda leaves: [] if leaves == "shapes" else [], key_valid=valid)
    check(full, key_valid=valid, causal_shift=1)


def test_a_query_without_keys_gets_zeros_not_nan() -> None:
    # shift -2: queries 0 and 1 see no key at all.
    q, k, v = inputs()
    out, probs = scored_attention(q, k, v, None, scale=1.0, causal_shift=-2)
    assert torch.isfinite(out).all() and (probs[:, :, :2] == 0).all()
    assert (out[:, :, :2] == 0).all()
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    check(full, causal_shift=-2)


def test_dropout_uses_its_mask_in_forward_and_backward(monkeypatch) -> None:
    keep = torch.rand(B, H, T, S, generator=torch.Generator().manual_seed(3)) > 0.3
    monkeypatch.setattr(scored, "dropout_keep", lambda probs, p: keep)
    q, k, v = inputs()
    table = torch.randn(B, H, T, S, requires_grad=True)
    w = torch.randn(B, H, T, D)
    got = scored_attention(q, k, v, table, scale=0.5, causal_shift=2, dropout=0.3)
    want = reference(q, k, v, [(table, 0)], scale=0.5, causal_shift=2, keep=keep, p=0.3)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    g = torch.autograd.grad((got[0] * w).sum() + got[1].sum(), [q, k, v, table])
    r = torch.autograd.grad((want[0] * w).sum() + want[1].sum(), [q, k, v, table])
    for a, b in zip(g, r, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_dropout_drops_the_asked_share() -> None:
    torch.manual_seed(0)
    probs = torch.empty(64, 64, 64)
    kept = scored.dropout_keep(probs, 0.25).float().mean().item()
    assert abs(kept - 0.75) < 0.01


def test_gradcheck_in_float64() -> None:
    q, k, v = inputs(torch.float64)
    table = torch.randn(1, H, T, S, dtype=torch.float64, requires_grad=True)
    piece = torch.randn(B, 1, T, 3, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, table, piece):
        out, probs = scored_attention(q, k, v, [(table, 0), (piece, 2)], scale=0.3, causal_shift=1)
        return out, probs

    assert torch.autograd.gradcheck(fn, (q, k, v, table, piece))


def test_a_part_past_the_keys_is_an_error() -> None:
    q, k, v = inputs()
    with pytest.raises(ValueError, match="exceeds S=7"):
        scored_attention(q, k, v, [(torch.zeros(B, H, T, 3), 5)], scale=1.0)


# The schemes with a score term (a bias, its parts, or a value term), as their hooks say.
SCORED = [
    n
    for n in available()
    if build(n, d_model=8, n_heads=2, n_layers=1)
    .for_attention(layer=0, kind=AttnKind.CAUSAL)
    .adds_scores
]


@pytest.mark.parametrize("name", SCORED)
@pytest.mark.parametrize("kind", [AttnKind.CAUSAL, AttnKind.BIDIRECTIONAL])
def test_module_matches_sdpa_with_the_dense_term(monkeypatch, name: str, kind: AttnKind) -> None:
    """The module's scored path equals SDPA with the score term as its mask (the CUDA
    route), in outputs and in the gradients of the input and every parameter."""
    enc = build(name, d_model=H * D, n_heads=H, n_layers=1)
    if kind is AttnKind.BIDIRECTIONAL and enc.causal_only:
        pytest.skip(f"{name} is causal only")
    hook = enc.for_attention(layer=0, kind=kind)
    attn = Attention(d_model=H * D, n_heads=H, dropout=0.0, pos=hook)
    x = torch.randn(B, 9, H * D)
    valid = torch.ones(B, 9, dtype=torch.bool)
    valid[1, 7:] = False
    pos = torch.arange(9)[None]
    params = [x.requires_grad_(), *attn.parameters(), *enc.parameters()]

    kv = None if kind is AttnKind.CAUSAL else valid

    def run():
        out = attn(x, enc.context(pos, pos, kind), key_valid=kv)
        return out, torch.autograd.grad(out.square().sum(), params, allow_unused=True)

    calls = []
    real = backends.scored_attention
    monkeypatch.setattr(
        backends, "scored_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    got = run()
    assert calls, "the CPU path should be scored_attention"
    if attn.pos.needs_probs:
        return  # a value term needs the probabilities: there is no SDPA route to compare
    monkeypatch.setattr(backends, "fused_bias_kernel", lambda q: True)
    want = run()
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(got[1], want[1], strict=True):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_deberta_parts_sum_to_its_score_bias() -> None:
    """DeBERTa hands its p2c term over in key chunks; their sum is its score_bias."""
    enc = build("deberta", d_model=H * D, n_heads=H, n_layers=1, max_distance=4, bucket_size=0)
    hook = enc.for_attention(layer=0, kind=AttnKind.BIDIRECTIONAL)
    hook.view_keys_per_row = 0.0  # the view path even for a short sequence
    hook.view_min_queries = 0
    hook.p2c_chunk = 1  # chunks of T = 3 keys: two of them over the 6 keys
    q, k = torch.randn(B, H, 6, D), torch.randn(B, H, 6, D)
    pos = torch.arange(6)[None]
    ctx = enc.context(pos[:, 2:5], pos, AttnKind.BIDIRECTIONAL, starts=(2, 0))
    parts = hook.score_parts(q[:, :, 2:5], k, ctx)
    assert len(parts) > 2  # c2p, then p2c chunks
    dense = dense_parts(parts, 6)
    torch.testing.assert_close(dense, hook.score_bias(q[:, :, 2:5], k, ctx))
    hook.view_keys_per_row = 1e9  # the gather path: the reference
    torch.testing.assert_close(dense, hook.score_bias(q[:, :, 2:5], k, ctx))


@pytest.mark.parametrize("name", ["shaw", "xl", "deberta", "alibi", "t5", "fire"])
@pytest.mark.parametrize("kind", [AttnKind.CAUSAL, AttnKind.BIDIRECTIONAL])
def test_hand_written_backward_equals_plain_autograd(
    name: str, kind: AttnKind, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The written-out backward is an optimisation only: plain autograd through the same
    softmax (backends.plain_attention) gives the same output and gradients, value terms,
    key padding and query blocks included."""
    enc = build(name, d_model=H * D, n_heads=H, n_layers=1)
    hook = enc.for_attention(layer=0, kind=kind)
    attn = Attention(d_model=H * D, n_heads=H, dropout=0.0, pos=hook)
    attn.max_score_bytes = 4 * H * 40 * 4 * 7  # blocks of 7 queries
    x = torch.randn(4, 40, H * D, requires_grad=True)
    valid = torch.ones(4, 40, dtype=torch.bool)
    valid[2, 30:] = False
    pos = torch.arange(40)[None]
    params = [x, *attn.parameters(), *enc.parameters()]
    results = []
    for hand in (True, False):
        monkeypatch.setattr(backends, "HAND_WRITTEN_BACKWARD", hand)
        out = attn(x, enc.context(pos, pos, kind, starts=(0, 0)), key_valid=valid)
        grads = torch.autograd.grad(out.square().sum(), params, allow_unused=True)
        results.append([out, *[g for g in grads if g is not None]])
    assert len(results[0]) == len(results[1]) > 2
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
