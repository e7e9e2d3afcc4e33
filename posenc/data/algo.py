"""Procedural algorithmic tasks for length generalization (``task=algo``).

Every instance is drawn from a seeded generator: no data files, and the answer of each
problem is plain Python that the tests recompute. An instance has a *size* ``n`` (what
"length" means for that problem, see :data:`PROBLEMS`). Models are trained on sizes in
``[lo, hi]`` and tested on sizes up to a multiple of ``hi``. A problem has one of two
layouts (:attr:`Problem.tagged`):

- *prompt and answer* (the classic problems, selective copy, counting): decoder-only
  ``BOS prompt SEP answer EOS`` with the loss on the answer and its EOS; encoder-decoder,
  source ``prompt`` and target ``answer`` (the decoder reads ``BOS answer`` and predicts
  ``answer EOS``). Tested by greedy decoding.
- *tagged* (flip-flop, state tracking): decoder-only ``BOS tokens``; some positions carry a
  label, the symbol the model must predict once it has read the tokens up to there (for
  flip-flop, the bit after each read). The loss covers the labels (flip-flop: every next
  token, the paper's language-modeling loss); scores count the labels only, predicted from
  the true prefix (teacher-forced), as Liu et al. and Merrill et al. score them.

Instances are a pure function of ``(stream, index)``: the training stream is keyed by the
run's seed, the validation and test streams by the problem alone, so every seed and every
encoder is tested on the same instances. A problem may have test *variants* (flip-flop's
sparse and dense splits): instances of another distribution, keyed by the variant too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import Dataset

from posenc.data.algo_problems import (
    BOS,
    EOS,
    GRIDS,
    PAD,
    PROBLEMS,
    SEP,
    SHAPES,
    SPECIALS,
    AlgoVocab,
    Options,
    Problem,
    bucket_name,
    buckets,
    grid_sizes,
    instance,
    longest_sequence,
    size_buckets,
    training_size,
)
from posenc.data.lm import physical_memory
from posenc.data.mt import MTCollator
from posenc.data.samplers import ENDLESS, BatchIndexSampler, ShardSampler, trainer_progress

__all__ = [
    "BOS",
    "EOS",
    "GRIDS",
    "PAD",
    "PROBLEMS",
    "SEP",
    "SHAPES",
    "SPECIALS",
    "AlgoDataModule",
    "AlgoVocab",
    "Options",
    "Problem",
    "bucket_name",
    "buckets",
    "collate_decoder",
    "collate_encdec",
    "collate_eval",
    "collate_tagged",
    "instance",
    "longest_sequence",
    "prompt_ids",
    "size_batches",
]


Example = tuple[list[int], list[int], int]  # (prompt or token ids, answer or label ids, size)
Collate = Callable[[Sequence[Example]], dict[str, Any]]


class AlgoSet(Dataset):
    """Encoded instances ``(prompt ids, answer ids, size)``; for a tagged problem
    ``(token ids, label ids, size)``, PAD where a token has no label.

    Args:
        problem: The problem.
        vocab: Its vocabulary.
        sizes: The size of each item.
        keys: The stream key of each item.
        variants: The variant of each item (default: the training distribution's).
        options: The instance options (``task.symbols`` ...).
    """

    def __init__(
        self,
        problem: Problem,
        vocab: AlgoVocab,
        sizes: Sequence[int],
        keys: Sequence[str],
        variants: Sequence[str] | None = None,
        *,
        options: Options,
    ) -> None:
        variants = [""] * len(sizes) if variants is None else list(variants)
        if not len(sizes) == len(keys) == len(variants):
            raise ValueError(f"{len(sizes)} sizes, {len(keys)} keys, {len(variants)} variants")
        self.problem, self.vocab = problem, vocab
        self.sizes, self.keys, self.variants = list(sizes), list(keys), variants
        self.options = options

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> Example:
        prompt, answer = instance(
            self.problem, self.sizes[i], self.keys[i], self.options, variant=self.variants[i]
        )
        return self.vocab.encode(prompt), self.vocab.encode(answer), self.sizes[i]


class TrainingStream(AlgoSet):
    """Training instances of sizes uniform over ``sizes``, drawn lazily from the run's seed
    (item ``i`` is the same instance in every process, for any ``i``); ``count`` (one
    process's ``max_steps`` batches) is its length."""

    def __init__(
        self,
        problem: Problem,
        vocab: AlgoVocab,
        sizes: Sequence[int],
        count: int,
        seed: int,
        options: Options,
    ) -> None:
        super().__init__(problem, vocab, [], [], options=options)
        if not sizes:
            raise ValueError(f"problem {problem.name}: no valid training size")
        self.train_sizes, self.count, self.seed = list(sizes), count, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> Example:
        n = training_size(self.seed, i, self.train_sizes)
        prompt, answer = instance(self.problem, n, f"train:{self.seed}:{i}", self.options)
        return self.vocab.encode(prompt), self.vocab.encode(answer), n


def evaluation_set(
    problem: Problem,
    vocab: AlgoVocab,
    split: str,
    sizes: Sequence[int],
    per_size: int,
    variants: Sequence[str] = ("",),
    *,
    options: Options,
) -> AlgoSet:
    """``per_size`` instances of every size and variant, keyed by ``split`` only (the same
    for every seed and encoder). A size a variant cannot hold (mqar's with more pairs) is
    left out of that variant: its cells stay empty."""
    grid = [
        (v, n, i)
        for v in variants
        for n in sizes
        if problem.valid(n, replace(options, variant=v))
        for i in range(per_size)
    ]
    return AlgoSet(
        problem,
        vocab,
        [n for _, n, _ in grid],
        [f"{split}:{i}" for _, _, i in grid],
        [v for v, _, _ in grid],
        options=options,
    )


def prompt_ids(prompt: Sequence[int]) -> list[int]:
    """The decoder-only prompt: ``BOS prompt SEP`` (the model writes the answer next)."""
    return [BOS, *prompt, SEP]


def collate_decoder(examples: Sequence[Example]) -> dict[str, Any]:
    """Pad decoder-only sequences ``BOS prompt SEP answer EOS`` on the right.

    Returns:
        ``input`` (B, T) and ``target`` (B, T) long, the sequences without their last and
        first token; ``loss_mask`` (B, T) bool, True exactly where ``target`` is an answer
        token or the EOS after it, and ``score_mask``, the same positions (scored);
        ``size`` (B,) long.
    """
    seqs = [[*prompt_ids(p), *a, EOS] for p, a, _ in examples]
    t = max(map(len, seqs)) - 1
    inp = torch.full((len(seqs), t), PAD, dtype=torch.long)
    tgt = torch.full((len(seqs), t), PAD, dtype=torch.long)
    mask = torch.zeros((len(seqs), t), dtype=torch.bool)
    for row, (seq, (p, a, _)) in enumerate(zip(seqs, examples, strict=True)):
        inp[row, : len(seq) - 1] = torch.tensor(seq[:-1])
        tgt[row, : len(seq) - 1] = torch.tensor(seq[1:])
        start = len(p) + 1  # target index of the first answer token
        mask[row, start : start + len(a) + 1] = True
    return {
        "input": inp,
        "target": tgt,
        "loss_mask": mask,
        "score_mask": mask,
        "size": torch.tensor([n for _, _, n in examples]),
    }


def collate_tagged(examples: Sequence[Example], lm_loss: bool = False) -> dict[str, Any]:
    """Pad tagged sequences ``BOS tokens`` on the right; the target at each position is
    its label (what the model must predict after reading the tokens so far).

    Args:
        examples: ``(token ids, label ids, size)``, PAD where a token has no label.
        lm_loss: Also train every other position on the next token (a language model:
            flip-flop with ``task.lm_loss``), not only the labelled ones.

    Returns:
        ``input`` (B, T) long ``BOS tokens`` (T = longest + 1); ``target`` (B, T) long: at
        input position j the label of token j-1 (the BOS has none), or with ``lm_loss``
        where there is none the next token; ``loss_mask`` (B, T) bool, True where a target
        is trained; ``score_mask`` (B, T) bool, True exactly at the labels; ``size`` (B,).
    """
    t = max(len(x) for x, _, _ in examples) + 1
    inp = torch.full((len(examples), t), PAD, dtype=torch.long)
    tgt = torch.full((len(examples), t), PAD, dtype=torch.long)
    score = torch.zeros((len(examples), t), dtype=torch.bool)
    for row, (x, labels, _) in enumerate(examples):
        if len(labels) != len(x):
            raise ValueError(f"{len(x)} tokens but {len(labels)} labels")
        inp[row, : len(x) + 1] = torch.tensor([BOS, *x])
        label = torch.tensor([PAD, *labels])
        if lm_loss:  # next tokens, then the labels over them (flip-flop's are equal)
            tgt[row, : len(x)] = torch.tensor(x)
        tgt[row, : len(x) + 1] = torch.where(label != PAD, label, tgt[row, : len(x) + 1])
        score[row, : len(x) + 1] = label != PAD
    return {
        "input": inp,
        "target": tgt,
        "loss_mask": tgt != PAD,
        "score_mask": score,
        "size": torch.tensor([n for _, _, n in examples]),
    }


def size_batches(
    sizes: Sequence[int], batch_size: int, variants: Sequence[str] | None = None
) -> list[list[int]]:
    """Indices grouped into batches of one size (and variant) each (evaluation batches
    need no padding of the prompt, so the cache decodes every row at the same positions),
    by variant in order of first appearance, then by size."""
    variants = [""] * len(sizes) if variants is None else variants
    order = {v: j for j, v in enumerate(dict.fromkeys(variants))}
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (n, v) in enumerate(zip(sizes, variants, strict=True)):
        groups.setdefault((order[v], n), []).append(i)
    return [
        idx[j : j + batch_size]
        for _, idx in sorted(groups.items())
        for j in range(0, len(idx), batch_size)
    ]


def collate_encdec(examples: Sequence[Example]) -> dict[str, Any]:
    """Encoder-decoder batches: the prompt as source, the answer as target (the keys of
    :class:`posenc.data.mt.MTCollator`, with ``size`` in place of ``index``, and
    ``score_mask``, the target's mask)."""
    batch = MTCollator(PAD, BOS, EOS)(examples)
    batch["size"] = batch.pop("index")
    batch["score_mask"] = batch["tgt_mask"]
    return batch


def collate_eval(examples: Sequence[Example]) -> dict[str, Any]:
    """Evaluation batches of one size: ``prompt`` (B, P) for the decoder-only model
    (``BOS prompt SEP``, left-padded to the longest, ``prompt_pad`` (B,) pads each),
    ``src`` (B, S) for the encoder-decoder (the bare prompt, right-padded; ``src_mask``
    (B, S) True at real tokens), ``answer`` (B, A) padded references, ``answer_len`` (B,)
    and ``size`` (B,). Prompts of one size have one length except counting's, whose
    statements vary in length."""
    p = max(len(x) for x, _, _ in examples)
    a = max(len(ans) for _, ans, _ in examples)
    prompt = torch.full((len(examples), p + 2), PAD, dtype=torch.long)
    src = torch.full((len(examples), p), PAD, dtype=torch.long)
    answer = torch.full((len(examples), a), PAD, dtype=torch.long)
    for row, (x, ans, _) in enumerate(examples):
        prompt[row, p - len(x) :] = torch.tensor(prompt_ids(x), dtype=torch.long)
        src[row, : len(x)] = torch.tensor(x, dtype=torch.long)
        answer[row, : len(ans)] = torch.tensor(ans, dtype=torch.long)
    lengths = torch.tensor([len(x) for x, _, _ in examples])
    return {
        "prompt": prompt,
        "prompt_pad": p - lengths,
        "src": src,
        "src_mask": torch.arange(p)[None, :] < lengths[:, None],
        "answer": answer,
        "answer_len": torch.tensor([len(ans) for _, ans, _ in examples]),
        "size": torch.tensor([n for _, _, n in examples]),
    }


class Batches(Dataset):
    """Whole batches as items (each of one size and variant), so a loader with
    ``batch_size=None`` and :class:`posenc.data.samplers.ShardSampler` splits them across
    ranks, each once. Each batch has ``variant`` (B,) long: the index of its instances'
    variant in ``variants``."""

    def __init__(
        self,
        data: AlgoSet,
        batch_size: int,
        collate: Collate,
        variants: Sequence[str] = ("",),
    ) -> None:
        self.data, self.collate = data, collate
        self.batches = size_batches(data.sizes, batch_size, data.variants)
        self.variant_index = {v: j for j, v in enumerate(variants)}

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict[str, Any]:
        rows = self.batches[i]
        batch = self.collate([self.data[j] for j in rows])
        batch["variant"] = torch.full((len(rows),), self.variant_index[self.data.variants[rows[0]]])
        return batch


class TrainingBatches(Dataset):
    """Training batches by index: item ``j`` is batch ``j``, stream instances
    ``j * B .. (j + 1) * B - 1``. Paired with a
    :class:`posenc.data.samplers.BatchIndexSampler`, a resumed run continues the stream
    where it stopped and DDP ranks draw distinct batches."""

    def __init__(self, stream: TrainingStream, batch_size: int, collate: Collate) -> None:
        self.stream, self.batch_size, self.collate = stream, batch_size, collate

    def __getitem__(self, j: int) -> dict[str, Any]:
        first = j * self.batch_size
        return self.collate([self.stream[first + i] for i in range(self.batch_size)])


class AlgoDataModule(pl.LightningDataModule):
    """Training, validation and test data of one problem.

    Args:
        problem: ``task.problem``.
        shape: ``decoder`` or ``encdec`` (how batches are laid out).
        train_lengths: ``[lo, hi]`` training sizes.
        top: The largest test size.
        options: The instance options (``task.symbols``, ``task.pairs`` ...:
            :class:`Options`).
        batch_size: Training instances per step.
        eval_batch_size: Evaluation instances per batch.
        steps: Training steps (the stream's length).
        val_per_size: Validation instances per training size.
        test_per_size: Test instances per size and variant.
        seed: The training stream's seed.
        test_grid: Test sizes (:data:`GRIDS`), or ``auto`` for the problem's own.
        lm_loss: Train a tagged problem that is a language (flip-flop) on every next token,
            not only on its labels.
    """

    def __init__(
        self,
        *,
        problem: str,
        shape: str,
        train_lengths: Sequence[int],
        top: int,
        options: Options,
        batch_size: int,
        eval_batch_size: int,
        steps: int,
        val_per_size: int,
        test_per_size: int,
        seed: int,
        test_grid: str = "auto",
        lm_loss: bool = False,
    ) -> None:
        super().__init__()
        self.problem = PROBLEMS[problem]
        self.options = options
        self.vocab = AlgoVocab(self.problem, options)
        self.shape = shape
        self.lo, self.hi = (int(x) for x in train_lengths)
        self.top = int(top)
        self.grid = self.problem.grid if test_grid == "auto" else test_grid
        self.lm_loss = bool(lm_loss) and self.problem.lm
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.steps, self.seed = steps, seed
        self.val_per_size, self.test_per_size = val_per_size, test_per_size

    @property
    def collate(self) -> Collate:
        if self.problem.tagged:
            return partial(collate_tagged, lm_loss=self.lm_loss)
        return collate_decoder if self.shape == "decoder" else collate_encdec

    def train_sizes(self) -> list[int]:
        return self.problem.sizes(self.lo, self.hi, self.options)

    def test_sizes(self) -> list[int]:
        return grid_sizes(self.problem, self.lo, self.hi, self.top, self.grid, self.options)

    def buckets(self, width: int) -> list[tuple[int, int]]:
        """The report's size buckets (:func:`size_buckets`)."""
        return size_buckets(
            self.problem, self.lo, self.hi, self.top, self.grid, width, self.options
        )

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        """Batches drawn in order from the stream by the trainer's progress
        (:class:`posenc.data.samplers.BatchIndexSampler`), in one endless epoch
        (:data:`posenc.data.samplers.ENDLESS`)."""
        stream = TrainingStream(
            self.problem,
            self.vocab,
            self.train_sizes(),
            self.steps * self.batch_size,
            self.seed,
            self.options,
        )
        data = TrainingBatches(stream, self.batch_size, self.collate)
        sampler = BatchIndexSampler(ENDLESS, trainer_progress(self), self.seed)
        return torch.utils.data.DataLoader(data, batch_size=None, sampler=sampler)

    def _eval(
        self,
        split: str,
        sizes: list[int],
        per_size: int,
        collate: Collate,
        variants: Sequence[str] = ("",),
    ) -> torch.utils.data.DataLoader:
        data = Batches(
            evaluation_set(
                self.problem, self.vocab, split, sizes, per_size, variants, options=self.options
            ),
            self.eval_batch_size,
            collate,
            variants,
        )
        return torch.utils.data.DataLoader(data, batch_size=None, sampler=ShardSampler(data))

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._eval("val", self.train_sizes(), self.val_per_size, self.collate)

    def test_dataloader(self) -> torch.utils.data.DataLoader:
        collate = self.collate if self.problem.tagged else collate_eval
        return self._eval(
            "test", self.test_sizes(), self.test_per_size, collate, self.problem.variants
        )


def memory_problem(t: Any, n_heads: int, n_layers: int, cpu: bool, test_hi: int) -> str | None:
    """The problem with an algorithmic task's sizes that would exhaust the memory, or None:
    its test set (``task.test_per_size`` instances of every size of the test grid up to
    ``test_hi``, for each test distribution, held in memory) or, on a CPU (``cpu``), the
    attention scores of one training batch at the largest training size
    (``batch x heads x T^2`` per layer, kept for the backward pass).

    Args:
        t: The task, typed and its keys checked (:class:`posenc.schema.AlgoTask`).
        n_heads: ``model.n_heads``.
        n_layers: ``model.n_layers``.
        cpu: Whether training runs on the CPU.
        test_hi: The largest test size.
    """
    ram = physical_memory()
    if not ram:
        return None
    problem, (lo, hi), options = PROBLEMS[t.problem], t.train_lengths, t.options()
    grid = problem.grid if t.test_sizes == "auto" else t.test_sizes
    sizes = grid_sizes(problem, lo, hi, test_hi, grid, options)
    # int64 token ids, input and target, of every instance of every distribution
    positions = sum(longest_sequence(problem, n, t.shape, options) for n in sizes)
    test_bytes = t.test_per_size * len(problem.variants) * positions * 8 * 2
    if test_bytes > ram / 4:
        where = f"every size {sizes[0]}..{sizes[-1]}" if grid == "every" else f"sizes {sizes}"
        return (
            f"task.train_lengths=[{lo},{hi}]: its test set ({t.test_per_size} instances "
            f"of {where}, task.test_multiple={t.test_multiple}) needs "
            f"{test_bytes / 2**30:.1f} GiB, over a quarter of this machine's "
            f"{ram / 2**30:.1f} GiB; lower the largest size, task.test_multiple or "
            f"task.test_per_size"
        )
    longest = longest_sequence(problem, hi, t.shape, options)
    scores = t.batch_size * n_heads * longest**2 * 4 * n_layers
    if cpu and scores > ram:
        return (
            f"task.train_lengths=[{lo},{hi}]: a training batch at size {hi} ({longest} "
            f"positions) holds {t.batch_size} x {n_heads} heads x {longest}^2 attention "
            f"scores in each of {n_layers} layers: {scores / 2**30:.1f} GiB, more than "
            f"this machine's {ram / 2**30:.1f} GiB; lower the largest size or "
            f"task.batch_size"
        )
    return None
