"""The translation task's loss, and the attention directions it relies on, for every encoder."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from posenc.model import EncoderDecoder
from posenc.tasks.mt import label_smoothed_nll
from tests.conftest import BIDIRECTIONAL_YAMLS


def test_label_smoothed_loss_matches_a_hand_computation() -> None:
    eps = 0.1
    logits = torch.tensor([[[1.0, 2.0, 0.5], [0.3, -1.0, 4.0]]])  # (B=1, T=2, V=3)
    target = torch.tensor([[1, 0]])
    mask = torch.tensor([[True, False]])  # the second position is padding
    log_z = math.log(math.exp(1.0) + math.exp(2.0) + math.exp(0.5))
    nll = log_z - 2.0
    smooth = log_z - (1.0 + 2.0 + 0.5) / 3  # mean over the 3 classes of -log p
    loss, nll_sum = label_smoothed_nll(logits, target, mask, eps)
    assert float(nll_sum) == pytest.approx(nll, abs=1e-6)
    assert float(loss) == pytest.approx((1 - eps) * nll + eps * smooth, abs=1e-6)
    # ... and PyTorch's own label smoothing agrees, padding ignored.
    ref = F.cross_entropy(
        logits.flatten(0, 1),
        target.masked_fill(~mask, -100).flatten(),
        label_smoothing=eps,
        reduction="sum",
    )
    assert float(loss) == pytest.approx(float(ref), abs=1e-6)
    # No smoothing: the loss is the NLL.
    loss0, nll0 = label_smoothed_nll(logits, target, mask, 0.0)
    assert float(loss0) == pytest.approx(float(nll0), abs=1e-7)


def _model(encoder: str) -> EncoderDecoder:
    torch.manual_seed(0)
    return EncoderDecoder(
        src_vocab_size=20,
        tgt_vocab_size=20,
        encoder=encoder,
        n_layers=2,
        d_model=16,
        n_heads=2,
        d_ff=32,
        dropout=0.0,
    ).eval()


@pytest.mark.parametrize("encoder", BIDIRECTIONAL_YAMLS)
@torch.no_grad()
def test_encoder_is_bidirectional_and_decoder_causal(encoder: str) -> None:
    model = _model(encoder)
    src = torch.randint(4, 20, (1, 7))
    tgt = torch.randint(4, 20, (1, 6))
    memory = model.encode(src)
    # Encoder: changing the last source token changes the first position's output.
    src2 = src.clone()
    src2[0, -1] = 4 if src[0, -1] != 4 else 5
    assert not torch.allclose(model.encode(src2)[:, 0], memory[:, 0], atol=1e-5)
    # Decoder: changing target token 3 leaves positions 0-2 exactly as they were.
    logits = model.decode(tgt, memory)
    tgt2 = tgt.clone()
    tgt2[0, 3] = 4 if tgt[0, 3] != 4 else 5
    logits2 = model.decode(tgt2, memory)
    torch.testing.assert_close(logits2[:, :3], logits[:, :3], atol=1e-5, rtol=0)
    assert not torch.allclose(logits2[:, 3], logits[:, 3], atol=1e-5)


@pytest.mark.parametrize("encoder", BIDIRECTIONAL_YAMLS)
@torch.no_grad()
def test_source_padding_is_invisible(encoder: str) -> None:
    """Batched decoding relies on it: a padded source encodes and decodes as the bare one."""
    model = _model(encoder)
    src = torch.randint(4, 20, (1, 5))
    tgt = torch.randint(4, 20, (1, 4))
    padded = torch.cat([src, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    valid = padded != 0
    torch.testing.assert_close(
        model.encode(padded, valid)[:, :5], model.encode(src), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(model(padded, tgt, valid), model(src, tgt), atol=1e-5, rtol=0)
