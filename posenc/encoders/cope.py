"""Contextual position encoding, CoPE (Golovneva, Wang, Weston and Sukhbaatar 2024,
"Contextual Position Encoding: Learning to Count What's Important", section 3).

Notation: B batch, H heads, T queries, S keys, D head dim; i query and j key index.

A position is counted, not given: each query decides, with a gate per key, which
tokens count, and a key's position is the number of counted tokens from it up to the
query,

    g_it = sigmoid(q_i . k_t / sqrt(D)),      p_ij = sum_{t = j .. i} g_it   (t visible to i),

clamped to ``npos - 1``. The position enters the logits through a learned embedding
``e[p]`` per integer position, interpolated between the two integers around the
fractional ``p_ij``:

    score(i, j) = (q_i . k_j + (1 - w) q_i . e[floor p_ij] + w q_i . e[ceil p_ij]) / sqrt(D),

``w = p_ij - floor p_ij``. As in the authors' code (facebookresearch/RAM,
``projects/cope/src/cope/context_position.py``): the gates read the same keys as the
content score, masked keys (later ones, padding) count nothing, the position term is
divided by ``sqrt(D)`` with the content score, the embeddings ``(D, npos)`` are one
table per layer shared by its heads and start at zero, and ``npos`` is the training
length + 1 (counts 0 .. the longest context; here ``count_limit + 1``). No gradient
flows through the rounding, only through ``w``.

The term needs every key's gate for each query, so it is built as a ``(B, H, T, S)``
score term (no FlexAttention ``score_mod``); a cached decoding step counts over the
cache's keys as the full pass does, so no extra state is kept. Causal attention only
(the count runs from the key to the query).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from posenc.encoders.base import AttentionContext, AttentionPositional, CausalOnly
from posenc.encoders.registry import register

#: Queries per block of :func:`cope_term`. The term's intermediates (gates, counts,
#: their indices and weights, two reads of the table) come to about 16 float32
#: ``(B, H, T, S)`` tensors, all kept for the backward pass when built at once. Built a
#: block of queries at a time, and recomputed in the backward pass while training
#: (activation checkpointing), only one block's exist at any time, and the backward
#: pass keeps the inputs and the ``(B, H, T, S)`` result.
COPE_BLOCK = 256


def cope_term(q: Tensor, k: Tensor, table: Tensor, visible: Tensor, scale: float) -> Tensor:
    """CoPE's position logits, ``(B, H, T, S)`` in the units of the scaled score, in
    ``q``'s dtype, computed :data:`COPE_BLOCK` queries at a time (each query's count
    reads only its own row of gates).

    Args:
        q: ``(B, H, T, D)`` queries. k: ``(B, H, S, D)`` keys.
        table: ``(D, npos)`` position embeddings (one per integer count).
        visible: ``(B|1, 1, T, S)`` bool, the keys each query may see.
        scale: The content score's multiplier ``1 / sqrt(D)``.
    """
    t = q.shape[-2]
    blocks = []
    for start in range(0, t, COPE_BLOCK):
        rows = (q[..., start : start + COPE_BLOCK, :], k, table)
        seen = visible[..., start : start + COPE_BLOCK, :]
        if torch.is_grad_enabled():
            blocks.append(checkpoint(_cope_rows, *rows, seen, scale, use_reentrant=False))
        else:
            blocks.append(_cope_rows(*rows, seen, scale))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-2)


def _cope_rows(q: Tensor, k: Tensor, table: Tensor, visible: Tensor, scale: float) -> Tensor:
    """:func:`cope_term` for the queries of ``q``, at once."""
    out_dtype = q.dtype
    acc = torch.promote_types(q.dtype, torch.float32)
    q, k = q.to(acc), k.to(acc)
    gates = torch.sigmoid((q @ k.transpose(-1, -2)) * scale) * visible  # (B, H, T, S)
    # p_ij = sum_{t >= j} g_it: a reverse cumulative sum over keys (masked ones add 0)
    counts = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=table.shape[-1] - 1)
    at_int = q @ table.to(acc)  # (B, H, T, npos): q_i . e[p] for every integer p
    lo = counts.detach().floor()
    w = counts - lo  # the only path of the gradient into the gates
    lo_i = lo.long()
    hi_i = counts.detach().ceil().long()
    term = at_int.gather(-1, lo_i) * (1 - w) + at_int.gather(-1, hi_i) * w
    return (term * scale).to(out_dtype)


class _CopeAttention(AttentionPositional):
    """Per-layer hook: this layer's position embeddings, counted per query."""

    score_term = True

    def __init__(self, *, head_dim: int, npos: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(head_dim, npos))  # the authors' start: 0

    def score_bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        return cope_term(q, k, self.table, ctx.visible(), self.scale(q.shape[-1]))


@register("cope")
class CoPE(CausalOnly):
    """Contextual position encoding (module docstring).

    Args:
        count_limit: The largest count a position can take (counts are clamped to it):
            the training length, as the authors' ``npos = block_size + 1`` (the YAML sets
            it so; 512 here, the YAML's fallback).

    Raises:
        ValueError: ``count_limit < 1``, or bidirectional attention.
    """

    causal_reason = "CoPE counts gated tokens from each key up to the query (keys at or before it)"
    data_dependent = True
    uses_positions = False  # positions are counted from the gates, never read

    def __init__(
        self, *, d_model: int, n_heads: int, n_layers: int, count_limit: int = 512
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if isinstance(count_limit, bool) or not isinstance(count_limit, int) or count_limit < 1:
            raise ValueError(
                f"cope: count_limit must be a positive integer (the largest position a count "
                f"can reach, the training length by default), got {count_limit!r}"
            )
        self.npos = count_limit + 1

    def causal_hooks(self, *, layer: int) -> AttentionPositional:
        return _CopeAttention(head_dim=self.head_dim, npos=self.npos)
