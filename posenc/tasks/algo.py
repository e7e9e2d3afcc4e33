"""Algorithmic tasks (:mod:`posenc.data.algo`) as a LightningModule, in either model shape.

Notation: B instances, P prompt length, A answer length (EOS not counted), V vocabulary.

Training and validation are teacher-forced cross-entropy over the answer tokens and their
EOS (``val/acc``: the share of those tokens whose argmax is right; ``val/seq_acc``: the
share of instances whose every answer token and EOS is the argmax, which is greedy
decoding's exact match, since greedy then sees the right prefix at every step). Testing
greedy-decodes every instance with the key/value cache and scores it by size ``n``:

- ``seq_acc``: the output equals the answer exactly (and ends there, with EOS);
- ``acc``: the share of answer positions whose output token is right.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.aggregation import SumMetric

from posenc.data.algo import BOS, EOS, PAD
from posenc.model import DecoderLM, EncoderDecoder, count_parameters
from posenc.tasks.decode import greedy
from posenc.tasks.generate import generate
from posenc.tasks.optim import check_finite, configure_adamw

SHAPES = ("decoder", "encdec")
Batch = dict[str, Tensor]
#: Validation sums (over ranks): loss, right tokens, tokens, exact instances, instances.
VAL_SUMS = ("loss", "right", "tokens", "exact", "count")


def exact_rows(hit: Tensor, mask: Tensor) -> Tensor:
    """``(B,)`` bool: every answer position of the row (``mask``) has its argmax right
    (``hit``); rows without answer positions (padding) are not exact.

    Args:
        hit: ``(B, T)`` bool, argmax equals the target.
        mask: ``(B, T)`` bool, the answer tokens and EOS.
    """
    return (hit | ~mask).all(-1) & mask.any(-1)


def score(output: Sequence[int], answer: Sequence[int]) -> tuple[bool, int]:
    """Exact match, and how many answer positions the output has right.

    Args:
        output: The generated ids before the first EOS (all of them if there was none).
        answer: The reference ids, without EOS.
    """
    return list(output) == list(answer), sum(o == a for o, a in zip(output, answer, strict=False))


def until_eos(ids: Sequence[int]) -> list[int]:
    """The ids before the first EOS (all of them if there is none)."""
    ids = list(ids)
    return ids[: ids.index(EOS)] if EOS in ids else ids


class LengthAccuracy(Metric):
    """Sums by instance size ``0 .. top``: instances, exact matches, answer tokens and
    right tokens (reduced by ``sum`` across ranks).

    Args:
        top: The largest size scored.
    """

    full_state_update = False
    count: Tensor
    exact: Tensor
    tokens: Tensor
    right: Tensor

    def __init__(self, top: int) -> None:
        super().__init__()
        for name in ("count", "exact", "tokens", "right"):
            self.add_state(name, torch.zeros(top + 1, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, size: Tensor, exact: Tensor, tokens: Tensor, right: Tensor) -> None:
        """Add ``(B,)`` sizes, exact matches (0/1), answer lengths and right tokens."""
        for state, value in (
            (self.count, torch.ones_like(exact)),
            (self.exact, exact),
            (self.tokens, tokens),
            (self.right, right),
        ):
            state.index_add_(0, size.long(), value.double())

    def compute(self) -> dict[str, Tensor]:
        return {
            "count": self.count,
            "exact": self.exact,
            "tokens": self.tokens,
            "right": self.right,
        }


class AlgoTask(pl.LightningModule):
    """Train a model on an algorithmic problem; test exact match by instance size.

    Args:
        vocab_size: The problem's vocabulary (specials included).
        encoder: The positional encoder's Hydra config (``_target_`` + ``_partial_``).
        model: Model sizes (``conf/model/algo.yaml``).
        optim: Optimiser settings (``task.optim``).
        max_steps: Length of the LR schedule.
        shape: ``decoder`` (decoder-only: prompt, SEP, answer) or ``encdec``
            (encoder-decoder: prompt -> answer).
        top_size: The largest instance size tested.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        encoder: dict[str, Any],
        model: dict[str, Any],
        optim: dict[str, Any],
        max_steps: int,
        shape: str,
        top_size: int,
    ) -> None:
        super().__init__()
        if shape not in SHAPES:
            raise ValueError(f"task.shape={shape!r}: allowed {', '.join(SHAPES)}")
        self.save_hyperparameters()
        sizes = {k: v for k, v in model.items() if k != "compile"}
        self.model: DecoderLM | EncoderDecoder
        if shape == "decoder":
            self.model = DecoderLM(vocab_size=vocab_size, encoder=instantiate(encoder), **sizes)
        else:
            self.model = EncoderDecoder(
                src_vocab_size=vocab_size,
                tgt_vocab_size=vocab_size,
                encoder=instantiate(encoder),
                share_embeddings=True,
                **sizes,
            )
        if model.get("compile"):
            self.model.compile()
        self.n_params = count_parameters(self.model)
        self.sums = torch.nn.ModuleDict({k: SumMetric() for k in VAL_SUMS})
        self.by_size = LengthAccuracy(top_size)
        self.results: dict[str, Tensor] = {}

    def _logits(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        """Teacher-forced logits ``(B, T, V)``, targets ``(B, T)`` and the answer mask."""
        if self.hparams["shape"] == "decoder":
            return self.model(batch["input"]), batch["target"], batch["loss_mask"]
        logits = self.model(batch["src"], batch["tgt_in"], batch["src_mask"])
        return logits, batch["tgt_out"], batch["tgt_mask"]

    def _loss(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Summed loss, right argmax tokens, token count, exact instances and instance
        count over the answer tokens (EOS included)."""
        logits, target, mask = self._logits(batch)
        nll = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="none")
        hit = logits.argmax(-1) == target  # (B, T)
        right = hit & mask
        return (
            nll.view_as(target)[mask].sum(),
            right.sum(),
            mask.sum(),
            exact_rows(hit, mask).sum(),
            mask.any(-1).sum(),
        )

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss_sum, _, n, _, _ = self._loss(batch)
        loss = loss_sum / n
        check_finite(loss, self.global_step)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def _sum(self, name: str) -> SumMetric:
        return cast(SumMetric, self.sums[name])

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        for key, value in zip(VAL_SUMS, self._loss(batch), strict=True):
            self._sum(key).update(value)

    def on_validation_epoch_end(self) -> None:
        loss, right, n, exact, count = (self._sum(k).compute() for k in VAL_SUMS)
        n = n.clamp(min=1)
        self.log("val/loss", loss / n, prog_bar=True)
        self.log("val/acc", 100 * right / n, prog_bar=True)
        self.log("val/seq_acc", 100 * exact / count.clamp(min=1), prog_bar=True)
        for name in self.sums:
            self._sum(name).reset()

    # ---- greedy decoding -------------------------------------------------------------------

    @torch.no_grad()
    def answer(self, batch: Batch) -> list[list[int]]:
        """Greedy outputs (ids before EOS) of an evaluation batch, whose instances all have
        one size; each gets one token more than its reference answer, room for the EOS."""
        budget = batch["answer_len"] + 1
        if self.hparams["shape"] == "encdec":
            assert isinstance(self.model, EncoderDecoder)  # built for shape=encdec
            out = greedy(self.model, batch["src"], None, bos=BOS, eos=EOS, pad=PAD, max_len=budget)
            return out.tokens
        assert isinstance(self.model, DecoderLM)  # built for shape=decoder
        prompt = batch["prompt"]
        full = generate(self.model, prompt, int(budget.max()), temperature=0.0)
        return [
            until_eos(row[: int(b)])
            for row, b in zip(full[:, prompt.shape[1] :].tolist(), budget.tolist(), strict=True)
        ]

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        outputs = self.answer(batch)
        answers = [
            row[:n]
            for row, n in zip(batch["answer"].tolist(), batch["answer_len"].tolist(), strict=True)
        ]
        scored = [score(o, a) for o, a in zip(outputs, answers, strict=True)]
        exact = torch.tensor([float(e) for e, _ in scored], device=self.device)
        right = torch.tensor([float(r) for _, r in scored], device=self.device)
        self.by_size.update(batch["size"], exact, batch["answer_len"], right)

    def on_test_epoch_end(self) -> None:
        self.results = {k: v.detach().cpu() for k, v in self.by_size.compute().items()}
        self.by_size.reset()

    def configure_optimizers(self) -> Any:
        return configure_adamw(self, self.hparams["optim"], self.hparams["max_steps"])
