"""Multi-head attention with one straight path for every positional scheme.

Notation: B batch, H heads, T queries, S keys, D head dim, C d_model.

The module knows nothing of any scheme: it projects q, k and v and hands them, with
its :class:`~posenc.encoders.base.AttentionPositional` hooks, to
:func:`posenc.model.backends.attend`, which picks SDPA, FlexAttention or the explicit
softmax. On a CPU, long inputs of a scheme with a score term go a block of queries at
a time (``score_budget``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posenc.encoders.base import AttentionContext, AttentionPositional, AttnKind, head_dim
from posenc.model.backends import attend, use_flex
from posenc.model.cache import CROSS_KEYS, CROSS_VALUES, KEYS, RAW, VALUES, LayerCache
from posenc.model.modifiers import HeadRMSNorm, LogitModifiers, Modifiers
from posenc.model.streaming import STREAMING, streaming_attend


class Attention(nn.Module):
    """Multi-head self- or cross-attention.

    Args:
        d_model: Model width C.
        n_heads: Number of heads H (must divide C).
        dropout: Dropout on the attention probabilities.
        pos: The positional hooks for this module (from ``encoder.for_attention``).
        score_budget: CPU query blocking: see ``max_score_bytes``.
        qkv_bias: Biases on the q, k and v projections (False: none, as the FoX and
            PaTH authors' layers have them).
        modifiers: QK-norm, logit scale, sinks and this layer's sliding window
            (:mod:`posenc.model.modifiers`; the window applies to causal attention only);
            None: none of them.

    Raises:
        ValueError: ``n_heads`` does not divide ``d_model``, or a modifier cannot apply
            to the scheme (:meth:`~posenc.model.modifiers.Modifiers.refusal`).
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
        qkv_bias: bool = True,
        modifiers: Modifiers | None = None,
    ) -> None:
        super().__init__()
        mods = modifiers or Modifiers()
        refusal = mods.refusal(pos)
        if refusal:
            raise ValueError(refusal)
        #: On a CPU, the most bytes of one (B, H, T, S) score matrix of a scheme that
        #: adds score terms; longer inputs go a block of queries at a time (same
        #: result), which keeps them in cache and skips causally masked keys. None: no
        #: blocking. GPUs never block: one kernel over all queries is what they want.
        self.max_score_bytes = score_budget
        #: ``auto`` (by device and scheme), ``flex`` (forced; compiled on a GPU),
        #: ``flex_eager`` (forced, the unfused reference kernel: for debugging a
        #: ``score_mod``) or ``explicit``: see :mod:`posenc.model.backends`.
        self.backend = "auto"
        self.n_heads = n_heads
        self.head_dim = head_dim(d_model, n_heads)
        self.dropout = dropout
        self.q_proj = nn.Linear(d_model, d_model, bias=qkv_bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=qkv_bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=qkv_bias)
        self.out_proj = nn.Linear(d_model, d_model)
        # (modules only when on: with every option off the model is what it was)
        self.q_norm = HeadRMSNorm(self.head_dim) if mods.qk_norm else None
        self.k_norm = HeadRMSNorm(self.head_dim) if mods.qk_norm else None
        self.logits = (
            LogitModifiers(n_heads, logit_scale=mods.logit_scale, sinks=mods.sinks)
            if mods.on_logits
            else None
        )
        #: The keys a causal query sees at most (:mod:`posenc.model.window`); None: all.
        self.window = mods.window
        self.pos = pos

    def _heads(self, x: Tensor, proj: nn.Linear, norm: HeadRMSNorm | None = None) -> Tensor:
        """``proj(x)`` split into heads, ``(B, H, *, D)``, and QK-norm's ``norm`` if any
        (before any scheme sees q or k)."""
        out = proj(x).unflatten(-1, (self.n_heads, self.head_dim)).transpose(1, 2)  # (B,H,*,D)
        return out if norm is None else norm(out)

    def forward(
        self,
        x: Tensor,
        ctx: AttentionContext,
        *,
        memory: Tensor | None = None,
        key_valid: Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """Attend from ``x (B, T, C)`` to itself or to ``memory (B, S, C)``.

        Args:
            x: Queries' input.
            ctx: The stack's shared positional context for this attention kind.
            memory: Keys' and values' input for cross-attention; None for self.
            key_valid: ``(B, S)`` True for real keys.
            cache: Incremental decoding: ``x`` holds the new tokens only, and their keys
                and values join the cached ones (:mod:`posenc.model.cache`).

        Returns:
            ``(B, T, C)``.
        """
        shared = ctx  # the stack's, the same for every layer
        # the scheme's per-layer view of the pass (FoX's gates from x); default: ctx
        ctx = self.pos.with_input(x, ctx, key_valid=key_valid, cache=cache)
        if cache is not None:
            return self._cached(x, ctx, memory, key_valid, cache, shared)
        src = x if memory is None else memory
        q = self._heads(x, self.q_proj, self.q_norm)  # (B, H, T, D)
        k = self._heads(src, self.k_proj, self.k_norm)  # (B, H, S, D)
        v = self._heads(src, self.v_proj)  # (B, H, S, D)
        if memory is None:
            k, v = self.pos.transform_kv(x, k, v, key_valid=key_valid, cache=None)
        stream = shared.get(STREAMING) if memory is None else None
        if stream is not None:  # evaluation-time StreamingLLM (the stack's setting)
            shift = k.shape[-2] - q.shape[-2]
            out = streaming_attend(self.pos, q, k, v, ctx, stream, shift=shift, key_valid=key_valid)
            return self._merge(x, out)
        b, h, t, _ = q.shape
        s = k.shape[-2]
        causal = ctx.kind is AttnKind.CAUSAL
        block = t
        p_drop = self.dropout if self.training else 0.0
        if (
            self.pos.adds_scores
            and not self.pos.owns_attention  # its own computation, over all queries
            and self.max_score_bytes
            and q.device.type == "cpu"
            and not use_flex(self.backend, q, self.pos, p_drop)
        ):
            # (FlexAttention is one call over all queries, with one mask per pass.)
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
        return self._merge(x, out)

    def _cached(
        self,
        x: Tensor,
        ctx: AttentionContext,
        memory: Tensor | None,
        key_valid: Tensor | None,
        cache: LayerCache,
        shared: AttentionContext,
    ) -> Tensor:
        """:meth:`forward` for new tokens ``x`` with a static cache (its slots ``cache.at``
        for them); one call for all queries, over all the cache's slots. ``ctx`` is this
        layer's context (:meth:`~AttentionPositional.with_input`), ``shared`` the
        stack's."""
        q = self._heads(x, self.q_proj, self.q_norm)  # (B, H, T, D), new queries
        t = q.shape[-2]
        if memory is not None:  # cross-attention: the encoder output's keys, once
            k, v = cache.get(CROSS_KEYS), cache.get(CROSS_VALUES)
            if k is None or v is None:
                k = self._heads(memory, self.k_proj, self.k_norm)
                v = self._heads(memory, self.v_proj)
                cache.put(CROSS_KEYS, k)
                cache.put(CROSS_VALUES, v)
            return self._merge(x, self._attend(q, k, v, ctx, key_valid, shift=k.shape[-2] - t))
        assert cache.at is not None  # the stack sets this step's slots
        k_new, v_new = self.pos.transform_kv(
            x,
            self._heads(x, self.k_proj, self.k_norm),  # (B, H, T, D)
            self._heads(x, self.v_proj),
            key_valid=key_valid,
            cache=cache,
        )
        values = cache.extend(VALUES, v_new)  # (B, H, S, D)
        stream = shared.get(STREAMING)
        if stream is not None:  # projected keys, transformed at every step
            raw = cache.extend(RAW, k_new)
            out = streaming_attend(
                self.pos, q, raw, values, ctx, stream, shift=cache.at[0], key_valid=key_valid
            )
            return self._merge(x, out)
        if ctx.stable_keys:
            # new keys transformed once, at their own positions
            # (the new keys' context is the same for every layer of the step: cut once)
            new_keys = ctx.shared("step_keys", lambda: shared.keys_at(cache.at))
            q_t, k_t = self.pos.transform_qk(q, k_new, new_keys)
            keys = raw = cache.extend(KEYS, k_t)
            if k_t is not k_new and self.pos.adds_scores:  # score terms read projected keys
                raw = cache.extend(RAW, k_new)
        else:  # the key transform depends on the pass: all keys again, from projected ones
            raw = cache.extend(RAW, k_new)
            q_t, keys = self.pos.transform_qk(q, raw, ctx)
        p_drop = self.dropout if self.training else 0.0
        # query i sits at slot at[0] + i and sees slots up to it: a causal shift of at[0]
        out = attend(
            self.pos,
            q,
            raw,
            values,
            ctx,
            key_valid=key_valid,
            shift=cache.at[0],
            p_drop=p_drop,
            backend=self.backend,
            transformed=(q_t, keys),
            cache=cache,
            mods=self.logits,
            window=self.window,
        )
        return self._merge(x, out)

    def _merge(self, x: Tensor, out: Tensor) -> Tensor:
        """The scheme's output hook on ``out (B, H, T, D)`` (queries' input ``x``), then
        the heads merged and projected: ``(B, T, C)``."""
        out = self.pos.transform_output(x, out)
        return self.out_proj(out.transpose(1, 2).flatten(-2))  # (B, T, C)

    def query_block(
        self, b: int, h: int, t: int, s: int, itemsize: int, *, causal: bool = False
    ) -> int:
        """Queries per block: one ``(B, H, block, S)`` score matrix stays within
        ``max_score_bytes`` (at least one query), and causal attention uses blocks of at
        most ``causal_block`` queries, since each block skips the keys masked for all of
        its queries (about half the work of a long sequence, as a fused causal kernel
        skips it)."""
        assert self.max_score_bytes is not None  # called only with a budget (not None)
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
        p_drop = self.dropout if self.training else 0.0
        return attend(
            self.pos,
            q,
            k,
            v,
            ctx,
            key_valid=key_valid,
            shift=shift,
            p_drop=p_drop,
            backend=self.backend,
            mods=self.logits,
            window=self.window,
        )


class _KeyPrefixes(torch.autograd.Function):
    """``x[..., :stop, :]`` for each stop, as views; the backward adds their gradients
    into one buffer in place."""

    @staticmethod
    def forward(ctx, x: Tensor, stops: tuple[int, ...]) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.stops, ctx.shape = stops, x.shape
        return tuple(x.narrow(-2, 0, stop) for stop in stops)

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, None]:
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
