"""xPos, RoPE with an exponential decay (Sun et al. 2023, "A Length-Extrapolatable
Transformer", ACL 2023).

Notation: B batch, H heads, T queries, S keys, D head dim, R = D rotated dims,
n a query position, m a key position, i = 0 .. R/2-1 a rotated pair.

Pair i is rotated by the angle ``pos * theta_i`` exactly as RoPE does
(``theta_i = base^(-2i/R)``, see :mod:`posenc.encoders.rope`) and scaled: the query
at n by ``zeta_i^(n / scale_base)``, the key at m by ``zeta_i^(-m / scale_base)``, with

    zeta_i = (2i/R + gamma) / (1 + gamma)    in (0, 1)    (defaults gamma = 0.4, scale_base = 512)

so pair i contributes ``zeta_i^((n - m) / scale_base) * <rotated q pair, rotated k pair>``
to the score: RoPE's relative score with a decay in ``n - m`` that is strongest for the
high-frequency pairs (small i). Scaling RoPE's cos and sin tables by the per-pair
factor gives the scaled rotation with RoPE's own kernel, in both layouts.

Numerics: ``zeta_0^(n / 512)`` with ``zeta_0 = 0.4 / 1.4`` is ``exp(-0.00245 n)``, so at
large positions the query factors underflow and the key factors overflow (float32 at
n ~ 36000, float16 at n ~ 4500, sooner with a smaller scale_base). Since the score
depends on ``n - m`` only, both exponents are taken relative to a common offset, the
centre of each row's key positions: the factors then stay within about
``zeta_0^(+-S / (2 scale_base))`` for S keys, wherever the sequence sits. The rotation
itself uses the true positions, as RoPE's does.

Bidirectional attention: refused. The decay is defined for keys at or before the
query (n >= m); for later keys the same factor grows with distance, so an encoder
would attend more to far-away future tokens. Use xPos in decoder-only models, or rope
in a translation encoder.

Cross-attention: nothing (positions of two different sequences are not comparable).
"""

from __future__ import annotations

import torch
from torch import Tensor

from posenc.encoders.base import AttentionContext, AttentionPositional, CausalOnly
from posenc.encoders.registry import register
from posenc.encoders.rope import LAYOUTS, put_rotation_tables, rope_frequencies, rotate_qk
from posenc.errors import unknown_value


def xpos_zeta(rot_dim: int, gamma: float = 0.4, device=None) -> Tensor:
    """``zeta_i = (2i/R + gamma) / (1 + gamma)`` for ``i = 0 .. R/2-1``, float32 ``(R/2,)``."""
    i = torch.arange(rot_dim // 2, device=device, dtype=torch.float32)
    return (2.0 * i / rot_dim + gamma) / (1.0 + gamma)


class _ScaledRotateQK(AttentionPositional):
    """Per-layer hook: rotate and scale q and k with the stack's per-forward tables."""

    def transform_qk(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        return rotate_qk(q, k, ctx)


@register("xpos")
class XPos(CausalOnly):
    """xPos: rotary embedding with a per-pair exponential decay, causal attention only.

    Args:
        base: ``theta_i = base^(-2i/R)`` as in RoPE.
        layout: ``interleaved`` (RoFormer pairs) or ``half`` (GPT-NeoX rotate_half).
        gamma: Offset of ``zeta_i``; larger is a weaker decay.
        scale_base: Positions per unit of the decay exponent; larger is a weaker decay.

    Raises:
        ValueError: Odd head dim, unknown layout, ``base <= 1``, ``gamma <= 0``,
            ``scale_base <= 0``; and ``for_attention`` with bidirectional attention.
    """

    relative = True
    causal_reason = (
        "xPos's decay zeta^((n - m) / scale_base) is defined only for keys at or before "
        "the query (m <= n); for later keys it would grow with distance"
    )
    causal_instead = "encoder=rope for task=mt"

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_layers: int,
        base: float = 10000.0,
        layout: str = "interleaved",
        gamma: float = 0.4,
        scale_base: float = 512.0,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if layout not in LAYOUTS:
            raise ValueError(f"xpos: {unknown_value('layout', layout, LAYOUTS)}")
        if self.head_dim % 2:
            raise ValueError(
                f"xpos: the head dim d_model / n_heads = {d_model} / {n_heads} = "
                f"{self.head_dim} must be even (it is rotated in pairs); change d_model or "
                f"n_heads"
            )
        if not base > 1.0:
            raise ValueError(f"xpos: base must be > 1, got {base}; the default is 10000")
        if not gamma > 0.0:
            raise ValueError(
                f"xpos: gamma must be > 0 (zeta_0 = gamma / (1 + gamma) must be positive), "
                f"got {gamma}; the default is 0.4"
            )
        if not scale_base > 0.0:
            raise ValueError(
                f"xpos: scale_base must be > 0, got {scale_base}; the default is 512 "
                f"(larger is a weaker decay)"
            )
        self.rot_dim = self.head_dim
        self.base = float(base)
        self.layout = layout
        self.gamma = float(gamma)
        self.scale_base = float(scale_base)

    def tables(self, positions: Tensor, centre: Tensor, sign: float) -> tuple[Tensor, Tensor]:
        """Scaled cos and sin at ``positions (B|1, T)``, each ``(B|1, 1, T, R/2)`` float32.

        Args:
            positions: Integer positions.
            centre: ``(B|1, 1)`` common offset of the decay exponents.
            sign: +1 for queries (``zeta^(n/scale_base)``), -1 for keys.
        """
        device = positions.device
        # Built on the fly in float32 (R/2 numbers): no buffer for a module cast to round.
        inv_freq = rope_frequencies(self.rot_dim, self.base, device=device)
        log_zeta = xpos_zeta(self.rot_dim, self.gamma, device=device).log()
        angle = positions.float()[..., None] * inv_freq  # (B|1, T, R/2)
        shifted = (positions - centre).float()[..., None]  # (B|1, T, 1), exact integers
        scale = torch.exp(shifted * (sign * log_zeta / self.scale_base))  # (B|1, T, R/2)
        return (angle.cos() * scale)[:, None], (angle.sin() * scale)[:, None]

    def prepare_causal(self, ctx: AttentionContext) -> None:
        q_pos, k_pos = ctx.q_pos, ctx.k_pos
        ctx.stable_keys = False  # the decay's centre follows the keys of the pass
        if ctx.lengths is not None:
            # a static cache's slots: the real keys are at 0 .. length - 1 (per row), the
            # centre a full pass over them takes (the rest are empty slots)
            centre = ((ctx.lengths - 1) // 2)[:, None]
        elif k_pos.shape[-1]:
            centre = (k_pos.amin(-1, keepdim=True) + k_pos.amax(-1, keepdim=True)) // 2
        else:
            centre = k_pos.new_zeros(k_pos.shape[0], 1)
        # q's tables grow and k's decay, so they are never one object
        put_rotation_tables(
            ctx, self.layout, self.tables(q_pos, centre, 1.0), self.tables(k_pos, centre, -1.0)
        )

    def causal_hooks(self, *, layer: int) -> AttentionPositional:
        return _ScaledRotateQK()
