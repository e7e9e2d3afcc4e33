"""Section ``compile`` of ``experiments/bench.py``: a training step, eager vs compiled.

Each encoder's ``DecoderLM`` is timed as written and under ``torch.compile`` (the same
weights, the same batch), interleaved; the ratio is the compiled step's speed relative
to the eager one. The compilation itself (warm-up) is not timed. On a 2-core CPU this
is reported, with no goal: ``torch.compile`` is for GPUs, where fused kernels and
fewer launches pay; here it shows that every encoder compiles and runs as one graph.
"""

from __future__ import annotations

from typing import Any

import torch
from bench_common import Row, interleaved
from bench_train import _stepper, make_model, random_batch

from posenc.encoders import available


def run(
    *,
    model_cfg: dict[str, Any],
    vocab: int,
    shape: tuple[int, int],
    rounds: int,
    steps: int,
    backend: str,
    encoders: list[str] | None,
    device: torch.device,
) -> dict[str, Any]:
    """Time eager and compiled training steps per encoder.

    Args:
        model_cfg: DecoderLM sizes.
        vocab: Vocabulary size.
        shape: ``(batch, length)``.
        rounds: Measured rounds per encoder (after one warm-up round that compiles).
        steps: Training steps per measurement.
        backend: ``torch.compile`` backend (``inductor`` generates code; ``eager`` only
            traces, for a quick check).
        encoders: Which encoders (None: all registered).
        device: Where to run.

    Returns:
        ``{"config", "baseline", "unit", "rows"}``.
    """
    batch, length = shape
    ids, tgt = random_batch(batch, length, vocab, device, seed=length)
    rows: list[Row] = []
    for enc in encoders or available():
        torch._dynamo.reset()
        model, opt = make_model(enc, model_cfg, vocab, device, length)
        compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
        measure = {
            "eager": _stepper(model, opt, ids, tgt, steps, device),
            "compiled": _stepper(compiled, opt, ids, tgt, steps, device),
        }
        stats = interleaved(measure, baseline="eager", rounds=rounds)
        for name in ("eager", "compiled"):
            s = stats[name]
            note = f"{batch * length / s['median_s']:,.0f} tok/s"
            rows.append(
                Row(
                    f"{name}: {enc} @ {batch}x{length}",
                    s["median_s"],
                    s["ratio"],
                    None,
                    note=note,
                    raw=s,
                )
            )
    return {
        "config": {
            "model": model_cfg,
            "vocab": vocab,
            "shape_BT": shape,
            "steps": steps,
            "backend": backend,
        },
        "baseline": "eager",
        "unit": "seconds per step",
        "rows": rows,
    }
