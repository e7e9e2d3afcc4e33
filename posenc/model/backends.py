"""Attention backends: which kernel runs one attention call, chosen by what the scheme
needs and by the device. The model never branches on a scheme; it calls :func:`attend`.

Notation: B batch, H heads, T queries, S keys, D head dim.

* SDPA without a score term (fused flash / memory-efficient kernels).
* FlexAttention for a score term on a GPU: the scheme's ``score_mod`` reads small
  per-offset tables by ``q_idx``/``kv_idx`` (no ``(B, H, T, S)`` bias is written);
  causality and key padding are a block mask, whose empty blocks are skipped.
* The explicit softmax where the probabilities are needed (a value term), with dropout
  (FlexAttention has none), and for training on a CPU (no FlexAttention backward there
  in torch 2.13): :func:`~posenc.model.scored.scored_attention`, whose backward is
  written out (1.03x-1.20x a CPU training step, see the README), or with
  ``HAND_WRITTEN_BACKWARD = False`` :func:`plain_attention`, the same values through
  autograd. On a GPU without a ``score_mod`` the term is SDPA's additive mask.

``Attention.backend = "flex"`` or ``"explicit"`` forces one (the parity tests run the
flex path's forward on a CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from posenc.encoders.base import (
    AttentionContext,
    AttentionPositional,
    AttnKind,
    ScoreMod,
    ScoreParts,
    dense_parts,
)
from posenc.model.scored import scored_attention

BACKENDS = ("auto", "flex", "explicit")
#: The explicit softmax with its written-out backward (True) or plain autograd (False).
HAND_WRITTEN_BACKWARD = True


def attention_mask(
    *,
    bias: Tensor | None,
    causal: bool,
    key_valid: Tensor | None,
    t: int,
    s: int,
    dtype: torch.dtype,
    device: torch.device,
    shift: int | None = None,
) -> Tensor | None:
    """Combine score bias, causal mask and key padding into one additive mask.

    Causality is by index: query i sees keys ``j <= i + shift``, where the default
    ``shift = S - T`` aligns the last query with the last key (a cache, or all of a
    sequence when S = T); a block of queries starting at q0 of T in all uses
    ``shift = q0 + S - T``.

    Args:
        bias: ``(B|1, H|1, T, S)`` additive logits or None.
        causal: Mask keys after each query.
        key_valid: ``(B, S)`` bool, True for real (non-padding) keys, or None.
        t: Query length T.
        s: Key length S.
        dtype: Mask dtype (must match the queries for SDPA).
        device: Mask device.
        shift: Causal offset (see above).

    Returns:
        ``(B|1, H|1, T, S)`` additive mask with ``-inf`` where attention is not
        allowed, or None when nothing is masked or added.
    """
    mask = None if bias is None else bias.to(dtype)
    neg = float("-inf")
    if causal:
        i = torch.arange(t, device=device)[:, None]
        j = torch.arange(s, device=device)[None, :]
        shift = s - t if shift is None else shift
        blocked = torch.zeros(t, s, dtype=dtype, device=device).masked_fill(j > i + shift, neg)
        mask = blocked if mask is None else mask + blocked
    if key_valid is not None:
        pad = torch.zeros(key_valid.shape, dtype=dtype, device=device)
        pad = pad.masked_fill(~key_valid, neg)[:, None, None, :]  # (B, 1, 1, S)
        mask = pad if mask is None else mask + pad
    return mask


def plain_attention(
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
    """:func:`~posenc.model.scored.scored_attention` through autograd: the reference."""
    t, s = q.shape[-2], k.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, T, S)
    if bias is not None:
        scores = scores + (bias if isinstance(bias, Tensor) else dense_parts(bias, s))
    if causal_shift is not None:
        i = torch.arange(t, device=q.device)[:, None]
        j = torch.arange(s, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + causal_shift, float("-inf"))
    if key_valid is not None:
        scores = scores.masked_fill(~key_valid[:, None, None, :], float("-inf"))
    acc = torch.promote_types(q.dtype, torch.float32)
    probs = torch.softmax(scores, -1, dtype=acc).to(q.dtype).nan_to_num(0.0)  # empty rows: 0
    if dropout > 0.0:
        probs = F.dropout(probs, dropout)
    return probs @ v, probs


def fused_bias_kernel(q: Tensor) -> bool:
    """Whether ``scaled_dot_product_attention`` has a fused kernel for a score term that
    needs a gradient on ``q``'s device (CUDA's memory-efficient kernel); on a CPU it
    takes its unfused math path, slower than the explicit one."""
    return q.device.type == "cuda"


def use_flex(backend: str, q: Tensor, pos: AttentionPositional, p_drop: float) -> bool:
    """FlexAttention for this call: forced, or on a GPU for a scheme with a score term,
    no value term and no dropout."""
    if backend == "flex":
        return True
    return (
        backend == "auto"
        and q.device.type == "cuda"
        and pos.adds_scores
        and not pos.needs_probs
        and p_drop == 0.0
    )


def flex_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    score_mod: ScoreMod | None,
    *,
    scale: float,
    causal_shift: int | None,
    key_valid: Tensor | None,
) -> Tensor:
    """FlexAttention with the causal mask and key padding as a block mask.

    Args:
        q: ``(B, H, T, D)``. k: ``(B, H, S, D)``. v: ``(B, H, S, D)``.
        score_mod: The scheme's term, or None.
        scale: Multiplier of ``q k^T``.
        causal_shift: None, or query i sees keys ``j <= i + shift``.
        key_valid: ``(B, S)`` True for real keys, or None.

    Returns:
        ``(B, H, T, D)``; a query that sees no key gets zeros.
    """
    (b, _, t, _), s = q.shape, k.shape[-2]
    block_mask = None
    if causal_shift is not None or key_valid is not None:

        def mask_mod(b_i: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            ok = kv_idx >= 0  # all True, of the index's shape
            if causal_shift is not None:
                ok = ok & (kv_idx <= q_idx + causal_shift)
            if key_valid is not None:
                ok = ok & key_valid[b_i, kv_idx]
            return ok

        block_mask = create_block_mask(
            mask_mod, b if key_valid is not None else None, None, t, s, device=q.device
        )
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)


def attend(
    pos: AttentionPositional,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ctx: AttentionContext,
    *,
    key_valid: Tensor | None,
    shift: int,
    p_drop: float,
    backend: str = "auto",
    transformed: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """One attention call with the scheme's hooks, on the backend that fits.

    Args:
        pos: The scheme's hooks.
        q: ``(B, H, T, D)`` projected queries. k: ``(B, H, S, D)``. v: ``(B, H, S, D)``.
        ctx: The stack's context for these queries and keys.
        key_valid: ``(B, S)`` True for real keys, or None.
        shift: Causal offset (:func:`attention_mask`).
        p_drop: Dropout on the probabilities (0 in evaluation).
        backend: ``auto``, ``flex`` or ``explicit``.
        transformed: The content score's q and k when the caller transformed them
            already (a cache keeps transformed keys); else ``transform_qk(q, k, ctx)``.

    Returns:
        ``(B, H, T, D)``.
    """
    t, s = q.shape[-2], k.shape[-2]
    causal = ctx.kind is AttnKind.CAUSAL
    scale = pos.scale(q.shape[-1])
    if use_flex(backend, q, pos, p_drop) and not pos.needs_probs:
        score_mod = pos.score_mod(q, k, ctx) if pos.adds_scores else None
        if score_mod is not None or not pos.adds_scores:
            q, k = pos.transform_qk(q, k, ctx) if transformed is None else transformed
            return flex_attend(q, k, v, score_mod, scale=scale,
                               causal_shift=shift if causal else None, key_valid=key_valid)
    parts = pos.score_parts(q, k, ctx)
    q, k = pos.transform_qk(q, k, ctx) if transformed is None else transformed
    if parts is None and not pos.needs_probs and key_valid is None and causal and t == s \
            and shift == 0:
        # Nothing to add: let SDPA pick its fused causal kernel.
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p_drop, is_causal=True,
                                              scale=scale)
    if pos.needs_probs or (parts is not None and not fused_bias_kernel(q)):
        explicit = scored_attention if HAND_WRITTEN_BACKWARD else plain_attention
        out, probs = explicit(q, k, v, parts, scale=scale, causal_shift=shift if causal else None,
                              key_valid=key_valid, dropout=p_drop)
        extra = pos.value_term(probs, ctx) if pos.needs_probs else None
        return out if extra is None else out + extra
    # SDPA with the term as its additive mask: on CUDA its memory-efficient kernel.
    mask = attention_mask(bias=None if parts is None else dense_parts(parts, s), causal=causal,
                          key_valid=key_valid, t=t, s=s, dtype=q.dtype, device=q.device,
                          shift=shift)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p_drop,
                                          scale=scale)
