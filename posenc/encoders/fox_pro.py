"""The "Pro" block of the Forgetting Transformer (Lin et al. 2025, section 3.2): what FoX
Pro adds around the forget gate, as the authors' layer does it (zhixuan-lin/
forgetting-transformer, ``src/forgetting_transformer/model/forgetting_transformer/
modeling_forgetting_transformer.py``, ``ForgettingAttentionLayer`` with
``use_k_shift``, ``use_v_shift``, ``qk_norm``, ``use_output_gate`` and
``use_output_norm``, their ``pro_*`` configs).

Notation: B batch, H heads, T tokens, D head dim, C = H D; ``x_t`` the block's
normalised input.

In the order the layer applies them:

1. Key and value shift (``ShiftLinear``): each head mixes a token's projected key with
   the previous token's, by a data-dependent weight,

       a_t = sigmoid(w_h . x_t)            (per head, no bias)
       k'_t = (1 - a_t) k_t + a_t k_{t-1}  (k_{-1} = 0; a padding token's k counts as 0)

   and the same, with its own ``w_h``, for the values.
2. QK-norm: per-head RMS normalisation of the (shifted) keys and of the queries, with a
   learned scale per channel (ones at first), eps 1e-5 (the authors' ``GroupNorm``
   default; ``is_rms_norm``): ``q / sqrt(mean_D(q^2) + eps) * g``. Before RoPE, when
   there is one.
3. Output normalisation and gate (``FusedGroupNormGated``, sigmoid): each head's
   output normalised as in 2 with eps 1e-6 (their ``norm_eps``) and its own scale, then
   multiplied by ``sigmoid(W_o x_t)`` (``C x C``, no bias), before the output projection.

Linear weights start at N(0, 0.02) as the authors' (and posenc's) initialisation. The
rest of their Pro configs (no biases in q/k/v/o, a smaller MLP) is the model's, not the
scheme's: ``model.qkv_bias=false`` gives the former.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from posenc.encoders.base import Slot, normal_linears

#: In a layer's decoding cache: the last key and value before the step (B, H, 1, D).
K_PREV: Slot[Tensor] = Slot("fox_k_prev")
V_PREV: Slot[Tensor] = Slot("fox_v_prev")

#: The authors' eps of QK-norm (their GroupNorm's default) and of the output norm.
QK_NORM_EPS = 1e-5
OUT_NORM_EPS = 1e-6


def head_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x (B, H, T, D)`` over its D channels per head: ``x / sqrt(mean(x^2) + eps)``,
    times ``weight (H, D)``; computed in float32 at least, returned in ``x``'s dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    y = x.to(acc)
    y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + eps)
    return (y * weight.to(acc)[:, None, :]).to(x.dtype)


class FoxPro(nn.Module):
    """One layer's Pro parts (module docstring).

    Args:
        d_model: C.
        n_heads: H.
    """

    def __init__(self, *, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        head_dim = d_model // n_heads
        self.k_shift = nn.Linear(d_model, n_heads, bias=False)  # w_h of the key shift
        self.v_shift = nn.Linear(d_model, n_heads, bias=False)
        self.q_norm = nn.Parameter(torch.ones(n_heads, head_dim))
        self.k_norm = nn.Parameter(torch.ones(n_heads, head_dim))
        self.out_gate = nn.Linear(d_model, d_model, bias=False)  # W_o
        self.out_norm = nn.Parameter(torch.ones(n_heads, head_dim))

    def init_weights(self) -> None:
        """Linears N(0, 0.02), norm scales 1."""
        normal_linears(self)
        for scale in (self.q_norm, self.k_norm, self.out_norm):
            nn.init.ones_(scale)

    def shift(
        self, x: Tensor, k: Tensor, v: Tensor, *, key_valid: Tensor | None, cache: Any | None
    ) -> tuple[Tensor, Tensor]:
        """Keys and values ``(B, H, T, D)`` of the tokens ``x (B, T, C)`` shifted towards
        the previous token's; with a cache, the previous token of the first new one is
        the last of the step before (kept as ``fox_k_prev``, ``fox_v_prev``)."""
        valid = None
        if key_valid is not None:  # (B, T): padding's projections count as zeros
            valid = key_valid if cache is None else key_valid.index_select(1, cache.at)
        k = self._shift(x, k, self.k_shift, K_PREV, valid, cache)
        v = self._shift(x, v, self.v_shift, V_PREV, valid, cache)
        return k, v

    @staticmethod
    def _shift(
        x: Tensor,
        y: Tensor,
        proj: nn.Linear,
        name: Slot[Tensor],
        valid: Tensor | None,
        cache: Any | None,
    ) -> Tensor:
        acc = torch.promote_types(y.dtype, torch.float32)
        a = torch.sigmoid(proj(x).to(acc)).transpose(1, 2)[..., None]  # (B, H, T, 1)
        src = y if valid is None else y.masked_fill(~valid[:, None, :, None], 0.0)
        first = src.new_zeros(src[..., :1, :].shape)  # (B, H, 1, D): nothing before
        if cache is not None:
            state = cache.get(name)  # updated in place: one graph per step
            if state is None:
                state = first
                cache.put(name, state)
            first = state.clone()
            state.copy_(src[..., -1:, :])
        prev = torch.cat([first, src[..., :-1, :]], dim=2)  # (B, H, T, D): y_{t-1}
        return ((1.0 - a) * y.to(acc) + a * prev.to(acc)).to(y.dtype)

    def norm_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """QK-norm of ``q (B, H, T, D)`` and ``k (B, H, S, D)``."""
        return (
            head_rms_norm(q, self.q_norm, QK_NORM_EPS),
            head_rms_norm(k, self.k_norm, QK_NORM_EPS),
        )

    def gate_output(self, x: Tensor, out: Tensor) -> Tensor:
        """``out (B, H, T, D)`` normalised per head and gated by ``sigmoid(W_o x)``."""
        acc = torch.promote_types(out.dtype, torch.float32)
        g = self.out_gate(x).to(acc).unflatten(-1, (self.n_heads, -1)).transpose(1, 2)
        normed = head_rms_norm(out.to(acc), self.out_norm, OUT_NORM_EPS)  # (B, H, T, D)
        return (normed * torch.sigmoid(g)).to(out.dtype)


__all__ = ["FoxPro", "head_rms_norm"]
