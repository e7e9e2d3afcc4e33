"""The plug-point contract between positional encoders and the shared transformer.

Notation: B batch, H heads, T query length, S key length, D head dim, C d_model.

A positional scheme is split in two objects:

* :class:`PositionalEncoder`, one per transformer stack. It owns what the whole
  stack shares (tables, global vectors), may act on the token embeddings
  (:meth:`PositionalEncoder.embed`), and once per forward pass builds an
  :class:`AttentionContext` that every layer of the stack reads (so tables and
  gather indices are computed once, not once per layer).
* :class:`AttentionPositional`, one per attention module, made by
  :meth:`PositionalEncoder.for_attention`. It owns per-layer parameters and
  implements the hooks that attention calls, always in this order:

  1. ``score_bias(q, k, ctx)`` -> additive logits ``(B|1, H|1, T, S)`` or None,
     computed from the *projected* q and k;
  2. ``transform_qk(q, k, ctx)`` -> the q and k used for the content score;
  3. the content score ``q @ k^T * scale(D)`` plus the bias, masked, softmaxed;
  4. ``value_term(probs, ctx)`` -> ``(B, H, T, D)`` added to ``probs @ v``
     (only when ``needs_probs`` is true; otherwise the fused kernel runs).

Every hook defaults to "nothing", so a scheme overrides only what it uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import torch
from torch import Tensor, nn


class AttnKind(str, Enum):
    """Which attention a context is for."""

    CAUSAL = "causal"  # decoder self-attention
    BIDIRECTIONAL = "bidirectional"  # encoder self-attention
    CROSS = "cross"  # decoder queries over encoder keys

    @property
    def is_self(self) -> bool:
        return self is not AttnKind.CROSS


@dataclass
class AttentionContext:
    """Per-forward state shared by all layers of one stack for one attention kind.

    Attributes:
        q_pos: Query positions, ``(B|1, T)`` int64.
        k_pos: Key positions, ``(B|1, S)`` int64.
        kind: Causal, bidirectional or cross attention.
        extra: Scheme-specific shared tensors (tables, gather indices).
        query_dims: For each entry of ``extra`` indexed by query, the dim that is, so
            attention can cut the context into blocks of queries (see
            :meth:`slice_queries`). A scheme that puts a per-query tensor in ``extra``
            must list it here.
    """

    q_pos: Tensor
    k_pos: Tensor
    kind: AttnKind
    extra: dict[str, Any] = field(default_factory=dict)
    query_dims: dict[str, int] = field(default_factory=dict)

    def slice_queries(self, start: int, stop: int) -> AttentionContext:
        """The context of queries ``start:stop`` only (keys unchanged)."""
        stop = min(stop, self.q_pos.shape[-1])
        extra = dict(self.extra)
        for key, dim in self.query_dims.items():
            extra[key] = extra[key].narrow(dim, start, stop - start)
        return replace(self, q_pos=self.q_pos[:, start:stop], extra=extra)

    def rel(self) -> Tensor:
        """Relative distance ``i - j`` (query minus key position), ``(B|1, T, S)``."""
        return self.q_pos[:, :, None] - self.k_pos[:, None, :]


class AttentionPositional(nn.Module):
    """Per-attention-module hooks; the base class does nothing at every hook."""

    #: True when the scheme needs the attention probabilities (a value term);
    #: attention then takes its explicit-softmax path instead of the fused kernel.
    needs_probs: bool = False

    @property
    def adds_scores(self) -> bool:
        """Whether the scheme materialises ``(B, H, T, S)`` terms (a score bias or the
        probabilities); attention then works through the queries in blocks when that
        matrix would be large."""
        return self.needs_probs or type(self).score_bias is not AttentionPositional.score_bias

    def scale(self, head_dim: int) -> float:
        """Multiplier of the content score ``q @ k^T`` (and of nothing else)."""
        return head_dim**-0.5

    def score_bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor | None:
        """Additive attention logits, already in the units of the scaled score.

        Args:
            q: Projected queries ``(B, H, T, D)``.
            k: Projected keys ``(B, H, S, D)``.
            ctx: The stack's shared context.

        Returns:
            ``(B|1, H|1, T, S)`` or None.
        """
        return None

    def transform_qk(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        """Return the queries and keys that enter the content score."""
        return q, k

    def value_term(self, probs: Tensor, ctx: AttentionContext) -> Tensor | None:
        """Extra output ``(B, H, T, D)`` from the probabilities ``(B, H, T, S)``."""
        return None


class PositionalEncoder(nn.Module):
    """One per stack. Subclasses take keyword arguments ``d_model``, ``n_heads``,
    ``n_layers`` (filled in by the model builder) plus their own settings."""

    #: True for schemes whose attention scores depend only on relative positions.
    relative: bool = False
    #: Longest sequence the scheme can encode, or None for no limit.
    max_length: int | None = None
    #: Context-extension methods the scheme can apply to a trained model at evaluation
    #: time (RoPE: linear, ntk, dynamic_ntk, yarn). A scheme that lists any must provide
    #: ``scaled(method, factor, original_length)``, a context manager that applies the
    #: method inside the ``with`` block and restores the previous setting after it.
    scaling_methods: tuple[str, ...] = ()

    def __init__(self, *, d_model: int, n_heads: int, n_layers: int) -> None:
        super().__init__()
        if d_model <= 0 or n_heads <= 0 or n_layers <= 0:
            raise ValueError(
                f"d_model, n_heads and n_layers must be positive, got {d_model}, {n_heads}, "
                f"{n_layers}"
            )
        if d_model % n_heads:
            raise ValueError(
                f"n_heads={n_heads} must divide d_model={d_model}; pick a divisor of {d_model}"
            )
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_layers = n_layers
        self.head_dim = d_model // n_heads

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        """Hook (a): act on token embeddings ``x (B, T, C)`` at ``positions (B|1, T)``."""
        return x

    def context(self, q_pos: Tensor, k_pos: Tensor, kind: AttnKind) -> AttentionContext:
        """Build the shared per-forward state for one attention kind of the stack."""
        return AttentionContext(q_pos=q_pos, k_pos=k_pos, kind=kind)

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        """Make the per-layer hooks for attention module ``layer`` of ``kind``."""
        return AttentionPositional()


def gather_rel(table: Tensor, index: Tensor) -> Tensor:
    """Pick per-pair scores from per-distance scores.

    Args:
        table: ``(B, H, T, R)`` scores of each query against each of R distance slots.
        index: ``(B|1, T, S)`` slot of each (query, key) pair, values in ``[0, R)``.

    Returns:
        ``(B, H, T, S)`` with ``out[b, h, i, j] = table[b, h, i, index[b, i, j]]``.
    """
    b, h, t, _ = table.shape
    idx = index[:, None].expand(b, h, t, index.shape[-1])  # (B, H, T, S), no copy
    return torch.gather(table, -1, idx)


def positions_like(x: Tensor, offset: int = 0) -> Tensor:
    """Default positions ``offset .. offset+T-1`` for ``x (B, T, ...)``, shape ``(1, T)``."""
    return torch.arange(offset, offset + x.shape[1], device=x.device)[None]
