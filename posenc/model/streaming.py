"""StreamingLLM at evaluation time: attention sinks plus a window of recent tokens
(Xiao et al., ICLR 2024, "Efficient Streaming Language Models with Attention Sinks").

Notation: B batch, H heads, T queries, S keys, D head dim, n sink keys.

Each query attends to the first ``sinks`` tokens of the text (the attention sinks) and to
the ``window`` most recent ones, itself included; the tokens in between have left the
cache. Positions are assigned *within the cache*, as the paper does (section 3.2: a
cache holding tokens [0, 1, 2, 3, 6, 7, 8] gives them positions 0..6): the query's is
``min(i, sinks + window - 1)``, the sinks keep ``0 .. sinks-1`` and the window's keys
sit right below the query. Since the window is contiguous and ends at the query, a
window key's distance to the query is the one in the text, ``i - j``; only the sinks
move, to ``min(i, sinks + window - 1) - j``.

So a scheme whose scores depend on the query-key distance alone (``relative``: RoPE,
ALiBi, T5, KERPLE, ...) is scored twice with its own hooks: over the window with the
text's positions, and over the sinks with the query at its cache position (a second
context, built once per pass: :func:`attach`); both join one softmax
(:func:`streaming_attend`). NoPE needs the mask alone. Schemes whose scores are not a
function of that distance (absolute embeddings, FIRE's normalisation by the query's
position), content-dependent ones, and those that compute their own weights cannot be
re-indexed per query and are refused (:func:`refusal`), as are the model's logit
modifiers and its own sliding window, which the setting would change.

A full pass and a static cache's step run the same computation (the cache keeps
projected keys and transforms them per step, as the paper's cache keeps keys before
RoPE), so cached decoding equals the full pass with this mask. The static cache masks
the evicted slots instead of freeing them: the outputs of a rolling cache, not its
memory. Scores are explicit, a block of queries at a time: in a full pass a block of
about the cache's span scores only the keys it can see, the sinks and the slice of keys
from its first query's window to its last query (``(B, H, T', n + window + T' - 1)`` at
most, so a pass costs O(T span), not O(T S)); a static cache's step, whose slot is a
tensor that a slice would have to read back to the host, scores all its slots with the
evicted ones masked. This is an evaluation path, never a training one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
from torch import Tensor

from posenc.encoders.base import (
    AttentionContext,
    AttentionPositional,
    AttnKind,
    PositionalEncoder,
    Slot,
    dense_parts,
)

if TYPE_CHECKING:
    from posenc.model.attention import Attention
    from posenc.model.transformer import DecoderLM


class Streaming(NamedTuple):
    """The sizes of StreamingLLM's cache.

    Attributes:
        sinks: The first tokens every query keeps seeing (the paper's 4), >= 0.
        window: The most recent tokens a query sees, itself included, >= 1.
    """

    sinks: int
    window: int

    @property
    def span(self) -> int:
        """The most keys a query sees: the cache's size."""
        return self.sinks + self.window


#: The setting and the sinks' context (None without sinks), put by :func:`attach`.
STREAMING: Slot[tuple[Streaming, AttentionContext | None]] = Slot("streaming")

#: Most bytes of one query block's float32 scores.
BLOCK_BYTES = 256 * 2**20

#: Fewest queries in a block when keys are cut to those a block can see: smaller blocks
#: score fewer keys per query (at most ``sinks + window + block``) but cost more calls.
MIN_QUERY_BLOCK = 128

#: True: each block of queries scores only the keys it can see, the sinks and a slice
#: around its window; False: all S keys, the rest masked (what a static cache's step
#: does, its slot being a tensor). The same outputs; False is the reference to compare.
SLICE_KEYS = True


def sizes_problem(
    sinks: object, window: object, seq_len: int | None = None, prefix: str = "streaming "
) -> str | None:
    """Why ``sinks`` and ``window`` are not a StreamingLLM cache, or None.

    Args:
        sinks: Sink tokens, an integer >= 0.
        window: Window tokens, an integer >= 1.
        seq_len: The training length, which their sum may not pass; None: unchecked.
        prefix: What the message puts before ``sinks=`` and ``window=`` (the keys).
    """

    def integer(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not (integer(sinks) and sinks >= 0):  # type: ignore[operator]
        return f"{prefix}sinks={sinks!r}: must be an integer >= 0 (the paper keeps 4)"
    if not (integer(window) and window >= 1):  # type: ignore[operator]
        return f"{prefix}window={window!r}: must be an integer >= 1 (the recent tokens kept)"
    span = sinks + window  # type: ignore[operator]
    if seq_len is not None and span > seq_len:
        return (
            f"{prefix}sinks + {prefix}window = {sinks} + {window} = {span}: more than the "
            f"training length {seq_len}, so queries would see positions the model never "
            f"trained on; give sinks + window <= {seq_len}"
        )
    return None


def refusal(model: DecoderLM) -> str | None:
    """Why StreamingLLM's re-indexed positions cannot apply to ``model``, or None."""
    enc: PositionalEncoder = model.encoder
    name = enc.name
    if enc.data_dependent:
        return f"{name}'s positions come from the content, which cannot be re-indexed"
    if enc.uses_positions and not enc.relative:
        return (
            f"{name}'s scores are not a function of the query-key distance alone, so "
            f"positions cannot be re-indexed inside the cache per query"
        )
    if enc.pass_dependent:
        return f"{name}'s positions depend on the length of the whole pass"
    for layer in model.stack.layers:
        attn = cast("Attention", layer.self_attn)
        pos = attn.pos
        if pos.owns_attention or pos.needs_probs:
            return f"{pos.scheme} computes its own attention weights or a value term"
        if attn.logits is not None or attn.window is not None:
            return (
                "the model's sinks, logit scale or sliding window would change with the "
                "streaming mask (model.sinks, model.logit_scale, model.window)"
            )
    return None


def attach(
    ctx: AttentionContext,
    encoder: PositionalEncoder,
    setting: Streaming,
    k_pos: Tensor,
    bound: int,
) -> None:
    """Put :data:`STREAMING` into the causal ``ctx``: the setting, and the context of the
    sinks, whose queries sit at their cache positions ``min(q_pos, span - 1)`` and whose
    keys are the first ``sinks`` of ``k_pos (B|1, S)``."""
    n = min(setting.sinks, k_pos.shape[-1])
    sink_ctx = None
    if n:
        q_pos = ctx.q_pos.clamp(max=setting.span - 1)  # (B|1, T)
        sink_ctx = encoder.context(q_pos, k_pos[:, :n], AttnKind.CAUSAL, bound=bound)
    ctx.put(STREAMING, (setting, sink_ctx))


def _logits(pos: AttentionPositional, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
    """The scheme's logits ``(B, H, T, S)``: content score and score term, unmasked."""
    parts = pos.score_parts(q, k, ctx)
    q_t, k_t = pos.transform_qk(q, k, ctx)
    scores = (q_t @ k_t.transpose(-1, -2)) * pos.scale(q.shape[-1])  # (B, H, T, S)
    return scores if parts is None else scores + dense_parts(parts, k.shape[-2])


def query_block(b: int, h: int, t: int, s: int, setting: Streaming, *, sliced: bool) -> int:
    """Queries per block: within :data:`BLOCK_BYTES` of float32 scores, and, when keys are
    cut (``sliced``), about the cache's span, so a block's keys stay O(span) rather than
    O(S)."""
    block, width = t, s
    if sliced:
        block = min(t, max(setting.span, MIN_QUERY_BLOCK))
        width = min(s, setting.sinks + setting.window + block)  # the most a block scores
    return max(1, min(block, BLOCK_BYTES // max(1, 8 * b * h * width)))


def visible_keys(a: int, stop: int, shift: int, setting: Streaming, s: int) -> tuple[int, int]:
    """The keys ``[lo, hi)`` past the sinks that queries ``a .. stop-1`` (at key slots
    ``i + shift``) can see in their windows: ``max(sinks, a + shift - window + 1)`` up to
    the last query's own slot. Never empty (a block that sees only sinks keeps one key,
    masked), so every scheme's hooks get at least one key."""
    hi = min(s, max(1, stop + shift))
    lo = max(0, min(max(setting.sinks, a + shift - setting.window + 1), hi - 1))
    return lo, hi


def streaming_attend(
    pos: AttentionPositional,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ctx: AttentionContext,
    stream: tuple[Streaming, AttentionContext | None],
    *,
    shift: int | Tensor,
    key_valid: Tensor | None,
) -> Tensor:
    """Causal attention of ``q (B, H, T, D)`` over the sinks and the window of ``k`` and
    ``v (B, H, S, D)`` (projected keys), query i at slot ``i + shift``, a block of queries
    at a time: with an int ``shift``, each block against the keys it can see only
    (:func:`visible_keys`); with a tensor one, against all S (same result).

    Args:
        pos: The layer's hooks. ctx: The layer's context (the text's positions).
        stream: The stack context's :data:`STREAMING` entry (a layer's own view of the
            context, a mix member's, need not carry it).
        shift: The causal offset: an int, or a static cache's slot (0-d tensor).
        key_valid: ``(B, S)`` True for real keys, or None.

    Returns:
        ``(B, H, T, D)``.
    """
    b, h, t, _ = q.shape
    s = k.shape[-2]
    setting, sink_ctx = stream
    n = min(setting.sinks, s)
    sink_valid = None if key_valid is None else key_valid[:, :n]
    # keys are cut with Python ints only: a tensor shift would need a host read
    cut = shift if isinstance(shift, int) and SLICE_KEYS else None
    block = query_block(b, h, t, s, setting, sliced=cut is not None)
    wide = torch.promote_types(q.dtype, torch.float32)  # a softmax in float32 at least
    parts = []
    for a in range(0, t, block):  # Python ints: the same graph for every pass
        stop = min(t, a + block)
        lo, hi = (0, s) if cut is None else visible_keys(a, stop, cut, setting, s)
        sub = ctx.slice_queries(a, stop).key_range(lo, hi)
        valid = None if key_valid is None else key_valid[:, lo:hi]
        sub = replace(sub, key_valid=valid, shift=shift + a - lo)
        offsets = sub.key_offsets()  # (T', S'): key slot minus the query's own slot
        j = torch.arange(lo, hi, device=q.device)
        # the window: keys i - window < j <= i, less the sinks (scored at their positions)
        band = (offsets <= 0) & (offsets > -setting.window) & (j >= n)
        q_a = q[:, :, a:stop]
        logits = _logits(pos, q_a, k[:, :, lo:hi], sub).to(wide).masked_fill(~band, float("-inf"))
        v_a, seen = v[:, :, lo:hi], valid  # seen: (B, n + S') what the softmax may take
        if sink_ctx is not None:  # the sinks' values and padding go first, as their logits
            sinks_sub = sink_ctx.slice_queries(a, stop)
            sinks_sub = replace(sinks_sub, key_valid=sink_valid, shift=shift + a)
            sinks = _logits(pos, q_a, k[:, :, :n], sinks_sub).to(wide)  # (B, H, T', n)
            sinks = sinks.masked_fill(sinks_sub.key_offsets() > 0, float("-inf"))  # causal
            logits = torch.cat((sinks, logits), dim=-1)  # (B, H, T', n + S')
            v_a = torch.cat((v[:, :, :n], v_a), dim=-2)  # (B, H, n + S', D)
            if valid is not None and sink_valid is not None:
                seen = torch.cat((sink_valid, valid), dim=-1)
        if seen is not None:
            logits = logits.masked_fill(~seen[:, None, None, :], float("-inf"))
        parts.append(logits.softmax(-1).to(v.dtype) @ v_a)  # (B, H, T', D)
    return torch.cat(parts, dim=2)
