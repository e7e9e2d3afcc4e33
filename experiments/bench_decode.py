"""Section ``decode`` of ``experiments/bench.py``: decoding with and without the KV cache.

* LM: greedy generation of ``new`` tokens after a ``prompt``-token prompt, per encoder;
  the ratio is the cached run's tokens/s over the uncached one's (goal: >= 5x).
* MT: beam search (beam 4) over a batch of sources, cached vs uncached, with random
  weights (a trained model decodes shorter outputs; the work per token is the same).

Both runs of a pair produce the same tokens (checked before timing; on a GPU, where the
cached step's kernels differ from the full pass's in float32 rounding, a greedy choice
between two near-equal logits may flip, so a difference is reported in the row's note
instead of stopping the benchmark).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from bench_common import Goal, Row, RowList, interleaved
from bench_steps import failure_text

from posenc.decoding.encdec import beam_search, output_limits
from posenc.decoding.lm import generate
from posenc.encoders import available
from posenc.model import DecoderLM, EncoderDecoder

GOAL = Goal(">=", 5.0)


def _first_difference(a: torch.Tensor, b: torch.Tensor, prompt: int) -> int | None:
    """Index of the first new token where two generations differ, or None."""
    if torch.equal(a, b):
        return None
    return int((a != b).any(0).nonzero()[0, 0]) - prompt


@contextmanager
def _logged(name: str) -> Iterator[list[str]]:
    """The messages logger ``name`` writes at INFO and above inside the block."""
    seen: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(
    *,
    model_cfg: dict[str, Any],
    vocab: int,
    prompt: int,
    new: int,
    rounds: int,
    mt_sentences: int,
    encoders: list[str] | None,
    device: torch.device,
    on_row: Callable[[Row], None] | None = None,
) -> dict[str, Any]:
    """Time cached and uncached decoding; ratios are cached speed over uncached. Each
    row goes to ``on_row`` as soon as it is measured."""
    rows = RowList(on_row)
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    for enc in encoders or available():
        torch.manual_seed(0)
        model = DecoderLM(vocab_size=vocab, encoder=enc, **model_cfg).to(device).eval()
        runs = {
            c: (lambda c=c, m=model: generate(m, ids, new, temperature=0, use_cache=c))
            for c in (True, False)
        }
        # On a GPU the cached step is replayed from a CUDA graph; its eager step beside it.
        eager = (
            {"cached-eager": lambda m=model: generate(m, ids, new, temperature=0, graphs=False)}
            if device.type == "cuda"
            else {}
        )
        try:  # the first runs compile; one scheme's failure leaves the others measured
            differ = _first_difference(runs[True](), runs[False](), prompt)
        except Exception as e:  # reported in the row
            if device.type != "cuda":
                raise
            text = failure_text(e)
            print(f"decode {enc}: failed: {text}", file=sys.stderr, flush=True)
            what = f"cached: LM {enc}, {new} new after {prompt}"
            rows.append(Row(what, None, None, None, note=f"failed: {text}", raw={"failed": text}))
            continue
        if differ is not None and device.type != "cuda":
            raise AssertionError(f"{enc}: cached generation differs from uncached")
        measure = {
            "uncached": lambda f=runs[False]: _timed(f) / new,
            "cached": lambda f=runs[True]: _timed(f) / new,
            **{k: (lambda f=f: _timed(f) / new) for k, f in eager.items()},
        }
        for f in eager.values():
            f()  # its first run compiles what the graphs' run did not
        with _logged("posenc.decoding.graphs") as why_eager:
            runs[True]()  # says why, when its step cannot be replayed
        stats = interleaved(measure, baseline="uncached", rounds=rounds, warmup=0)
        for name in measure:
            s = stats[name]
            goal = GOAL if name == "cached" else None
            note = f"{1 / s['median_s']:,.0f} tok/s"
            if differ is not None:
                note += f"; tokens differ from new token {differ} on"
            if name == "cached" and why_eager:
                note += f"; {why_eager[-1]}"
            rows.append(
                Row(
                    f"{name}: LM {enc}, {new} new after {prompt}",
                    s["median_s"],
                    s["ratio"],
                    goal,
                    note=note,
                    raw=s,
                )
            )
    # MT: beam 4 over synthetic sources of 10-30 tokens.
    torch.manual_seed(0)
    mt = (
        EncoderDecoder(src_vocab_size=vocab, tgt_vocab_size=vocab, encoder="rope", **model_cfg)
        .to(device)
        .eval()
    )
    lengths = torch.randint(10, 31, (mt_sentences,))
    src = torch.randint(3, vocab, (mt_sentences, int(lengths.max()))).to(device)
    valid = (torch.arange(src.shape[1])[None] < lengths[:, None]).to(device)
    limit = output_limits(valid, max_len_a=1.2, max_len_b=10)
    kw = dict(beam_size=4, length_penalty=0.6, bos=1, eos=2, pad=0, max_len=limit)
    beams = {c: (lambda c=c: beam_search(mt, src, valid, use_cache=c, **kw)) for c in (True, False)}
    if beams[True]().tokens != beams[False]().tokens and device.type != "cuda":
        raise AssertionError("MT: cached beam search differs from uncached")
    stats = interleaved(
        {"uncached": lambda: _timed(beams[False]), "cached": lambda: _timed(beams[True])},
        baseline="uncached",
        rounds=rounds,
        warmup=0,
    )
    for name in ("uncached", "cached"):
        s = stats[name]
        rows.append(
            Row(
                f"{name}: MT rope, beam 4, {mt_sentences} sentences",
                s["median_s"],
                s["ratio"],
                None,
                note="",
                raw=s,
            )
        )
    return {
        "config": {
            "model": model_cfg,
            "vocab": vocab,
            "prompt": prompt,
            "new": new,
            "mt_sentences": mt_sentences,
        },
        "baseline": "uncached",
        "unit": "seconds per token (LM), per batch (MT)",
        "rows": list(rows),
    }
