"""Attention with linear biases, ALiBi (Press, Smith and Lewis 2022, "Train Short, Test
Long", ICLR, section 3).

Notation: B batch, H heads, T queries, S keys; i query and j key position, m_h the
slope of head h.

No position enters the embeddings or q/k. Each head adds a fixed penalty that grows
linearly with distance to its (scaled) attention logits:

    score_h(i, j) = q_i . k_j / sqrt(D)  -  m_h * |i - j|

Under a causal mask only ``j <= i`` is seen, so this is the paper's ``-m_h (i - j)``;
in bidirectional (encoder) self-attention the same ``|i - j|`` gives the symmetric
variant. The slopes are not learned: for H a power of two they are the geometric
sequence ``2^(-8/H), 2^(-16/H), ..., 2^-8`` (8 heads: 1/2, 1/4, ..., 1/256). For other
H the authors take the slopes of the largest power of two ``p < H`` and append every
other slope (the 1st, 3rd, 5th, ...) of the 2p-head sequence until there are H.

Cross-attention: nothing (positions of two different sequences are not comparable).
"""

from __future__ import annotations

import torch
from torch import Tensor

from posenc.encoders.base import (
    AttentionContext,
    AttentionPositional,
    AttnKind,
    PositionalEncoder,
    ScoreMod,
    Slot,
)
from posenc.encoders.offsets import pair_distance
from posenc.encoders.registry import register

# What prepare leaves for the hooks: the heads' slopes, (H,) float32.
SLOPES: Slot[Tensor] = Slot("slopes")


def _power_of_two_slopes(n: int) -> list[float]:
    """``2^(-8k/n)`` for ``k = 1 .. n``: starts at ``2^(-8/n)``, same ratio."""
    return [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]


def alibi_slopes(n_heads: int) -> Tensor:
    """The slope ``m_h`` of each head, float32, shape ``(H,)``.

    Args:
        n_heads: Number of heads H.

    Returns:
        Powers of two ``2^(-8h/H)`` when H is a power of two; otherwise the slopes for
        the largest power of two ``p < H`` followed by slopes 0, 2, 4, ... of the
        2p-head sequence (e.g. 12 heads: 2^-1 .. 2^-8, then 2^-0.5, 2^-1.5, 2^-2.5,
        2^-3.5).

    Raises:
        ValueError: ``n_heads < 1``.
    """
    if n_heads < 1:
        raise ValueError(f"alibi: n_heads must be >= 1, got {n_heads}")
    p = 1 << (n_heads.bit_length() - 1)  # largest power of two <= H
    slopes = _power_of_two_slopes(p)
    if p < n_heads:
        slopes += _power_of_two_slopes(2 * p)[0::2][: n_heads - p]
    return torch.tensor(slopes, dtype=torch.float32)


class _AlibiAttention(AttentionPositional):
    """Per-layer hook: the fixed linear penalty, slopes from the stack's context."""

    score_term = True

    def score_bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        slopes = ctx[SLOPES]  # (H,) float32
        # Integer distances become float32 (exact up to 2^24) and the product is
        # rounded once to q's dtype, never an already-rounded bf16 distance.
        dist = ctx.rel().abs().to(torch.float32)  # (B|1, T, S)
        bias = dist[:, None] * -slopes[None, :, None, None]  # (B|1, H, T, S)
        return bias.to(q.dtype)

    def score_mod(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreMod:
        slopes, dist = ctx[SLOPES], pair_distance(ctx)
        return lambda score, b, h, i, j: score - slopes[h] * dist(b, i, j).abs()


@register("alibi")
class ALiBi(PositionalEncoder):
    """ALiBi: a fixed per-head linear distance penalty in self-attention.

    No settings: the slopes follow from the number of heads (:func:`alibi_slopes`).
    """

    relative = True
    slopes: Tensor  # a buffer (not saved): (H,) float32

    def __init__(self, *, d_model: int, n_heads: int, n_layers: int) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def prepare(self, ctx: AttentionContext) -> None:
        if ctx.kind is not AttnKind.CROSS:
            ctx.put(SLOPES, self.slopes)

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        return AttentionPositional() if kind is AttnKind.CROSS else _AlibiAttention()

    def _apply(self, fn, recurse=True):
        # A module cast (.half(), .to(bfloat16)) must not round slopes like 2^-0.5:
        # rebuild them in float32 on the new device.
        out = super()._apply(fn, recurse)
        if self.slopes.dtype != torch.float32:
            self.slopes = alibi_slopes(self.n_heads).to(self.slopes.device)
        return out
