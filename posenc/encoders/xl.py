"""Transformer-XL relative attention (Dai et al. 2019, section 3.3).

Notation: B batch, H heads, T queries, S keys, D head dim, C d_model, L distances.

The score of query i on key j is

    (q_i + u) . k_j  +  (q_i + v) . W_r R_{i-j}

with R the sinusoid of the distance ``i - j``, ``W_r`` a per-layer projection and
``u, v`` global per-head vectors shared by all layers. Instead of the paper's
"relative shift" (which fills the upper triangle with wrong values and is only
right under a causal mask) we score each query against the L distinct distances
present, ``(B, H, T, L)``, and pick the entry each pair (i, j) needs: a strided
view when positions are consecutive (:func:`~posenc.encoders.offsets.offset_view`),
a gather otherwise (per-row or randomized positions). Both are exact for causal,
bidirectional and offset positions.

Cross-attention: nothing (no relative distance between two sequences).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posenc.encoders.base import (
    AttentionContext,
    AttentionPositional,
    AttnKind,
    PositionalEncoder,
    ScoreMod,
    Slot,
    normal_linears,
)
from posenc.encoders.offsets import gather_rel, offset_view, pair_distance
from posenc.encoders.registry import register
from posenc.encoders.sinusoidal import sinusoid

# What prepare leaves for the hooks: sinusoids R of the distances lo.., the global u and v.
R: Slot[Tensor] = Slot("R")
LO: Slot[int] = Slot("lo")
U: Slot[Tensor] = Slot("u")
V: Slot[Tensor] = Slot("v")


class _XLAttention(AttentionPositional):
    """Per-layer hooks: the layer's own projection W_{k,R} of the shared sinusoids."""

    score_term = True

    def init_weights(self) -> None:
        """W_{k,R} ~ N(0, 0.02), as the authors' code (``init_std`` 0.02)."""
        normal_linears(self)

    def __init__(self, *, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.w_r = nn.Linear(d_model, d_model, bias=False)  # per-layer W_{k,R}

    def score_bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        # (L, H*D), row m for distance lo + m; once per layer, not per block of queries
        r = ctx.once(self, "r", lambda: self.w_r(ctx[R].to(q.dtype)))
        # (q + v) * scale: scaling the (B, H, T, D) factor, not the (B, H, T, S) term.
        qv = (q + ctx[V][:, None].to(q.dtype)) * self.scale(q.shape[-1])
        if ctx.starts is not None:  # consecutive positions: a Toeplitz view, no gather
            n_lo, n_hi = ctx.offset_range()  # offsets n = j - i, i.e. distances -n
            first = -n_hi - ctx[LO]  # row of the smallest distance needed
            if first >= 0 and -n_lo - ctx[LO] < r.shape[0]:
                r_n = r.narrow(0, first, n_hi - n_lo + 1).flip(0)  # rows for n_lo..n_hi
                r_n = r_n.unflatten(-1, (self.n_heads, -1)).transpose(0, 1)  # (H, L, D)
                per_n = qv @ r_n.transpose(-1, -2)  # (B, H, T, L)
                (q0, k0), s = ctx.starts, k.shape[-2]
                view = offset_view(per_n, row0=q0, col0=k0, lo=n_lo, cols=s)
                if view is not None:
                    return view
        r = r.unflatten(-1, (self.n_heads, -1)).transpose(0, 1)  # (H, L, D)
        per_dist = qv @ r.transpose(-1, -2)  # (B, H, T, L)
        rel = ctx.rel()  # (B|1, T, S), i - j
        if ctx.kind is AttnKind.CAUSAL:
            rel = rel.clamp_(min=0)  # later keys are masked; the table starts at <= 0
        return gather_rel(per_dist, rel.sub_(ctx[LO]))

    def score_mod(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreMod:
        r = ctx.once(self, "r", lambda: self.w_r(ctx[R].to(q.dtype)))  # (L, H*D)
        r = r.unflatten(-1, (self.n_heads, -1)).transpose(0, 1)  # (H, L, D)
        qv = (q + ctx[V][:, None].to(q.dtype)) * self.scale(q.shape[-1])
        per_dist = qv @ r.transpose(-1, -2)  # (B, H, T, L): distances lo, lo + 1, ...
        lo, last, dist = ctx[LO], r.shape[1] - 1, pair_distance(ctx)

        def mod(score: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            # clamped: masked pairs (causal keys after the query) may fall off the table
            return score + per_dist[b, h, i, (dist(b, i, j) - lo).clamp(0, last)]

        return mod

    def transform_qk(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        return q + ctx[U][:, None].to(q.dtype), k  # (H, 1, D) over (B, H, T, D)


@register("xl")
class TransformerXL(PositionalEncoder):
    """Transformer-XL relative positional attention (without segment recurrence).

    Args:
        base: Wavelength base of the sinusoid R.
    """

    relative = True

    def __init__(self, *, d_model: int, n_heads: int, n_layers: int, base: float = 10000.0) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if d_model % 2:
            raise ValueError(f"xl: d_model must be even for the sinusoid R, got {d_model}")
        self.base = base
        self.u = nn.Parameter(torch.randn(n_heads, self.head_dim) * 0.02)
        self.v = nn.Parameter(torch.randn(n_heads, self.head_dim) * 0.02)

    def prepare(self, ctx: AttentionContext) -> None:
        if ctx.kind is AttnKind.CROSS:
            return
        # The distances present (or that the positions' bound allows): O(T + S) rows.
        lo, hi = ctx.distance_range()
        if ctx.kind is AttnKind.CAUSAL:
            # Keys after the query are masked out anyway; don't build their distances
            # beyond -1 (which the strided view needs, see offset_range).
            lo, hi = max(lo, -1), max(hi, 0)
        dist = torch.arange(lo, hi + 1, device=ctx.q_pos.device)
        ctx.put(R, sinusoid(dist, self.d_model, base=self.base))
        ctx.put(LO, lo)
        ctx.put(U, self.u)
        ctx.put(V, self.v)

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        if kind is AttnKind.CROSS:
            return AttentionPositional()
        return _XLAttention(d_model=self.d_model, n_heads=self.n_heads)
