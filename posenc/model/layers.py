"""Pre-LN transformer block shared by the decoder-only and encoder-decoder stacks."""

from __future__ import annotations

from functools import partial

from torch import Tensor, nn

from posenc.encoders.base import AttentionContext, AttentionPositional
from posenc.model.attention import Attention
from posenc.model.cache import LayerCache
from posenc.model.modifiers import Modifiers


class FeedForward(nn.Sequential):
    """Position-wise MLP ``C -> d_ff -> C`` with GELU."""

    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__(
            nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model), nn.Dropout(dropout)
        )


class Block(nn.Module):
    """``x + SelfAttn(LN x)``, optionally ``+ CrossAttn(LN x, memory)``, ``+ FF(LN x)``.

    Args:
        d_model: Width C.
        n_heads: Heads H.
        d_ff: Hidden width of the feed-forward layer.
        dropout: Dropout on residual branches and attention probabilities.
        self_pos: Positional hooks for self-attention.
        cross_pos: Positional hooks for cross-attention, or None for no cross-attention.
        score_budget: CPU query blocking of attention with score terms (bytes; None: off).
        qkv_bias: Biases on the attention's q, k and v projections.
        modifiers: QK-norm, logit scale and sinks of every attention (None: none).
    """

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float,
        self_pos: AttentionPositional,
        cross_pos: AttentionPositional | None = None,
        score_budget: int | None = 8 * 2**20,
        qkv_bias: bool = True,
        modifiers: Modifiers | None = None,
    ) -> None:
        super().__init__()
        attention = partial(
            Attention,
            d_model=d_model,
            n_heads=n_heads,
            dropout=dropout,
            score_budget=score_budget,
            qkv_bias=qkv_bias,
            modifiers=modifiers,
        )
        self.ln_self = nn.LayerNorm(d_model)
        self.self_attn = attention(pos=self_pos)
        self.ln_cross = nn.LayerNorm(d_model) if cross_pos is not None else None
        self.cross_attn = attention(pos=cross_pos) if cross_pos is not None else None
        self.ln_ff = nn.LayerNorm(d_model)
        self.ff = FeedForward(d_model, d_ff, dropout)
        self.drop = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        ctx: AttentionContext,
        *,
        valid: Tensor | None = None,
        memory: Tensor | None = None,
        cross_ctx: AttentionContext | None = None,
        memory_valid: Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """Run the block.

        Args:
            x: ``(B, T, C)``.
            ctx: Self-attention context of the stack.
            valid: ``(B, T)`` True for real tokens.
            memory: ``(B, S, C)`` encoder output, for cross-attention.
            cross_ctx: Cross-attention context of the stack.
            memory_valid: ``(B, S)`` True for real source tokens.
            cache: This layer's key/value cache (incremental decoding), or None.

        Returns:
            ``(B, T, C)``.
        """
        x = x + self.drop(self.self_attn(self.ln_self(x), ctx, key_valid=valid, cache=cache))
        if self.cross_attn is not None and memory is not None:
            assert self.ln_cross is not None  # built together with cross_attn
            x = x + self.drop(
                self.cross_attn(
                    self.ln_cross(x), cross_ctx, memory=memory, key_valid=memory_valid, cache=cache
                )
            )
        return x + self.ff(self.ln_ff(x))
