"""Attention backends: which kernel runs one attention call, chosen by what the scheme
needs and by the device. The model never branches on a scheme; it calls :func:`attend`.

Notation: B batch, H heads, T queries, S keys, D head dim.

* SDPA without a score term (fused flash / memory-efficient kernels).
* FlexAttention for a score term on a GPU: the scheme's ``score_mod`` reads small
  per-offset tables by ``q_idx``/``kv_idx`` (no ``(B, H, T, S)`` bias is written);
  causality and key padding are a block mask, whose empty blocks are skipped, built
  once per forward pass (or decoding step) and shared by every layer. It always runs
  compiled (:func:`compiled_flex_attention`, compiled once at first use, as torchtune
  and gpt-fast do): uncompiled FlexAttention is PyTorch's unfused reference, which
  writes the scores. Inside a compiled model it is traced into the model's graph.
* The explicit softmax where the probabilities are needed (a value term), with dropout
  (FlexAttention has none), and for training on a CPU (no FlexAttention backward there
  in torch 2.13): :func:`~posenc.model.scored.scored_attention`, whose backward is
  written out (1.03x-1.20x a CPU training step, see the README), or with
  ``HAND_WRITTEN_BACKWARD = False`` :func:`plain_attention`, the same values through
  autograd. On a GPU without a ``score_mod`` the term is SDPA's additive mask.

A sliding window (:mod:`posenc.model.window`) is one more score part of ``-inf`` for the
explicit softmax and SDPA, and a condition of the block mask for FlexAttention.

``Attention.backend = "flex"`` or ``"explicit"`` forces one (the parity tests run the
flex path's forward on a CPU, where it is eager); ``"flex_eager"`` forces the unfused
FlexAttention on a GPU too, to debug a ``score_mod`` (prints and breakpoints work).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any, cast

import torch
import torch.nn.attention.flex_attention as flex_module
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from posenc.encoders.base import (
    AttentionContext,
    AttentionPositional,
    AttnKind,
    ScoreMod,
    ScoreParts,
    dense_parts,
)
from posenc.encoders.softmax import softmax_values
from posenc.model.modifiers import LogitModifiers, sink_probs
from posenc.model.scored import scored_attention
from posenc.model.window import window_part

#: How FlexAttention is asked for its log-sum-exp: ``return_aux`` since torch 2.9
#: (``return_lse`` is deprecated there), ``return_lse`` before.
_AUX_REQUEST: Any = getattr(flex_module, "AuxRequest", None)
LSE_REQUEST: dict[str, Any] = (
    {"return_aux": _AUX_REQUEST(lse=True)} if _AUX_REQUEST else {"return_lse": True}
)

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
    shift: int | Tensor | None = None,
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
    causal_shift: int | Tensor | None = None,
    key_valid: Tensor | None = None,
    dropout: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """:func:`~posenc.model.scored.scored_attention` through autograd: the reference (a
    tensor ``causal_shift``, a static cache's slot, works here only)."""
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
    out, used, _ = softmax_values(scores, v, dtype=q.dtype, dropout=dropout)
    return out, used


def fused_bias_kernel(q: Tensor) -> bool:
    """Whether ``scaled_dot_product_attention`` has a fused kernel for a score term that
    needs a gradient on ``q``'s device (CUDA's memory-efficient kernel); on a CPU it
    takes its unfused math path, slower than the explicit one."""
    return q.device.type == "cuda"


#: FlexAttention's GPU kernel needs head dims of at least 16 (torch 2.11: "NYI:
#: embedding dimension of the query, key, and value must be at least 16").
FLEX_MIN_HEAD_DIM = 16


def use_flex(backend: str, q: Tensor, pos: AttentionPositional, p_drop: float) -> bool:
    """FlexAttention for this call: forced (``flex``, ``flex_eager``), or on a GPU for a
    scheme with a score term, no value term and no dropout, heads of at least
    :data:`FLEX_MIN_HEAD_DIM`, and, when gradients are recorded, a score term whose
    FlexAttention backward is fast (:attr:`AttentionPositional.flex_trains`)."""
    if backend in ("flex", "flex_eager"):
        return True
    return (
        backend == "auto"
        and q.device.type == "cuda"
        and pos.adds_scores
        and not pos.needs_probs
        and p_drop == 0.0
        and q.shape[-1] >= FLEX_MIN_HEAD_DIM
        and (pos.flex_trains or not torch.is_grad_enabled())
    )


#: Devices whose FlexAttention runs compiled (a fused kernel). On a CPU FlexAttention
#: only runs when forced (it has no backward there in torch 2.13), eagerly.
COMPILED_FLEX_DEVICES = {"cuda"}
#: Compiled graphs one compiled FlexAttention kernel may keep (one per shape class of its
#: calls: static, then dynamic lengths; a decoding step; with and without the
#: log-sum-exp). Past dynamo's default of 8 for one function it would fall back to the
#: unfused eager kernel with a warning, so its calls raise the limit.
FLEX_RECOMPILE_LIMIT = 64
#: Tiles of the compiled FlexAttention's forward kernel on a GPU (``kernel_options``:
#: ``BLOCK_M`` queries by ``BLOCK_N`` keys); empty: torch's choice. Without any score
#: term, FlexAttention trained at 0.72x SDPA's speed with torch's tiles and 1.05x with
#: 64 x 128 on an H200 (one layer, 4x4096, four heads of 64: docs/gpu/, the probe of
#: 2026-11-28); whole training steps have not been measured with them, so the default
#: stays torch's. ``experiments/bench.py --flex-tiles 64,128`` sets them.
FLEX_KERNEL_OPTIONS: dict[str, int] = {}
#: The compiled kernels built so far, one per :func:`_specialization` (see
#: :func:`compiled_flex_attention`).
_compiled_flex: dict[tuple[Any, ...], Callable[..., Tensor]] = {}
#: Kernels one ``score_mod`` and ``mask_mod`` code may have, one per value of the constants
#: they capture; past it, one more for all other values (:func:`compiled_flex_attention`).
FLEX_SPECIALIZATIONS = 8
#: Constants of a closure read into a kernel's key (ints, floats, strings...).
_CONSTANTS = (bool, int, float, str, type(None))


def _closure_constants(fn: Any, found: list[Any], depth: int = 0) -> None:
    """``fn``'s code and the constants its closure captures, and those of the functions
    it captures, in order (a ``score_mod`` or ``mask_mod`` and its helpers)."""
    code = getattr(fn, "__code__", None)
    if code is None or depth > 4:
        found.append(type(fn).__name__)
        return
    found.append(code)
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            found.append(None)
            continue
        if isinstance(value, _CONSTANTS) or (
            isinstance(value, tuple) and all(isinstance(v, _CONSTANTS) for v in value)
        ):
            found.append(value)
        elif callable(value) and hasattr(value, "__code__"):
            _closure_constants(value, found, depth + 1)
        else:
            found.append(type(value).__name__)


def _specialization(score_mod: ScoreMod | None, mask: BlockMask | None) -> tuple[Any, ...]:
    """What one compiled kernel is for: the code of the ``score_mod`` and of the mask's
    ``mask_mod``, and every constant their closures capture (a scheme's clip distance or
    bucket count, a window). A kernel only ever sees one value of each, so dynamo never
    turns such an int into a symbol (Inductor's FlexAttention lowering cannot take one
    among a ``score_mod``'s captured values: torch 2.11 to 2.13 fail to compile it)."""
    score: list[Any] = []
    _closure_constants(score_mod, score)
    masking: list[Any] = []
    if mask is not None:
        masking.append(mask.BLOCK_SIZE)
        _closure_constants(mask.mask_mod, masking)
    return tuple(score), tuple(masking)


def compiled_flex_attention(
    score_mod: ScoreMod | None = None, mask: BlockMask | None = None
) -> Callable[..., Tensor]:
    """``flex_attention`` through ``torch.compile``: the fused kernel that never writes
    the ``(B, H, T, S)`` scores, compiled once per :func:`_specialization` at its first
    use. Inside a model that is being compiled (``model.compile=true``) it is
    ``flex_attention`` itself, which dynamo traces into the model's own graph (a
    compiled function called from a compiled region would be traced through anyway).

    Each specialization is a function of its own name, so dynamo keeps its shapes apart
    from the others': they are static at first and become dynamic where they change
    (torch's default). Training's one shape and a cached decoding step each get one
    static kernel, while evaluation at several lengths or uncached generation (a new
    length each step) compile two kernels, not one per length. (One kernel for every
    scheme, as before, needed Python ints specialized, the block mask's lengths among
    them, and so recompiled at every new length: uncached generation on a GPU did not
    finish 512 tokens in 280 s.) A code whose constants change from call to call
    (bidirectional XL's and DeBERTa's smallest distance, with the length) gets
    :data:`FLEX_SPECIALIZATIONS` kernels, then one more for all its other values, with
    ints specialized (each value compiled again, up to the recompile limit)."""
    if torch.compiler.is_compiling():
        return flex_attention
    key = _specialization(score_mod, mask)
    kernel = _compiled_flex.get(key)
    if kernel is not None:
        return kernel
    codes = key[0][:1], key[1][:2]  # the score_mod's code; the block size, the mask's code
    if sum(k[0][:1] == codes[0] and k[1][:2] == codes[1] for k in _compiled_flex) >= (
        FLEX_SPECIALIZATIONS
    ):
        key = (*codes, "ints specialized")
        kernel = _compiled_flex.get(key)
        if kernel is None:
            kernel = _compiled_flex[key] = _ints_specialized(_new_kernel())
        return kernel
    kernel = _compiled_flex[key] = _new_kernel()
    return kernel


def _new_kernel() -> Callable[..., Tensor]:
    """``torch.compile`` of ``flex_attention`` under a name of its own: a copy of the
    function whose code is renamed (dynamo keeps what it learns of a function's shapes
    per code name), with the same globals and defaults."""
    name = f"posenc_flex_attention_{len(_compiled_flex)}"
    copy = types.FunctionType(
        flex_attention.__code__.replace(co_name=name),
        flex_attention.__globals__,
        name,
        flex_attention.__defaults__,
        flex_attention.__closure__,
    )
    copy.__kwdefaults__ = flex_attention.__kwdefaults__
    return cast(Callable[..., Tensor], torch.compile(copy))


def _ints_specialized(kernel: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``kernel`` called with dynamo's ``specialize_int``: every Python int a constant."""

    def call(*args: Any, **kwargs: Any) -> Tensor:
        with torch._dynamo.config.patch(specialize_int=True):
            return kernel(*args, **kwargs)

    return call


def _compiled_call_config() -> AbstractContextManager[Any]:
    """Dynamo's settings for one eager call of a compiled kernel, nothing inside a
    compiled model, whose own settings count: the per-function recompile limit raised to
    :data:`FLEX_RECOMPILE_LIMIT` (the option is ``cache_size_limit`` before torch 2.7)."""
    if torch.compiler.is_compiling():
        return nullcontext()
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) >= FLEX_RECOMPILE_LIMIT:
        return nullcontext()
    return config.patch({name: FLEX_RECOMPILE_LIMIT})


@functools.cache
def _compiled_create_block_mask() -> Callable[..., BlockMask]:
    """``create_block_mask`` compiled, once per process: torch's advice in place of its
    ``_compile=True`` flag, deprecated and to be removed."""
    return cast(Callable[..., BlockMask], torch.compile(create_block_mask))


def block_mask(
    ctx: AttentionContext,
    *,
    t: int,
    s: int,
    causal_shift: int | Tensor | None,
    key_valid: Tensor | None,
    device: torch.device,
    window: int | None = None,
) -> BlockMask | None:
    """The block mask of causality, a sliding window and key padding, built once per
    context (a stack's forward pass, or a decoding step) and shared by every layer with
    the same window: it depends only on T, S, the causal shift, the window and the key
    padding, which all those layers of a pass share.

    Args:
        ctx: The stack's context (its memo keeps the mask for the other layers).
        t: Queries T. s: Keys S.
        causal_shift: None, or query i sees keys ``j <= i + shift``; a tensor for a
            static cache's slot (one per decoding step).
        key_valid: ``(B, S)`` True for real keys, or None.
        device: Where the mask lives.
        window: With a causal shift, query i also sees no key
            ``j <= i + shift - window`` (:mod:`posenc.model.window`); None: off.

    Returns:
        The BlockMask, or None when nothing is masked.
    """
    if causal_shift is None and key_valid is None:
        return None
    shift_key = causal_shift if isinstance(causal_shift, int | None) else "slot"
    key = ("block_mask", t, s, shift_key, key_valid is not None, window)

    def make() -> BlockMask:
        def mask_mod(b_i: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            ok = kv_idx >= 0  # all True, of the index's shape
            if causal_shift is not None:
                ok = ok & (kv_idx <= q_idx + causal_shift)
                if window is not None:
                    ok = ok & (kv_idx > q_idx + causal_shift - window)
            if key_valid is not None:
                ok = ok & key_valid[b_i, kv_idx]
            return ok

        b = key_valid.shape[0] if key_valid is not None else None
        # Built eagerly, the mask evaluates mask_mod on the whole (T, S) grid with int64
        # indices (about 170 MB above the model at T = 4096 on an H200, torch 2.11):
        # compiled, block by block. Inside a compiled model it is traced anyway.
        compiled = device.type in COMPILED_FLEX_DEVICES and not torch.compiler.is_compiling()
        build = _compiled_create_block_mask() if compiled else create_block_mask
        return build(mask_mod, b, None, t, s, device=device)

    return cast(BlockMask, ctx.shared(key, make))


def flex_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    score_mod: ScoreMod | None,
    *,
    scale: float,
    mask: BlockMask | None,
    eager: bool = False,
    mods: LogitModifiers | None = None,
) -> Tensor:
    """FlexAttention with the causal mask and key padding as a block mask.

    Args:
        q: ``(B, H, T, D)``. k: ``(B, H, S, D)``. v: ``(B, H, S, D)``.
        score_mod: The scheme's term, or None.
        scale: Multiplier of ``q k^T``.
        mask: :func:`block_mask`'s mask, or None.
        eager: The unfused reference kernel (debugging; it writes the scores).
        mods: The attention's logit modifiers: with a sink, the kernel's log-sum-exp
            takes the sink's share out of the output (a logit scale is in
            ``score_mod`` already).

    Returns:
        ``(B, H, T, D)``; a query that sees no key gets zeros.
    """
    kernel: Callable[..., Any] = flex_attention
    limit: AbstractContextManager[Any] = nullcontext()
    if not eager:
        kernel, limit = compiled_flex_attention(score_mod, mask), _compiled_call_config()
    sink = mods is not None and mods.sink is not None
    tiles = (
        {"kernel_options": dict(FLEX_KERNEL_OPTIONS)} if FLEX_KERNEL_OPTIONS and q.is_cuda else {}
    )
    with limit:
        out = kernel(
            q, k, v, score_mod=score_mod, block_mask=mask, scale=scale,
            **(LSE_REQUEST if sink else {}), **tiles,
        )  # fmt: skip
    if mods is None or not sink:
        return cast(Tensor, out)
    out, aux = out
    return mods.flex_sink(out, aux if isinstance(aux, Tensor) else aux.lse)


def attend(
    pos: AttentionPositional,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ctx: AttentionContext,
    *,
    key_valid: Tensor | None,
    shift: int | Tensor,
    p_drop: float,
    backend: str = "auto",
    transformed: tuple[Tensor, Tensor] | None = None,
    cache: Any | None = None,
    mods: LogitModifiers | None = None,
    window: int | None = None,
) -> Tensor:
    """One attention call with the scheme's hooks, on the backend that fits, or the
    scheme's own :meth:`~posenc.encoders.base.AttentionPositional.attend` when it
    declares ``owns_attention``. The hooks see this call's key padding and causal
    offset in ``ctx.key_valid`` and ``ctx.shift``.

    Args:
        pos: The scheme's hooks.
        q: ``(B, H, T, D)`` projected queries. k: ``(B, H, S, D)``. v: ``(B, H, S, D)``.
        ctx: The stack's context for these queries and keys.
        key_valid: ``(B, S)`` True for real keys, or None.
        shift: Causal offset (:func:`attention_mask`): an int, or a 0-d tensor for the
            slot of a static cache's first new query.
        p_drop: Dropout on the probabilities (0 in evaluation).
        backend: ``auto``, ``flex``, ``flex_eager`` or ``explicit``.
        transformed: The content score's q and k when the caller transformed them
            already (a cache keeps transformed keys); else ``transform_qk(q, k, ctx)``.
        cache: The layer's cache in a decoding step (for a scheme's own ``attend``).
        mods: The attention's logit scale and sinks (:mod:`posenc.model.modifiers`), or
            None: the logits, every score term included, times the scale's per-query
            factor (``q`` scaled, and the terms; FlexAttention's ``score_mod`` scales
            its whole logit), and the sink as a column of its own.
        window: A causal query's sliding window (:mod:`posenc.model.window`): the keys
            it sees at most, itself included; None (and in attention that is not
            causal): off. The sink's column stays in every query's view.

    Returns:
        ``(B, H, T, D)``.
    """
    t, s = q.shape[-2], k.shape[-2]
    causal = ctx.kind is AttnKind.CAUSAL
    window = window if causal else None
    if window is not None and isinstance(shift, int) and t - 1 + shift < window:
        window = None  # no query reaches past the window: the computation without one
    ctx = replace(ctx, key_valid=key_valid, shift=shift if causal else None)
    if pos.owns_attention:
        q, k = pos.transform_qk(q, k, ctx) if transformed is None else transformed
        return pos.attend(q, k, v, ctx, p_drop=p_drop, cache=cache)
    scale = pos.scale(q.shape[-1])
    factor = None
    if mods is not None:
        causal_shift = shift if causal else None
        factor = mods.factor(t, s, shift=causal_shift, key_valid=key_valid, q=q, window=window)
    if use_flex(backend, q, pos, p_drop) and not pos.needs_probs:
        score_mod = pos.score_mod(q, k, ctx) if pos.adds_scores else None
        if score_mod is not None or not pos.adds_scores:
            q, k = pos.transform_qk(q, k, ctx) if transformed is None else transformed
            mask = block_mask(
                ctx,
                t=t,
                s=s,
                causal_shift=shift if causal else None,
                key_valid=key_valid,
                device=q.device,
                window=window,
            )
            eager = backend == "flex_eager" or q.device.type not in COMPILED_FLEX_DEVICES
            if mods is not None:
                score_mod = mods.flex_mod(score_mod, factor, b=q.shape[0], t=t)
            return flex_attend(q, k, v, score_mod, scale=scale, mask=mask, eager=eager, mods=mods)
    parts = pos.score_parts(q, k, ctx)
    q, k = pos.transform_qk(q, k, ctx) if transformed is None else transformed
    if factor is not None:  # the whole logit: the content score and every score term
        q = q * factor
        parts = None if parts is None else [(term * factor, c0) for term, c0 in parts]
    if window is not None:  # after the scale (0 * -inf is no mask), before the sink's column
        far = window_part(ctx, t=t, s=s, shift=shift, window=window, dtype=q.dtype, device=q.device)
        parts = [*(parts or []), far]
    if mods is not None:
        k, v, parts, sunk, key_valid = mods.sink_column(
            k, v, parts, t=t, shift=shift if causal else None, key_valid=key_valid
        )
        shift, s = shift if sunk is None else sunk, k.shape[-2]
    static_shift = isinstance(shift, int)
    if (
        parts is None
        and not pos.needs_probs
        and key_valid is None
        and causal
        and t == s
        and static_shift
        and shift == 0
    ):
        # Nothing to add: let SDPA pick its fused causal kernel.
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=p_drop, is_causal=True, scale=scale
        )
    if pos.needs_probs or (parts is not None and not fused_bias_kernel(q)):
        causal_shift = shift if causal else None
        if HAND_WRITTEN_BACKWARD and not isinstance(causal_shift, Tensor):
            out, probs = scored_attention(
                q, k, v, parts, scale=scale, causal_shift=causal_shift,
                key_valid=key_valid, dropout=p_drop,
            )  # fmt: skip
        else:  # or a static cache's step (a tensor shift), which never trains
            out, probs = plain_attention(
                q, k, v, parts, scale=scale, causal_shift=causal_shift,
                key_valid=key_valid, dropout=p_drop,
            )  # fmt: skip
        extra = pos.value_term(sink_probs(probs, mods), ctx) if pos.needs_probs else None
        return out if extra is None else out + extra

    # SDPA with the term as its additive mask: on CUDA its memory-efficient kernel.
    def make_dense() -> Tensor | None:
        return attention_mask(
            bias=None if parts is None else dense_parts(parts, s),
            causal=causal,
            key_valid=key_valid,
            t=t,
            s=s,
            dtype=q.dtype,
            device=q.device,
            shift=shift,
        )

    if parts is None:  # the mask alone, the same for every layer (a cache's step): once
        shift_key = shift if isinstance(shift, int) else "slot"
        key = ("dense_mask", t, s, causal, shift_key, key_valid is not None, q.dtype)
        dense = ctx.shared(key, make_dense)
    else:
        dense = make_dense()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, dropout_p=p_drop, scale=scale)
