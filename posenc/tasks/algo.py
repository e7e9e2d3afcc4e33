"""Algorithmic tasks (:mod:`posenc.data.algo`) as a LightningModule, in either model shape.

Notation: B instances, P prompt length, A answer length (EOS not counted), V vocabulary.

Training and validation are teacher-forced cross-entropy over the answer tokens and their
EOS, or a tagged problem's labels (:mod:`posenc.data.algo`). Validation scores the same
positions: ``val/acc``, the share whose argmax is right, and ``val/seq_acc``, the share of
instances with all of them right (greedy decoding's exact match, since greedy then sees
the right prefix at every step). Testing greedy-decodes every instance with the key/value
cache (a tagged problem: one teacher-forced pass, as its papers score it) and scores it by
size ``n`` and test variant:

- ``seq_acc``: the output equals the answer exactly (and ends there, with EOS); tagged:
  every label is right;
- ``acc``: the share of answer positions (labels) whose output token is right.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.aggregation import SumMetric

from posenc.data.algo import BOS, EOS, PAD, PROBLEMS, SEP, SHAPES
from posenc.decoding.encdec import greedy
from posenc.decoding.lm import generate
from posenc.model import DecoderLM, EncoderDecoder
from posenc.training.module import TaskModule
from posenc.training.optim import check_finite

Batch = dict[str, Tensor]
#: Validation sums (over ranks): loss, trained tokens, right scored tokens, scored tokens,
#: exact instances, instances.
VAL_SUMS = ("loss", "trained", "right", "tokens", "exact", "count")
#: Test instances of each size whose greedy output a run keeps (``examples.md``).
EXAMPLES = 3


class Example(NamedTuple):
    """One greedy-decoded test instance: its size and test variant (index), its input ids
    (padding and BOS left out), its answer ids and the output ids before EOS."""

    size: int
    variant: int
    prompt: list[int]
    answer: list[int]
    output: list[int]


def exact_rows(hit: Tensor, mask: Tensor) -> Tensor:
    """``(B,)`` bool: every scored position of the row (``mask``) has its argmax right
    (``hit``); rows without scored positions (padding) are not exact.

    Args:
        hit: ``(B, T)`` bool, argmax equals the target.
        mask: ``(B, T)`` bool, the scored positions.
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
    """Sums by test variant and instance size ``0 .. top``: instances, exact matches,
    answer tokens and right tokens (reduced by ``sum`` across ranks).

    Args:
        top: The largest size scored.
        variants: How many test variants (distributions) are scored.
    """

    full_state_update = False
    count: Tensor
    exact: Tensor
    tokens: Tensor
    right: Tensor

    def __init__(self, top: int, variants: int = 1) -> None:
        super().__init__()
        self.shape = (variants, top + 1)
        for name in ("count", "exact", "tokens", "right"):
            zeros = torch.zeros(variants * (top + 1), dtype=torch.float64)
            self.add_state(name, zeros, dist_reduce_fx="sum")

    def update(
        self,
        size: Tensor,
        exact: Tensor,
        tokens: Tensor,
        right: Tensor,
        variant: Tensor | None = None,
    ) -> None:
        """Add ``(B,)`` sizes, exact matches (0/1), answer lengths and right tokens, of
        the variants ``variant`` (B,) (default: the first)."""
        index = size.long()
        if variant is not None:
            index = index + variant.long() * self.shape[1]
        for state, value in (
            (self.count, torch.ones_like(exact)),
            (self.exact, exact),
            (self.tokens, tokens),
            (self.right, right),
        ):
            state.index_add_(0, index, value.double())

    def compute(self) -> dict[str, Tensor]:
        """Each sum as ``(variants, top + 1)``."""
        return {
            "count": self.count.view(self.shape),
            "exact": self.exact.view(self.shape),
            "tokens": self.tokens.view(self.shape),
            "right": self.right.view(self.shape),
        }


class AlgoTask(TaskModule[DecoderLM | EncoderDecoder]):
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
        problem: ``task.problem``: its layout (tagged or not) and test variants.
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
        problem: str = "copy",
    ) -> None:
        super().__init__()
        if shape not in SHAPES:
            raise ValueError(f"task.shape={shape!r}: allowed {', '.join(SHAPES)}")
        self.problem = PROBLEMS[problem]
        if shape not in self.problem.shapes:
            raise ValueError(f"task.shape={shape!r}: {problem} runs in {self.problem.shapes}")
        self.save_hyperparameters()
        self.shape = shape
        if shape == "decoder":
            self.build_model(
                DecoderLM, encoder, model, optim=optim, max_steps=max_steps, vocab_size=vocab_size
            )
        else:
            self.build_model(
                EncoderDecoder,
                encoder,
                model,
                optim=optim,
                max_steps=max_steps,
                src_vocab_size=vocab_size,
                tgt_vocab_size=vocab_size,
                share_embeddings=True,
            )
        self.sums = torch.nn.ModuleDict({k: SumMetric() for k in VAL_SUMS})
        self.by_size = LengthAccuracy(top_size, len(self.problem.variants))
        #: After testing: the sums of :class:`LengthAccuracy` by variant name.
        self.results: dict[str, dict[str, Tensor]] = {}
        #: After testing (greedy-decoded problems): the first :data:`EXAMPLES` instances of
        #: each size and variant in test order (gathered from every process), sorted by
        #: variant and size.
        self.examples: list[Example] = []
        #: The sizes whose examples a test keeps (None: every size).
        self.example_sizes: set[int] | None = None
        #: While testing: this process's kept instances by their place in the test order.
        self._kept: list[tuple[tuple[int, int], Example]] = []

    def _logits(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        """Teacher-forced logits ``(B, T, V)``, targets ``(B, T)`` and the loss mask."""
        if self.shape == "decoder":
            return self.model(batch["input"]), batch["target"], batch["loss_mask"]
        logits = self.model(batch["src"], batch["tgt_in"], batch["src_mask"])
        return logits, batch["tgt_out"], batch["tgt_mask"]

    def _loss(self, batch: Batch) -> dict[str, Tensor]:
        """Sums over a batch (:data:`VAL_SUMS`): the loss over the trained positions
        (``trained`` of them), then over the scored ones (the answer and its EOS, or the
        labels): right argmax tokens, their count, exact instances and instances."""
        logits, target, mask = self._logits(batch)
        scored = batch["score_mask"]
        nll = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="none")
        hit = logits.argmax(-1) == target  # (B, T)
        return {
            "loss": nll.view_as(target)[mask].sum(),
            "trained": mask.sum(),
            "right": (hit & scored).sum(),
            "tokens": scored.sum(),
            "exact": exact_rows(hit, scored).sum(),
            "count": scored.any(-1).sum(),
        }

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        sums = self._loss(batch)
        loss = sums["loss"] / sums["trained"]
        check_finite(loss, self.global_step)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def _sum(self, name: str) -> SumMetric:
        return cast(SumMetric, self.sums[name])

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        for key, value in self._loss(batch).items():
            self._sum(key).update(value)

    def on_validation_epoch_end(self) -> None:
        sums = {k: self._sum(k).compute() for k in self.sums}
        self.log("val/loss", sums["loss"] / sums["trained"].clamp(min=1), prog_bar=True)
        self.log("val/acc", 100 * sums["right"] / sums["tokens"].clamp(min=1), prog_bar=True)
        self.log("val/seq_acc", 100 * sums["exact"] / sums["count"].clamp(min=1), prog_bar=True)
        for name in self.sums:
            self._sum(name).reset()

    # ---- greedy decoding -------------------------------------------------------------------

    @torch.no_grad()
    def answer(self, batch: Batch) -> list[list[int]]:
        """Greedy outputs (ids before EOS) of an evaluation batch, whose instances all have
        one size; each gets one token more than its reference answer, room for the EOS.
        Prompts of different lengths (counting's) are left-padded for the decoder-only
        model, each row at its own positions, and masked for the encoder-decoder."""
        budget = batch["answer_len"] + 1
        ragged = bool(batch["prompt_pad"].any())  # one host read per test batch
        if self.shape == "encdec":
            assert isinstance(self.model, EncoderDecoder)  # built for shape=encdec
            valid = batch["src_mask"] if ragged else None
            out = greedy(self.model, batch["src"], valid, bos=BOS, eos=EOS, pad=PAD, max_len=budget)
            return out.tokens
        assert isinstance(self.model, DecoderLM)  # built for shape=decoder
        prompt = batch["prompt"]
        pad = batch["prompt_pad"] if ragged else None
        full = generate(self.model, prompt, int(budget.max()), temperature=0.0, pad=pad)
        return [
            until_eos(row[: int(b)])
            for row, b in zip(full[:, prompt.shape[1] :].tolist(), budget.tolist(), strict=True)
        ]

    @torch.no_grad()
    def forced(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        """A tagged batch scored in one teacher-forced pass: ``(B,)`` exact (0/1), right
        labels and labels."""
        logits, target, _ = self._logits(batch)
        scored = batch["score_mask"]
        hit = logits.argmax(-1) == target
        return exact_rows(hit, scored).double(), (hit & scored).sum(-1), scored.sum(-1)

    def decoded(self, batch: Batch, place: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        """An evaluation batch greedy-decoded: ``(B,)`` exact (0/1), right answer tokens
        and answer tokens; its first instances are kept as examples (``place``: the batch's
        index in the whole test set)."""
        outputs = self.answer(batch)
        answers = [
            row[:n]
            for row, n in zip(batch["answer"].tolist(), batch["answer_len"].tolist(), strict=True)
        ]
        self._keep(batch, outputs, answers, place)
        scored = [score(o, a) for o, a in zip(outputs, answers, strict=True)]
        exact = torch.tensor([float(e) for e, _ in scored], device=self.device)
        right = torch.tensor([float(r) for _, r in scored], device=self.device)
        return exact, right, batch["answer_len"]

    def _keep(
        self, batch: Batch, outputs: list[list[int]], answers: list[list[int]], place: int
    ) -> None:
        """Keep the first :data:`EXAMPLES` instances of each size and variant this process
        tests (inputs without padding, BOS or the decoder's closing SEP)."""
        sizes = batch["size"].tolist()
        variants = batch["variant"].tolist() if "variant" in batch else [0] * len(sizes)
        have = Counter((e.size, e.variant) for _, e in self._kept)
        wanted = [
            (self.example_sizes is None or n in self.example_sizes) and have[n, v] < EXAMPLES
            for n, v in zip(sizes, variants, strict=True)
        ]
        if not any(wanted):  # most batches: their sizes have their examples already
            return
        inputs = batch["prompt" if self.shape == "decoder" else "src"].tolist()
        for row, (size, variant, ids, answer, output) in enumerate(
            zip(sizes, variants, inputs, answers, outputs, strict=True)
        ):
            if not wanted[row] or have[size, variant] >= EXAMPLES:
                continue
            have[size, variant] += 1
            prompt = [i for i in ids if i not in (PAD, BOS)]
            if self.shape == "decoder" and prompt and prompt[-1] == SEP:
                prompt = prompt[:-1]
            example = Example(int(size), int(variant), prompt, list(answer), list(output))
            self._kept.append(((place, row), example))

    def _gather_examples(self) -> list[Example]:
        """Every process's kept instances, the first :data:`EXAMPLES` of each size and
        variant in test order: what one process testing everything keeps."""
        kept = self._kept
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            parts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(parts, kept)  # once, at the end of testing
            kept = [k for part in parts for k in part]
        out: list[Example] = []
        have: Counter[tuple[int, int]] = Counter()
        for _, e in sorted(kept, key=lambda k: k[0]):
            if have[e.size, e.variant] < EXAMPLES:
                have[e.size, e.variant] += 1
                out.append(e)
        return sorted(out, key=lambda e: (e.variant, e.size))

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        if self.problem.tagged:
            exact, right, tokens = self.forced(batch)
        else:
            # each process tests every W-th batch from its rank on (ShardSampler)
            world = 1 if self._trainer is None else self.trainer.world_size
            exact, right, tokens = self.decoded(batch, batch_idx * world + self.global_rank)
        self.by_size.update(batch["size"], exact, tokens, right, batch.get("variant"))

    def on_test_epoch_start(self) -> None:
        self.examples, self._kept = [], []

    def on_test_epoch_end(self) -> None:
        sums = {k: v.detach().cpu() for k, v in self.by_size.compute().items()}
        self.results = {
            name: {k: v[j] for k, v in sums.items()} for j, name in enumerate(self.problem.variants)
        }
        self.by_size.reset()
        self.examples = self._gather_examples()
