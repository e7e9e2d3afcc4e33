"""The algorithmic-task job: fit on sizes ``[lo, hi]``, then greedy-decode test instances
of every size up to ``test_multiple * hi`` (or of ``hi`` and its doublings; a tagged
problem is scored teacher-forced); the problem's metrics by size bucket and test variant in
``metrics.json``, TensorBoard and the terminal."""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.loggers import TensorBoardLogger

from posenc import schema
from posenc.data.algo import AlgoDataModule, bucket_name
from posenc.files import write_text_atomic
from posenc.plots import accuracy_vs_size
from posenc.results import AlgoRecord, BySize, MetricName, names
from posenc.schema import Run, result_name
from posenc.tasks.algo import EXAMPLES, AlgoTask, score
from posenc.training import job
from posenc.training.callbacks import Throughput
from posenc.training.trainer import (
    init_from_checkpoint,
    load_for_eval,
    log_hparams,
    to_dict,
)

log = logging.getLogger(__name__)

METRIC_DOC = {
    "seq_acc": "test/seq_acc@len<a>-<b>: % of test instances of size a..b whose greedy "
    "output is exactly the answer (ending with EOS); tagged problems: whose every label is "
    "predicted right from the true prefix",
    "acc": "test/acc@len<a>-<b>: % of answer tokens of those instances that the greedy output "
    "has right, position by position (tagged: % of labels right)",
    "read_err": "test/read_err@len<a>-<b>: % of read instructions whose bit the model "
    "predicts wrong, given the true prefix (Liu et al. 2023's error rate), over the reads of "
    "the instances of size a..b; read_err_sparse / read_err_dense: the same on the sparse "
    "(ignore probability 0.98) and dense (0.1) test strings",
}


def _ratio(num: float, den: float) -> float:
    return 100 * num / den if den else math.nan


#: Test metrics in percent from the sums of a size or bucket (instances ``count``, exact
#: ``exact``, scored tokens ``tokens``, right ones ``right``); a problem names the ones of
#: its tables (``Problem.metrics``), ``by_size`` holds them all.
METRICS: dict[str, Callable[[dict[str, float]], float]] = {
    "seq_acc": lambda s: _ratio(s["exact"], s["count"]),
    "acc": lambda s: _ratio(s["right"], s["tokens"]),
    "read_err": lambda s: _ratio(s["tokens"] - s["right"], s["tokens"]),
}


def metric_name(kind: str, variant: str) -> str:
    """``read_err`` of the sparse variant is ``read_err_sparse``; the training
    distribution's keeps the plain name."""
    return f"{kind}_{variant}" if variant else kind


def top_size(cfg: Run[schema.AlgoTask]) -> int:
    """The largest test size: ``test_multiple * hi``."""
    return int(math.floor(cfg.task.test_multiple * cfg.task.train_lengths[1]))


def datamodule(cfg: Run[schema.AlgoTask]) -> AlgoDataModule:
    t = cfg.task
    return AlgoDataModule(
        problem=t.problem,
        shape=t.shape,
        train_lengths=list(t.train_lengths),
        top=top_size(cfg),
        options=t.options(),
        batch_size=t.batch_size,
        eval_batch_size=t.eval_batch_size,
        steps=cfg.trainer.max_steps,
        val_per_size=t.val_per_size,
        test_per_size=t.test_per_size,
        seed=cfg.seed,
        test_grid=t.test_sizes,
        lm_loss=t.lm_loss,
    )


def vocab_fingerprints(dm: AlgoDataModule) -> tuple[str]:
    """What the checkpoint records in place of a tokenizer's fingerprints (one here)."""
    return (hashlib.sha256("\n".join(dm.vocab.tokens).encode()).hexdigest(),)


def algo_task(cfg: Run[schema.AlgoTask], dm: AlgoDataModule) -> AlgoTask:
    if cfg.eval_only:
        return load_for_eval(AlgoTask, cfg, len(dm.vocab), vocab_fingerprints(dm))
    task = AlgoTask(
        vocab_size=len(dm.vocab),
        encoder=to_dict(cfg.encoder),
        model=to_dict(cfg.model),
        optim=to_dict(cfg.task.optim),
        max_steps=cfg.trainer.max_steps,
        shape=cfg.task.shape,
        top_size=top_size(cfg),
        problem=cfg.task.problem,
    )
    if cfg.init_from:
        init_from_checkpoint(task, cfg.init_from)
    return task


def run(cfg: Run[schema.AlgoTask], run_dir: Path) -> dict[str, Any]:
    """Fit, then accuracy by instance size."""
    dm = datamodule(cfg)
    task = algo_task(cfg, dm)
    throughput = Throughput("input" if cfg.task.shape == "decoder" else "tgt_in")
    fitted = job.fit(cfg, run_dir, task, throughput, dm, vocab_fingerprints(dm))
    sizes = dm.test_sizes()
    log.info(
        "testing sizes %s (%d instance%s each%s), %s",
        f"{sizes[0]}..{sizes[-1]}" if dm.grid == "every" else ", ".join(map(str, sizes)),
        cfg.task.test_per_size,
        "" if cfg.task.test_per_size == 1 else "s",
        f" of {len(dm.problem.variants)} variants" if len(dm.problem.variants) > 1 else "",
        "teacher-forced" if dm.problem.tagged else "greedy decoding",
    )
    task.example_sizes = example_sizes(dm, int(cfg.task.bucket_width))
    fitted.trainer.test(task, datamodule=dm, ckpt_path=fitted.best or None, verbose=False)
    return finish(cfg, run_dir, dm, task, fitted, throughput)


def by_size(
    results: dict[str, Any], sizes: list[int], kinds: tuple[str, ...] = ("seq_acc", "acc")
) -> BySize:
    """Per size: instances, ``seq_acc`` and ``acc`` and the other ``kinds`` (percent)."""
    out = {}
    for n in sizes:
        part = {k: float(v[n]) for k, v in results.items()}
        row: dict[str, float] = {"count": int(part["count"])}
        for kind in dict.fromkeys(("seq_acc", "acc", *kinds)):
            row[kind] = METRICS[kind](part)
        out[n] = row
    return out


def bucket_metrics(
    results: dict[str, Any],
    ranges: list[tuple[int, int]],
    kinds: tuple[str, ...] = ("seq_acc", "acc"),
    variant: str = "",
) -> dict[MetricName, float | None]:
    """``test/<kind>@len<a>-<b>`` (percent) per bucket and kind (``<kind>_<variant>`` for
    a test variant): sums over the sizes of the bucket, so every instance weighs the same."""
    metrics: dict[MetricName, float | None] = {}
    for a, b in ranges:
        part = {k: float(v[a : b + 1].sum()) for k, v in results.items()}
        for kind in kinds:
            name = MetricName.of("test", metric_name(kind, variant), bucket_name((a, b)))
            metrics[name] = METRICS[kind](part)
    return metrics


def variant_pairs(dm: AlgoDataModule) -> dict[str, int]:
    """Key-value pairs of each test variant, for a problem that varies them (mqar)."""
    pairs = dm.problem.pairs
    if pairs is None:
        return {}
    return {v: pairs(replace(dm.options, variant=v)) for v in dm.problem.variants}


def finish(
    cfg: Run[schema.AlgoTask],
    run_dir: Path,
    dm: AlgoDataModule,
    task: AlgoTask,
    fitted: job.Fitted,
    throughput: Throughput,
) -> dict[str, Any]:
    """Collect metrics; write metrics.json, the figure and HParams (rank zero only)."""
    t = cfg.task
    lo, hi = (int(x) for x in t.train_lengths)
    problem = dm.problem
    ranges = dm.buckets(int(t.bucket_width))
    metrics: dict[MetricName, float | None] = {}
    for variant in problem.variants:
        metrics |= bucket_metrics(task.results[variant], ranges, problem.metrics, variant)
    metrics |= names(fitted.val)
    sizes = dm.test_sizes()
    kinds = tuple(dict.fromkeys(("seq_acc", "acc", *problem.metrics)))  # by_size's
    fields = AlgoRecord(
        problem=t.problem,
        shape=t.shape,
        encoder=result_name(cfg),
        encoder_class=cfg.encoder._target_.rsplit(".", 1)[-1],
        seed=cfg.seed,
        train_lengths=[lo, hi],
        size_means=problem.size,
        source=problem.paper,
        test_sizes=dm.grid,
        buckets=[bucket_name(r) for r in ranges],
        metric_doc={k: METRIC_DOC[k] for k in kinds},
        table_metrics=[metric_name(k, v) for v in problem.variants for k in problem.metrics],
        metrics=metrics,
        by_size=by_size(task.results[""], sizes, kinds),
        by_size_variants={v: by_size(task.results[v], sizes, kinds) for v in problem.variants if v},
        variant_pairs=variant_pairs(dm),
    )
    result = job.record(cfg, task, fitted, throughput, fields)

    def files() -> dict[str, Path]:
        _tensorboard(fitted.trainer, cfg, result)
        if not task.examples:
            return {}
        path = run_dir / EXAMPLES_FILE
        try:
            write_text_atomic(path, examples_text(result, task, dm))
        except OSError as err:  # the results are written; the examples only show them
            log.warning("%s not written: %s", path, err)
            return {}
        return {"examples": path}

    return job.write(run_dir, fitted.trainer, result, files)


#: The run's example answers, beside metrics.json.
EXAMPLES_FILE = "examples.md"
#: Sizes whose examples a run shows when it tests more (then: each size bucket's ends).
EXAMPLE_SIZES = 48
#: Tokens shown of a longer input, answer or output: half from each end.
SHOWN_TOKENS = 64


def example_sizes(dm: AlgoDataModule, width: int) -> set[int]:
    """The test sizes ``examples.md`` shows: every one, or, past :data:`EXAMPLE_SIZES`,
    the first and last of each size bucket (the buckets of ``metrics.json``)."""
    sizes = dm.test_sizes()
    if len(sizes) <= EXAMPLE_SIZES:
        return set(sizes)
    return {n for lo, hi in dm.buckets(width) for n in (lo, hi)} & set(sizes)


def _shown(tokens: list[str]) -> str:
    """A code span of ``tokens`` (``(empty)`` for none) that a markdown table keeps in
    one cell: newline, space, ``|`` and backtick tokens drawn as other signs, and the
    middle of a long sequence left out."""
    if not tokens:
        return "(empty)"
    signs = {"\n": "⏎", " ": "␣", "|": "\\|", "`": "'"}
    marks = [signs.get(t, t) for t in tokens]
    if len(marks) > SHOWN_TOKENS:
        half = SHOWN_TOKENS // 2
        marks = [*marks[:half], f"…({len(marks) - 2 * half} more)…", *marks[-half:]]
    return f"`{' '.join(marks)}`"


def examples_text(result: AlgoRecord, task: AlgoTask, dm: AlgoDataModule) -> str:
    """``examples.md``: the greedy outputs of the first test instances of each size beside
    their answers, to see how a run fails past training (an answer cut short, one token
    too many, right digits in the wrong place), not only how often."""
    lo, hi = result.train_lengths
    variants = dm.problem.variants
    lines = [
        f"# Greedy answers: {result.problem}, `{result.encoder}`, seed {result.seed}",
        "",
        f"Trained on sizes {lo}..{hi}; sizes above {hi} are past training. The first "
        f"{EXAMPLES} test instances of each size shown: the input, the answer, the model's "
        "greedy output (its tokens before the end token; `(empty)`: it ended at once) and "
        "the answer tokens it has right, position by position. Sequences longer than "
        f"{SHOWN_TOKENS} tokens are shown by their two ends.",
        "",
        "| size | input | answer | output | right |",
        "|---|---|---|---|---|",
    ]
    tokens = dm.vocab.tokens
    for ex in task.examples:
        exact, right = score(ex.output, ex.answer)
        size = f"{ex.size} ({variants[ex.variant]})" if variants[ex.variant] else str(ex.size)
        cells = [_shown([tokens[i] for i in ids]) for ids in (ex.prompt, ex.answer, ex.output)]
        lines.append(
            f"| {size} | {' | '.join(cells)} | "
            f"{right}/{len(ex.answer)}{' (exact)' if exact else ''} |"
        )
    return "\n".join(lines) + "\n"


def _tensorboard(trainer: pl.Trainer, cfg: Run[schema.AlgoTask], result: AlgoRecord) -> None:
    logger = trainer.logger
    if not isinstance(logger, TensorBoardLogger):
        return
    # The report's figure, with this run as the one curve of each panel.
    panels = {
        k: {result.encoder: {n: (row[k], None) for n, row in result.by_size.items()}}
        for k in ("seq_acc", "acc")
    }
    title = f"{result.encoder}: {result.problem} ({result.shape})"
    lo, hi = result.train_lengths
    figure = accuracy_vs_size(panels, (lo, hi), title)
    logger.experiment.add_figure("test/accuracy_vs_size", figure, trainer.global_step)
    hparams = {
        "encoder": result.encoder,
        "task": "algo",
        "problem": result.problem,
        "shape": result.shape,
        "n_params": result.n_params,
    }
    log_hparams(trainer, cfg, hparams, result.metrics)
