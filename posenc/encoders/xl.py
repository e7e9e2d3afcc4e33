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

With ``fold=true`` the position term is folded into the content score instead: the
sinusoid's angle-difference identity splits ``R_{i-j}`` into a factor of the query's
position and one of the key's. Per head, with ``a_i = W_r^T (q_i + v)`` (C wide, its
sine and cosine halves ``a^s``, ``a^c`` per frequency ``w``),

    a_i . R_{i-j} = sum_w  a^s sin((i - j) w) + a^c cos((i - j) w)  =  q~_i . k~_j,
    q~_i = [a^s sin(i w) + a^c cos(i w),  a^c sin(i w) - a^s cos(i w)],
    k~_j = [cos(j w),  sin(j w)],

so the whole score is one dot product ``[q_i + u, q~_i] . [k_j, k~_j]`` of width
``D + C``, which ``scaled_dot_product_attention`` computes without any ``(T, S)`` term:
memory linear in T, at about ``(D + C) / D`` times the content score's work. The same
weights serve both forms (a checkpoint trained with one evaluates with the other).

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
from posenc.encoders.sinusoidal import sinusoid, sinusoid_frequencies

# What prepare leaves for the hooks: sinusoids R of the distances lo.., the global u and v.
R: Slot[Tensor] = Slot("R")
LO: Slot[int] = Slot("lo")
U: Slot[Tensor] = Slot("u")
V: Slot[Tensor] = Slot("v")
W: Slot[Tensor] = Slot("w")  # the sinusoid's frequencies, for the folded form


class _XLLayer(AttentionPositional):
    """Per-layer hooks: the layer's own projection W_{k,R} of the shared sinusoids."""

    def init_weights(self) -> None:
        """W_{k,R} ~ N(0, 0.02), as the authors' code (``init_std`` 0.02)."""
        normal_linears(self)

    def __init__(self, *, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.w_r = nn.Linear(d_model, d_model, bias=False)  # per-layer W_{k,R}


class _XLFolded(_XLLayer):
    """The position term folded into a wider content score (module docstring)."""

    widens_qk = True

    def transform_qk(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        # angles in float32 at least (float64 for a float64 check), as the sinusoid's
        work = torch.promote_types(q.dtype, torch.float32)
        freq = ctx[W].to(work)  # (C/2,)
        w = self.w_r.weight.unflatten(0, (self.n_heads, -1)).to(q.dtype)  # (H, D, C)
        a = ((q + ctx[V][:, None].to(q.dtype)) @ w).to(work)  # (B, H, T, C)
        a_sin, a_cos = a[..., 0::2], a[..., 1::2]  # R interleaves sin and cos
        angle = ctx.q_pos.to(work)[:, None, :, None] * freq  # (B|1, 1, T, C/2)
        sin, cos = angle.sin(), angle.cos()
        q_fold = torch.cat((a_sin * sin + a_cos * cos, a_cos * sin - a_sin * cos), dim=-1)
        angle = ctx.k_pos.to(work)[:, None, :, None] * freq  # (B|1, 1, S, C/2)
        k_fold = torch.cat((angle.cos(), angle.sin()), dim=-1).to(k.dtype)
        k_fold = k_fold.expand(k.shape[0], k.shape[1], -1, -1)
        q_u = q + ctx[U][:, None].to(q.dtype)
        return torch.cat((q_u, q_fold.to(q.dtype)), dim=-1), torch.cat((k, k_fold), dim=-1)


class _XLAttention(_XLLayer):
    """The position term as a score term: each query against the distances present."""

    score_term = True

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
        lo, dist = ctx[LO], pair_distance(ctx)

        def mod(score: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            # The table holds every distance present but, in causal attention, none below
            # -1: masked pairs (keys after the query) are clamped onto it. No upper bound
            # (one that changes with the length would compile a kernel per length).
            return score + per_dist[b, h, i, (dist(b, i, j) - lo).clamp(min=0)]

        return mod

    def transform_qk(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        return q + ctx[U][:, None].to(q.dtype), k  # (H, 1, D) over (B, H, T, D)


@register("xl")
class TransformerXL(PositionalEncoder):
    """Transformer-XL relative positional attention (without segment recurrence).

    Args:
        base: Wavelength base of the sinusoid R.
        fold: Compute the position term inside one wider dot product (module
            docstring) instead of as a score term: the same numbers, memory linear in T.
    """

    relative = True

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_layers: int,
        base: float = 10000.0,
        fold: bool = False,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if d_model % 2:
            raise ValueError(f"xl: d_model must be even for the sinusoid R, got {d_model}")
        if not isinstance(fold, bool):
            raise ValueError(f"xl: fold must be true or false, got {fold!r}")
        self.base = base
        self.fold = fold
        self.u = nn.Parameter(torch.randn(n_heads, self.head_dim) * 0.02)
        self.v = nn.Parameter(torch.randn(n_heads, self.head_dim) * 0.02)

    def prepare(self, ctx: AttentionContext) -> None:
        if ctx.kind is AttnKind.CROSS:
            return
        ctx.put(U, self.u)
        ctx.put(V, self.v)
        if self.fold:  # positions enter by their own angles: no table of distances
            ctx.put(
                W, sinusoid_frequencies(self.d_model, self.base, "interleaved", ctx.q_pos.device)
            )
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

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        if kind is AttnKind.CROSS:
            return AttentionPositional()
        layer_class = _XLFolded if self.fold else _XLAttention
        return layer_class(d_model=self.d_model, n_heads=self.n_heads)
