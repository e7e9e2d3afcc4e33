"""Rotary position embedding, RoPE (Su et al. 2021, RoFormer, section 3.4).

Notation: B batch, H heads, T sequence, D head dim, R rotated dims (R <= D, even).

Pair i of a query or key at position m is rotated by the angle ``m * theta_i`` with
``theta_i = base^(-2i/R)``. Then ``<R_m q, R_n k>`` depends on q, k and ``n - m``
only, so attention scores are relative. Two layouts of the pairs are in use:

* ``interleaved``: pair i is dims ``(2i, 2i+1)`` -- RoFormer, torchtune, fairseq2;
* ``half``: pair i is dims ``(i, i + R/2)`` -- GPT-NeoX, Hugging Face ("rotate_half").

They are the same map up to a fixed permutation of the dims, but weights trained
under one are wrong under the other, so the layout is a named option.

Cross-attention: nothing. Decoder and encoder positions index different sequences,
so their difference means nothing; queries and keys pass through unrotated.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posenc.encoders.base import AttentionContext, AttentionPositional, AttnKind, PositionalEncoder
from posenc.encoders.registry import register

LAYOUTS = ("interleaved", "half")


def rope_frequencies(rot_dim: int, base: float = 10000.0, device=None) -> Tensor:
    """``theta_i = base^(-2i/R)`` for ``i = 0 .. R/2-1``, float32, shape ``(R/2,)``."""
    if rot_dim <= 0 or rot_dim % 2:
        raise ValueError(
            f"rope: the rotated dimension must be a positive even number, got {rot_dim}; "
            f"choose head_dim and fraction so that head_dim * fraction is even"
        )
    i = torch.arange(rot_dim // 2, device=device, dtype=torch.float32)
    return base ** (-2.0 * i / rot_dim)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, layout: str = "interleaved") -> Tensor:
    """Rotate the first ``R = 2 * cos.shape[-1]`` dims of ``x``; pass the rest through.

    The rotation is done in float32 and the result cast back to ``x.dtype``, so
    bf16/fp16 inputs keep the precision of the angle at large positions. The
    interleaved layout runs as one complex product (pairs are adjacent, so ``x`` is
    viewed as complex without a copy): about as fast as an elementwise copy, where the
    textbook ``x1*cos - x2*sin, x1*sin + x2*cos`` form is several times slower
    (``experiments/bench.py``). The ``half`` layout has no such view and uses that form.

    Args:
        x: ``(B, H, T, D)``.
        cos: ``(B|1, 1, T, R/2)`` float32 cosines of the angles.
        sin: Same shape, sines.
        layout: ``interleaved`` or ``half``.

    Returns:
        ``(B, H, T, D)`` in ``x.dtype``.
    """
    half = cos.shape[-1]
    rot = x[..., : 2 * half].float()
    if layout == "interleaved":
        if rot.stride(-1) != 1 or any(st % 2 for st in rot.stride()[:-1]):
            rot = rot.contiguous()  # view_as_complex needs adjacent, aligned pairs
        z = torch.view_as_complex(rot.unflatten(-1, (half, 2)))  # (B, H, T, R/2)
        out = torch.view_as_real(z * torch.complex(cos, sin)).flatten(-2)
    elif layout == "half":
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    else:
        raise ValueError(f"rope: unknown layout {layout!r}; allowed: {', '.join(LAYOUTS)}")
    out = out.to(x.dtype)
    return out if 2 * half == x.shape[-1] else torch.cat((out, x[..., 2 * half :]), dim=-1)


class _RotateQK(AttentionPositional):
    """Per-layer hook: rotate q and k with the stack's cached tables."""

    def transform_qk(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        layout = ctx.extra["layout"]
        q = apply_rope(q, ctx.extra["q_cos"], ctx.extra["q_sin"], layout)
        k = apply_rope(k, ctx.extra["k_cos"], ctx.extra["k_sin"], layout)
        return q, k


@register("rope")
class RoPE(PositionalEncoder):
    """Rotary embedding of queries and keys in self-attention.

    Args:
        base: ``theta_i = base^(-2i/R)``; 10000 in the paper.
        layout: ``interleaved`` (RoFormer) or ``half`` (GPT-NeoX / rotate_half).
        fraction: Share of each head's dims that is rotated (GPT-NeoX's
            ``rotary_pct``); the first ``head_dim * fraction`` dims rotate.
        cache_len: Initial length of the cos/sin cache; it grows on demand.

    Raises:
        ValueError: Odd rotated dimension, fraction outside (0, 1], unknown layout.
    """

    relative = True

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_layers: int,
        base: float = 10000.0,
        layout: str = "interleaved",
        fraction: float = 1.0,
        cache_len: int = 2048,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if layout not in LAYOUTS:
            raise ValueError(f"rope: unknown layout {layout!r}; allowed: {', '.join(LAYOUTS)}")
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"rope: fraction must be in (0, 1], got {fraction}")
        if base <= 1.0:
            raise ValueError(f"rope: base must be > 1, got {base}")
        rot = self.head_dim * fraction
        if rot != int(rot) or int(rot) % 2:
            raise ValueError(
                f"rope: rotated dimension head_dim * fraction = {self.head_dim} * {fraction} = "
                f"{rot:g} must be an even integer; change fraction or d_model/n_heads"
            )
        self.rot_dim = int(rot)
        self.base = float(base)
        self.layout = layout
        self.register_buffer(
            "inv_freq", rope_frequencies(self.rot_dim, self.base), persistent=False
        )
        self.register_buffer("_cos", torch.empty(0, self.rot_dim // 2), persistent=False)
        self.register_buffer("_sin", torch.empty(0, self.rot_dim // 2), persistent=False)
        self._grow(cache_len)

    def _grow(self, n: int) -> None:
        """Extend the float32 cos/sin cache to at least ``n`` positions (powers of two)."""
        size = max(1, self._cos.shape[0])
        while size < n:
            size *= 2
        if size <= self._cos.shape[0]:
            return
        pos = torch.arange(size, device=self.inv_freq.device, dtype=torch.float32)
        angle = torch.outer(pos, self.inv_freq)  # (N, R/2), float32 even under autocast
        self._cos, self._sin = angle.cos(), angle.sin()

    def tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin at ``positions (B|1, T)``, each ``(B|1, 1, T, R/2)`` float32."""
        if positions.numel() == 0:
            empty = self._cos.new_empty(positions.shape[0], 1, 0, self.rot_dim // 2)
            return empty, empty
        if int(positions.min()) < 0:
            raise ValueError("rope: positions must be >= 0 (the cache is indexed by position)")
        self._grow(int(positions.max()) + 1)
        return self._cos[positions][:, None], self._sin[positions][:, None]

    def context(self, q_pos: Tensor, k_pos: Tensor, kind: AttnKind) -> AttentionContext:
        ctx = super().context(q_pos, k_pos, kind)
        if kind is AttnKind.CROSS:
            return ctx
        q_cos, q_sin = self.tables(q_pos)
        k_cos, k_sin = (q_cos, q_sin) if k_pos is q_pos else self.tables(k_pos)
        ctx.extra.update(layout=self.layout, q_cos=q_cos, q_sin=q_sin, k_cos=k_cos, k_sin=k_sin)
        ctx.query_dims.update(q_cos=-2, q_sin=-2)
        return ctx

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        return AttentionPositional() if kind is AttnKind.CROSS else _RotateQK()

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module signature
        # A module cast (.half(), .to(bfloat16)) must not round the angles: rebuild
        # the frequencies and the cache in float32 on the new device.
        out = super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            n = self._cos.shape[0]
            device = self.inv_freq.device
            self.inv_freq = rope_frequencies(self.rot_dim, self.base, device=device)
            self._cos = self._sin = torch.empty(0, self.rot_dim // 2, device=device)
            self._grow(n)
        return out
