"""The tail of every explicit softmax: masked logits -> softmax -> dropout -> values.

Notation: B batch, H heads, T queries, S keys, Dv value dim.

Attention's explicit softmax (:mod:`posenc.model.backends`, :mod:`posenc.model.scored`)
and the schemes that own their attention (selective attention, PaTH) end the same way;
they differ only in how they make the logits, so the tail is written here once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def softmax_values(
    logits: Tensor,
    v: Tensor,
    *,
    visible: Tensor | None = None,
    dtype: torch.dtype | None = None,
    dropout: float = 0.0,
    keep: Tensor | None = None,
    empty_rows: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax over the keys each query may see, dropout, and the weighted sum of values.

    Args:
        logits: ``(B, H, T, S)`` in units of the softmax.
        v: Values ``(B, H, S, Dv)``.
        visible: ``(B|1, H|1, T, S)`` bool, the keys each query may see; None when
            ``logits`` are masked already (or nothing is).
        dtype: The probabilities' dtype, and the product's with the values (default:
            ``v``'s). The softmax itself runs in float32 or wider.
        dropout: Probability of dropping an attention probability (training only).
        keep: The dropout's keep mask, drawn ahead by a caller whose written-out
            backward reuses it; None draws one through ``F.dropout``.
        empty_rows: Whether some query may see no key: its row of probabilities is then
            zeros, not NaN (False saves a pass where no row can be empty).

    Returns:
        ``(out (B, H, T, Dv) in v's dtype, used, probs)``: ``used`` are the probabilities
        that multiplied ``v`` (after dropout), ``probs`` the ones before.
    """
    if visible is not None:
        logits = logits.masked_fill(~visible, float("-inf"))
    acc = torch.promote_types(logits.dtype, torch.float32)
    probs = torch.softmax(logits, -1, dtype=acc).to(dtype or v.dtype)
    del logits  # a caller that passed its scores alone frees them before dropout's buffers
    if empty_rows:
        # In place where autograd keeps no copy of the softmax (a written-out backward,
        # or no gradient): one (B, H, T, S) buffer fewer.
        probs = probs.nan_to_num(0.0) if probs.requires_grad else probs.nan_to_num_(0.0)
    if keep is not None:
        used = probs * keep / (1.0 - dropout)
    else:
        used = F.dropout(probs, dropout) if dropout > 0.0 else probs
    return (used @ v.to(used.dtype)).to(v.dtype), used, probs
