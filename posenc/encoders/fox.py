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

Initial bias (``bias_init``, for the ``full`` and ``bias_only`` gates):

* ``zero`` (default, the authors' full-gate start): ``b_h = 0``, so every gate starts at
  ``sigmoid(0) = 1/2`` and a key 100 tokens back starts about 69 logits behind.
* ``spread``: decay times spread over the heads, the form the authors' code uses for its
  fixed and bias-only gates (``fgate_bias_init``): ``T_h`` log-spaced from
  ``decay_time_min`` to ``decay_time_max`` over the H heads and
  ``b_h = -log(exp(1 / T_h) - 1)``, so that ``log sigmoid(b_h) = -1 / T_h``: head h
  starts forgetting a factor e every ``T_h`` tokens. (The authors' code takes both bounds
  as required settings; posenc's defaults are 2 and 128, the LM's training length.)
  With the ``full`` gate this start is posenc's own combination: the authors'
  ``ForgettingAttentionLayer`` refuses ``fgate_bias_init`` for its full gate.

``pro=true`` adds the Pro block around the gate (:mod:`posenc.encoders.fox_pro`: key and
value shift, QK-norm, output normalisation and gate), the paper's "FoX (Pro)".

With a constant gate the term is ``(i - j) log f_h``, computed from the positions as
ALiBi computes its own; the ``full`` gate sums the gates of the tokens themselves, so
it never reads positions: padding tokens (left-padded prompts) add no gate, and
decoding with the cache carries each row's running sum of log-gates (the cache's
``fox_total``) and every key's ``G_j`` (``fox_keys``).

Causal attention only: the sum runs from the key to the query.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc.encoders.alibi import alibi_slopes
from posenc.encoders.base import (
    AttentionContext,
    AttentionPositional,
    CausalOnly,
    ScoreMod,
    Slot,
    normal_linears,
)
from posenc.encoders.fox_pro import FoxPro
from posenc.encoders.offsets import pair_distance
from posenc.encoders.registry import register
from posenc.encoders.rope import RoPE, _RotateQK
from posenc.errors import unknown_value

# What with_input leaves for the score term: the cumulative log gates G, (B, H, T) and (B, H, S).
GATE_Q: Slot[Tensor] = Slot("fox_q", query_dim=2)
GATE_K: Slot[Tensor] = Slot("fox_k", key_dim=2)
#: In a layer's decoding cache: the running total of log f (B, H, 1) and G_j of every slot.
TOTAL: Slot[Tensor] = Slot("fox_total")
KEYS_G: Slot[Tensor] = Slot("fox_keys", key_dim=2)

GATES = ("full", "bias_only", "fixed")
#: Initial gate biases (module docstring).
BIAS_INITS = ("zero", "spread")


def spread_bias(n_heads: int, decay_time_min: float, decay_time_max: float) -> Tensor:
    """``(H,)`` float64 biases whose gates ``sigmoid(b_h) = exp(-1 / T_h)`` have decay
    times ``T_h`` log-spaced from ``decay_time_min`` to ``decay_time_max`` (the authors'
    ``fgate_bias_init``, ``ForgettingAttentionLayer`` in zhixuan-lin/forgetting-transformer,
    ``modeling_forgetting_transformer.py``, for its fixed and bias-only gates; that layer
    refuses it with the full gate, where posenc allows it as its own combination)."""
    log_t = torch.linspace(
        math.log(decay_time_min), math.log(decay_time_max), n_heads, dtype=torch.float64
    )
    return -torch.log(torch.expm1(1.0 / log_t.exp()))


class _FoxAttention(AttentionPositional):
    """Per-layer hooks: this layer's forget gates, and RoPE's rotation when asked."""

    score_term = True
    slopes: Tensor  # gate=fixed: a buffer (not saved), (H,) float32

    def init_weights(self) -> None:
        """The gate's ``w_h`` ~ N(0, 0.02), ``b_h`` as ``bias_init`` says (a fixed gate:
        set when built); the Pro block's own (:meth:`FoxPro.init_weights`)."""
        normal_linears(self)
        if self.pro is not None:
            self.pro.init_weights()
        self._init_bias()

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        gate: str,
        rotate: bool,
        start_bias: Tensor | None = None,
        pro: bool = False,
    ) -> None:
        super().__init__()
        self.gate = gate
        self.rotate = _RotateQK() if rotate else None
        self.start_bias = start_bias  # (H,) float64, or None: zeros
        self.pro = FoxPro(d_model=d_model, n_heads=n_heads) if pro else None
        if gate == "full":
            self.proj = nn.Linear(d_model, n_heads)  # w_h, b_h of every head
        elif gate == "bias_only":
            self.bias = nn.Parameter(torch.zeros(n_heads))
        else:  # log f_h = -m_h, kept float32 as ALiBi keeps its slopes
            self.n_heads = n_heads
            self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)
        self._init_bias()

    def _init_bias(self) -> None:
        """``b_h``: zeros, or the spread decay times of ``bias_init=spread``."""
        if self.gate == "fixed":
            return
        bias = self.proj.bias if self.gate == "full" else self.bias
        with torch.no_grad():
            bias.copy_(torch.zeros_like(bias) if self.start_bias is None else self.start_bias)

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
            total = cache.get(TOTAL)  # (B, H, 1), updated in place: one graph
            if total is None:
                total = g.new_zeros(g.shape[:-1] + (1,))
                cache.put(TOTAL, total)
            g = g + total
            total.copy_(g[..., -1:])
            g_keys = cache.extend(KEYS_G, g)  # (B, H, S): G_j of every slot
        out = ctx.grown()
        out.put(GATE_Q, g)
        out.put(GATE_K, g_keys)
        return out

    def score_bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        if self.gate == "full":
            g_q, g_k = ctx[GATE_Q], ctx[GATE_K]
            return (g_q[..., :, None] - g_k[..., None, :]).to(q.dtype)  # (B, H, T, S)
        # (i - j) log f_h as ALiBi builds -m_h |i - j|: float32 distances, one rounding
        dist = ctx.rel().to(torch.float32)  # (B|1, T, S)
        return (dist[:, None] * self.log_decay()[None, :, None, None]).to(q.dtype)

    def score_mod(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreMod:
        if self.gate == "full":
            g_q, g_k = ctx[GATE_Q], ctx[GATE_K]
            return lambda score, b, h, i, j: score + g_q[b, h, i] - g_k[b, h, j]
        log_f, dist = self.log_decay(), pair_distance(ctx)
        return lambda score, b, h, i, j: score + log_f[h] * dist(b, i, j)

    def transform_qk(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        if self.pro is not None:  # QK-norm before any rotation, as the authors' layer
            q, k = self.pro.norm_qk(q, k)
        return (q, k) if self.rotate is None else self.rotate.transform_qk(q, k, ctx)

    def transform_kv(
        self,
        x: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        key_valid: Tensor | None,
        cache: Any | None,
    ) -> tuple[Tensor, Tensor]:
        if self.pro is None:
            return k, v
        return self.pro.shift(x, k, v, key_valid=key_valid, cache=cache)

    def transform_output(self, x: Tensor, out: Tensor) -> Tensor:
        return out if self.pro is None else self.pro.gate_output(x, out)


@register("fox")
class FoX(CausalOnly):
    """The forget gate of the Forgetting Transformer (module docstring).

    Args:
        gate: ``full`` (the paper's data-dependent gate), ``bias_only`` or ``fixed``
            (ALiBi's slopes as constant gates).
        rope: Also rotate q and k with RoPE (base 10000, interleaved pairs).
        bias_init: ``zero`` (the authors' full-gate start) or ``spread`` (decay times
            spread over the heads, the authors' start for the bias-only gate; with the
            ``full`` gate posenc's own combination); ``full`` and ``bias_only`` gates.
        decay_time_min: Shortest decay time of ``spread`` (tokens, > 0).
        decay_time_max: Longest decay time of ``spread`` (>= ``decay_time_min``).
        pro: The Pro block (:mod:`posenc.encoders.fox_pro`).

    Raises:
        ValueError: An unknown gate or bias_init, ``spread`` with a fixed gate or bad
            decay times, a ``pro`` that is not a bool, or bidirectional attention.
    """

    causal_reason = (
        "the forget gates are accumulated from each key up to the query (keys at or before it)"
    )
    data_dependent = True
    uses_positions = False  # the paper's FoX: the gates see tokens, not positions

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_layers: int,
        gate: str = "full",
        rope: bool = False,
        bias_init: str = "zero",
        decay_time_min: float = 2.0,
        decay_time_max: float = 128.0,
        pro: bool = False,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if gate not in GATES:
            raise ValueError(
                f"fox: {unknown_value('gate', gate, GATES)} (full is the paper's "
                f"data-dependent forget gate)"
            )
        _check_init(gate, bias_init, decay_time_min, decay_time_max)
        self.gate = gate
        self.pro = pro
        self.start_bias = (
            spread_bias(n_heads, decay_time_min, decay_time_max) if bias_init == "spread" else None
        )
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
            start_bias=self.start_bias,
            pro=self.pro,
        )


def _check_init(gate: str, bias_init: str, t_min: float, t_max: float) -> None:
    """Refuse an unknown ``bias_init``, ``spread`` where there is no bias to set, and
    decay times that are not ``0 < t_min <= t_max``. ``spread`` with the ``full`` gate
    stays allowed, though the authors' layer asserts against it: a start of posenc's own.

    Raises:
        ValueError: One line naming the value and what is allowed.
    """
    if bias_init not in BIAS_INITS:
        raise ValueError(
            f"fox: {unknown_value('bias_init', bias_init, BIAS_INITS)} (zero is "
            f"the authors' full-gate start, spread their decay times over heads)"
        )
    if bias_init == "spread" and gate == "fixed":
        raise ValueError(
            "fox: bias_init=spread sets a learned gate's bias, and gate=fixed has none (its "
            "gates are ALiBi's slopes); use gate=full or gate=bias_only with bias_init=spread"
        )
    ok = all(isinstance(t, int | float) and not isinstance(t, bool) for t in (t_min, t_max))
    if not (ok and math.isfinite(t_min) and math.isfinite(t_max) and 0 < t_min <= t_max):
        raise ValueError(
            f"fox: decay_time_min={t_min!r}, decay_time_max={t_max!r}: need finite numbers "
            f"with 0 < decay_time_min <= decay_time_max (tokens), e.g. 2 and 128"
        )


__all__ = ["BIAS_INITS", "FoX", "GATES", "spread_bias"]
