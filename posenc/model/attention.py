"""Multi-head attention with one straight path for every positional scheme.

Notation: B batch, H heads, T queries, S keys, D head dim, C d_model.

The module knows nothing of any scheme: it calls the hooks of its
:class:`~posenc.encoders.base.AttentionPositional` in a fixed order. Without a score
term it runs ``scaled_dot_product_attention`` (fused kernels). With one, or when the
scheme declares ``needs_probs``, it runs :func:`~posenc.model.scored.scored_attention`
(one explicit softmax with a hand-written backward), except on CUDA, where SDPA's
memory-efficient kernel takes the score term as its additive mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc.encoders.base import AttentionContext, AttentionPositional, AttnKind, dense_parts
from posenc.model.scored import scored_attention


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


class Attention(nn.Module):
    """Multi-head self- or cross-attention.

    Args:
        d_model: Model width C.
        n_heads: Number of heads H (must divide C).
        dropout: Dropout on the attention probabilities.
        pos: The positional hooks for this module (from ``encoder.for_attention``).
        score_budget: CPU query blocking: see ``max_score_bytes``.
    """

    #: Most queries per block in causal attention with score terms (see query_block).
    causal_block: int = 128

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        dropout: float,
        pos: AttentionPositional,
        score_budget: int | None = 8 * 2**20,
    ) -> None:
        super().__init__()
        #: On a CPU, the most bytes of one (B, H, T, S) score matrix of a scheme that
        #: adds score terms; longer inputs go a block of queries at a time (same
        #: result), which keeps them in cache and skips causally masked keys. None: no
        #: blocking. GPUs never block: one kernel over all queries is what they want.
        self.max_score_bytes = score_budget
        if d_model % n_heads:
            raise ValueError(f"n_heads={n_heads} must divide d_model={d_model}")
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.pos = pos

    def _heads(self, x: Tensor, proj: nn.Linear) -> Tensor:
        return proj(x).unflatten(-1, (self.n_heads, self.head_dim)).transpose(1, 2)  # (B,H,*,D)

    def forward(
        self,
        x: Tensor,
        ctx: AttentionContext,
        *,
        memory: Tensor | None = None,
        key_valid: Tensor | None = None,
    ) -> Tensor:
        """Attend from ``x (B, T, C)`` to itself or to ``memory (B, S, C)``.

        Args:
            x: Queries' input.
            ctx: The stack's shared positional context for this attention kind.
            memory: Keys' and values' input for cross-attention; None for self.
            key_valid: ``(B, S)`` True for real keys.

        Returns:
            ``(B, T, C)``.
        """
        src = x if memory is None else memory
        q = self._heads(x, self.q_proj)  # (B, H, T, D)
        k = self._heads(src, self.k_proj)  # (B, H, S, D)
        v = self._heads(src, self.v_proj)  # (B, H, S, D)
        b, h, t, _ = q.shape
        s = k.shape[-2]
        causal = ctx.kind is AttnKind.CAUSAL
        block = t
        if self.pos.adds_scores and self.max_score_bytes and q.device.type == "cpu":
            block = self.query_block(b, h, t, s, q.element_size(), causal=causal)
        if block >= t:
            out = self._attend(q, k, v, ctx, key_valid, shift=s - t)
        else:  # the same computation, a block of queries at a time
            parts = []
            starts = range(0, t, block)
            # Causal: the block's last query sees keys up to a + block - 1 + (S - T);
            # the rest are masked for every query of the block, so leave them out.
            stops = [min(s, a + block + s - t) if causal else s for a in starts]
            # split, not slicing, for q, and key_prefixes for k and v: their backward
            # joins the blocks' gradients in one buffer (a slice's allocates zeros of the
            # whole tensor for each block and sums them).
            q_blocks = q.split(block, dim=2)
            k_blocks, v_blocks = key_prefixes(k, stops), key_prefixes(v, stops)
            for i, a in enumerate(starts):
                sub = ctx.slice_queries(a, a + block)
                if stops[i] < s:
                    sub = sub.slice_keys(stops[i])
                kv = None if key_valid is None else key_valid[:, : stops[i]]
                parts.append(
                    self._attend(q_blocks[i], k_blocks[i], v_blocks[i], sub, kv, shift=a + s - t)
                )
            out = torch.cat(parts, dim=2)
        return self.out_proj(out.transpose(1, 2).flatten(-2))  # (B, T, C)

    def query_block(
        self, b: int, h: int, t: int, s: int, itemsize: int, *, causal: bool = False
    ) -> int:
        """Queries per block: one ``(B, H, block, S)`` score matrix stays within
        ``max_score_bytes`` (at least one query), and causal attention uses blocks of at
        most ``causal_block`` queries, since each block skips the keys masked for all of
        its queries (about half the work of a long sequence, as a fused causal kernel
        skips it)."""
        block = max(1, min(t, self.max_score_bytes // max(1, b * h * s * itemsize)))
        return min(block, self.causal_block) if causal else block

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        ctx: AttentionContext,
        key_valid: Tensor | None,
        shift: int,
    ) -> Tensor:
        """Hooks, mask and attention for queries ``q (B, H, T, D)``; returns ``(B, H, T, D)``."""
        t, s = q.shape[-2], k.shape[-2]
        parts = self.pos.score_parts(q, k, ctx)
        q, k = self.pos.transform_qk(q, k, ctx)
        causal = ctx.kind is AttnKind.CAUSAL
        scale = self.pos.scale(self.head_dim)
        p_drop = self.dropout if self.training else 0.0
        if (
            parts is None
            and key_valid is None
            and causal
            and t == s
            and shift == 0
            and not self.pos.needs_probs
        ):
            # Nothing to add: let SDPA pick its fused causal kernel.
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=p_drop, is_causal=True, scale=scale
            )
        if self.pos.needs_probs or (parts is not None and not fused_bias_kernel(q)):
            out, probs = scored_attention(
                q,
                k,
                v,
                parts,
                scale=scale,
                causal_shift=shift if causal else None,
                key_valid=key_valid,
                dropout=p_drop,
            )
            extra = self.pos.value_term(probs, ctx) if self.pos.needs_probs else None
            return out if extra is None else out + extra
        mask = attention_mask(
            bias=None if parts is None else dense_parts(parts, s),
            causal=causal,
            key_valid=key_valid,
            t=t,
            s=s,
            dtype=q.dtype,
            device=q.device,
            shift=shift,
        )
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p_drop, scale=scale
        )


class _KeyPrefixes(torch.autograd.Function):
    """``x[..., :stop, :]`` for each stop, as views; the backward adds their gradients
    into one buffer in place."""

    @staticmethod
    def forward(ctx, x: Tensor, stops: tuple[int, ...]) -> tuple[Tensor, ...]:  # noqa: ANN001
        ctx.set_materialize_grads(False)
        ctx.stops, ctx.shape = stops, x.shape
        return tuple(x.narrow(-2, 0, stop) for stop in stops)

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, None]:  # noqa: ANN001
        given = sorted(
            ((stop, g) for stop, g in zip(ctx.stops, grads, strict=True) if g is not None),
            key=lambda pair: -pair[0],
        )
        if not given:
            return None, None
        (top, first), rest = given[0], given[1:]
        out = first.new_empty(ctx.shape)
        out.narrow(-2, 0, top).copy_(first)
        out.narrow(-2, top, ctx.shape[-2] - top).zero_()
        for stop, g in rest:
            out.narrow(-2, 0, stop).add_(g)
        return out, None


def key_prefixes(x: Tensor, stops: list[int]) -> tuple[Tensor, ...]:
    """The first ``stops[i]`` keys of ``x (B, H, S, D)`` for each block of queries.

    The same values as ``x[:, :, :stop]`` for each stop, but the gradient is one
    ``(B, H, S, D)`` buffer that every block adds its prefix into, where slicing would
    pad each block's gradient with zeros to the full length and sum the padded ones.
    """
    if not x.requires_grad:
        return tuple(x[:, :, :stop] for stop in stops)
    return _KeyPrefixes.apply(x, tuple(stops))


def fused_bias_kernel(q: Tensor) -> bool:
    """Whether ``scaled_dot_product_attention`` has a fused kernel for a score term that
    needs a gradient on ``q``'s device (CUDA's memory-efficient kernel); on CPU it takes
    its unfused math path, slower than :func:`~posenc.model.scored.scored_attention`."""
    return q.device.type == "cuda"
