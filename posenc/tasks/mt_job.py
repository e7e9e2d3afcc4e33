"""The translation job: fit, decode the test set, score BLEU/chrF overall and by source length;
``metrics.json``, ``test.hyp.txt``, a figure, samples and HParams in the run directory."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from hydra.utils import instantiate
from matplotlib.figure import Figure
from pytorch_lightning.loggers import TensorBoardLogger

from posenc import schema
from posenc.data.mt import MTDataModule, restore_order
from posenc.data.sources import check_splits
from posenc.data.tokenizers import fingerprints, to_payload
from posenc.eval.bleu import corpus_scores, scores_by_bucket, signature
from posenc.plots import bleu_by_length_figure, close
from posenc.results import MetricName, MTRecord, names
from posenc.schema import Run, result_name
from posenc.tasks.mt import MTTask
from posenc.training import job
from posenc.training.callbacks import Throughput
from posenc.training.trainer import (
    init_from_checkpoint,
    load_for_eval,
    log_hparams,
    to_dict,
)

log = logging.getLogger(__name__)

LENGTH_PENALTY_DOC = "GNMT: hypotheses ranked by logprob / ((5 + |Y|) / 6) ** alpha, |Y| incl. EOS"


def mt_datamodule(cfg: Run[schema.MTTask]) -> MTDataModule:
    t = cfg.task
    return MTDataModule(
        source=instantiate(cfg.data.source),
        tokenizer=to_dict(cfg.tokenizer),
        cache_dir=cfg.paths.cache_dir,
        max_tokens=t.max_tokens,
        max_train_src_len=t.max_train_src_len,
        max_len=t.max_len,
        length_buckets=list(t.length_buckets),
        seed=cfg.seed,
    )


def mt_task(
    cfg: Run[schema.MTTask], dm: MTDataModule, tokenizer: tuple[str, ...] | None = None
) -> MTTask:
    """A new task (with ``init_from``'s weights, if set), or the one stored in
    ``cfg.ckpt_path`` for ``eval_only`` (checked against the tokenizer's fingerprint)."""
    if cfg.eval_only:  # config validation guarantees ckpt_path
        task = load_for_eval(MTTask, cfg, dm.vocab_size, tokenizer)
        task.set_output_cap(cfg.task.max_len)
        return task
    t = cfg.task
    task = MTTask(
        vocab_size=dm.vocab_size,
        encoder=to_dict(cfg.encoder),
        model=to_dict(cfg.model),
        optim=to_dict(t.optim),
        max_steps=cfg.trainer.max_steps,
        label_smoothing=t.label_smoothing,
        share_embeddings=t.share_embeddings,
        ids={"pad": dm.pad_id, "bos": dm.bos_id, "eos": dm.eos_id},
        val_bleu_sentences=t.val_bleu_sentences,
        max_len_a=t.decode.max_len_a,
        max_len_b=t.decode.max_len_b,
        max_len=t.max_len,
    )
    if cfg.init_from:
        init_from_checkpoint(task, cfg.init_from)
    return task


def run(cfg: Run[schema.MTTask], run_dir: Path) -> dict[str, Any]:
    """Translation: fit, then decode ``task.eval_split`` and score it."""
    dm = mt_datamodule(cfg)
    dm.setup("fit")
    check_splits("mt", [cfg.task.eval_split], dm.splits, cfg.data.get("name"))  # not after training
    split = cfg.task.eval_split
    tokenizer = fingerprints(dm.tokenizer)
    task = mt_task(cfg, dm, tokenizer)
    throughput = Throughput(key="tgt_in")  # target tokens (with padding) per second
    fitted = job.fit(cfg, run_dir, task, throughput, dm, tokenizer, to_payload(dm.tokenizer))
    d = cfg.task.decode
    task.configure_test(
        beam_size=d.beam_size,
        length_penalty=d.length_penalty,
        max_sentences=cfg.task.eval_max_sentences,
        use_cache=d.use_cache,
    )
    loader = dm.test_dataloader() if split == "test" else dm.val_dataloader()
    trainer = fitted.trainer
    t0 = time.perf_counter()
    trainer.test(task, dataloaders=loader, ckpt_path=fitted.best or None, verbose=False)
    decode_time = time.perf_counter() - t0
    loss = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")}
    return finish_mt(cfg, run_dir, dm, task, fitted, throughput, decode_time, loss)


def score(
    dm: MTDataModule, split: str, hyps: list[tuple[int, list[int]]]
) -> tuple[list[str], dict[str, float], dict[str, dict[str, float]]]:
    """Detokenize decoded ``(file index, ids)`` pairs and score them against the references.

    Returns:
        Hypotheses in file order, ``{"bleu", "chrf"}`` and the per-bucket scores (with n).
    """
    if not hyps:
        raise ValueError(f"no {split} sentence was decoded; check task.eval_max_sentences")
    index, ids = zip(*hyps, strict=True)
    text = restore_order(index, [dm.tokenizer.decode(x) for x in ids])
    n = len(text)
    refs = dm.references(split)[:n]
    overall = corpus_scores(text, refs)
    by_bucket = scores_by_bucket(text, refs, dm.source_lengths(split)[:n], dm.length_buckets)
    return text, overall, by_bucket


def finish_mt(
    cfg: Run[schema.MTTask],
    run_dir: Path,
    dm: MTDataModule,
    task: MTTask,
    fitted: job.Fitted,
    throughput: Throughput,
    decode_time: float,
    loss: dict[str, float],
) -> dict[str, Any]:
    """Score the decoded split; write metrics.json, test.hyp.txt, figure and TensorBoard."""
    split = cfg.task.eval_split
    hyps, overall, by_bucket = score(dm, split, task.test_hyps)
    metrics: dict[MetricName, float | None] = {
        MetricName.of(split, kind): overall[kind] for kind in ("bleu", "chrf")
    }
    for kind in ("bleu", "chrf"):
        for name, s in by_bucket.items():
            metrics[MetricName.of(split, kind, name)] = s[kind]
    # test/loss ..., then val/bleu, val/loss ...
    metrics |= names(dict(sorted((fitted.val | loss).items())))
    d = cfg.task.decode
    fields = MTRecord(
        encoder=result_name(cfg),
        encoder_class=cfg.encoder._target_.rsplit(".", 1)[-1],
        seed=cfg.seed,
        data=cfg.data.name,
        eval_split=split,
        n_sentences=len(hyps),
        metrics=metrics,
        buckets={name: int(s["n"]) for name, s in by_bucket.items()},
        bucket_doc="source length in tokens of the joint tokenizer; lenA-B is A <= n < B",
        bleu_signature=signature(),
        decode={
            "beam_size": d.beam_size,
            "length_penalty": d.length_penalty,
            "length_penalty_kind": LENGTH_PENALTY_DOC,
            "max_len": f"min({d.max_len_a} * source length + {d.max_len_b}, {task.max_out_cap})",
        },
        max_train_src_len=cfg.task.max_train_src_len,
        data_stats=dm.stats,
    )
    result = job.record(
        cfg,
        task,
        fitted,
        throughput,
        fields,
        decode_time=decode_time,
        throughput_kind="target tokens incl. padding, training steps only",
    )

    def files() -> None:
        _write_lines_atomic(run_dir / f"{split}.hyp.txt", hyps)
        fig = bleu_by_length_figure(
            by_bucket,
            dm.length_buckets,
            cfg.task.max_train_src_len,
            f"{result.encoder}: {split} BLEU",
        )
        fig.savefig(run_dir / "bleu_by_length.png", dpi=120)
        _tensorboard(fitted.trainer, cfg, dm, result, hyps, fig)

    message = f"{split} BLEU {overall['bleu']:.2f} chrF {overall['chrf']:.2f}"
    return job.write(run_dir, fitted.trainer, result, files, message)


def _write_lines_atomic(path: Path, lines: list[str]) -> None:
    """One hypothesis per line, through a temporary file: never a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    os.replace(tmp, path)


def _samples_markdown(
    sources: list[str], refs: list[str], hyps: list[str], lengths: list[int], k: int
) -> str:
    """A table of ``k`` translations spread evenly over source length, shortest first."""
    order = sorted(range(len(hyps)), key=lambda i: (lengths[i], i))
    step = (len(order) - 1) / max(1, k - 1)
    picks = list(dict.fromkeys(order[round(j * step)] for j in range(k))) if order else []

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| len | source | reference | hypothesis |", "|---|---|---|---|"]
    rows += [
        f"| {lengths[i]} | {cell(sources[i])} | {cell(refs[i])} | {cell(hyps[i])} |" for i in picks
    ]
    return "\n".join(rows)


def _tensorboard(
    trainer: pl.Trainer,
    cfg: Run[schema.MTTask],
    dm: MTDataModule,
    result: MTRecord,
    hyps: list[str],
    fig: Figure,
) -> None:
    """BLEU-by-length figure, sample translations, and HParams linked to the results."""
    logger = trainer.logger
    if not isinstance(logger, TensorBoardLogger):
        close(fig)
        return
    writer, step, split = logger.experiment, trainer.global_step, result.eval_split
    writer.add_figure(f"{split}/bleu_by_source_length", fig, step)  # closes the figure
    n = len(hyps)
    writer.add_text(
        f"{split}/samples",
        _samples_markdown(
            dm.sources(split)[:n],
            dm.references(split)[:n],
            hyps,
            dm.source_lengths(split)[:n],
            cfg.task.samples,
        ),
        step,
    )
    hparams = {
        "encoder": result.encoder,
        "task": "mt",
        "data": result.data,
        "n_params": result.n_params,
        "beam_size": cfg.task.decode.beam_size,
        "max_train_src_len": str(cfg.task.max_train_src_len),
    }
    log_hparams(trainer, cfg, hparams, result.metrics)
