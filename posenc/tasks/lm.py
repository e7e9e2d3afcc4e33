"""Language modeling as a thin LightningModule around :class:`~posenc.model.DecoderLM`.

Notation: B batch, T window length, V vocabulary.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple, cast

import torch.nn.functional as F
from torch import Tensor, nn

from posenc.encoders.base import Scalable
from posenc.eval.lengths import TokenNLL, describe_metric
from posenc.model import DecoderLM
from posenc.model.streaming import Streaming
from posenc.training.module import TaskModule
from posenc.training.optim import check_finite

log = logging.getLogger(__name__)


class Extension(NamedTuple):
    """A context-extension method applied to one evaluation loader (RoPE ``scaled``)."""

    method: str
    factor: float
    original_length: int


class StreamingExtension(NamedTuple):
    """StreamingLLM applied to one evaluation loader: a mask and positions re-indexed
    inside the cache, for any scheme that allows it (:mod:`posenc.model.streaming`)."""

    method: str  # "streaming"
    sinks: int
    window: int


#: What one evaluation loader runs under: a RoPE scaling, StreamingLLM, or None (plain).
EvalExtension = Extension | StreamingExtension | None


class LMTask(TaskModule[DecoderLM]):
    """Train a decoder-only LM; evaluate perplexity on named windowed loaders.

    Args:
        vocab_size: Tokenizer vocabulary.
        encoder: The encoder's Hydra config (``_target_`` + ``_partial_``).
        model: Model sizes (``conf/model``); ``compile: true`` compiles the model
            (``torch.compile`` of its forward, in place: checkpoints keep their keys).
        optim: Optimiser settings (``task.optim``).
        max_steps: Length of the LR schedule.
        seq_len: Training context length.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        encoder: dict[str, Any],
        model: dict[str, Any],
        optim: dict[str, Any],
        max_steps: int,
        seq_len: int,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.seq_len = seq_len
        self.build_model(
            DecoderLM, encoder, model, optim=optim, max_steps=max_steps, vocab_size=vocab_size
        )
        self.val_nll = TokenNLL(seq_len)
        self.eval_metrics = nn.ModuleDict()  # loader name -> TokenNLL, set by set_eval_loaders
        self.eval_names: list[str] = []
        self.eval_extensions: list[EvalExtension] = []
        self.results: dict[str, dict[str, Tensor]] = {}

    def forward(self, ids: Tensor, positions: Tensor | None = None) -> Tensor:
        """Logits ``(B, T, V)``."""
        return self.model(ids, positions)

    def token_nll(self, batch: dict[str, Tensor]) -> Tensor:
        """Per-token negative log-likelihood ``(B, T)`` of ``batch['target']``."""
        logits = self(batch["input"])
        return F.cross_entropy(
            logits.float().flatten(0, 1), batch["target"].flatten(), reduction="none"
        ).view_as(batch["target"])

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Mean token NLL; with per-target ``weight`` (the passkey mix), the weighted mean."""
        nll = self.token_nll(batch)
        weight = batch.get("weight")
        loss = nll.mean() if weight is None else (nll * weight).sum() / weight.sum()
        check_finite(loss, self.global_step)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.val_nll.update(self.token_nll(batch), batch["loss_mask"])

    def on_validation_epoch_end(self) -> None:
        out = self.val_nll.compute()
        self.log("val/loss", out["loss"].float(), prog_bar=True)
        self.log("val/ppl", out["ppl"].float())
        self.val_nll.reset()

    @property
    def eval_labels(self) -> list[str]:
        """Per evaluation loader, what it evaluates (``test ppl@512 nonoverlap``): the
        progress display's names."""
        return [describe_metric(n) for n in self.eval_names]

    def set_eval_loaders(
        self,
        names: list[str],
        lengths: list[int],
        extensions: list[EvalExtension] | None = None,
    ) -> None:
        """Declare the evaluation loaders (in the order given to ``trainer.test``).

        Args:
            names: Metric name of each loader.
            lengths: Window length of each loader.
            extensions: Per loader, the context-extension method its forward passes run
                under, or None for the model as configured (the default for all).
        """
        self.eval_names = list(names)
        self.eval_extensions = list(extensions or [None] * len(names))
        if len(self.eval_extensions) != len(names):
            raise ValueError(
                f"{len(names)} loader names but {len(self.eval_extensions)} extensions"
            )
        self.eval_metrics = nn.ModuleDict(
            {
                n.replace("/", "|").replace("@", "_at_").replace(".", "_"): TokenNLL(L)
                for n, L in zip(names, lengths, strict=True)
            }
        ).to(self.device)
        self.results = {}

    def _metric(self, idx: int) -> TokenNLL:
        return cast(TokenNLL, list(self.eval_metrics.values())[idx])

    def _extension(self, idx: int) -> AbstractContextManager:
        """The encoder switched to loader ``idx``'s method for the ``with`` block; state is
        per loader and restored after every batch, so each rank of DDP does the same."""
        ext = self.eval_extensions[idx] if idx < len(self.eval_extensions) else None
        if ext is None:
            return nullcontext()
        if isinstance(ext, StreamingExtension):
            return self.model.streaming(Streaming(ext.sinks, ext.window))
        # Only schemes with scaling_methods get an extension (the LM job checks).
        encoder = cast(Scalable, self.model.encoder)
        return encoder.scaled(ext.method, ext.factor, ext.original_length)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        with self._extension(dataloader_idx):
            nll = self.token_nll(batch)
        self._metric(dataloader_idx).update(nll, batch["loss_mask"])

    def on_test_epoch_end(self) -> None:
        for i, name in enumerate(self.eval_names):
            out = self._metric(i).compute()
            self.results[name] = {k: v.detach().cpu() for k, v in out.items()}
            self.log(name, out["ppl"].float(), add_dataloader_idx=False)
            self._metric(i).reset()
