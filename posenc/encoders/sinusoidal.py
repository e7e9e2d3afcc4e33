"""Fixed sinusoidal absolute positions (Vaswani et al. 2017, section 3.5).

Three tables are in use; ``layout`` names them (C = d_model, i = 0 .. C/2 - 1):

* ``interleaved``, the paper's: ``PE[pos, 2i] = sin(pos * w_i)``,
  ``PE[pos, 2i+1] = cos(pos * w_i)`` with ``w_i = base^(-2i/C)``.
* ``concat``, tensor2tensor's ``get_timing_signal_1d`` and fairseq's
  ``SinusoidalPositionalEmbedding``: ``[sin(pos * w_i) ... | cos(pos * w_i) ...]`` with
  ``w_i = base^(-i/(C/2 - 1))``, so the slowest pair's wavelength is exactly
  ``2 pi base`` (the paper's stops short of it). For C = 2 the one frequency is 1, as
  tensor2tensor's ``max(C/2 - 1, 1)`` gives. (fairseq also starts positions after its
  padding index; here positions are as given.)
* ``concat_marian``: the paper's frequencies ``base^(-2i/C)`` as ``[sin ... | cos ...]``,
  the table of Hugging Face's ``MarianSinusoidalPositionalEmbedding``; a permutation of
  ``interleaved``.

The table's entries are in [-1, 1]. How large it should be next to the token
embeddings depends on how those are made (``amplitude``; docs/design.md, measurements
in docs/results.md):

* ``auto`` (default): as is beside token embeddings multiplied by ``sqrt(C)`` (the
  paper, section 3.4; tensor2tensor and fairseq initialise them N(0, C^-0.5), so both
  terms have entries of size about 1: posenc's translation model), and times
  :data:`UNSCALED_AMPLITUDE` = 128^-0.5 beside unscaled GPT-2-style N(0, 0.02) tokens
  (the LM and algorithmic models). 128^-0.5 is where x-transformers'
  ``ScaledSinusoidalEmbedding`` starts its learned scale at the LM's width; it is kept
  fixed across widths because what matters is its ratio to the tokens' 0.02. At full
  size beside 0.02 tokens the table swamps them (each token is a few percent of the
  first LayerNorm's input) and the model learns slowly or not at all.
* a number: the table times that number, whatever the tokens (1: the raw table).
"""

from __future__ import annotations

import torch
from torch import Tensor

from posenc.encoders.base import PositionalEncoder
from posenc.encoders.registry import register
from posenc.errors import unknown_value

LAYOUTS = ("interleaved", "concat", "concat_marian")
#: ``amplitude`` values that are not numbers.
AMPLITUDES = ("auto",)
#: ``auto``'s amplitude beside unscaled N(0, 0.02) token embeddings (module docstring).
UNSCALED_AMPLITUDE = 128**-0.5


def sinusoid_frequencies(dim: int, base: float, layout: str, device=None) -> Tensor:
    """``w_i``, ``(dim/2,)`` float32: ``base^(-2i/dim)``, or ``base^(-i/(dim/2 - 1))`` for
    ``concat``; computed in float64 and rounded once."""
    i = torch.arange(dim // 2, device=device, dtype=torch.float64)
    denom = max(dim // 2 - 1, 1) if layout == "concat" else dim / 2
    return (base ** (-i / denom)).float()


def sinusoid(
    positions: Tensor, dim: int, *, base: float = 10000.0, layout: str = "interleaved"
) -> Tensor:
    """Sinusoidal features of (possibly negative) positions, computed in float32.

    Args:
        positions: Any shape ``(*)``, integer or float.
        dim: Feature size, even.
        base: Wavelength base (10000 in the paper).
        layout: One of :data:`LAYOUTS` (module docstring).

    Returns:
        ``(*, dim)`` float32.

    Raises:
        ValueError: For an odd ``dim`` or an unknown layout.
    """
    if dim % 2:
        raise ValueError(f"sinusoidal features need an even dimension, got {dim}")
    if layout not in LAYOUTS:
        raise ValueError(unknown_value("sinusoid layout", layout, LAYOUTS))
    inv_freq = sinusoid_frequencies(dim, base, layout, device=positions.device)
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
        layout: ``interleaved`` (the paper), ``concat`` (tensor2tensor / fairseq) or
            ``concat_marian`` (module docstring).
        amplitude: ``auto`` (the table as is beside token embeddings scaled by
            ``sqrt(C)``, times :data:`UNSCALED_AMPLITUDE` beside unscaled ones; module
            docstring) or a positive number multiplying the table.
    """

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_layers: int,
        base: float = 10000.0,
        layout: str = "interleaved",
        amplitude: float | str = "auto",
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if layout not in LAYOUTS:
            raise ValueError(f"sinusoidal: {unknown_value('layout', layout, LAYOUTS)}")
        if d_model % 2:
            raise ValueError(f"sinusoidal: d_model must be even, got {d_model}")
        if isinstance(amplitude, str):
            if amplitude not in AMPLITUDES:
                raise ValueError(
                    f"sinusoidal: amplitude={amplitude!r}; allowed: auto or a positive number"
                )
        elif not amplitude > 0:
            raise ValueError(
                f"sinusoidal: amplitude={amplitude} must be positive (1: the raw table), or auto"
            )
        self.base = base
        self.layout = layout
        self.amplitude_setting = amplitude
        # auto, until a model says otherwise: beside unscaled tokens (DecoderLM's default)
        self.match_token_embeddings(scaled=False)

    def _amplitude(self, *, tokens_scaled: bool) -> float:
        if isinstance(self.amplitude_setting, str):  # auto
            return 1.0 if tokens_scaled else UNSCALED_AMPLITUDE
        return float(self.amplitude_setting)

    def match_token_embeddings(self, *, scaled: bool) -> None:
        self.amplitude = self._amplitude(tokens_scaled=scaled)

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        pe = sinusoid(positions, self.d_model, base=self.base, layout=self.layout)  # (B|1, T, C)
        return x + (pe * self.amplitude).to(x.dtype)
