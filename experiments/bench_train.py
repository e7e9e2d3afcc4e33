"""Section ``train`` of ``experiments/bench.py``: training-step throughput per encoder.

Notation: B batch, T sequence length, V vocabulary.

One step is forward, cross-entropy, backward, gradient-norm clipping at 1.0 (as
``conf/trainer/default.yaml`` sets) and an AdamW step, the work of one step of
``python run.py task=lm`` without Lightning around it. Tokens per step are equal
at every length, so steps/s ratios are tokens/s ratios.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from bench_common import Goal, Row, interleaved, per_call_seconds
from torch import Tensor, nn

from posenc.encoders import available, get
from posenc.model import DecoderLM
from posenc.training.optim import adamw_groups

BASELINE = "none"
# Issue 6: absolute schemes add one (B, T, C) add, RoPE two elementwise passes
# per layer, the relative schemes an explicit (T, S) score term. Issue 8's schemes
# get the goal of their family: xPos is RoPE with scaled tables; ALiBi, T5 and FIRE
# add a (T, S) score bias.
GOALS = {
    "learned": Goal(">=", 0.97),
    "sinusoidal": Goal(">=", 0.97),
    "rope": Goal(">=", 0.93),
    "xpos": Goal(">=", 0.93),
    "shaw": Goal(">=", 0.6),
    "xl": Goal(">=", 0.6),
    "deberta": Goal(">=", 0.6),
    "alibi": Goal(">=", 0.6),
    "t5": Goal(">=", 0.6),
    "fire": Goal(">=", 0.6),
}


def random_batch(
    batch: int, length: int, vocab: int, device: torch.device, seed: int
) -> tuple[Tensor, Tensor]:
    """Token ids and next-token targets, each ``(B, T)``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (batch, length + 1), generator=gen).to(device)
    return ids[:, :-1], ids[:, 1:]


def make_model(
    encoder: str,
    model_cfg: dict[str, Any],
    vocab: int,
    device: torch.device,
    train_length: int | None = None,
    **settings: Any,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A DecoderLM with ``encoder``'s registered defaults (and ``settings``) and posenc's
    AdamW groups.

    ``train_length``: FIRE's threshold L starts at the training length in a real run
    (``conf/encoder/fire.yaml``), so the benchmark sets it to the longest length it
    trains at instead of the class default; learned positions get a table that long
    when their default (1024) is shorter.
    """
    torch.manual_seed(0)
    if encoder == "fire" and train_length is not None:
        settings = {"threshold": float(train_length), **settings}
    if encoder == "learned" and train_length is not None and train_length > 1024:
        settings = {"max_len": train_length, **settings}
    factory: Any = functools.partial(get(encoder), **settings) if settings else encoder
    model = DecoderLM(vocab_size=vocab, encoder=factory, **model_cfg).to(device).train()
    opt = torch.optim.AdamW(adamw_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.99))
    return model, opt


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    ids: Tensor,
    tgt: Tensor,
    autocast: torch.dtype | None = None,
) -> None:
    """Forward, loss, backward, clip to norm 1.0, AdamW step; the forward and loss under
    ``autocast`` to that dtype when given (bf16 on a GPU, as a GPU run trains)."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=autocast, enabled=autocast is not None):
        logits = model(ids)  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def _stepper(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    ids: Tensor,
    tgt: Tensor,
    steps: int,
    device: torch.device,
    autocast: torch.dtype | None = None,
) -> Callable[[], float]:
    """A closure timing ``steps`` training steps; returns seconds per step."""
    return lambda: per_call_seconds(
        lambda: train_step(model, opt, ids, tgt, autocast), steps, device
    )


def supported(encoder: str, model: nn.Module, length: int) -> str:
    """Empty if the encoder can run ``length`` tokens, else the reason it cannot."""
    limit = model.encoder.max_length
    return "" if limit is None or length <= limit else f"max_length {limit} < T={length}"


def run(
    *,
    model_cfg: dict[str, Any],
    shapes: list[tuple[int, int]],
    vocab: int,
    rounds: int,
    steps: int,
    device: torch.device,
) -> dict[str, Any]:
    """Time ``steps`` training steps per encoder and shape, interleaved across encoders.

    Args:
        model_cfg: DecoderLM sizes (n_layers, d_model, n_heads, d_ff, dropout).
        shapes: ``(batch, length)`` pairs, all with the same ``batch * length``.
        vocab: Vocabulary size.
        rounds: Measured rounds (one warm-up round is added).
        steps: Training steps per measurement.
        device: Where to run.

    Returns:
        ``{"config", "baseline", "rows"}``.
    """
    encoders = [BASELINE] + [e for e in available() if e != BASELINE]
    longest = max(length for _, length in shapes)
    models = {e: make_model(e, model_cfg, vocab, device, longest) for e in encoders}
    rows: list[Row] = []
    for batch, length in shapes:
        ids, tgt = random_batch(batch, length, vocab, device, seed=length)
        measure: dict[str, Callable[[], float]] = {}
        skipped = {}
        for enc, (model, opt) in models.items():
            reason = supported(enc, model, length)
            if reason:
                skipped[enc] = reason
                continue
            measure[enc] = _stepper(model, opt, ids, tgt, steps, device)
        stats = interleaved(measure, baseline=BASELINE, rounds=rounds)
        tokens = batch * length
        for enc in encoders:
            what = f"{enc} @ {batch}x{length}"
            if enc in skipped:
                rows.append(Row(what, None, None, GOALS.get(enc), note=skipped[enc]))
                continue
            s = stats[enc]
            s["tokens_per_s"] = [tokens / t for t in s["times_s"]]
            note = f"{tokens / s['median_s']:,.0f} tok/s"
            rows.append(Row(what, s["median_s"], s["ratio"], GOALS.get(enc), note=note, raw=s))
    return {
        "config": {"model": model_cfg, "vocab": vocab, "shapes_BT": shapes, "steps": steps},
        "baseline": BASELINE,
        "unit": "seconds per step",
        "rows": rows,
    }
