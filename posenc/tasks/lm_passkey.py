"""The LM job's passkey-retrieval evaluation (:mod:`posenc.eval.passkey`): one grid of
accuracy by length and depth per evaluated split, ``<split>/passkey@L`` scalars (mean
over depths), and their TensorBoard scalars and heatmap; and, for a run trained on the
passkey mix, ``val/passkey`` (at the training length) at every validation
(:class:`PasskeyValidation`), the metric of the passkey learnability gate
(:mod:`posenc.training.gate`).

The grid is the longest part of a run evaluated at 16x on a CPU: each length it finishes
is kept in the run folder (:data:`PROGRESS`, removed once ``metrics.json`` is written),
so a run stopped during it and resumed (``resume=true``) scores only the lengths left."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from posenc.data.lm import LMDataModule
from posenc.data.passkey import DOC, PasskeyFormat
from posenc.data.tokenizers import Tokenizer
from posenc.eval.passkey import evaluate_length, greedy
from posenc.files import write_text_atomic
from posenc.model import DecoderLM
from posenc.plots import heatmap_figure
from posenc.results import MetricName, Metrics, Passkey
from posenc.training.digests import weights
from posenc.training.gate import PASSKEY

log = logging.getLogger(__name__)


def metric_name(split: str, length: int) -> MetricName:
    """``test/passkey@512``: accuracy at length 512, mean over depths."""
    return MetricName.of(split, "passkey", length)


@dataclass(frozen=True)
class Settings:
    """What the passkey evaluation and :class:`PasskeyValidation` read from the run (the
    LM job reads them: :func:`posenc.tasks.lm_job.passkey_settings`).

    Attributes:
        key_len: Letters per key (``task.eval.passkey.key_len``).
        lengths: The grid's lengths in tokens (empty: the evaluation is off).
        depths: The needle's relative depths.
        samples: Instances per cell.
        seed: The instances' seed.
        measure_unlearned: Evaluate beyond the training length a run that missed its
            passkey gate.
        splits: The evaluated splits (``task.eval.splits``).
        seq_len: The training length (``task.seq_len``).
        batch_size: Instances decoded at once (``task.eval_batch_size``).
    """

    key_len: int
    lengths: list[int]
    depths: list[float]
    samples: int
    seed: int
    measure_unlearned: bool
    splits: list[str]
    seq_len: int
    batch_size: int

    def format(self, tokenizer: Tokenizer) -> PasskeyFormat:
        """The passkey format with ``tokenizer`` (raises as :class:`PasskeyFormat` does)."""
        return PasskeyFormat(tokenizer, self.key_len)


#: The file in a run folder that keeps the passkey lengths scored so far (:class:`Finished`).
PROGRESS = "passkey_progress.json"


class Finished:
    """The passkey rows (accuracy by depth, by metric name) a run has scored so far, kept in
    ``path`` after each length and read back only for the same weights and settings.

    Args:
        path: The file (None: nothing is kept).
        model: The evaluated model (its weights' digest keys the file).
        settings: The grid's settings (they key the file too).
        write: Whether this process writes the file (rank zero; every rank reads it).
    """

    def __init__(
        self, path: Path | None, model: DecoderLM, settings: Settings, write: bool
    ) -> None:
        self.path, self.write = path, write
        self.rows: dict[str, list[float]] = {}
        if path is None:
            return
        self.key = {"weights": weights(model), "settings": dataclasses.asdict(settings)}
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # none, or cut short
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict) and data.get("key") == self.key:
                self.rows = dict(data["rows"])

    def add(self, name: str, row: list[float]) -> None:
        """Keep ``row``; a file that cannot be written costs only the resumption."""
        self.rows[name] = row
        if self.path is None or not self.write:
            return
        try:
            write_text_atomic(self.path, json.dumps({"key": self.key, "rows": self.rows}))
        except OSError as err:
            log.warning("%s not written (%s): a resumed run would score it again", name, err)


def evaluate(
    settings: Settings,
    dm: LMDataModule,
    model: DecoderLM,
    device: torch.device,
    learned: bool | None = None,
    progress: Path | None = None,
    write: bool = True,
) -> tuple[dict[str, Any], dict[str, float], dict[str, str]]:
    """Run the passkey grid of every evaluated split.

    Lengths the encoder cannot run (``learned`` past ``max_len``) get NaN cells and a
    reason under ``skipped``, like the perplexity columns; so do lengths past
    ``task.seq_len`` when the run missed its passkey gate (``learned`` False), unless
    ``task.eval.passkey.measure_unlearned``: a model that does not retrieve at the
    training length says nothing about retrieval beyond it, and decoding at 16x is the
    longest part of such a run.

    Args:
        settings: The grid and how it is decoded.
        dm: The set-up data module (tokenizer, split streams).
        model: The LM to evaluate (put in eval mode and moved to ``device`` here).
        device: Where decoding runs.
        learned: Whether the run met its passkey gate (``task.learned.metric`` =
            ``val/passkey``) at its last validation; None: no such gate, or not
            validated (``eval_only``).
        progress: Where the lengths scored so far are kept (:class:`Finished`): those it
            holds for these weights and settings are not scored again.
        write: Whether this process writes ``progress`` (rank zero).

    Returns:
        ``(block, metrics, skipped)``: the ``passkey`` entry of ``metrics.json`` (empty when
        the evaluation is off), the ``<split>/passkey@L`` scalars, the skipped metrics with
        their reasons.
    """
    s, lengths = settings, settings.lengths
    if not lengths:
        return {}, {}, {}
    depths = s.depths
    fmt = s.format(dm.tokenizer)
    model = model.to(device).eval()
    limit, enc_name = model.encoder.max_length, type(model.encoder).__name__
    unlearned = learned is False and not s.measure_unlearned
    finished = Finished(progress, model, s, write)
    metrics: dict[str, float] = {}
    skipped: dict[str, str] = {}
    grids: dict[str, list[list[float]]] = {}
    for split in s.splits:
        stream = dm.lm_split_tokens(split)
        rows = []
        for length in lengths:
            name = metric_name(split, length)
            reason = None
            if unlearned and length > s.seq_len:
                reason = (
                    "the run missed its passkey gate (task.learned); "
                    f"length {length} not evaluated (task.eval.passkey.measure_unlearned=true "
                    "measures it)"
                )
            elif limit is not None and length > limit:
                reason = (
                    f"encoder {enc_name} encodes at most {limit} positions; "
                    f"length {length} not evaluated"
                )
            if reason:
                skipped[name] = reason
                log.warning("%s: %s", name, skipped[name])
                rows.append([math.nan] * len(depths))
                metrics[name] = math.nan
                continue
            acc = finished.rows.get(name)
            kept = acc is not None
            if acc is None:
                acc = evaluate_length(
                    greedy(model),
                    fmt,
                    stream,
                    length,
                    depths,
                    samples=s.samples,
                    seed=s.seed,
                    batch_size=s.batch_size,
                    device=device,
                    log=partial(log.info, "%s %s", split),  # log(line): "<split> <line>"
                )
                finished.add(name, acc)
            rows.append(acc)
            metrics[name] = sum(acc) / len(acc)
            log.info(
                "%s = %.3f (by depth %s)%s",
                name,
                metrics[name],
                " ".join(f"{a:.2f}" for a in acc),
                f", kept from the stopped evaluation ({PROGRESS})" if kept else "",
            )
        grids[split] = rows
    block = {
        "doc": DOC,
        "key_len": fmt.key_len,
        "samples": s.samples,
        "seed": s.seed,
        "lengths": lengths,
        "depths": depths,
        "accuracy": grids,  # split -> [length][depth]
    }
    return block, metrics, skipped


def tensorboard(
    writer: Any,
    block: Passkey,
    metrics: Metrics,
    encoder: str,
    seq_len: int,
    step: int,
) -> None:
    """The ``<split>/passkey@L`` scalars and a length x depth heatmap per split."""
    for name, value in metrics.items():
        if (
            name.kind == "passkey"
            and not name.extension
            and name.where
            and value is not None
            and math.isfinite(value)
        ):
            writer.add_scalar(name, value, step)
    for split, grid in block.accuracy.items():
        fig = heatmap_figure(
            grid, block.lengths, block.depths, seq_len, f"{encoder}: {split} passkey accuracy"
        )
        writer.add_figure(f"{split}/passkey", fig, step)


class PasskeyValidation(pl.Callback):
    """Passkey retrieval at the training length on the validation split, logged as
    ``val/passkey`` (mean over depths, in [0, 1]) at every validation: the
    instances of the test grid's settings (``task.eval.passkey``: depths, samples, seed,
    key length), with filler from the validation text, decoded greedily with the cache.

    Args:
        settings: The grid's settings (depths, samples, seed, key length, training length,
            batch size).
        dm: The set-up data module.
    """

    def __init__(self, settings: Settings, dm: LMDataModule) -> None:
        self.fmt = settings.format(dm.tokenizer)
        self.stream = dm.lm_split_tokens("val")
        self.length = settings.seq_len
        self.depths = settings.depths
        self.samples, self.seed = settings.samples, settings.seed
        self.batch_size = settings.batch_size

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        acc = evaluate_length(
            greedy(pl_module.model),  # type: ignore[arg-type]  # LMTask.model: a DecoderLM
            self.fmt,
            self.stream,
            self.length,
            self.depths,
            samples=self.samples,
            seed=self.seed,
            batch_size=self.batch_size,
            device=pl_module.device,
        )
        # The same instances and weights on every rank: the same value, no sync needed.
        pl_module.log(PASSKEY, sum(acc) / len(acc))
