"""The shared transformer: attention, blocks, stacks, LM and encoder-decoder."""

from posenc.model.attention import Attention
from posenc.model.backends import attention_mask
from posenc.model.transformer import DecoderLM, EncoderDecoder, Stack, count_parameters

__all__ = [
    "Attention",
    "DecoderLM",
    "EncoderDecoder",
    "Stack",
    "attention_mask",
    "count_parameters",
]
