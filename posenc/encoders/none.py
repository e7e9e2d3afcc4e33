"""No positional information ("NoPE"): the baseline.

In causal attention the mask alone leaks order (Kazemnejad et al. 2023); in
bidirectional and cross-attention the model is permutation-invariant.
"""

from posenc.encoders.base import PositionalEncoder
from posenc.encoders.registry import register


@register("none")
class NoPositions(PositionalEncoder):
    """Every hook is the base class's no-op."""

    uses_positions = False
