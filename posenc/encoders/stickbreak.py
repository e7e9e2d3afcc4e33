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
``r_i = 1 - sum_j A_ij``, goes to (``remainder``):

* ``head_bias`` (default, the authors' model layer: IBM dolomite-engine,
  ``lm_engine/hf_models/modeling_utils/sequence_mixer_blocks/stickbreaking_attention.py``,
  ``SBAttention``): a learned vector per head, ``b_h`` (zeros at first), and each head's
  output is then normalised over its D channels (``GroupNorm(H, C)``: mean and biased
  variance per head, eps 1e-5, a learned scale and shift per channel, ones and zeros at
  first) before the output projection:

      u_i = sum_j A_ij v_j + r_i b_h,      o_i = (u_i - mean(u_i)) / sqrt(var(u_i) + eps) * g + c

* ``value`` (the kernel package's test, ``sb_ref`` plus ``rem * v``; posenc's form before
  ``head_bias`` became the default): the query's own value, no normalisation:

      o_i = sum_j A_ij v_j + r_i v_i

Which keys break the stick (``attend_current``), as in the authors' reference
(github.com/shawntan/stickbreaking-attention: ``sb_attn(..., attend_current=False)``,
and ``stickbreaking_attention/sb_ref.py`` with its tests' masks):

* ``False`` (default, the paper's): only the keys before the query, ``j < i``; the
  paper's process runs "for each token before the current" (abstract), and its
  reference masks the diagonal (``triu(0)``). With ``remainder=value`` the query's own
  value enters through the remainder alone.
* ``True``: the query's own key breaks the stick too, ``j <= i`` (the product then runs
  over ``j < k <= i``); what is left still goes where ``remainder`` says.

Dropout (``p_drop``) acts on the weights ``A``; the remainder is taken from the weights
before dropout. Keys a query may not see (later ones, padding, a cache's empty slots)
get exactly zero weight and break nothing. A query that is itself padding (its own slot
not visible) gets no remainder: zeros before the normalisation, never NaN.

Bidirectional attention: refused (the stick is broken walking back from the query, a
causal order). Cross-attention: nothing, as for every scheme.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc.encoders.base import AttentionContext, AttentionPositional, CausalOnly
from posenc.encoders.registry import register
from posenc.errors import unknown_value

#: Where what is left of the stick goes (module docstring).
REMAINDERS = ("head_bias", "value")
#: The authors' GroupNorm's eps (torch's default, which SBAttention keeps).
GROUP_NORM_EPS = 1e-5


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
    """Per-layer hooks: the whole attention call; with ``remainder=head_bias`` the
    authors' per-head remainder vector and their normalisation over each head."""

    owns_attention = True

    def __init__(
        self, *, attend_current: bool, remainder: str, n_heads: int, head_dim: int
    ) -> None:
        super().__init__()
        self.attend_current = attend_current
        self.remainder = remainder
        if remainder == "head_bias":
            self.head_bias = nn.Parameter(torch.zeros(n_heads, head_dim))  # b_h
            self.norm = nn.GroupNorm(n_heads, n_heads * head_dim, eps=GROUP_NORM_EPS)

    def init_weights(self) -> None:
        """The authors' start: ``b_h = 0``, the normalisation's scale 1 and shift 0."""
        if self.remainder == "head_bias":
            nn.init.zeros_(self.head_bias)
            self.norm.reset_parameters()

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
        if self.remainder == "value":
            weights = a + rem * own  # the remainder on v_i; 0 where not visible
            return (weights @ v.to(acc)).to(v.dtype)
        real = own.any(-1, keepdim=True)  # (B|1, 1, T, 1): the query is not padding
        out = a @ v.to(acc) + (rem * real) * self.head_bias.to(acc)[:, None, :]  # (B,H,T,D)
        return self._normalise(out).to(v.dtype)

    def _normalise(self, out: Tensor) -> Tensor:
        """The authors' ``GroupNorm(H, C)`` on ``(B*T, C)`` rows: one group per head, so
        each head's D channels of ``out (B, H, T, D)`` are normalised together."""
        b, h, t, d = out.shape
        rows = out.transpose(1, 2).reshape(b * t, h * d)  # (B*T, C), heads contiguous
        rows = F.group_norm(
            rows,
            h,
            self.norm.weight.to(rows.dtype),
            self.norm.bias.to(rows.dtype),
            self.norm.eps,
        )
        return rows.view(b, t, h, d).transpose(1, 2)  # (B, H, T, D)


@register("stickbreak")
class StickBreaking(CausalOnly):
    """Stick-breaking attention instead of softmax attention; no positional encoding.

    Args:
        attend_current: ``False`` (default, the paper's and the reference's): only keys
            before the query break the stick. ``True``: the query's own key breaks the
            stick too.
        remainder: ``head_bias`` (default, the authors' model layer: a learned vector
            per head, then a normalisation over each head) or ``value`` (the query's own
            value, as the kernel package's test).

    Raises:
        ValueError: A bad ``attend_current`` or ``remainder``; ``for_attention`` with
            bidirectional attention.
    """

    causal_reason = (
        "stick-breaking attention breaks each query's stick walking back from the query "
        "over the keys before it, an order that keys after the query do not have"
    )
    data_dependent = True
    uses_positions = False

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_layers: int,
        attend_current: bool = False,
        remainder: str = "head_bias",
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if remainder not in REMAINDERS:
            raise ValueError(
                f"stickbreak: {unknown_value('remainder', remainder, REMAINDERS)} "
                f"(head_bias is the authors' model layer, value the query's own value)"
            )
        self.attend_current = attend_current
        self.remainder = remainder

    def causal_hooks(self, *, layer: int) -> AttentionPositional:
        return _StickBreaking(
            attend_current=self.attend_current,
            remainder=self.remainder,
            n_heads=self.n_heads,
            head_dim=self.head_dim,
        )
