"""Relative position representations (Shaw, Uszkoreit and Vaswani 2018).

Notation: B batch, H heads, T queries, S keys, D head dim, K clip distance.

Eq. 3-5 of the paper: with ``a_ij = w[clip(j - i, -K, K)]``,

    e_ij = q_i . (k_j + a^K_ij) / sqrt(D)        z_i = sum_j alpha_ij (v_j + a^V_ij)

The tables ``w^K, w^V`` have ``2K+1`` rows of size D and are shared across heads
(as in the paper). Cost: one ``(T, 2K+1)`` matmul per head, never a ``(T, S, D)``
tensor of per-pair embeddings. With consecutive positions the ``2K+1`` scores are
spread over the key-minus-query offsets (the clipped ends expanded, not recomputed)
and read as a strided (Toeplitz) view; the value term lays the probabilities out the
same way and sums the offsets that share a row. Other positions use a gather (and a
scatter for the value term). The value term needs the attention probabilities, so
with ``value=True`` attention takes its explicit-softmax path.

Cross-attention: nothing (positions of two different sequences are not comparable).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc.encoders.base import (
    AttentionContext,
    AttentionPositional,
    AttnKind,
    PositionalEncoder,
    ScoreMod,
    ScoreParts,
    Slot,
    dense_parts,
)
from posenc.encoders.offsets import (
    gather_rel,
    offset_view,
    offset_window,
    pair_distance,
    window_parts,
)
from posenc.encoders.registry import register

# What prepare leaves for the hooks: the clipping distance and the shared tables.
CLIP: Slot[int] = Slot("clip")
KEY_TABLE: Slot[Tensor] = Slot("key_table")
VALUE_TABLE: Slot[Tensor | None] = Slot("value_table")


def _table(k: int, dim: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(2 * k + 1, dim) * 0.02)


def _segments(n_lo: int, n_hi: int, k: int) -> tuple[int, int, int, int]:
    """Split offsets ``n_lo .. n_hi`` by row: how many fall in row 0 (``n <= -K``), the
    first and last offset of the rows of their own (``-K < n < K``), and how many fall
    in row 2K (``n >= K``)."""
    left = max(0, min(n_hi, -k) - n_lo + 1)
    right = max(0, n_hi - max(n_lo, k) + 1)
    return left, max(n_lo, -k + 1), min(n_hi, k - 1), right


def slots_to_offsets(per_slot: Tensor, n_lo: int, n_hi: int, k: int) -> Tensor:
    """``(..., 2K+1)`` per-row values to ``(..., L)`` per-offset values for offsets
    ``n_lo .. n_hi``: entry n is row ``clip(n, -K, K) + K``. The clipped ends are
    expanded, not computed again."""
    left, m_lo, m_hi, right = _segments(n_lo, n_hi, k)
    lead = per_slot.shape[:-1]
    parts = []
    if left:
        parts.append(per_slot[..., :1].expand(*lead, left))
    if m_hi >= m_lo:
        parts.append(per_slot[..., m_lo + k : m_hi + k + 1])
    if right:
        parts.append(per_slot[..., 2 * k :].expand(*lead, right))
    return torch.cat(parts, dim=-1)


def offsets_to_slots(per_offset: Tensor, n_lo: int, k: int) -> Tensor:
    """The adjoint of :func:`slots_to_offsets`: sum ``(..., L)`` per-offset values
    (offsets ``n_lo ..``) into their ``2K+1`` rows."""
    width = per_offset.shape[-1]
    left, m_lo, m_hi, right = _segments(n_lo, n_lo + width - 1, k)
    lead = per_offset.shape[:-1]
    zero = per_offset.new_zeros(*lead, 1)
    first = per_offset[..., :left].sum(-1, keepdim=True) if left else zero
    last = per_offset[..., width - right :].sum(-1, keepdim=True) if right else zero
    if m_hi >= m_lo:
        mid = per_offset[..., left : left + m_hi - m_lo + 1]
        mid = F.pad(mid, (m_lo + k - 1, k - 1 - m_hi))  # rows 1 .. 2K-1
    else:
        mid = per_offset.new_zeros(*lead, 2 * k - 1)
    return torch.cat([first, mid, last], dim=-1)


class _ShawAttention(AttentionPositional):
    """Per-layer hooks; tables are the layer's own or the stack's shared ones."""

    score_term = True

    def __init__(self, *, k: int, head_dim: int, value: bool, own_tables: bool) -> None:
        super().__init__()
        self.needs_probs = value
        self.key_table = _table(k, head_dim) if own_tables else None
        self.value_table = _table(k, head_dim) if own_tables and value else None

    def _tables(self, ctx: AttentionContext) -> tuple[Tensor, Tensor | None]:
        if self.key_table is not None:
            return self.key_table, self.value_table
        return ctx[KEY_TABLE], ctx.get(VALUE_TABLE)

    @staticmethod
    def _slot(ctx: AttentionContext) -> Tensor:
        """Row of each (query, key) pair, ``clip(j - i, -K, K) + K``: ``(B|1, T, S)``."""
        k = ctx[CLIP]
        return ctx.rel().neg_().clamp_(-k, k).add_(k)

    def score_bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        return dense_parts(self.score_parts(q, k, ctx), k.shape[-2])

    def score_parts(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreParts:
        key_table, _ = self._tables(ctx)
        scale = self.scale(q.shape[-1])
        per_slot = (q @ key_table.to(q.dtype).T) * scale  # (B, H, T, 2K+1), scaled while small
        if ctx.starts is not None:  # per offset, read as a strided view: no gather
            clip = ctx[CLIP]
            w = offset_window(ctx, -clip, clip)  # beyond +-K a row's score is constant
            parts = window_parts(
                ctx,
                w,
                left=per_slot[..., :1],
                table=slots_to_offsets(per_slot, w.n_lo, w.n_hi, clip),  # (B, H, T, L)
                right=per_slot[..., 2 * clip :],
            )
            if parts is not None:
                return parts
        return [(gather_rel(per_slot, self._slot(ctx)), 0)]

    def score_mod(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreMod:
        """The key term (the value term needs the probabilities: explicit path)."""
        key_table, _ = self._tables(ctx)
        clip, dist = ctx[CLIP], pair_distance(ctx)
        per_slot = (q @ key_table.to(q.dtype).T) * self.scale(q.shape[-1])  # (B, H, T, 2K+1)

        def mod(score: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return score + per_slot[b, h, i, (-dist(b, i, j)).clamp(-clip, clip) + clip]

        return mod

    def value_term(self, probs: Tensor, ctx: AttentionContext) -> Tensor | None:
        _, value_table = self._tables(ctx)
        if value_table is None:
            return None
        b, h, t, s = probs.shape
        if ctx.starts is not None:
            # The window's probabilities laid out by offset (the inverse of the score's
            # view; its rows never overlap), summed per row; the constant ends add their
            # columns' total to the first and last row.
            clip = ctx[CLIP]
            w = offset_window(ctx, -clip, clip)
            mass = probs.new_zeros(b, h, t, w.n_hi - w.n_lo + 1)  # (B, H, T, L)
            (q0, k0) = ctx.starts
            view = offset_view(mass, row0=q0, col0=k0 + w.left, lo=w.n_lo, cols=w.right - w.left)
            if view is not None:
                view.copy_(probs[..., w.left : w.right])
                per_slot = offsets_to_slots(mass, w.n_lo, clip)  # (B, H, T, 2K+1)
                ends = [probs[..., : w.left].sum(-1, keepdim=True)]
                ends += [per_slot.new_zeros(b, h, t, 2 * clip - 1)]
                ends += [probs[..., w.right :].sum(-1, keepdim=True)]
                per_slot = per_slot + torch.cat(ends, dim=-1)
                return per_slot @ value_table.to(probs.dtype)  # (B, H, T, D)
        slot = self._slot(ctx)[:, None].expand(b, h, t, s)
        # Sum the probabilities that fall into each clipped distance, then mix rows.
        mass = probs.new_zeros(b, h, t, value_table.shape[0]).scatter_add_(-1, slot, probs)
        return mass @ value_table.to(probs.dtype)  # (B, H, T, D)


@register("shaw")
class ShawRelative(PositionalEncoder):
    """Shaw et al. 2018 relative positions: key term and (optionally) value term.

    Args:
        max_distance: Clip distance K; distances beyond +-K share a row. The paper
            found K >= 2..4 enough for translation.
        value: Also add the value term ``a^V`` (needs the explicit-softmax path).
        per_layer: One pair of tables per layer (True) or one shared by the stack.
    """

    relative = True

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_layers: int,
        max_distance: int = 16,
        value: bool = True,
        per_layer: bool = True,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if max_distance < 1:
            raise ValueError(f"shaw: max_distance must be >= 1, got {max_distance}")
        self.max_distance = max_distance
        self.value = value
        self.per_layer = per_layer
        if not per_layer:
            self.key_table = _table(max_distance, self.head_dim)
            self.value_table = _table(max_distance, self.head_dim) if value else None

    def prepare(self, ctx: AttentionContext) -> None:
        if ctx.kind is AttnKind.CROSS:
            return
        ctx.put(CLIP, self.max_distance)
        if not self.per_layer:
            ctx.put(KEY_TABLE, self.key_table)
            ctx.put(VALUE_TABLE, self.value_table)

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        if kind is AttnKind.CROSS:
            return AttentionPositional()
        return _ShawAttention(
            k=self.max_distance, head_dim=self.head_dim, value=self.value, own_tables=self.per_layer
        )
