"""Learned absolute position embeddings (as in GPT-2 / BERT), added to tokens."""

from __future__ import annotations

from torch import Tensor, nn

from posenc.encoders.base import PositionalEncoder
from posenc.encoders.registry import register


@register("learned")
class LearnedAbsolute(PositionalEncoder):
    """A trainable ``(max_len, C)`` table added to the token embeddings.

    It has no entry for positions ``>= max_len``, so it cannot run past them.
    Cross-attention: nothing (positions entered through the embeddings).

    Args:
        max_len: Number of positions with an embedding.
        init_std: Standard deviation of the normal initialisation.
    """

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_layers: int,
        max_len: int = 1024,
        init_std: float = 0.02,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if max_len <= 0:
            raise ValueError(f"learned: max_len must be positive, got {max_len}")
        self.max_len = self.max_length = max_len
        self.table = nn.Embedding(max_len, d_model)
        nn.init.normal_(self.table.weight, std=init_std)

    def check_length(self, bound: int) -> None:
        if bound > self.max_len:
            raise ValueError(
                f"learned: asked for a sequence of length {bound} but max_len={self.max_len}; "
                f"learned absolute positions cannot extrapolate. Raise encoder.max_len "
                f"(before training) or evaluate at lengths <= {self.max_len}."
            )

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        return x + self.table(positions).to(x.dtype)  # (B|1, T, C) broadcast over B
