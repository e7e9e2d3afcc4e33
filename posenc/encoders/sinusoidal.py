"""Fixed sinusoidal absolute positions (Vaswani et al. 2017, section 3.5).

``PE[pos, 2i] = sin(pos / base^(2i/C))`` and ``PE[pos, 2i+1] = cos(pos / base^(2i/C))``.
Some toolkits (tensor2tensor, fairseq) concatenate instead: ``[sin ... | cos ...]``;
that is the ``concat`` layout. Both carry the same information, permuted.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posenc.encoders.base import PositionalEncoder
from posenc.encoders.registry import register

LAYOUTS = ("interleaved", "concat")


def sinusoid(
    positions: Tensor, dim: int, *, base: float = 10000.0, layout: str = "interleaved"
) -> Tensor:
    """Sinusoidal features of (possibly negative) positions, computed in float32.

    Args:
        positions: Any shape ``(*)``, integer or float.
        dim: Feature size, even.
        base: Wavelength base (10000 in the paper).
        layout: ``interleaved`` (sin at even, cos at odd indices) or ``concat``.

    Returns:
        ``(*, dim)`` float32.

    Raises:
        ValueError: For an odd ``dim`` or an unknown layout.
    """
    if dim % 2:
        raise ValueError(f"sinusoidal features need an even dimension, got {dim}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sinusoid layout {layout!r}; allowed: {', '.join(LAYOUTS)}")
    inv_freq = base ** (
        -torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim
    )
    angle = positions.to(torch.float32)[..., None] * inv_freq  # (*, dim/2)
    if layout == "interleaved":
        return torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(-2)
    return torch.cat((angle.sin(), angle.cos()), dim=-1)


@register("sinusoidal")
class Sinusoidal(PositionalEncoder):
    """Adds the fixed sinusoid table to the token embeddings.

    Cross-attention: nothing (positions entered through the embeddings).

    Args:
        base: Wavelength base.
        layout: ``interleaved`` (the paper) or ``concat``.
    """

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_layers: int,
        base: float = 10000.0,
        layout: str = "interleaved",
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if layout not in LAYOUTS:
            raise ValueError(
                f"sinusoidal: unknown layout {layout!r}; allowed: {', '.join(LAYOUTS)}"
            )
        if d_model % 2:
            raise ValueError(f"sinusoidal: d_model must be even, got {d_model}")
        self.base = base
        self.layout = layout

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        pe = sinusoid(positions, self.d_model, base=self.base, layout=self.layout)  # (B|1, T, C)
        return x + pe.to(x.dtype)
