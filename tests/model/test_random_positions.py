"""Randomized positional encodings (Ruoss et al. 2023): sorted random positions in
training, plain positions in evaluation, and every encoder honouring per-row positions."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from posenc.config import ConfigError
from posenc.model import DecoderLM, EncoderDecoder
from posenc.model.transformer import random_positions
from posenc.train import train
from tests.conftest import ENCODER_YAMLS, ROOT, compose_run

SIZES = dict(d_model=32, n_heads=4, n_layers=2)


def factory(name: str):
    return instantiate(OmegaConf.load(ROOT / "conf" / "encoder" / f"{name}.yaml"))


def test_draws_are_sorted_distinct_in_range_and_seeded() -> None:
    torch.manual_seed(3)
    p = random_positions(64, 20, 50)
    assert p.shape == (64, 20) and p.dtype == torch.int64
    assert (p[:, 1:] > p[:, :-1]).all()  # strictly increasing: sorted and distinct
    assert p.min() >= 0 and p.max() < 50
    assert len({tuple(r) for r in p.tolist()}) > 1  # rows draw independently
    # Every position of the range is drawn sometimes (uniform subset, not a prefix).
    assert torch.bincount(p.flatten(), minlength=50).min() > 0
    torch.manual_seed(3)
    assert torch.equal(p, random_positions(64, 20, 50))
    # Taking every position of the range leaves nothing to randomise.
    assert torch.equal(random_positions(2, 7, 7), torch.arange(7).expand(2, 7))


def test_range_smaller_than_the_sequence_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="random_positions=8 is smaller than the sequence length"):
        random_positions(1, 9, 8)


@pytest.mark.parametrize("name", ENCODER_YAMLS)
def test_per_row_positions_equal_one_row_at_a_time(name: str) -> None:
    """Random positions come as a (B, T) tensor: each row must be encoded at its own
    positions, exactly as if it were run alone."""
    model = DecoderLM(vocab_size=40, encoder=factory(name), **SIZES).eval()
    for n, p in model.named_parameters():  # make every positional parameter count
        if ".encoder." in n or ".pos." in n:
            torch.nn.init.normal_(p)
    ids = torch.randint(0, 40, (3, 10))
    torch.manual_seed(1)
    pos = random_positions(3, 10, 200)
    with torch.no_grad():
        together = model(ids, pos)
        alone = torch.cat([model(ids[b : b + 1], pos[b : b + 1]) for b in range(3)])
        plain = model(ids)
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    # the positions were used, unless the scheme declares it never reads them
    assert torch.allclose(together, plain, atol=1e-4) != model.encoder.uses_positions


def test_training_draws_positions_evaluation_uses_plain_ones() -> None:
    torch.manual_seed(0)
    model = DecoderLM(vocab_size=40, encoder="sinusoidal", random_positions=64, **SIZES)
    plain = DecoderLM(vocab_size=40, encoder="sinusoidal", **SIZES)
    plain.load_state_dict(model.state_dict())
    ids = torch.randint(0, 40, (2, 12))
    model.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), plain(ids))  # eval: 0 .. T-1
    model.train(), plain.train()  # dropout is 0, so only positions can differ
    with torch.no_grad():
        torch.manual_seed(5)
        drawn = random_positions(2, 12, 64)
        torch.manual_seed(5)
        out = model(ids)
        torch.testing.assert_close(out, plain(ids, drawn))
        assert not torch.allclose(out, plain(ids), atol=1e-4)


def test_causal_mask_holds_with_random_positions() -> None:
    model = DecoderLM(vocab_size=40, encoder="rope", random_positions=500, **SIZES).train()
    ids = torch.randint(0, 40, (2, 12))
    changed = ids.clone()
    changed[:, 7:] = (ids[:, 7:] + 1) % 40
    with torch.no_grad():
        torch.manual_seed(2)
        a = model(ids)
        torch.manual_seed(2)
        b = model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])


def test_translation_model_takes_the_option_in_both_stacks() -> None:
    model = EncoderDecoder(
        src_vocab_size=40,
        tgt_vocab_size=40,
        encoder="learned",
        random_positions=300,
        dropout=0.0,
        **SIZES,
    )
    assert model.encoder_stack.random_positions == model.decoder_stack.random_positions == 300
    src, tgt = torch.randint(0, 40, (2, 9)), torch.randint(0, 40, (2, 6))
    model(src, tgt).sum().backward()
    # Rows of the learned table far beyond the sequence length were trained.
    table = model.encoder_stack.encoder.table.weight.grad
    assert table[20:300].abs().sum() > 0 and table[300:].abs().sum() == 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.random_positions=8"], "model.random_positions=8: smaller than task.seq_len=16"),
        (["model.random_positions=0"], "model.random_positions=0: must be a positive integer"),
        (
            ["encoder=learned", "encoder.max_len=64", "model.random_positions=128"],
            "larger than encoder.max_len=64",
        ),
    ],
)
def test_bad_values_fail_before_training(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        train(compose_run(tmp_path, *overrides))


def _table(run: Path) -> torch.Tensor:
    """The learned position table of a run's last checkpoint, (max_len, C)."""
    state = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    return next(v for k, v in state.items() if k.endswith("encoder.table.weight"))


def test_tiny_lm_run_with_random_positions(tmp_path: Path) -> None:
    """Through the whole job: training with model.random_positions=256 draws positions
    up to 255, so rows 16..255 of the learned table train (they would not if the option
    were dropped on its way to the model), and rows from 256 on do not."""
    drawn = train(compose_run(tmp_path / "drawn", "encoder=learned", "model.random_positions=256"))
    plain = train(compose_run(tmp_path / "plain", "encoder=learned"))
    assert drawn["config"]["model"]["random_positions"] == 256
    a, b = _table(tmp_path / "drawn" / "run"), _table(tmp_path / "plain" / "run")
    assert not torch.allclose(a[16:256], b[16:256])  # same seed and init: only draws differ
    torch.testing.assert_close(a[256:], b[256:], rtol=0, atol=0)
    assert drawn["metrics"]["test/ppl@16"] != plain["metrics"]["test/ppl@16"]
    assert all(math.isfinite(v) for k, v in drawn["metrics"].items() if k.startswith("test/"))


def test_a_causal_only_encoder_in_translation_fails_before_any_data(tmp_path: Path) -> None:
    """Config checks make the attention hooks a task needs, so xPos (causal only) in a
    translation encoder is refused with its own message, not mid-run."""
    from hydra import compose, initialize_config_dir

    from posenc.config import validate

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "task=mt",
                "encoder=xpos",
                f"paths.output_dir={tmp_path}",
                f"paths.cache_dir={tmp_path}",
            ],
        )
    with pytest.raises(ConfigError, match="encoder: .*xpos.*causal"):
        validate(cfg)
