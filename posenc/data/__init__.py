"""Data for posenc: downloads, sources (text and parallel corpora), tokenizers, the LM and
translation data modules, generated algorithmic problems and passkey instances."""

from posenc.data.download import FILES, DataUnavailableError, data_dir, fetch, read_text
from posenc.data.lm import LMDataModule, eval_stream_length, score_masks, window_starts
from posenc.data.sources import text_files, tinyshakespeare, wikitext103
from posenc.data.tokenizers import (
    CharTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    build_tokenizer,
)

__all__ = [
    "FILES",
    "CharTokenizer",
    "DataUnavailableError",
    "LMDataModule",
    "SentencePieceTokenizer",
    "Tokenizer",
    "build_tokenizer",
    "data_dir",
    "eval_stream_length",
    "fetch",
    "read_text",
    "score_masks",
    "text_files",
    "tinyshakespeare",
    "window_starts",
    "wikitext103",
]
