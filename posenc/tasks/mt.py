"""Machine translation as a thin LightningModule around :class:`~posenc.model.EncoderDecoder`.

Notation: B batch, S source length, T decoder length (BOS + target, or target + EOS),
V vocabulary.

Batches are the dicts of :class:`posenc.data.mt.MTCollator`. Training is teacher forcing with
label-smoothed cross-entropy over real target tokens (padding ignored). Each validation also
greedy-decodes the first ``val_bleu_sentences`` validation sentences (file order) and logs
their corpus BLEU as ``val/bleu``. Testing decodes with :meth:`MTTask.configure_test`'s
settings and keeps ``(file index, token ids)`` pairs for the job to score.
"""

from __future__ import annotations

import logging
import math
from typing import Any, cast

import torch
from torch import Tensor
from torchmetrics.aggregation import SumMetric

from posenc.data.samplers import all_ranks
from posenc.decoding.encdec import Decoded, beam_search, greedy, output_limits
from posenc.eval.bleu import corpus_scores
from posenc.model import EncoderDecoder
from posenc.training.module import TaskModule
from posenc.training.optim import check_finite

log = logging.getLogger(__name__)

Batch = dict[str, Tensor]


def label_smoothed_nll(
    logits: Tensor, target: Tensor, mask: Tensor, epsilon: float
) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed cross-entropy and summed NLL over the real target tokens.

    Per token, ``(1 - eps) * -log p(y) + eps * mean_v(-log p(v))``: the target distribution
    puts ``1 - eps + eps / V`` on the reference and ``eps / V`` on every other token (padding
    included, as in ``torch.nn.functional.cross_entropy(label_smoothing=eps)``).

    Args:
        logits: ``(B, T, V)``.
        target: ``(B, T)`` reference ids.
        mask: ``(B, T)`` True for real tokens (target and EOS), False for padding.
        epsilon: Smoothing in ``[0, 1)``.

    Returns:
        ``(loss_sum, nll_sum)``, scalars summed over the masked tokens (divide by
        ``mask.sum()`` for per-token means).
    """
    logp = logits.float().log_softmax(-1)  # fp32 softmax: bf16 would bias the loss
    nll = -logp.gather(-1, target[..., None]).squeeze(-1)  # (B, T)
    smooth = -logp.mean(-1)  # (B, T)
    loss = (1.0 - epsilon) * nll + epsilon * smooth
    return loss[mask].sum(), nll[mask].sum()


class MTTask(TaskModule[EncoderDecoder]):
    """Train a translator; report validation loss and greedy BLEU; decode the test set.

    Args:
        vocab_size: Joint source/target vocabulary.
        encoder: The positional encoder's Hydra config (``_target_`` + ``_partial_``); the
            encoder and decoder stacks each get their own instance.
        model: Model sizes (``conf/model/mt.yaml``).
        optim: Optimiser settings (``task.optim``).
        max_steps: Length of the LR schedule.
        label_smoothing: Epsilon of the smoothed loss, in ``[0, 1)``.
        share_embeddings: One table for source, target and output.
        ids: ``{"pad": ..., "bos": ..., "eos": ...}`` of the tokenizer.
        val_bleu_sentences: Greedy-decode this many validation sentences each validation
            (0 turns ``val/bleu`` off).
        max_len_a: Output budget per source token when decoding.
        max_len_b: Output budget on top, see :func:`posenc.decoding.encdec.output_limits`.
        max_len: Most tokens decoding generates for any sentence (``task.max_len``, the
            longest training target), whatever ``max_len_a`` gives for a long source;
            None: no cap beyond the decoder's positions.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        encoder: dict[str, Any],
        model: dict[str, Any],
        optim: dict[str, Any],
        max_steps: int,
        label_smoothing: float = 0.1,
        share_embeddings: bool = True,
        ids: dict[str, int],
        val_bleu_sentences: int = 200,
        max_len_a: float = 1.2,
        max_len_b: int = 10,
        max_len: int | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"task.label_smoothing={label_smoothing}: must be in [0, 1)")
        self.save_hyperparameters()
        self.label_smoothing = label_smoothing
        self.val_bleu_sentences = val_bleu_sentences
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        self.build_model(
            EncoderDecoder,
            encoder,
            model,
            optim=optim,
            max_steps=max_steps,
            src_vocab_size=vocab_size,
            tgt_vocab_size=vocab_size,
            share_embeddings=share_embeddings,
        )
        self.pad, self.bos, self.eos = ids["pad"], ids["bos"], ids["eos"]
        # Decoder inputs hold BOS at position 0, so an absolute table of L positions allows
        # at most L - 1 generated tokens.
        self.set_output_cap(max_len)
        # Validation and test sums; torchmetrics reduces them across ranks.
        self.sums = torch.nn.ModuleDict({k: SumMetric() for k in ("loss", "nll", "tokens")})
        self._val_hyps: list[tuple[int, list[int]]] = []
        self.test_decode: dict[str, Any] = {"beam_size": 1, "length_penalty": 0.0}
        self.test_max_sentences: int | None = None
        #: ``(file index, token ids)`` of every decoded test sentence, in loader order.
        self.test_hyps: list[tuple[int, list[int]]] = []

    def set_output_cap(self, max_len: int | None) -> None:
        """Decode at most ``max_len`` tokens per sentence (None: no cap of its own).

        Decoder inputs hold BOS at position 0, so an absolute table of L positions also
        caps the output at L - 1 tokens.
        """
        caps = [] if max_len is None else [int(max_len)]
        limit = self.model.decoder_stack.encoder.max_length
        caps += [] if limit is None else [limit - 1]
        self.max_out_cap = min(caps, default=None)

    def forward(self, src: Tensor, tgt_in: Tensor, src_valid: Tensor | None = None) -> Tensor:
        """Teacher-forced logits ``(B, T, V)``."""
        return self.model(src, tgt_in, src_valid)

    def _loss_sums(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        logits = self(batch["src"], batch["tgt_in"], batch["src_mask"])
        loss, nll = label_smoothed_nll(
            logits, batch["tgt_out"], batch["tgt_mask"], self.label_smoothing
        )
        return loss, nll, batch["tgt_mask"].sum()

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss_sum, nll_sum, n = self._loss_sums(batch)
        loss = loss_sum / n
        check_finite(loss, self.global_step)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/nll", nll_sum / n)
        return loss

    # ---- decoding --------------------------------------------------------------------------

    def translate(
        self,
        src: Tensor,
        src_valid: Tensor,
        *,
        beam_size: int = 1,
        length_penalty: float = 0.0,
        use_cache: bool = True,
    ) -> Decoded:
        """Decode ``src (B, S)``: greedy for ``beam_size == 1``, else beam search; with the
        key/value cache unless ``use_cache`` is false (the same output, slower)."""
        limit = output_limits(
            src_valid,
            max_len_a=self.max_len_a,
            max_len_b=self.max_len_b,
            cap=self.max_out_cap,
        )
        ids = {"bos": self.bos, "eos": self.eos, "pad": self.pad}
        if beam_size == 1:
            return greedy(self.model, src, src_valid, max_len=limit, use_cache=use_cache, **ids)
        return beam_search(
            self.model,
            src,
            src_valid,
            beam_size=beam_size,
            length_penalty=length_penalty,
            max_len=limit,
            use_cache=use_cache,
            **ids,
        )

    def _decode_first(
        self, batch: Batch, limit: int | None, **settings: Any
    ) -> list[tuple[int, list[int]]]:
        """Decode the batch rows whose file index is below ``limit`` (all for None)."""
        rows = torch.arange(batch["src"].shape[0], device=batch["src"].device)
        if limit is not None:
            rows = rows[batch["index"] < limit]
        if rows.numel() == 0:
            return []
        src, valid = batch["src"][rows], batch["src_mask"][rows]
        s = int(valid.sum(-1).max())  # the chosen rows may need less padding
        out = self.translate(src[:, :s], valid[:, :s], **settings)
        return list(zip(batch["index"][rows].tolist(), out.tokens, strict=True))

    # ---- validation and test ---------------------------------------------------------------

    def _sum(self, name: str) -> SumMetric:
        return cast(SumMetric, self.sums[name])

    def _update_sums(self, batch: Batch) -> None:
        loss, nll, n = self._loss_sums(batch)
        self._sum("loss").update(loss)
        self._sum("nll").update(nll)
        self._sum("tokens").update(n)

    def _log_sums(self, split: str) -> None:
        loss, nll, n = (self._sum(k).compute() for k in ("loss", "nll", "tokens"))
        n = n.clamp(min=1)
        self.log(f"{split}/loss", loss / n, prog_bar=split == "val")
        self.log(f"{split}/nll", nll / n)
        self.log(f"{split}/ppl", (nll / n).exp())
        for name in self.sums:
            self._sum(name).reset()

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._update_sums(batch)
        if self.val_bleu_sentences > 0:
            self._val_hyps += self._decode_first(batch, self.val_bleu_sentences)

    def on_validation_epoch_end(self) -> None:
        self._log_sums("val")
        hyps, self._val_hyps = all_ranks(self._val_hyps), []
        dm = getattr(self.trainer, "datamodule", None)
        if self.val_bleu_sentences == 0 or dm is None or not hasattr(dm, "references"):
            return
        bleu = math.nan  # none of the first N sentences was in the batches validated
        if hyps:
            refs = dm.references("val")
            text = [dm.tokenizer.decode(ids) for _, ids in hyps]
            bleu = corpus_scores(text, [refs[i] for i, _ in hyps])["bleu"]
        else:
            log.warning(
                "val/bleu is NaN: trainer.limit_val_batches left out all of the first %d "
                "validation sentences; use limit_val_batches=1.0",
                self.val_bleu_sentences,
            )
        # Every rank scores the sentences all ranks decoded: the same value everywhere.
        self.log("val/bleu", bleu, prog_bar=True, rank_zero_only=True)

    def configure_test(
        self,
        *,
        beam_size: int,
        length_penalty: float,
        max_sentences: int | None,
        use_cache: bool = True,
    ) -> None:
        """Decoding settings of :meth:`test_step`; ``max_sentences`` keeps the first N in
        file order (None: all). Clears earlier test outputs."""
        self.test_decode = {
            "beam_size": int(beam_size),
            "length_penalty": float(length_penalty),
            "use_cache": bool(use_cache),
        }
        self.test_max_sentences = max_sentences
        self.test_hyps = []

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._update_sums(batch)
        self.test_hyps += self._decode_first(batch, self.test_max_sentences, **self.test_decode)

    def on_test_epoch_end(self) -> None:
        self._log_sums("test")
        self.test_hyps = all_ranks(self.test_hyps)  # each rank decoded its shard
