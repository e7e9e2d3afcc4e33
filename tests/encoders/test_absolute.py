"""Learned and sinusoidal absolute encoders against their definitions."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from posenc.encoders.learned import LearnedAbsolute
from posenc.encoders.sinusoidal import Sinusoidal, sinusoid
from posenc.model import DecoderLM, EncoderDecoder


def test_sinusoid_values_from_vaswani() -> None:
    # PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)).
    d = 6
    pe = sinusoid(torch.tensor([0, 1, 50]), d)
    for row, pos in enumerate((0, 1, 50)):
        for i in range(d // 2):
            w = 10000 ** (2 * i / d)
            assert pe[row, 2 * i].item() == pytest.approx(math.sin(pos / w), abs=1e-6)
            assert pe[row, 2 * i + 1].item() == pytest.approx(math.cos(pos / w), abs=1e-6)


# d = 6, positions 0, 1, 2, written out from each table's formula.
# The paper's frequencies base^(-2i/6): 1, 10^(-4/3) = 0.0464158883, 10^(-8/3) = 0.0021544347.
SIN_PAPER = [
    [0.0, 0.0, 0.0],
    [0.8414709848, 0.0463992235, 0.0021544330],
    [0.9092974268, 0.0926985008, 0.0043088560],
]
COS_PAPER = [
    [1.0, 1.0, 1.0],
    [0.5403023059, 0.9989229760, 0.9999976792],
    [-0.4161468365, 0.9956942241, 0.9999907168],
]
# tensor2tensor / fairseq: base^(-i/(6/2 - 1)) = 1, 0.01, 0.0001.
SIN_T2T = [
    [0.0, 0.0, 0.0],
    [0.8414709848, 0.0099998333, 0.0001],
    [0.9092974268, 0.0199986667, 0.0002],
]
COS_T2T = [
    [1.0, 1.0, 1.0],
    [0.5403023059, 0.9999500004, 0.9999999950],
    [-0.4161468365, 0.9998000067, 0.9999999800],
]


def interleave(sin: list, cos: list) -> torch.Tensor:
    return torch.tensor(
        [
            [v for pair in zip(s, c, strict=True) for v in pair]
            for s, c in zip(sin, cos, strict=True)
        ]
    )


@pytest.mark.parametrize(
    ("layout", "want"),
    [
        ("interleaved", interleave(SIN_PAPER, COS_PAPER)),  # sin w0, cos w0, sin w1, ...
        ("concat", torch.cat((torch.tensor(SIN_T2T), torch.tensor(COS_T2T)), -1)),
        ("concat_marian", torch.cat((torch.tensor(SIN_PAPER), torch.tensor(COS_PAPER)), -1)),
    ],
)
def test_every_layout_by_hand(layout: str, want: torch.Tensor) -> None:
    got = sinusoid(torch.arange(3), 6, layout=layout)
    torch.testing.assert_close(got, want, atol=2e-7, rtol=0)


def test_concat_layouts_differ_at_d32_and_marian_is_interleaved_permuted() -> None:
    pos = torch.arange(20)
    inter = sinusoid(pos, 8)
    marian = sinusoid(pos, 8, layout="concat_marian")
    torch.testing.assert_close(marian, inter[:, [0, 2, 4, 6, 1, 3, 5, 7]])
    # the tensor2tensor table's slowest wavelength is 2 pi base exactly (i = d/2 - 1)
    concat = sinusoid(torch.tensor([10000.0 * math.pi / 2]), 32, layout="concat")
    assert concat[0, 15].item() == pytest.approx(1.0, abs=1e-6)
    far = torch.arange(512)
    diff = sinusoid(far, 32, layout="concat") - sinusoid(far, 32, layout="concat_marian")
    assert diff.abs().max() > 1.9  # issue #27: up to 1.91 apart at d = 32
    # d = 2: one frequency, 1, for every table (tensor2tensor's max(d/2 - 1, 1))
    for layout in ("interleaved", "concat", "concat_marian"):
        torch.testing.assert_close(
            sinusoid(pos, 2, layout=layout), torch.stack((pos.sin(), pos.cos()), -1).float()
        )


def test_sinusoidal_embed_adds_the_table_at_the_given_positions() -> None:
    enc = Sinusoidal(d_model=8, n_heads=2, n_layers=1, amplitude=1.0)
    x = torch.randn(2, 3, 8)
    pos = torch.tensor([[10, 11, 12]])
    torch.testing.assert_close(enc.embed(x, pos), x + sinusoid(pos, 8))
    with pytest.raises(ValueError, match="allowed: interleaved, concat, concat_marian"):
        Sinusoidal(d_model=8, n_heads=2, n_layers=1, layout="sin-cos")


@pytest.mark.parametrize("embed_scale", [False, True])
@pytest.mark.parametrize("d", [16, 64])
def test_sinusoidal_amplitude_follows_the_token_embeddings(embed_scale: bool, d: int) -> None:
    """``auto``: the raw table beside tokens scaled by sqrt(C) (the paper), the table
    times 128^-0.5 beside unscaled N(0, 0.02) tokens at any width (each position's
    vector of norm sqrt(C / 256), not sqrt(C / 2)); a number is used as given, whatever
    the tokens. In the decoder-only model and both stacks of the translator."""
    x, pos = torch.zeros(1, 3, d), torch.tensor([[0, 5, 9]])
    sizes = dict(d_model=d, n_heads=2, n_layers=1, embed_scale=embed_scale)
    model = DecoderLM(vocab_size=5, encoder="sinusoidal", **sizes)
    want = 1.0 if embed_scale else 1 / math.sqrt(128)
    torch.testing.assert_close(model.encoder.embed(x, pos), want * sinusoid(pos, d))
    norms = model.encoder.embed(x, pos).norm(dim=-1)
    torch.testing.assert_close(norms, torch.full((1, 3), math.sqrt(d / 2) * want))
    fixed = functools.partial(Sinusoidal, amplitude=0.5)
    model = DecoderLM(vocab_size=5, encoder=fixed, **sizes)
    torch.testing.assert_close(model.encoder.embed(x, pos), 0.5 * sinusoid(pos, d))
    mt = EncoderDecoder(src_vocab_size=5, tgt_vocab_size=5, encoder="sinusoidal", **sizes)
    for stack in (mt.encoder_stack, mt.decoder_stack):
        torch.testing.assert_close(stack.encoder.embed(x, pos), want * sinusoid(pos, d))


@pytest.mark.parametrize("amplitude", ["big", 0.0, -1.0])
def test_sinusoidal_refuses_a_bad_amplitude(amplitude: object) -> None:
    with pytest.raises(ValueError, match="amplitude"):
        Sinusoidal(d_model=8, n_heads=2, n_layers=1, amplitude=amplitude)


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
