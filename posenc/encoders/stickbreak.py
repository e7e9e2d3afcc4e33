"""Stick-breaking attention (Tan et al., "Scaling Stick-Breaking Attention: An Efficient
Implementation and In-depth Study", ICLR 2025; arXiv:2410.17980).

Notation: B batch, H heads, T queries, S keys, D head dim; i a query, j and k keys.

No softmax and no positional encoding. With the logits ``z_ij = q_i . k_j / sqrt(D)`` and
the break points ``beta_ij = sigmoid(z_ij)``, query i walks back from its nearest key
and gives each key the share of what is left of a unit stick that the key's break point
asks for:

    A_ij = beta_ij * prod_{j < k < i} (1 - beta_ik)                   (keys j < i)
    log A_ij = logsigmoid(z_ij) + sum_{j < k < i} logsigmoid(-z_ik)

so order comes from the products alone (a recency bias), and the weights of a row sum
to at most 1. The sum over the keys between j and the query is a reverse cumulative sum
over the key axis, taken in float32 at least. What is left of the stick,
``1 - sum_j A_ij``, goes to the query's own value:

    o_i = sum_j A_ij v_j + (1 - sum_j A_ij) v_i

Which keys break the stick (``attend_current``), as in the authors' reference
(github.com/shawntan/stickbreaking-attention: ``sb_attn(..., attend_current=False)``,
and ``stickbreaking_attention/sb_ref.py`` with its tests' masks):

* ``False`` (default, the paper's): only the keys before the query, ``j < i``; the
  paper's process runs "for each token before the current" (abstract), and its
  reference masks the diagonal (``triu(0)``). The query's own value enters through the
  remainder alone.
* ``True``: the query's own key breaks the stick too, ``j <= i`` (the product then runs
  over ``j < k <= i``); what is left still goes to ``v_i``, as the reference's tests add
  ``rem * v`` for both settings.

Dropout (``p_drop``) acts on the weights ``A``; the remainder is taken from the weights
before dropout. Keys a query may not see (later ones, padding, a cache's empty slots)
get exactly zero weight, remainder included, and break nothing; a query that sees no key
at all gets zeros, never NaN.

Bidirectional attention: refused (the stick is broken walking back from the query, a
causal order). Cross-attention: nothing, as for every scheme.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc.encoders.base import AttentionContext, AttentionPositional, CausalOnly
from posenc.encoders.registry import register


def stickbreak_weights(z: Tensor, breaks: Tensor) -> Tensor:
    """Stick-breaking weights from logits, in log space.

    Args:
        z: ``(B, H, T, S)`` logits ``q_i . k_j / sqrt(D)``, float32 or float64.
        breaks: ``(B|1, 1|H, T, S)`` bool, the keys that break query i's stick (False
            for keys after it, invisible ones and, unless it attends to itself, its own).

    Returns:
        ``(B, H, T, S)`` weights ``A_ij`` of ``z``'s dtype, exactly 0 where ``breaks`` is
        False; each row sums to at most 1.
    """
    log_keep = torch.where(breaks, F.logsigmoid(-z), 0.0)  # log(1 - beta_ik), 0: no break
    # sum over the breaking keys after j: an inclusive cumulative sum from the last key
    # back, moved one key to the left. Every term is <= 0, so the running sum never
    # cancels (a total minus a forward cumsum would lose the small sums near the query).
    from_right = log_keep.flip(-1).cumsum(-1).flip(-1)  # sum_{k >= j}
    after = F.pad(from_right[..., 1:], (0, 1))  # sum_{k > j}
    log_a = torch.where(breaks, F.logsigmoid(z) + after, float("-inf"))
    return log_a.exp()


class _StickBreaking(AttentionPositional):
    """Per-layer hooks: the whole attention call (no parameters)."""

    owns_attention = True

    def __init__(self, *, attend_current: bool) -> None:
        super().__init__()
        self.attend_current = attend_current

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
        """``(B, H, T, D)`` stick-breaking attention of ``q (B, H, T, D)`` over ``k`` and
        ``v (B, H, S, D)``; each row depends on its own logits only, so a cached step
        needs no state beyond the keys and values (``cache`` unused)."""
        acc = torch.promote_types(q.dtype, torch.float32)  # bf16/fp16 -> float32
        z = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * self.scale(q.shape[-1])  # (B,H,T,S)
        visible = ctx.visible()  # (B|1, 1, T, S): j <= i + shift, and not padding
        # Query i's own key sits at index i + shift (a full pass: i; a cached step: its slot)
        own = visible & (ctx.key_offsets() == 0)  # (B|1, 1, T, S)
        breaks = visible if self.attend_current else visible & ~own
        a = stickbreak_weights(z, breaks)  # (B, H, T, S)
        rem = 1.0 - a.sum(-1, keepdim=True)  # (B, H, T, 1), what is left of the stick
        if p_drop > 0.0:
            a = F.dropout(a, p_drop)
        weights = a + rem * own  # the remainder on v_i; 0 where not visible
        return (weights @ v.to(acc)).to(v.dtype)


@register("stickbreak")
class StickBreaking(CausalOnly):
    """Stick-breaking attention instead of softmax attention; no positional encoding.

    Args:
        attend_current: ``False`` (default, the paper's and the reference's): only keys
            before the query break the stick, and the query's own value takes the
            remainder. ``True``: the query's own key breaks the stick too.

    Raises:
        ValueError: ``for_attention`` with bidirectional attention.
    """

    causal_reason = (
        "stick-breaking attention breaks each query's stick walking back from the query "
        "over the keys before it, an order that keys after the query do not have"
    )
    data_dependent = True
    uses_positions = False

    def __init__(
        self, *, d_model: int, n_heads: int, n_layers: int, attend_current: bool = False
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        self.attend_current = attend_current

    def causal_hooks(self, *, layer: int) -> AttentionPositional:
        return _StickBreaking(attend_current=self.attend_current)
