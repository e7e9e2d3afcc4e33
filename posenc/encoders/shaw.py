"""Relative position representations (Shaw, Uszkoreit and Vaswani 2018).

Notation: B batch, H heads, T queries, S keys, D head dim, K clip distance.

Eq. 3-5 of the paper: with ``a_ij = w[clip(j - i, -K, K)]``,

    e_ij = q_i . (k_j + a^K_ij) / sqrt(D)        z_i = sum_j alpha_ij (v_j + a^V_ij)

The tables ``w^K, w^V`` have ``2K+1`` rows of size D and are shared across heads
(as in the paper). Cost: one ``(T, 2K+1)`` matmul per head and a gather instead of a
``(T, S, D)`` tensor of per-pair embeddings. The value term needs the attention
probabilities, so with ``value=True`` attention takes its explicit-softmax path.

Cross-attention: nothing (positions of two different sequences are not comparable).
"""

from __future__ import annotations

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


def _table(k: int, dim: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(2 * k + 1, dim) * 0.02)


class _ShawAttention(AttentionPositional):
    """Per-layer hooks; tables are the layer's own or the stack's shared ones."""

    def __init__(self, *, k: int, head_dim: int, value: bool, own_tables: bool) -> None:
        super().__init__()
        self.needs_probs = value
        self.key_table = _table(k, head_dim) if own_tables else None
        self.value_table = _table(k, head_dim) if own_tables and value else None

    def _tables(self, ctx: AttentionContext) -> tuple[Tensor, Tensor | None]:
        if self.key_table is not None:
            return self.key_table, self.value_table
        return ctx.extra["key_table"], ctx.extra.get("value_table")

    @staticmethod
    def _slot(ctx: AttentionContext) -> Tensor:
        """Row of each (query, key) pair, ``clip(j - i, -K, K) + K``: ``(B|1, T, S)``."""
        k = ctx.extra["clip"]
        return ctx.rel().neg_().clamp_(-k, k).add_(k)

    def score_bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        key_table, _ = self._tables(ctx)
        per_slot = q @ key_table.to(q.dtype).T  # (B, H, T, 2K+1)
        return gather_rel(per_slot, self._slot(ctx)) * self.scale(q.shape[-1])

    def value_term(self, probs: Tensor, ctx: AttentionContext) -> Tensor | None:
        _, value_table = self._tables(ctx)
        if value_table is None:
            return None
        b, h, t, s = probs.shape
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

    def context(self, q_pos: Tensor, k_pos: Tensor, kind: AttnKind) -> AttentionContext:
        ctx = super().context(q_pos, k_pos, kind)
        if kind is AttnKind.CROSS:
            return ctx
        ctx.extra["clip"] = self.max_distance
        if not self.per_layer:
            ctx.extra["key_table"] = self.key_table
            ctx.extra["value_table"] = self.value_table
        return ctx

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        if kind is AttnKind.CROSS:
            return AttentionPositional()
        return _ShawAttention(
            k=self.max_distance, head_dim=self.head_dim, value=self.value, own_tables=self.per_layer
        )
