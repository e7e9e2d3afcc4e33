"""The language-modeling job: fit, then perplexity at every evaluation length and
protocol; ``metrics.json``, figures and HParams in the run directory."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from hydra.utils import instantiate
from pytorch_lightning.loggers import TensorBoardLogger

from posenc import schema
from posenc.data.lm import LMDataModule
from posenc.data.passkey import passkey_problems
from posenc.data.samplers import ShardSampler
from posenc.data.sources import check_splits
from posenc.data.tokenizers import fingerprints, to_payload
from posenc.errors import refuse
from posenc.eval.lengths import PROTOCOLS, metric_name
from posenc.model.streaming import refusal
from posenc.plots import loss_by_position_figure, ppl_vs_length_figure
from posenc.results import LMRecord, MetricName, Passkey, names
from posenc.schema import Run, result_name
from posenc.tasks import lm_passkey
from posenc.tasks.lm import EvalExtension, Extension, LMTask, StreamingExtension
from posenc.training import checkpoints, gate, job
from posenc.training.callbacks import Throughput
from posenc.training.trainer import (
    init_from_checkpoint,
    load_for_eval,
    log_hparams,
    on_cpu,
    to_dict,
)

log = logging.getLogger(__name__)

PROTOCOL_DOC = {
    "nonoverlap": "ppl@L: non-overlapping windows of L tokens, every target token scored "
    "once, positions 0..L-1 in each window",
    "sliding": "ppl_sw@L: windows of L tokens advanced by the stride (default L/4); only the last "
    "`stride` targets of each window are scored (all in the first window), so "
    "each token is scored once with >= L - stride tokens of context",
}


EXTENSION_DOC = {
    "linear": "ppl+linear@L: position interpolation (Chen et al. 2023), angle m*theta_i -> "
    "(m/s)*theta_i",
    "ntk": "ppl+ntk@L: NTK-aware scaling (bloc97 2023; Peng et al. 2023 sec. 3.1), "
    "base -> base * s^(R/(R-2))",
    "dynamic_ntk": "ppl+dynamic_ntk@L: dynamic NTK (emozilla 2023; Peng et al. 2023 sec. 3.3), "
    "NTK with s' = max(1, alpha*l/L - (alpha-1)) at key length l > L, plain RoPE up to L",
    "yarn": "ppl+yarn@L: YaRN (Peng et al. 2023 sec. 3.4), NTK-by-parts frequencies and "
    "attention temperature sqrt(1/t) = 0.1 ln(s) + 1; ramp and temperature as "
    "encoder.yarn_ramp / encoder.yarn_temper say (default: the authors' code)",
    "streaming": "ppl+streaming@L: StreamingLLM (Xiao et al. 2024): each query attends to "
    "the first `sinks` tokens and the last `window` (task.eval.streaming), at positions "
    "re-indexed inside that cache as the paper does; for schemes whose scores depend on the "
    "query-key distance alone",
    "llama3": "ppl+llama3@L: Llama 3.1's frequency scaling, pairs with wavelength > "
    "L/low_freq_factor interpolated by s, < L/high_freq_factor kept, blended in between "
    "(encoder.low_freq_factor / encoder.high_freq_factor, default 1 and 4)",
}


def lm_datamodule(cfg: Run[schema.LMTask]) -> LMDataModule:
    t = cfg.task
    return LMDataModule(
        source=instantiate(cfg.data.source),
        tokenizer=to_dict(cfg.tokenizer),
        cache_dir=cfg.paths.cache_dir,
        seq_len=t.seq_len,
        batch_size=t.batch_size,
        eval_batch_size=t.eval_batch_size,
        eval_lengths=schema.eval_lengths(cfg.task),
        eval_max_tokens=t.eval.max_tokens,
        seed=cfg.seed,
        passkey_mix=float(t.passkey_mix),
        passkey_key_len=int(t.eval.passkey.key_len),
        passkey_answer_weight=float(t.passkey_answer_weight),
    )


def lm_task(
    cfg: Run[schema.LMTask], vocab_size: int, tokenizer: tuple[str, ...] | None = None
) -> LMTask:
    """A new task (with ``init_from``'s weights, if set), or the one stored in
    ``cfg.ckpt_path`` for ``eval_only`` (checked against the tokenizer's fingerprint)."""
    if cfg.eval_only:  # config validation guarantees ckpt_path
        task = load_for_eval(LMTask, cfg, vocab_size, tokenizer)
        trained = task.seq_len
        if cfg.task.eval.context_extension and trained != cfg.task.seq_len:
            log.warning(
                "context extension takes task.seq_len=%d as the original length, but the "
                "checkpoint was trained at %d; set task.seq_len=%d",
                cfg.task.seq_len,
                trained,
                trained,
            )
        return task
    task = LMTask(
        vocab_size=vocab_size,
        encoder=to_dict(cfg.encoder),
        model=to_dict(cfg.model),
        optim=to_dict(cfg.task.optim),
        max_steps=cfg.trainer.max_steps,
        seq_len=cfg.task.seq_len,
    )
    if cfg.init_from:
        init_from_checkpoint(task, cfg.init_from)
    return task


def passkey_settings(cfg: Run[schema.LMTask]) -> lm_passkey.Settings:
    """The passkey grid's settings (``task.eval.passkey``) and how it is decoded."""
    t, p = cfg.task, cfg.task.eval.passkey
    return lm_passkey.Settings(
        key_len=int(p.key_len),
        lengths=schema.passkey_lengths(t),
        depths=[float(d) for d in p.depths],
        samples=int(p.samples),
        seed=int(p.seed),
        measure_unlearned=bool(p.measure_unlearned),
        splits=list(t.eval.splits),
        seq_len=int(t.seq_len),
        batch_size=int(t.eval_batch_size),
    )


def run(cfg: Run[schema.LMTask], run_dir: Path) -> dict[str, Any]:
    """Language modeling: fit, then perplexity at every evaluation length and protocol."""
    dm = lm_datamodule(cfg)
    dm.setup("fit")
    check_splits("lm", cfg.task.eval.splits, dm.splits, cfg.data.get("name"))
    if not cfg.eval_only:
        dm.check_batch(on_cpu=on_cpu(cfg))
    mix = 0.0 if cfg.eval_only else cfg.task.passkey_mix
    passkey = passkey_settings(cfg)
    if passkey.lengths or mix:
        refuse(
            passkey_problems(
                passkey.lengths,
                passkey.format(dm.tokenizer).min_length(),
                {s: dm.lm_split_tokens(s).numel() for s in dm.splits},
                cfg.task.eval.splits,
                mix,
                cfg.task.seq_len,
            )
        )
    tokenizer = fingerprints(dm.tokenizer)
    task = lm_task(cfg, dm.vocab_size, tokenizer)
    throughput = Throughput()
    fitted = job.fit(
        cfg,
        run_dir,
        task,
        throughput,
        dm,
        tokenizer,
        to_payload(dm.tokenizer),
        [lm_passkey.PasskeyValidation(passkey, dm)] if mix else [],
    )
    trainer, best = fitted.trainer, fitted.best
    # Evaluation beyond the training context: one loader per (split, length, protocol,
    # context-extension method).
    names, lengths, extensions, loaders, skipped = eval_loaders(cfg, dm, task)
    task.set_eval_loaders(names, lengths, extensions)
    if loaders:
        trainer.test(task, dataloaders=loaders, ckpt_path=best or None, verbose=False)
    elif best:  # the passkey evaluation scores the best weights too
        task.load_state_dict(checkpoints.load(best)["state_dict"])
    verdict = gate.result(trainer, fitted.val)
    held = verdict.gate
    retrieves = verdict.learned if held is not None and held.metric == gate.PASSKEY else None
    progress = run_dir / lm_passkey.PROGRESS
    grid = lm_passkey.evaluate(
        passkey,
        dm,
        task.model,
        trainer.strategy.root_device,
        retrieves,
        progress,
        trainer.is_global_zero,
    )
    result = finish_lm(cfg, run_dir, task, fitted, throughput, skipped, grid)
    if trainer.is_global_zero:  # the rows are in metrics.json now
        progress.unlink(missing_ok=True)
    return result


def extension_setting(
    cfg: Run[schema.LMTask], method: str, length: int
) -> Extension | StreamingExtension:
    """The method's setting at evaluation length ``length``: original length
    ``task.seq_len``; ``extension_factor=auto`` gives ``s = max(1, length / seq_len)`` (and
    ``alpha = 1`` for ``dynamic_ntk``, whose ``s'`` then equals ``l / L``). ``streaming``:
    the sinks and window of ``task.eval.streaming``, the same at every length."""
    seq_len = cfg.task.seq_len
    if method == "streaming":
        s = cfg.task.eval.streaming
        return StreamingExtension(method, s.sinks, s.window_at(seq_len))
    factor = cfg.task.eval.extension_factor
    if factor == "auto":
        factor = 1.0 if method == "dynamic_ntk" else max(1.0, length / seq_len)
    return Extension(method, float(factor), int(seq_len))


def eval_loaders(
    cfg: Run[schema.LMTask], dm: LMDataModule, task: LMTask
) -> tuple[
    list[str], list[int], list[EvalExtension], list[torch.utils.data.DataLoader], dict[str, str]
]:
    """Names, lengths, extensions and loaders of the evaluation, and the skipped metrics
    with their reasons (lengths past a ``learned`` table, methods an encoder lacks,
    StreamingLLM where positions cannot be re-indexed)."""
    stride = cfg.task.eval.sliding_stride
    encoder = task.model.encoder
    limit, enc_name = encoder.max_length, type(encoder).__name__
    supported = encoder.scaling_methods
    no_streaming = refusal(task.model)
    methods = [None, *cfg.task.eval.context_extension]
    names, lengths, extensions, loaders, skipped = [], [], [], [], {}
    for split in cfg.task.eval.splits:
        for length in schema.eval_lengths(cfg.task):
            for protocol in cfg.task.eval.protocols:
                for method in methods:
                    name = metric_name(split, protocol, length, method)
                    if limit is not None and length > limit:
                        skipped[name] = (
                            f"encoder {enc_name} encodes at most {limit} "
                            f"positions; length {length} not evaluated"
                        )
                    elif method == "streaming" and no_streaming:
                        skipped[name] = f"streaming does not apply: {no_streaming}; not evaluated"
                    elif method not in (None, "streaming") and method not in supported:
                        skipped[name] = (
                            f"encoder {enc_name} has no context-extension method {method!r} "
                            f"(it supports: {', '.join(supported) or 'none'}); not evaluated"
                        )
                    if name in skipped:
                        log.warning("%s: %s", name, skipped[name])
                        continue
                    step = None if protocol == "nonoverlap" else (stride or max(1, length // 4))
                    names.append(name)
                    lengths.append(length)
                    extensions.append(
                        None if method is None else extension_setting(cfg, method, length)
                    )
                    windows = dm.eval_windows(split, length, step)
                    loaders.append(
                        torch.utils.data.DataLoader(
                            windows,
                            batch_size=cfg.task.eval_batch_size,
                            # Under DDP each window is scored on exactly one rank (no padding).
                            sampler=ShardSampler(windows),
                            num_workers=0,
                        )
                    )
    return names, lengths, extensions, loaders, skipped


def finish_lm(
    cfg: Run[schema.LMTask],
    run_dir: Path,
    task: LMTask,
    fitted: job.Fitted,
    throughput: Throughput,
    skipped: dict[str, str],
    passkey: tuple[dict[str, Any], dict[str, float], dict[str, str]] = ({}, {}, {}),
) -> dict[str, Any]:
    """Collect metrics; write metrics.json, figures and HParams (rank zero only).

    Args:
        passkey: :func:`posenc.tasks.lm_passkey.evaluate`'s block, metrics and skipped.
    """
    passkey_block, passkey_metrics, passkey_skipped = passkey
    not_run = names(skipped | passkey_skipped)
    metrics: dict[MetricName, float | None] = {n: float("nan") for n in not_run}
    metrics |= names(passkey_metrics)
    tokens: dict[MetricName, int] = {}
    by_position: dict[MetricName, list[float]] = {}
    for name, out in names(task.results).items():
        metrics[name] = float(out["ppl"])
        tokens[name] = int(out["tokens"])
        if name.kind == "ppl":  # non-overlapping windows, with or without a method
            by_position[name] = [round(float(x), 5) for x in out["loss_by_position"]]
    metrics = dict(sorted(metrics.items(), key=_metric_order)) | names(fitted.val)
    encoder = cfg.encoder._target_.rsplit(".", 1)[-1]
    fields = LMRecord(
        encoder=result_name(cfg),
        encoder_class=encoder,
        seed=cfg.seed,
        seq_len=cfg.task.seq_len,
        eval_lengths=schema.eval_lengths(cfg.task),
        protocols={p: PROTOCOL_DOC[p] for p in cfg.task.eval.protocols},
        context_extension={m: EXTENSION_DOC[m] for m in cfg.task.eval.context_extension},
        # Per metric: the method, s (alpha for dynamic_ntk) and original length L used;
        # for streaming, its sinks and window.
        extension_settings={
            MetricName(n): e._asdict()
            for n, e in zip(task.eval_names, task.eval_extensions, strict=True)
            if e is not None
        },
        metrics=metrics,
        scored_tokens=tokens,
        skipped=not_run,
        loss_by_position=by_position,
        passkey=Passkey(**passkey_block) if passkey_block else None,
    )
    result = job.record(cfg, task, fitted, throughput, fields)
    return job.write(
        run_dir, fitted.trainer, result, lambda: _tensorboard(fitted.trainer, cfg, result)
    )


def _metric_order(item: tuple[MetricName, float | None]) -> tuple[str, str, str, int]:
    """``test/ppl@128`` < ``test/ppl@1024`` < ``test/ppl+linear@128``: by split, protocol,
    context-extension method (plain first), then numeric length."""
    name = item[0]
    return name.split_name, name.kind, name.extension, name.length or 0


def _tensorboard(trainer: pl.Trainer, cfg: Run[schema.LMTask], result: LMRecord) -> None:
    """Perplexity-vs-length and loss-by-position figures, and HParams linked to results."""
    logger = trainer.logger
    if not isinstance(logger, TensorBoardLogger):
        return
    writer = logger.experiment
    seq_len = cfg.task.seq_len
    for split in cfg.task.eval.splits:
        curves: dict[str, dict[int, float]] = {}
        for name, value in result.metrics.items():
            length = name.length
            if name.split_name == split and length is not None and name.kind in PROTOCOLS.values():
                label = {v: k for k, v in PROTOCOLS.items()}.get(name.kind, name.kind)
                label += f"+{name.extension}" if name.extension else ""
                curves.setdefault(label, {})[length] = math.nan if value is None else value
        if curves:
            writer.add_figure(
                f"{split}/ppl_vs_length",
                ppl_vs_length_figure(curves, seq_len, f"{result.encoder}: {split} perplexity"),
                trainer.global_step,
            )
        # One figure per context-extension method (plain first), one curve per length.
        by_ext: dict[str, dict[str, list[float]]] = {}
        for name, curve in result.loss_by_position.items():
            if name.split_name == split:
                by_ext.setdefault(name.extension, {})[f"L={name.where}"] = curve
        for extension, pos in by_ext.items():
            suffix = f"+{extension}" if extension else ""
            writer.add_figure(
                f"{split}/loss_by_position{suffix}",
                loss_by_position_figure(
                    pos, seq_len, f"{result.encoder}{suffix}: {split} loss by position"
                ),
                trainer.global_step,
            )
    if result.passkey is not None:
        lm_passkey.tensorboard(
            writer, result.passkey, result.metrics, result.encoder, seq_len, trainer.global_step
        )
    hparams = {
        "encoder": result.encoder,
        "task": "lm",
        "seq_len": seq_len,
        "n_params": result.n_params,
    }
    log_hparams(trainer, cfg, hparams, result.metrics)
