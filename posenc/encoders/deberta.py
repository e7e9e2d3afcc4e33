"""DeBERTa disentangled attention (He et al. 2020/2021, section 3.1).

Notation: B batch, H heads, T queries, S keys, D head dim, C d_model, P = 2 * span.

The score of query i on key j sums three terms, scaled by ``1/sqrt(3D)``:

    content-to-content  q_i . k_j
    content-to-position q_i . K^r_{delta(i, j)}
    position-to-content k_j . Q^r_{delta(j, i)}

``K^r = P W_{k,r}`` and ``Q^r = P W_{q,r}`` project one relative-position table P
(shared by all layers of the stack) with per-layer matrices. ``delta`` maps the
distance ``i - j`` to a row of P: clipped to ``[-span, span)``, and, with
``bucket_size > 0``, log-bucketed beyond ``bucket_size / 2`` up to ``max_distance``
(DeBERTa-v2). Both terms are computed per distinct row, ``(B, H, T, P)``, and
gathered with explicit query and key positions, so T != S is handled (the
original gather assumes equal query and key lengths).

Cross-attention: nothing (no relative distance between two sequences).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from posenc.encoders.base import (
    AttentionContext,
    AttentionPositional,
    AttnKind,
    PositionalEncoder,
    gather_rel,
)
from posenc.encoders.registry import register


def log_bucket(rel: Tensor, bucket_size: int, max_distance: int) -> Tensor:
    """Log-bucket signed distances: exact up to ``bucket_size/2``, log-spaced beyond.

    A distance ``r`` with ``|r| > m`` (``m = bucket_size // 2``) becomes
    ``sign(r) * (m + ceil((m - 1) * log(|r| / m) / log((max_distance - 1) / m)))``,
    which reaches ``bucket_size - 1`` at ``|r| = max_distance - 1``.

    Args:
        rel: Integer distances, any shape.
        bucket_size: Number of buckets on each side.
        max_distance: Distance mapped to the last log bucket.

    Returns:
        Integer tensor of the same shape.
    """
    mid = bucket_size // 2
    mag = rel.abs()
    # float64: |r| = max_distance - 1 must give a ratio of exactly 1, not 1 + ulp.
    ratio = torch.log(mag.clamp(min=mid).double() / mid) / math.log((max_distance - 1) / mid)
    far = mid + torch.ceil(ratio * (mid - 1)).long()
    return torch.where(mag <= mid, rel, torch.sign(rel) * far)


class _DebertaAttention(AttentionPositional):
    def __init__(self, *, d_model: int, n_heads: int, c2p: bool, p2c: bool) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_terms = 1 + int(c2p) + int(p2c)
        self.w_kr = nn.Linear(d_model, d_model, bias=False) if c2p else None
        self.w_qr = nn.Linear(d_model, d_model, bias=False) if p2c else None

    def scale(self, head_dim: int) -> float:
        return (self.n_terms * head_dim) ** -0.5  # 1/sqrt(3D) with both terms

    def _project(self, w: nn.Linear, table: Tensor, dtype: torch.dtype) -> Tensor:
        return w(table.to(dtype)).unflatten(-1, (self.n_heads, -1)).transpose(0, 1)  # (H, P, D)

    def score_bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor | None:
        x = ctx.extra
        table, rows, lo = x["table"], x["rows"], x["lo"]
        rel = ctx.rel() - lo  # (B|1, T, S): i - j, offset into the rows lookup
        bias = None
        if self.w_kr is not None:  # content-to-position: q_i . K^r[delta(i, j)]
            per_row = q @ self._project(self.w_kr, table, q.dtype).transpose(-1, -2)  # (B,H,T,P)
            bias = gather_rel(per_row, rows[rel])
        if self.w_qr is not None:  # position-to-content: k_j . Q^r[delta(j, i)]
            per_row = k @ self._project(self.w_qr, table, k.dtype).transpose(-1, -2)  # (B,H,S,P)
            # delta(j, i) is the row of distance j - i = -(i - j): index (B|1, S, T).
            p2c_rows = x["rows_neg"][rel.transpose(-1, -2)]
            p2c = gather_rel(per_row, p2c_rows).transpose(-1, -2)  # (B, H, T, S)
            bias = p2c if bias is None else bias + p2c
        return None if bias is None else bias * self.scale(q.shape[-1])


@register("deberta")
class DebertaRelative(PositionalEncoder):
    """DeBERTa disentangled attention with a shared relative-position table.

    Args:
        max_distance: Largest distance told apart (DeBERTa's max_relative_positions).
        bucket_size: Log buckets on each side (DeBERTa-v2's position_buckets);
            0 disables log bucketing and clips at ``max_distance`` instead.
        c2p: Use the content-to-position term.
        p2c: Use the position-to-content term.
    """

    relative = True

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_layers: int,
        max_distance: int = 128,
        bucket_size: int = 32,
        c2p: bool = True,
        p2c: bool = True,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if max_distance < 2:
            raise ValueError(f"deberta: max_distance must be >= 2, got {max_distance}")
        if bucket_size and not 4 <= bucket_size < 2 * (max_distance - 1):
            raise ValueError(
                f"deberta: bucket_size={bucket_size} must be 0 (no log buckets) or in "
                f"[4, 2 * (max_distance - 1)) = [4, {2 * (max_distance - 1)})"
            )
        self.max_distance = max_distance
        self.bucket_size = bucket_size
        self.c2p, self.p2c = c2p, p2c
        self.span = bucket_size if bucket_size else max_distance
        self.table = nn.Parameter(torch.randn(2 * self.span, d_model) * 0.02)

    def row(self, rel: Tensor) -> Tensor:
        """Row of the table for signed distances ``rel`` (delta in the paper)."""
        if self.bucket_size:
            rel = log_bucket(rel, self.bucket_size, self.max_distance)
        return (rel + self.span).clamp(0, 2 * self.span - 1)

    def context(self, q_pos: Tensor, k_pos: Tensor, kind: AttnKind) -> AttentionContext:
        ctx = super().context(q_pos, k_pos, kind)
        if kind is AttnKind.CROSS:
            return ctx
        # delta for each distance present, from the extreme positions: O(T + S) lookups
        # that the layers index per pair (rows[d - lo] for d = i - j; rows_neg for -d).
        lo = int(q_pos.min()) - int(k_pos.max())
        hi = int(q_pos.max()) - int(k_pos.min())
        dist = torch.arange(lo, hi + 1, device=q_pos.device)
        ctx.extra.update(table=self.table, lo=lo, rows=self.row(dist), rows_neg=self.row(-dist))
        return ctx

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        if kind is AttnKind.CROSS:
            return AttentionPositional()
        return _DebertaAttention(
            d_model=self.d_model, n_heads=self.n_heads, c2p=self.c2p, p2c=self.p2c
        )
