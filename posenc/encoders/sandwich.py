"""Sandwich (Chi, Fan, Rudnicky and Ramadge 2023, "Dissecting Transformer Length
Extrapolation via the Lens of Receptive Field Analysis", ACL, section 5): a
parameter-free bias from the inner product of sinusoidal position embeddings.

Notation: B batch, H heads, T queries, S keys, R distances; i query and j key position,
h = 1 .. H a head, d' the width of the sinusoid, omega_k its frequencies.

No position enters the embeddings or q/k. The product of two sinusoidal embeddings
(sin and cos of ``m omega_k`` for each frequency) is a sum of cosines of the distance,
``p_i . p_j = sum_k cos((i - j) omega_k)``, so it depends on ``i - j`` alone and is
largest at distance 0. Sandwich adds it to the scaled logits ``q_i . k_j / sqrt(D)``,
shifted so that distance 0 adds nothing, and compressed per head as ALiBi's slopes are:

    score_h(i, j) = q_i . k_j / sqrt(D) + (sum_{k=1}^{d'/2} cos((i - j) omega_k) - d'/2) H / (8h)

with ``omega_k = 10000^(-2k / d')``, ``k = 1 .. d'/2``. The conventions (frequencies from
k = 1 to d'/2, the offset d'/2, the compression ``8h / H``) are the paper's equation as
NVIDIA NeMo's implementation of it (``SandwichRelativePositionEmbedding``, which cites
the paper) runs it; the authors' own release was not at hand. The bias is <= 0, 0 at
distance 0, and bounded below by ``-d' H / (8h)``: far keys all get about the same
penalty, which is what the paper argues lets the model extrapolate.

d' (``dim``) defaults to the head dim D, as NeMo builds it (``hidden_size // heads``).
The cosine is even, so bidirectional self-attention takes the same formula (symmetric in
i and j). Cross-attention: nothing (positions of two different sequences are not
comparable).
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
from posenc.encoders.offsets import pair_distance, toeplitz
from posenc.encoders.registry import register

#: The sinusoid's base, as Vaswani et al.'s.
BASE = 10000.0

# What prepare leaves for the hooks: the bias of each distance 0 .. M, (H, M + 1) float32.
TABLE: Slot[Tensor] = Slot("sandwich")


def head_scales(n_heads: int) -> Tensor:
    """``H / (8 h)`` for ``h = 1 .. H``, float32 ``(H,)``: each head's compression."""
    h = torch.arange(1, n_heads + 1, dtype=torch.float64)
    return (n_heads / (8.0 * h)).float()


def frequencies(dim: int) -> Tensor:
    """``omega_k = 10000^(-2k / d')`` for ``k = 1 .. d'/2``, float64 ``(d'/2,)``."""
    k = torch.arange(1, dim // 2 + 1, dtype=torch.float64)
    return BASE ** (-2.0 * k / dim)


def sandwich_table(distances: Tensor, *, dim: int, n_heads: int) -> Tensor:
    """The bias of each distance, ``(H, R)`` float32, for ``distances (R,)`` (any sign).

    Args:
        distances: Integer distances ``i - j``.
        dim: d', the sinusoid's width (even).
        n_heads: H.
    """
    omega = frequencies(dim).to(distances.device, torch.float32)
    # float32 angles, as RoPE's: exact integer distances times each frequency
    angles = distances.to(torch.float32)[:, None] * omega  # (R, d'/2)
    inner = torch.cos(angles).sum(-1) - dim / 2  # (R,), p_i . p_j - d'/2
    return head_scales(n_heads).to(distances.device)[:, None] * inner  # (H, R)


class _SandwichAttention(AttentionPositional):
    """Per-layer hook: the stack's table of the bias per distance, read per pair."""

    score_term = True

    def score_bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        table = ctx[TABLE]  # (H, M + 1), distance |i - j| = 0 .. M
        if ctx.starts is not None:  # consecutive positions: a Toeplitz view, no gather
            n_lo, n_hi = ctx.toeplitz_range()
            n = torch.arange(n_lo, n_hi + 1, device=table.device).abs_()
            bias = toeplitz(table[:, n], ctx)  # (H, T, S)
            if bias is not None:
                return bias[None].to(q.dtype)
        dist = ctx.rel().abs_()  # (B|1, T, S)
        return table[:, dist].movedim(0, 1).to(q.dtype)  # (B|1, H, T, S)

    def score_mod(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreMod:
        table, dist = ctx[TABLE], pair_distance(ctx)
        return lambda score, b, h, i, j: score + table[h, dist(b, i, j).abs()]


@register("sandwich")
class Sandwich(PositionalEncoder):
    """Sandwich: a fixed bias per head from the product of sinusoidal position embeddings.

    Args:
        dim: d', the width of the sinusoid (even); None: the head dim D.

    Raises:
        ValueError: ``dim`` is not a positive even integer.
    """

    relative = True

    def __init__(
        self, *, d_model: int, n_heads: int, n_layers: int, dim: int | None = None
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        dim = self.head_dim if dim is None else dim
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
            raise ValueError(
                f"sandwich: dim={dim!r} must be a positive even integer (the width of the "
                f"sinusoid, d'); leave encoder.dim=null for the head dim {self.head_dim}"
            )
        self.dim = dim

    def prepare(self, ctx: AttentionContext) -> None:
        if ctx.kind is AttnKind.CROSS:
            return
        lo, hi = ctx.distance_range()
        top = max(abs(lo), abs(hi))  # every |i - j| of the pass, Python ints: no host read
        distances = torch.arange(top + 1, device=ctx.q_pos.device)
        ctx.put(TABLE, sandwich_table(distances, dim=self.dim, n_heads=self.n_heads))

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        return AttentionPositional() if kind is AttnKind.CROSS else _SandwichAttention()
