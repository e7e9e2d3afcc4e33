"""Selective attention (Leviathan, Kalman and Matias 2024, "Selective Attention
Improves Transformer", section 2).

Notation: B batch, H heads, T queries, S keys; i a query, j a key, k a token in between.

A token may decide that an earlier token is no longer needed, for every later query. The
decision is read off head 0's logits: token k masks key j by
``relu(z^0_kj)``, ``z^0_kj = q^0_k . k^0_j / sqrt(D)``, and the masks accumulate over the
tokens before the query,

    F_ij = sum_{k < i} relu(z^0_kj) [j < k]            (a token never masks itself)
    score_h(i, j) = q_i . k_j / sqrt(D) - F_ij          (every head, head 0 included)

followed by the usual softmax over the keys the query may see. As the paper prescribes,
the first token (its <BOS>) is never masked: here each row's first real token (after a
left-padded prompt's padding), so that a row decodes the same alone or padded. Only
earlier keys are masked (``j < k``; a later key is invisible to k anyway), as in the
paper's causal selection matrix. One public reading, x-transformers' ``selective_attn``,
subtracts the same shifted cumulative sum but turns caching off for it; here the
accumulated mask of every key, ``sum`` over the tokens already decoded, is carried in
the layer's cache (``selective_acc``, ``(B, S)``), so cached decoding equals a full pass.

There are no positions and no parameters: selection is computed from the layer's own
queries and keys. Causal attention only. It replaces the attention call
(``owns_attention``): F needs every earlier query's row, so the queries are never split
into blocks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc.encoders.base import AttentionContext, AttentionPositional, CausalOnly, Slot
from posenc.encoders.registry import register
from posenc.encoders.softmax import softmax_values

#: In a layer's decoding cache: each key's accumulated penalty so far, (B, S).
ACC: Slot[Tensor] = Slot("selective_acc")


def selection(z0: Tensor, visible: Tensor, before: Tensor, first: Tensor) -> Tensor:
    """What each query's token masks: ``relu(z^0_kj)`` where key j is before token k,
    visible to it and not the row's first real token, else 0.

    Args:
        z0: ``(B, T, S)`` head 0's logits of the queries (tokens k).
        visible: ``(B|1, T, S)`` bool, the keys each query may see.
        before: ``(T, S)`` bool, key j strictly before token k.
        first: ``(B|1, S)`` bool, each row's first real token.

    Returns:
        ``(B, T, S)`` non-negative, of ``z0``'s dtype.
    """
    return F.relu(z0) * (visible & before & ~first[:, None, :])


class _Selective(AttentionPositional):
    """Per-layer hooks: the whole attention call, with the accumulated masks."""

    owns_attention = True

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        ctx: AttentionContext,
        *,
        p_drop: float,
        cache: Any | None,
    ) -> Tensor:
        """``(B, H, T, D)`` from ``q (B, H, T, D)``, ``k``, ``v (B, H, S, D)``; in a cached
        step the keys are every slot and ``cache`` carries each key's accumulated mask."""
        s = k.shape[-2]
        acc = torch.promote_types(q.dtype, torch.float32)
        z = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * self.scale(q.shape[-1])  # (B,H,T,S)
        visible = ctx.visible()  # (B|1, 1, T, S)
        before = ctx.key_offsets() < 0  # (T, S): keys strictly before each query's token
        if ctx.key_valid is None:
            first = (torch.arange(s, device=q.device) == 0)[None]  # (1, S)
        else:  # the first real token of each row: a left-padded prompt's first after padding
            first = ctx.key_valid & (ctx.key_valid.cumsum(-1) == 1)  # (B, S)
        g = selection(z[:, 0], visible[:, 0], before, first)  # (B, T, S)
        masked = g.cumsum(-2) - g  # F_ij: the tokens before query i within this call
        if cache is not None:  # and every token decoded in earlier steps
            total = cache.get(ACC)  # (B, S), updated in place: one graph
            if total is None:
                total = g.new_zeros(g.shape[0], s)
                cache.put(ACC, total)
            masked = masked + total[:, None, :]
            total.add_(g.sum(-2))
        logits = z - masked[:, None]
        out, _, _ = softmax_values(logits, v, visible=visible, dtype=acc, dropout=p_drop)
        return out


@register("selective")
class Selective(CausalOnly):
    """Selective attention (module docstring); no settings, no positions."""

    causal_reason = (
        "selective attention lets each token mask earlier tokens for the queries after "
        "it, an order that an encoder's keys do not have"
    )
    data_dependent = True
    uses_positions = False

    def causal_hooks(self, *, layer: int) -> AttentionPositional:
        return _Selective()
