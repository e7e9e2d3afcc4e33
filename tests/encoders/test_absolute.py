"""Learned and sinusoidal absolute encoders against their definitions."""

from __future__ import annotations

import math

import pytest
import torch

from posenc.encoders.learned import LearnedAbsolute
from posenc.encoders.sinusoidal import Sinusoidal, sinusoid
from posenc.model import DecoderLM


def test_sinusoid_values_from_vaswani() -> None:
    # PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)).
    d = 6
    pe = sinusoid(torch.tensor([0, 1, 50]), d)
    for row, pos in enumerate((0, 1, 50)):
        for i in range(d // 2):
            w = 10000 ** (2 * i / d)
            assert pe[row, 2 * i].item() == pytest.approx(math.sin(pos / w), abs=1e-6)
            assert pe[row, 2 * i + 1].item() == pytest.approx(math.cos(pos / w), abs=1e-6)


def test_concat_layout_is_a_permutation_of_interleaved() -> None:
    pos = torch.arange(20)
    inter = sinusoid(pos, 8)
    concat = sinusoid(pos, 8, layout="concat")
    torch.testing.assert_close(concat, inter[:, [0, 2, 4, 6, 1, 3, 5, 7]])


def test_sinusoidal_embed_adds_the_table_at_the_given_positions() -> None:
    enc = Sinusoidal(d_model=8, n_heads=2, n_layers=1)
    x = torch.randn(2, 3, 8)
    pos = torch.tensor([[10, 11, 12]])
    torch.testing.assert_close(enc.embed(x, pos), x + sinusoid(pos, 8))
    with pytest.raises(ValueError, match="allowed: interleaved, concat"):
        Sinusoidal(d_model=8, n_heads=2, n_layers=1, layout="sin-cos")


def test_learned_looks_up_its_table_and_refuses_longer_sequences() -> None:
    enc = LearnedAbsolute(d_model=8, n_heads=2, n_layers=1, max_len=16)
    x = torch.randn(1, 4, 8)
    pos = torch.tensor([[3, 4, 5, 6]])
    torch.testing.assert_close(enc.embed(x, pos), x + enc.table.weight[3:7])
    enc.check_length(16)
    with pytest.raises(ValueError, match=r"length 17 but max_len=16"):
        enc.check_length(17)
    model = DecoderLM(vocab_size=5, encoder="learned", d_model=8, n_heads=2, n_layers=1)
    with pytest.raises(ValueError, match=r"length 1025 but max_len=1024"):  # before any work
        model(torch.zeros(1, 1025, dtype=torch.long))
