"""Attention with an additive score term, forward and backward written out.

Notation: B batch, H heads, T queries, S keys, D head dim.

A scheme with a score term (Shaw, Transformer-XL, DeBERTa, ALiBi, T5, FIRE) cannot use
the fused attention kernels on CPU: ``scaled_dot_product_attention`` with a mask that
needs a gradient takes its unfused "math" path, which makes about a dozen passes over
the ``(B, H, T, S)`` scores per forward and backward (scaling q and k, adding the mask,
a softmax that also checks every row for being fully masked, and autograd's copies).
On a CPU those passes, not the matrix products, decide the speed of a long sequence.

:func:`scored_attention` computes the same thing with the fewest passes: the score term
is copied once into the score buffer, ``q k^T`` is accumulated onto it in place by the
matrix product, the causal mask touches only the columns it can mask, and the softmax
runs once. Its backward is the textbook one (Vaswani et al. 2017 attention, softmax
derivative ``dS = P * (dP - rowsum(dP * P))``), in which the gradient of the score term
is ``dS`` itself, summed over the dims the term was broadcast along.

It also returns the probabilities, so a scheme with a value term (Shaw) adds
``value_term(probs)`` and the gradient of that flows back into the same backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from posenc.encoders.base import ScoreParts
from posenc.encoders.softmax import softmax_values


def dropout_keep(probs: Tensor, p: float) -> Tensor:
    """Bool mask of kept probabilities (each kept with chance ``1 - p``); the RNG is
    torch's global one, as for ``F.dropout``."""
    return torch.empty_like(probs).bernoulli_(1.0 - p).bool()


def _scores(
    q3: Tensor,
    k3: Tensor,
    heads: tuple[int, int],
    parts: ScoreParts,
    scale: float,
    causal_shift: int | None,
    key_valid: Tensor | None,
) -> Tensor:
    """``q k^T * scale + parts`` with masked pairs at -inf, from ``q3 (B*H, T, D)`` and
    ``k3 (B*H, S, D)``: ``(B, H, T, S)``, contiguous."""
    (b, h), t, s = heads, q3.shape[-2], k3.shape[-2]
    scores = torch.empty(b, h, t, s, dtype=q3.dtype, device=q3.device)
    # Parts that tile the columns from the left are copied in (one pass each, broadcast
    # as needed); the rest of the buffer is zeroed and the other parts added on top.
    filled, rest = 0, []
    for term, c0 in parts:
        if c0 == filled:
            scores[..., c0 : c0 + term.shape[-1]].copy_(term)
            filled += term.shape[-1]
        else:
            rest.append((term, c0))
    # A part at column 0 was copied in: zero the columns no copied part covers and let
    # the product accumulate. Otherwise (or without parts) the product ignores the
    # uninitialised buffer (beta 0) and writes it, and the parts are added after it.
    accumulate = filled > 0
    if accumulate:
        if filled < s:
            scores[..., filled:].zero_()
        for term, c0 in rest:
            scores[..., c0 : c0 + term.shape[-1]].add_(term)
    beta = 1.0 if accumulate else 0.0
    scores.view(b * h, t, s).baddbmm_(q3, k3.transpose(1, 2), beta=beta, alpha=scale)
    if not accumulate:
        for term, c0 in rest:
            scores[..., c0 : c0 + term.shape[-1]].add_(term)
    if causal_shift is not None and causal_shift + 1 < s:
        # Query i sees keys j <= i + shift: only columns past the shift can be masked.
        c0 = max(0, causal_shift + 1)
        i = torch.arange(t, device=q3.device)[:, None]
        j = torch.arange(c0, s, device=q3.device)[None, :]
        scores[..., c0:].masked_fill_(j > i + causal_shift, float("-inf"))
    if key_valid is not None:
        scores.masked_fill_(~key_valid[:, None, None, :], float("-inf"))
    return scores


class _ScoredAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_valid: Tensor | None,
        keep: Tensor | None,
        *rest: Any,
    ) -> tuple[Tensor, Tensor]:
        # The settings come last: dynamo (torch 2.13) binds a non-tensor argument before
        # exactly two variadic tensors to the wrong parameter.
        *terms, settings = rest
        scale, causal_shift, p_drop, cols = settings
        parts = list(zip(terms, cols, strict=True))
        out, used, probs, q3, k3 = _forward(q, k, v, key_valid, keep, parts, settings)
        ctx.save_for_backward(q3, k3, v, probs, keep)
        ctx.scale, ctx.p_drop = scale, p_drop
        ctx.parts = [(term.shape, c0) for term, c0 in parts]
        ctx.set_materialize_grads(False)  # an unused output gets None, not a zero tensor
        return out, used

    @staticmethod
    def backward(ctx, d_out: Tensor | None, d_used: Tensor | None):
        q3, k3, v, probs, keep = ctx.saved_tensors
        n_in = 6 + len(ctx.parts)  # q, k, v, key_valid, keep, the terms, the settings
        if d_out is None and d_used is None:
            return (None,) * n_in
        b, h, t, s = probs.shape
        d = q3.shape[-1]
        d_v = None
        if d_out is not None:
            if ctx.needs_input_grad[2]:
                used = probs if keep is None else probs * keep / (1.0 - ctx.p_drop)
                d_v = used.transpose(-1, -2) @ d_out
            d_p = d_out @ v.transpose(-1, -2)  # (B, H, T, S)
            if d_used is not None:
                d_p += d_used
        else:
            assert d_used is not None  # both None returned above
            d_p = d_used.clone() if keep is not None else d_used  # scaled in place below
        if keep is not None:
            d_p.mul_(keep).div_(1.0 - ctx.p_drop)
        d_s = torch.ops.aten._softmax_backward_data(d_p, probs, -1, probs.dtype)
        del d_p
        d3 = d_s.view(b * h, t, s)
        d_q = d_k = None
        if ctx.needs_input_grad[0]:
            d_q = torch.bmm(d3, k3).mul_(ctx.scale).view(b, h, t, d)
        if ctx.needs_input_grad[1]:
            d_k = torch.bmm(d3.transpose(1, 2), q3)
            d_k = d_k.mul_(ctx.scale).view(b, h, s, d)
        d_terms = [
            _sum_to(d_s[..., c0 : c0 + shape[-1]], shape) if ctx.needs_input_grad[5 + i] else None
            for i, (shape, c0) in enumerate(ctx.parts)
        ]
        return d_q, d_k, d_v, None, None, *d_terms, None


def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_valid: Tensor | None,
    keep: Tensor | None,
    parts: ScoreParts,
    settings: tuple[float, int | None, float, tuple[int, ...]],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward pass: ``(out, used, probs, q3, k3)``, the last three what the
    backward needs (``used``: the probabilities after dropout)."""
    scale, causal_shift, p_drop, _ = settings
    b, h, t, d = q.shape
    s = k.shape[-2]
    q3, k3 = q.reshape(b * h, t, d), k.reshape(b * h, s, d)  # copies when strided, once
    # The scores are handed over, not kept: freed once softmaxed (the memory peak).
    out, used, probs = softmax_values(
        _scores(q3, k3, (b, h), parts, scale, causal_shift, key_valid),
        v,
        dtype=q.dtype,
        dropout=p_drop,
        keep=keep,
        empty_rows=_may_have_empty_rows(causal_shift, key_valid),
    )
    return out, used, probs, q3, k3


def _may_have_empty_rows(causal_shift: int | None, key_valid: Tensor | None) -> bool:
    """Whether some query may see no key at all (its softmax row would be NaN), from
    what is known without reading ``key_valid`` (no host read)."""
    return (causal_shift is not None and causal_shift < 0) or key_valid is not None


def _sum_to(grad: Tensor, shape: torch.Size) -> Tensor:
    """Sum ``grad`` over the dims a tensor of ``shape`` was broadcast along (leading
    dims it lacks, and dims of size 1)."""
    lead = grad.dim() - len(shape)
    if lead:
        grad = grad.sum(tuple(range(lead)))
    dims = [i for i, (g, n) in enumerate(zip(grad.shape, shape, strict=True)) if n == 1 and g != 1]
    return grad.sum(dims, keepdim=True) if dims else grad


def scored_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | ScoreParts | None,
    *,
    scale: float,
    causal_shift: int | None = None,
    key_valid: Tensor | None = None,
    dropout: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Softmax attention with an additive score term.

    Args:
        q: Queries ``(B, H, T, D)``.
        k: Keys ``(B, H, S, D)``.
        v: Values ``(B, H, S, Dv)``.
        bias: Score term ``(B|1, H|1, T, S)`` in units of the scaled score (any strides,
            e.g. a strided view of a per-offset table), or its :data:`ScoreParts`, or None.
        scale: Multiplier of ``q k^T``.
        causal_shift: None for no causal mask; else query i sees keys ``j <= i + shift``.
        key_valid: ``(B, S)`` True for real keys, or None.
        dropout: Probability of dropping an attention probability (training only).

    Returns:
        ``(out (B, H, T, Dv), probs (B, H, T, S))``: ``probs`` are the probabilities
        that multiplied ``v`` (after dropout), differentiable, for a value term.
    """
    parts = [] if bias is None else [(bias, 0)] if isinstance(bias, Tensor) else list(bias)
    s = k.shape[-2]
    for term, c0 in parts:
        if not 0 <= c0 <= c0 + term.shape[-1] <= s:
            raise ValueError(f"score part of width {term.shape[-1]} at column {c0} exceeds S={s}")
    keep = None
    if dropout > 0.0:
        with torch.no_grad():
            keep = dropout_keep(q.new_empty(*q.shape[:-1], s), dropout)
    settings = (scale, causal_shift, dropout, tuple(c0 for _, c0 in parts))
    terms = [term for term, _ in parts]
    if not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, *terms))):
        # No backward to write: the forward alone (dynamo in torch 2.13 also miscounts
        # the variadic terms of an autograd.Function it inlines without grad).
        out, used, *_ = _forward(q, k, v, key_valid, keep, parts, settings)
        return out, used
    return _ScoredAttention.apply(q, k, v, key_valid, keep, *terms, settings)
