"""Sections ``steps`` and ``flex`` of ``experiments/bench.py``: the training step a GPU
user gets, with and without ``model.compile=true`` (#34).

Notation: B batch, T length, H heads, S keys.

* ``steps``: every encoder's training step (``bench_train``'s: forward, loss, backward,
  clip, AdamW), under bf16 autocast on a GPU, as written (eager, the default) and with
  ``model.compile=true`` (``nn.Module.compile``, in place, as the tasks do), at each
  length with equal tokens per step. Per encoder and mode: tokens/s and the step's peak
  memory (on a GPU), each relative to ``none`` in the same mode and the same
  interleaved rounds, and the compiled step's speed relative to the eager one. With
  equal tokens per step, memory linear in T keeps the ratio to ``none`` flat from one
  length to the next; a ``(B, H, T, S)`` buffer would grow it with T.
* ``flex``: the schemes FlexAttention serves on a GPU (a score term, no value term:
  ALiBi, T5, FIRE, Transformer-XL, DeBERTa, Shaw without its value term, FoX), forced onto
  compiled FlexAttention (``Attention.backend = "flex"``) and onto the explicit path
  (``"explicit"``: SDPA with the dense term as its mask on a GPU), eager, relative to
  ``none``.

Both sections measure one encoder at a time, interleaved with ``none``, and hand each
row to ``on_row`` as soon as it is measured. The compilation (and FlexAttention's, on
first use) happens in the warm-up round, which is not timed.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from bench_common import Goal, Row, RowList, interleaved, summarise, sync
from bench_train import BASELINE, _stepper, make_model, random_batch
from torch import nn

from posenc.encoders import available
from posenc.model.attention import Attention

#: Encoders measured under another name: Shaw's key term alone is FlexAttention's form.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "shaw_no_value": ("shaw", {"value": False}),
    # Transformer-XL's position term inside one wider dot product (SDPA, no (T, S) term)
    "xl_fold": ("xl", {"fold": True}),
}
#: The schemes with a FlexAttention form (a score_mod, no value term).
FLEX = ["alibi", "t5", "fire", "xl", "deberta", "shaw_no_value", "fox"]
#: #34's goal for the default (eager) GPU path at the longest length: every score-term
#: scheme at >= 0.8x none's tokens/s.
FLEX_GOAL = Goal(">=", 0.8)
DTYPES = {"bf16": torch.bfloat16, "fp32": None}


def _build(
    encoder: str, model_cfg: dict[str, Any], vocab: int, device: torch.device, length: int
) -> tuple[nn.Module, torch.optim.Optimizer]:
    name, settings = VARIANTS.get(encoder, (encoder, {}))
    return make_model(name, model_cfg, vocab, device, length, **settings)


def _set_backend(model: nn.Module, backend: str) -> None:
    for m in model.modules():
        if isinstance(m, Attention):
            m.backend = backend


def peak_mib(fn: Callable[[], object], device: torch.device) -> float | None:
    """Peak memory of one call of ``fn`` above what was allocated before it, in MiB
    (a GPU's allocator statistics; None on a CPU, where the ``memory`` section
    measures)."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def _raise_recompile_limits() -> None:
    """Every compiled model of a process shares ``nn.Module._call_impl``'s compiled
    code, whose cache dynamo caps at 8 entries (past it, silently eager): one entry per
    model and shape here."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 256))
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 1024)


def _measure(
    models: dict[str, tuple[nn.Module, torch.optim.Optimizer]],
    ids: torch.Tensor,
    tgt: torch.Tensor,
    *,
    steps: int,
    rounds: int,
    device: torch.device,
    autocast: torch.dtype | None,
    baseline: str,
) -> tuple[dict[str, dict[str, Any]], dict[str, float | None]]:
    """Interleaved step times of ``models`` (the warm-up round compiles) and each one's
    peak step memory, measured after the timing. A model whose warm-up raises (a
    kernel that does not compile on this card, say) is left out of the rounds: its
    stats are ``{"failed": "<error>"}`` and the others are still measured; the
    baseline's failure is raised."""
    measure = {
        key: _stepper(model, opt, ids, tgt, steps, device, autocast)
        for key, (model, opt) in models.items()
    }
    failed: dict[str, dict[str, Any]] = {}
    for key in list(measure):  # the warm-up round, one model at a time
        try:
            measure[key]()
        except Exception as e:  # reported in the row; the others go on
            if key == baseline:
                raise
            failed[key] = {"failed": failure_text(e)}
            print(f"{key}: failed: {failed[key]['failed']}", file=sys.stderr, flush=True)
            del measure[key]
    stats: dict[str, dict[str, Any]] = interleaved(
        measure, baseline=baseline, rounds=rounds, warmup=0
    )
    peaks = {key: peak_mib(lambda f=f: f(), device) for key, f in measure.items()}
    stats.update(failed)
    peaks.update(dict.fromkeys(failed))
    return stats, peaks


def failure_text(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message that says
    something (Inductor wraps the cause in several lines of context)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    informative = [ln for ln in lines if "Error" in ln or "error" in ln] or lines or [""]
    return f"{type(e).__name__}: {informative[-1][:300]}"


def _ratio_to(stats: dict[str, dict[str, Any]], key: str, ref: str) -> float:
    """Median over rounds of ``ref``'s time over ``key``'s: ``key``'s speed vs ``ref``."""
    if "failed" in stats[ref] or "failed" in stats[key]:
        return math.nan
    pairs = zip(stats[ref]["times_s"], stats[key]["times_s"], strict=True)
    ratios = sorted(r / k for r, k in pairs)
    mid = len(ratios) // 2
    return ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2


def _row(
    what: str,
    stats: dict[str, dict[str, Any]],
    peaks: dict[str, float | None],
    key: str,
    ref: str,
    tokens: int,
    goal: Goal | None,
    extra: dict[str, Any] | None = None,
) -> Row:
    """One row: ``key``'s speed relative to ``ref`` (same rounds) and peak memory; a
    row without figures when either failed."""
    for name in (key, ref):
        if "failed" in stats[name]:
            return Row(
                what,
                None,
                None,
                None,
                note=f"{name} failed: {stats[name]['failed']}",
                raw={"failed": stats[name]["failed"]},
            )
    # The ratio and its spread against ``ref`` (``none`` in the same mode); the rounds'
    # own ratios are against the interleaving's baseline (eager ``none``).
    ratios = [r / k for r, k in zip(stats[ref]["times_s"], stats[key]["times_s"], strict=True)]
    s = summarise(stats[key]["times_s"], ratios)
    ratio = s["ratio"]
    s["tokens_per_s"] = tokens / s["median_s"]
    peak, ref_peak = peaks[key], peaks[ref]
    s["peak_mib"] = peak
    s["peak_ratio"] = None if peak is None or not ref_peak else peak / ref_peak
    s.update(extra or {})
    note = f"{tokens / s['median_s']:,.0f} tok/s"
    if peak is not None:
        note += f", peak {peak:,.0f} MiB ({s['peak_ratio']:.2f}x none)"
    return Row(what, s["median_s"], ratio, goal, note=note, raw=s)


def run_steps(
    *,
    model_cfg: dict[str, Any],
    vocab: int,
    shapes: list[tuple[int, int]],
    rounds: int,
    steps: int,
    dtype: str,
    modes: list[str],
    encoders: list[str] | None,
    device: torch.device,
    on_row: Callable[[Row], None] | None = None,
) -> dict[str, Any]:
    """Time every encoder's training step per shape, eager and compiled, interleaved.

    One encoder at a time, in rounds interleaved with ``none`` (whose models are built,
    and compiled, once per shape): each encoder's rows are final, and handed to
    ``on_row``, before the next one compiles, so a run stopped by a time limit keeps
    what it measured.

    Args:
        model_cfg: DecoderLM sizes.
        vocab: Vocabulary size.
        shapes: ``(batch, length)`` pairs with equal tokens per step.
        rounds: Measured rounds (after one warm-up round that compiles).
        steps: Training steps per measurement.
        dtype: ``bf16`` (autocast, on a GPU) or ``fp32``.
        modes: ``eager`` and/or ``compiled`` (``model.compile()``).
        encoders: Which (None: all registered); ``none`` is always added.
        device: Where to run.
        on_row: Called with each row as soon as it is measured.

    Returns:
        ``{"config", "baseline", "unit", "rows"}``; ratios are vs ``none`` in the same mode.
    """
    autocast = DTYPES[dtype] if device.type == "cuda" else None
    names = [BASELINE] + [e for e in encoders or available() if e != BASELINE]
    if "compiled" in modes:
        _raise_recompile_limits()
    rows = RowList(on_row)

    def build(enc: str, mode: str, length: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, opt = _build(enc, model_cfg, vocab, device, length)
        if mode == "compiled":
            model.compile()  # as model.compile=true does: in place, inductor
        return model, opt

    longest = max(t for _, t in shapes)
    for batch, length in shapes:
        ids, tgt = random_batch(batch, length, vocab, device, seed=length)
        base = {f"{mode}: {BASELINE}": build(BASELINE, mode, length) for mode in modes}
        for enc in names:
            models = dict(base)
            if enc != BASELINE:
                models.update({f"{mode}: {enc}": build(enc, mode, length) for mode in modes})
            stats, peaks = _measure(
                models,
                ids,
                tgt,
                steps=steps,
                rounds=rounds,
                device=device,
                autocast=autocast,
                baseline=f"{modes[0]}: {BASELINE}",
            )
            for mode in modes:
                key = f"{mode}: {enc}"
                flex_goal = (
                    mode == "eager" and length == longest and device.type == "cuda" and enc in FLEX
                )
                extra = {}
                vs_eager = math.nan
                if mode == "compiled" and "eager" in modes:
                    vs_eager = _ratio_to(stats, key, f"eager: {enc}")
                if not math.isnan(vs_eager):
                    extra["vs_eager"] = vs_eager
                rows.append(
                    _row(
                        f"{key} @ {batch}x{length}",
                        stats,
                        peaks,
                        key,
                        f"{mode}: {BASELINE}",
                        batch * length,
                        FLEX_GOAL if flex_goal else None,
                        extra,
                    )
                )
            del models
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del base
    return {
        "config": {
            "model": model_cfg,
            "vocab": vocab,
            "shapes_BT": shapes,
            "steps": steps,
            "dtype": dtype if autocast is not None else "fp32",
            "modes": modes,
        },
        "baseline": BASELINE,
        "unit": "seconds per step",
        "rows": list(rows),
    }


def run_flex(
    *,
    model_cfg: dict[str, Any],
    vocab: int,
    shape: tuple[int, int],
    rounds: int,
    steps: int,
    dtype: str,
    device: torch.device,
    on_row: Callable[[Row], None] | None = None,
) -> dict[str, Any]:
    """FlexAttention (forced) vs the explicit path, per scheme with a score_mod, eager:
    what decides :attr:`~posenc.encoders.base.AttentionPositional.flex_trains` (the
    default training path is the eager rows of the ``steps`` section). One scheme at a
    time, interleaved with ``none``; each row goes to ``on_row`` once measured.

    Returns:
        ``{"config", "baseline", "unit", "rows"}``; ratios are vs ``none``, and the flex
        rows' ``raw["vs_explicit"]`` is their speed relative to the explicit path.
    """
    autocast = DTYPES[dtype] if device.type == "cuda" else None
    batch, length = shape
    ids, tgt = random_batch(batch, length, vocab, device, seed=length)
    base = f"default: {BASELINE}"
    baseline_model = _build(BASELINE, model_cfg, vocab, device, length)
    # FlexAttention has no backward on a CPU (torch 2.13): only the explicit arms there.
    arms = ("flex", "explicit") if device.type == "cuda" else ("explicit",)
    rows = RowList(on_row)

    for i, enc in enumerate(FLEX):
        models = {base: baseline_model}
        for backend in arms:
            model, opt = _build(enc, model_cfg, vocab, device, length)
            _set_backend(model, backend)
            models[f"{backend}: {enc}"] = (model, opt)
        stats, peaks = _measure(
            models,
            ids,
            tgt,
            steps=steps,
            rounds=rounds,
            device=device,
            autocast=autocast,
            baseline=base,
        )
        if i == 0:
            rows.append(
                _row(f"{base} @ {batch}x{length}", stats, peaks, base, base, batch * length, None)
            )
        for backend in arms:
            key = f"{backend}: {enc}"
            extra = {}
            if backend == "flex":
                vs_explicit = _ratio_to(stats, key, f"explicit: {enc}")
                if not math.isnan(vs_explicit):
                    extra["vs_explicit"] = vs_explicit
            rows.append(
                _row(
                    f"{key} @ {batch}x{length}",
                    stats,
                    peaks,
                    key,
                    base,
                    batch * length,
                    None,
                    extra,
                )
            )
        del models
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "config": {
            "model": model_cfg,
            "vocab": vocab,
            "shape_BT": shape,
            "steps": steps,
            "dtype": dtype if autocast is not None else "fp32",
        },
        "baseline": base,
        "unit": "seconds per step",
        "rows": list(rows),
    }
