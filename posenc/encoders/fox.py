"""The Forgetting Transformer's forget gate, FoX (Lin, Nikishin, He and Courville 2025,
"Forgetting Transformer: Softmax Attention with a Forget Gate", ICLR, section 2).

Notation: B batch, H heads, T queries, S keys, C d_model; i query and j key position.

Each head h of each layer computes a scalar forget gate per token from the token's
input to the layer (the normalised block input ``x_t``),

    f_t = sigmoid(w_h . x_t + b_h),        G_i = sum_{t <= i} log f_t,

and adds the gates accumulated between key and query to the attention logits:

    score_h(i, j) = q_i . k_j / sqrt(D) + G_i - G_j
                  = q_i . k_j / sqrt(D) + sum_{j < t <= i} log f_t

(the gate term is outside the 1/sqrt(D) scale, as in the authors' code and
fla-org/flash-linear-attention's ``naive_forgetting_attn``). ``log f_t <= 0``, so the
term is a learned, data-dependent decay: ALiBi when every ``f_t`` is the same constant.
FoX uses no other positional information by default (the paper's FoX; ``rope=true``
adds RoPE to q and k, the paper's "FoX + RoPE" ablation).

Gates (``gate``):

* ``full`` (default, the paper's): ``w_h`` and ``b_h`` learned, one ``Linear(C, H)``
  per layer, initialised as the authors do (weights N(0, 0.02), biases 0: the shared
  model initialisation does exactly this).
* ``bias_only``: ``f = sigmoid(b_h)``, a learned per-head constant (the paper's
  data-independent ablation), biases 0 at first.
* ``fixed``: ``log f_h = -m_h``, ALiBi's slope (``b_h = -log(e^m_h - 1)``; our named
  variant: the paper's fixed gate spreads decay times between two bounds instead): FoX
  with this gate is ALiBi, bit for bit, which a test checks.

With a constant gate the term is ``(i - j) log f_h``, computed from the positions as
ALiBi computes its own; the ``full`` gate sums the gates of the tokens themselves, so
it never reads positions: padding tokens (left-padded prompts) add no gate, and
decoding with the cache carries each row's running sum of log-gates (the cache's
``fox_total``) and every key's ``G_j`` (``fox_keys``).

Causal attention only: the sum runs from the key to the query.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc.encoders.alibi import alibi_slopes
from posenc.encoders.base import (
    AttentionContext,
    AttentionPositional,
    CausalOnly,
    ScoreMod,
    normal_linears,
)
from posenc.encoders.offsets import pair_distance
from posenc.encoders.registry import register
from posenc.encoders.rope import RoPE, _RotateQK

GATES = ("full", "bias_only", "fixed")


class _FoxAttention(AttentionPositional):
    """Per-layer hooks: this layer's forget gates, and RoPE's rotation when asked."""

    score_term = True
    slopes: Tensor  # gate=fixed: a buffer (not saved), (H,) float32

    def init_weights(self) -> None:
        """The gate's ``w_h`` ~ N(0, 0.02), ``b_h = 0`` (a bias-only or fixed gate: set
        when built)."""
        normal_linears(self)

    def __init__(self, *, d_model: int, n_heads: int, gate: str, rotate: bool) -> None:
        super().__init__()
        self.gate = gate
        self.rotate = _RotateQK() if rotate else None
        if gate == "full":
            self.proj = nn.Linear(d_model, n_heads)  # w_h, b_h of every head
        elif gate == "bias_only":
            self.bias = nn.Parameter(torch.zeros(n_heads))
        else:  # log f_h = -m_h, kept float32 as ALiBi keeps its slopes
            self.n_heads = n_heads
            self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def log_decay(self) -> Tensor:
        """``log f_h`` of a constant gate, ``(H,)``, float32 or wider."""
        if self.gate == "fixed":
            return -self.slopes
        return F.logsigmoid(self.bias.to(torch.promote_types(self.bias.dtype, torch.float32)))

    def _apply(self, fn, recurse=True):
        # As ALiBi: a module cast must not round the fixed slopes (float32 on any device).
        out = super()._apply(fn, recurse)
        if self.gate == "fixed" and self.slopes.dtype != torch.float32:
            self.slopes = alibi_slopes(self.n_heads).to(self.slopes.device)
        return out

    def with_input(
        self, x: Tensor, ctx: AttentionContext, *, key_valid: Tensor | None, cache=None
    ) -> AttentionContext:
        if self.gate != "full":
            return ctx  # a constant gate: (i - j) log f, from the positions
        logit = self.proj(x)  # (B, T, H)
        acc = torch.promote_types(logit.dtype, torch.float32)  # bf16 gates sum in float32
        log_f = F.logsigmoid(logit.to(acc)).transpose(1, 2)  # (B, H, T)
        if key_valid is not None:  # padding adds no gate
            valid = key_valid if cache is None else key_valid.index_select(1, cache.at)
            log_f = log_f.masked_fill(~valid[:, None, :], 0.0)
        g = log_f.cumsum(-1)  # (B, H, T): G_i within this call
        g_keys = g
        if cache is not None:  # continue each row's running sum from the earlier steps
            total = cache.get("fox_total")  # (B, H, 1), updated in place: one graph
            if total is None:
                total = g.new_zeros(g.shape[:-1] + (1,))
                cache.put("fox_total", total)
            g = g + total
            total.copy_(g[..., -1:])
            g_keys = cache.extend("fox_keys", g)  # (B, H, S): G_j of every slot
        out = replace(
            ctx,
            extra=dict(ctx.extra),
            query_dims=dict(ctx.query_dims),
            key_dims=dict(ctx.key_dims),
        )
        out.put("fox_q", g, query_dim=2)
        out.put("fox_k", g_keys, key_dim=2)
        return out

    def score_bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        if self.gate == "full":
            g_q, g_k = ctx.extra["fox_q"], ctx.extra["fox_k"]
            return (g_q[..., :, None] - g_k[..., None, :]).to(q.dtype)  # (B, H, T, S)
        # (i - j) log f_h as ALiBi builds -m_h |i - j|: float32 distances, one rounding
        dist = ctx.rel().to(torch.float32)  # (B|1, T, S)
        return (dist[:, None] * self.log_decay()[None, :, None, None]).to(q.dtype)

    def score_mod(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreMod:
        if self.gate == "full":
            g_q, g_k = ctx.extra["fox_q"], ctx.extra["fox_k"]
            return lambda score, b, h, i, j: score + g_q[b, h, i] - g_k[b, h, j]
        log_f, dist = self.log_decay(), pair_distance(ctx)
        return lambda score, b, h, i, j: score + log_f[h] * dist(b, i, j)

    def transform_qk(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        return (q, k) if self.rotate is None else self.rotate.transform_qk(q, k, ctx)


@register("fox")
class FoX(CausalOnly):
    """The forget gate of the Forgetting Transformer (module docstring).

    Args:
        gate: ``full`` (the paper's data-dependent gate), ``bias_only`` or ``fixed``
            (ALiBi's slopes as constant gates).
        rope: Also rotate q and k with RoPE (base 10000, interleaved pairs).

    Raises:
        ValueError: An unknown gate, or bidirectional attention.
    """

    causal_reason = (
        "the forget gates are accumulated from each key up to the query (keys at or before it)"
    )
    data_dependent = True
    uses_positions = False  # the paper's FoX: the gates see tokens, not positions

    def __init__(
        self, *, d_model: int, n_heads: int, n_layers: int, gate: str = "full", rope: bool = False
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if gate not in GATES:
            raise ValueError(
                f"fox: unknown gate {gate!r}; allowed: {', '.join(GATES)} (full is the paper's "
                f"data-dependent forget gate)"
            )
        self.gate = gate
        self.rope = RoPE(d_model=d_model, n_heads=n_heads, n_layers=n_layers) if rope else None
        if gate != "full" or rope:  # positions enter: a constant gate's (i - j), RoPE
            self.uses_positions = True
            self.relative = True

    def prepare_causal(self, ctx: AttentionContext) -> None:
        if self.rope is not None:
            self.rope.prepare(ctx)

    def causal_hooks(self, *, layer: int) -> AttentionPositional:
        return _FoxAttention(
            d_model=self.d_model,
            n_heads=self.n_heads,
            gate=self.gate,
            rotate=self.rope is not None,
        )


__all__ = ["FoX", "GATES"]
