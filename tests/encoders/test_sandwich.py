"""Sandwich (Chi et al. 2023) against its bias written out per pair from the paper's
formula, ``(sum_{k=1}^{d'/2} cos((i - j) 10000^(-2k/d')) - d'/2) * H / (8h)``, in float64
with loops and math.cos (no tables)."""

from __future__ import annotations

import math

import pytest
import torch

from posenc.encoders.base import AttnKind
from posenc.encoders.sandwich import Sandwich, head_scales
from tests.encoders.test_bias import POSITIONS, attention, reference

C, H = 16, 4
KINDS = [AttnKind.CAUSAL, AttnKind.BIDIRECTIONAL]


def sandwich_by_hand(h: int, i: int, j: int, dim: int = C // H, n_heads: int = H) -> float:
    """Head ``h`` (0-based) for query position i and key position j."""
    inner = sum(math.cos((i - j) / 10000 ** (2 * k / dim)) for k in range(1, dim // 2 + 1))
    return (inner - dim / 2) * n_heads / (8 * (h + 1))


def test_head_scales_are_eight_h_over_h() -> None:
    """Four heads: the bias divided by 8h/H = 2, 4, 6, 8."""
    assert head_scales(4).tolist() == pytest.approx([1 / 2, 1 / 4, 1 / 6, 1 / 8], rel=1e-7)


def test_pinned_values() -> None:
    """d' = 4, one head (divided by 8): distance 100 gives
    (cos(100 / 100) + cos(100 / 10000) - 2) / 8; distance 0 nothing."""
    enc = Sandwich(d_model=4, n_heads=1, n_layers=1)
    pos = torch.tensor([[0, 100]])
    ctx = enc.context(pos, pos, AttnKind.BIDIRECTIONAL)
    hook = enc.for_attention(layer=0, kind=AttnKind.BIDIRECTIONAL)
    q = torch.zeros(1, 1, 2, 4)
    bias = hook.score_bias(q, q, ctx)[0, 0]
    want = (math.cos(1.0) + math.cos(0.01) - 2) / 8  # -0.0574...
    assert bias[0, 1].item() == pytest.approx(want, rel=1e-6)
    assert bias[1, 0].item() == bias[0, 1].item() and bias[0, 0].item() == 0.0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("where", sorted(POSITIONS))
def test_sandwich_matches_the_formula(kind: AttnKind, blocked: bool, where: str) -> None:
    """Attention outputs, with the Toeplitz view (consecutive positions) and the per-pair
    gather (per-row positions), in blocks of queries and not. d' = 32 > D: at d' = D = 4
    the lowest frequency is 10000^(-1/2), and the bias of distances below 10 is tiny."""
    enc = Sandwich(d_model=C, n_heads=H, n_layers=1, dim=32)
    x = torch.randn(2, 10, C)
    qp = POSITIONS[where](10)
    attn = attention(enc, kind, x, blocked=blocked)
    with torch.no_grad():
        out = attn(x, enc.context(qp, qp, kind))
    ref = reference(x, qp, kind, lambda h, i, j: sandwich_by_hand(h, i, j, 32))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    unbiased = reference(x, qp, kind, lambda h, i, j: 0.0)
    assert not torch.allclose(out, unbiased, atol=1e-3)  # the bias did something


@pytest.mark.parametrize("kind", KINDS)
def test_bias_depends_on_the_distance_alone(kind: AttnKind) -> None:
    """The bias at positions 0.. and at 1000.. (and per row) is one function of i - j:
    0 at distance 0, below 0 elsewhere, above its bound -d' H / (8h)."""
    dim = 32
    enc = Sandwich(d_model=C, n_heads=H, n_layers=1, dim=dim)
    hook = enc.for_attention(layer=0, kind=kind)
    q = torch.zeros(1, H, 12, C // H)
    biases = []
    for pos in (torch.arange(12)[None], torch.arange(1000, 1012)[None]):
        biases.append(hook.score_bias(q, q, enc.context(pos, pos, kind))[0])
    torch.testing.assert_close(biases[1], biases[0], atol=2e-5, rtol=0)
    i = torch.arange(12)
    want = torch.tensor(
        [[[sandwich_by_hand(h, a, b, dim) for b in range(12)] for a in range(12)] for h in range(H)]
    )
    seen = (i[:, None] >= i[None, :]) if kind is AttnKind.CAUSAL else torch.ones(12, 12).bool()
    torch.testing.assert_close(biases[0][:, seen], want[:, seen].float(), atol=1e-5, rtol=1e-5)
    off = ~torch.eye(12, dtype=torch.bool) & seen
    assert (biases[0].diagonal(dim1=-2, dim2=-1) == 0).all() and (biases[0][:, off] < 0).all()
    floor = -dim * head_scales(H)[:, None]
    assert (biases[0][:, seen] >= floor).all()


def test_far_distances_stay_accurate() -> None:
    """float32 angles at distances up to 5000 stay within 1e-3 of the float64 formula."""
    enc = Sandwich(d_model=64, n_heads=1, n_layers=1)
    pos = torch.tensor([[0, 1234, 5000]])
    ctx = enc.context(pos, pos, AttnKind.BIDIRECTIONAL)
    q = torch.zeros(1, 1, 3, 64)
    got = enc.for_attention(layer=0, kind=AttnKind.BIDIRECTIONAL).score_bias(q, q, ctx)[0, 0]
    for a, i in enumerate(pos[0].tolist()):
        for b, j in enumerate(pos[0].tolist()):
            assert got[a, b].item() == pytest.approx(sandwich_by_hand(0, i, j, 64, 1), abs=1e-3)


def test_cross_attention_adds_nothing() -> None:
    enc = Sandwich(d_model=C, n_heads=H, n_layers=1)
    assert not enc.for_attention(layer=0, kind=AttnKind.CROSS).score_term


@pytest.mark.parametrize("dim", [3, 0, -2, 2.5, True])
def test_a_bad_dim_is_refused(dim) -> None:
    with pytest.raises(ValueError, match=rf"^sandwich: dim={dim!r} must be a positive even"):
        Sandwich(d_model=C, n_heads=H, n_layers=1, dim=dim)
