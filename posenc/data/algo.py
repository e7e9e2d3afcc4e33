"""Procedural algorithmic tasks for length generalization (``task=algo``).

Every instance is drawn from a seeded generator: no data files, and the answer of each
problem is plain Python that the tests recompute. An instance has a *size* ``n`` (what
"length" means for that problem, see :data:`PROBLEMS`), a prompt and an answer, both lists
of symbols. Models are trained on sizes in ``[lo, hi]`` and tested on sizes up to a
multiple of ``hi``.

Sequences the models see (ids from :class:`AlgoVocab`):

- decoder-only: ``BOS prompt SEP answer EOS``; the loss covers the answer and its EOS;
- encoder-decoder: source ``prompt``, target ``answer`` (as translation: the decoder reads
  ``BOS answer`` and predicts ``answer EOS``).

Instances are a pure function of ``(stream, index)``: the training stream is keyed by the
run's seed, the validation and test streams by the problem alone, so every seed and every
encoder is tested on the same instances.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, TypedDict

import pytorch_lightning as pl
import torch
from torch.utils.data import Dataset

__all__ = [
    "PROBLEMS",
    "AlgoVocab",
    "Problem",
    "buckets",
    "collate_decoder",
    "instance",
    "prompt_ids",
]

Instance = tuple[list[str], list[str]]  # (prompt symbols, answer symbols)

SPECIALS = ("<pad>", "<bos>", "<sep>", "<eos>")
PAD, BOS, SEP, EOS = range(len(SPECIALS))
LETTERS = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"


def _letters(rng: random.Random, n: int, k: int) -> list[str]:
    return [LETTERS[rng.randrange(k)] for _ in range(n)]


def _copy(rng: random.Random, n: int, k: int, rev: bool) -> Instance:
    x = _letters(rng, n, k)
    return x, list(x)


def _reverse(rng: random.Random, n: int, k: int, rev: bool) -> Instance:
    x = _letters(rng, n, k)
    return x, x[::-1]


def _duplicate(rng: random.Random, n: int, k: int, rev: bool) -> Instance:
    x = _letters(rng, n, k)
    return x, x + x


def _sort(rng: random.Random, n: int, k: int, rev: bool) -> Instance:
    x = _letters(rng, n, k)
    return x, sorted(x)


def _number(rng: random.Random, n: int) -> int:
    """A uniform n-digit number (no leading zero; 0..9 for n = 1)."""
    return rng.randrange(10 ** (n - 1) if n > 1 else 0, 10**n)


def _addition(rng: random.Random, n: int, k: int, rev: bool) -> Instance:
    a, b = _number(rng, n), _number(rng, n)
    order = (lambda s: s[::-1]) if rev else (lambda s: s)
    return [*order(str(a)), "+", *order(str(b))], list(order(str(a + b)))


def _parity(rng: random.Random, n: int, k: int, rev: bool) -> Instance:
    bits = [rng.choice("01") for _ in range(n)]
    return bits, [str(bits.count("1") % 2)]


def _modarith(rng: random.Random, n: int, k: int, rev: bool) -> Instance:
    expr = [str(rng.randrange(5))]
    for _ in range(n - 1):
        expr += [rng.choice("+-*"), str(rng.randrange(5))]
    # Usual precedence (* before + and -); Python's % is non-negative for a positive modulus.
    return expr, [str(eval("".join(expr)) % 5)]


@dataclass(frozen=True)
class Problem:
    """One algorithmic problem.

    Attributes:
        name: The ``task.problem`` value.
        size: What the size ``n`` counts.
        alphabet: The symbols of prompts and answers, given ``task.symbols``.
        make: ``(rng, n, symbols, reverse_digits) -> (prompt, answer)``.
        lengths: ``n -> (prompt length, longest answer)`` in symbols.
        min_size: The smallest valid size.
        letters: The problem draws from ``task.symbols`` letters.
    """

    name: str
    size: str
    alphabet: Callable[[int], list[str]]
    make: Callable[[random.Random, int, int, bool], Instance]
    lengths: Callable[[int], tuple[int, int]]
    min_size: int = 1
    letters: bool = False


def _letter_alphabet(k: int) -> list[str]:
    return list(LETTERS[:k])


def longest_sequence(problem: Problem, n: int, shape: str) -> int:
    """The most positions an instance of size ``n`` takes in one stack: decoder-only
    ``BOS prompt SEP answer EOS``; encoder-decoder, the longer of the source and the
    decoder's ``BOS answer`` / ``answer EOS``."""
    prompt, answer = problem.lengths(n)
    return prompt + answer + 3 if shape == "decoder" else max(prompt, answer + 1)


#: ``task.problem`` -> :class:`Problem`.
PROBLEMS: dict[str, Problem] = {
    p.name: p
    for p in (
        Problem("copy", "symbols to copy", _letter_alphabet, _copy, lambda n: (n, n), letters=True),
        Problem(
            "reverse",
            "symbols to reverse",
            _letter_alphabet,
            _reverse,
            lambda n: (n, n),
            letters=True,
        ),
        Problem(
            "duplicate",
            "symbols to write twice",
            _letter_alphabet,
            _duplicate,
            lambda n: (n, 2 * n),
            letters=True,
        ),
        Problem("sort", "symbols to sort", _letter_alphabet, _sort, lambda n: (n, n), letters=True),
        Problem(
            "addition",
            "digits per operand",
            lambda k: [*DIGITS, "+"],
            _addition,
            lambda n: (2 * n + 1, n + 1),
        ),
        Problem("parity", "bits", lambda k: ["0", "1"], _parity, lambda n: (n, 1)),
        Problem(
            "modarith",
            "operands in 0..4 of + - * (mod 5)",
            lambda k: ["0", "1", "2", "3", "4", "+", "-", "*"],
            _modarith,
            lambda n: (2 * n - 1, 1),
        ),
    )
}


class AlgoVocab:
    """Ids: the four specials (:data:`SPECIALS`), then the problem's alphabet."""

    def __init__(self, problem: Problem, symbols: int) -> None:
        self.tokens = [*SPECIALS, *problem.alphabet(symbols)]
        self.ids = {s: i for i, s in enumerate(self.tokens)}

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, symbols: Sequence[str]) -> list[int]:
        return [self.ids[s] for s in symbols]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.tokens[i] for i in ids)


def instance(
    problem: Problem, n: int, key: str, *, symbols: int = 16, reverse_digits: bool = False
) -> Instance:
    """The instance of size ``n`` of stream position ``key`` (a pure function of both)."""
    if n < problem.min_size:
        raise ValueError(f"problem {problem.name}: size {n} is below {problem.min_size}")
    rng = random.Random(f"{problem.name}:{n}:{key}")
    return problem.make(rng, n, symbols, reverse_digits)


def training_size(seed: int, index: int, lo: int, hi: int) -> int:
    """The size of training instance ``index``: uniform in ``[lo, hi]``, from the seed."""
    return random.Random(f"size:{seed}:{index}").randint(lo, hi)


def buckets(lo: int, hi: int, top: int, width: int) -> list[tuple[int, int]]:
    """Size buckets: the training range ``[lo, hi]``, then ranges of ``width`` sizes up to
    ``top`` (the last one may be shorter): ``buckets(1, 16, 48, 8)`` gives
    ``[(1, 16), (17, 24), (25, 32), (33, 40), (41, 48)]``."""
    edges = list(range(hi, top, width)) + [top]
    return [(lo, hi)] + [(a + 1, b) for a, b in pairwise(edges)]


def bucket_name(bucket: tuple[int, int]) -> str:
    return f"len{bucket[0]}-{bucket[1]}"


class _InstanceOptions(TypedDict):
    """The keyword options of :func:`instance`."""

    symbols: int
    reverse_digits: bool


class AlgoSet(Dataset):
    """Encoded instances ``(prompt ids, answer ids, size)``.

    Args:
        problem: The problem.
        vocab: Its vocabulary.
        sizes: The size of each item.
        keys: The stream key of each item.
        symbols: ``task.symbols``.
        reverse_digits: ``task.reverse_digits``.
    """

    def __init__(
        self,
        problem: Problem,
        vocab: AlgoVocab,
        sizes: Sequence[int],
        keys: Sequence[str],
        *,
        symbols: int,
        reverse_digits: bool,
    ) -> None:
        if len(sizes) != len(keys):
            raise ValueError(f"{len(sizes)} sizes but {len(keys)} keys")
        self.problem, self.vocab = problem, vocab
        self.sizes, self.keys = list(sizes), list(keys)
        self.options: _InstanceOptions = {"symbols": symbols, "reverse_digits": reverse_digits}

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> tuple[list[int], list[int], int]:
        prompt, answer = instance(self.problem, self.sizes[i], self.keys[i], **self.options)
        return self.vocab.encode(prompt), self.vocab.encode(answer), self.sizes[i]


class TrainingStream(AlgoSet):
    """``count`` training instances of sizes uniform in ``[lo, hi]``, drawn lazily from
    the run's seed (item ``i`` is the same instance in every process)."""

    def __init__(
        self,
        problem: Problem,
        vocab: AlgoVocab,
        lo: int,
        hi: int,
        count: int,
        seed: int,
        **options: Any,
    ) -> None:
        super().__init__(problem, vocab, [], [], **options)
        self.lo, self.hi, self.count, self.seed = lo, hi, count, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[list[int], list[int], int]:
        n = training_size(self.seed, i, self.lo, self.hi)
        prompt, answer = instance(self.problem, n, f"train:{self.seed}:{i}", **self.options)
        return self.vocab.encode(prompt), self.vocab.encode(answer), n


def evaluation_set(
    problem: Problem,
    vocab: AlgoVocab,
    split: str,
    sizes: Sequence[int],
    per_size: int,
    **options: Any,
) -> AlgoSet:
    """``per_size`` instances of every size, keyed by ``split`` only (the same for every
    seed and encoder)."""
    grid = [(n, i) for n in sizes for i in range(per_size)]
    return AlgoSet(
        problem, vocab, [n for n, _ in grid], [f"{split}:{i}" for _, i in grid], **options
    )


def prompt_ids(prompt: Sequence[int]) -> list[int]:
    """The decoder-only prompt: ``BOS prompt SEP`` (the model writes the answer next)."""
    return [BOS, *prompt, SEP]


def collate_decoder(examples: Sequence[tuple[list[int], list[int], int]]) -> dict[str, Any]:
    """Pad decoder-only sequences ``BOS prompt SEP answer EOS`` on the right.

    Returns:
        ``input`` (B, T) and ``target`` (B, T) long, the sequences without their last and
        first token; ``loss_mask`` (B, T) bool, True exactly where ``target`` is an answer
        token or the EOS after it; ``size`` (B,) long.
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
        "size": torch.tensor([n for _, _, n in examples]),
    }


def size_batches(sizes: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of one size each (evaluation batches need no padding
    of the prompt, so the cache decodes every row at the same positions)."""
    by_size: dict[int, list[int]] = {}
    for i, n in enumerate(sizes):
        by_size.setdefault(n, []).append(i)
    return [
        idx[j : j + batch_size]
        for _, idx in sorted(by_size.items())
        for j in range(0, len(idx), batch_size)
    ]


def collate_encdec(examples: Sequence[tuple[list[int], list[int], int]]) -> dict[str, Any]:
    """Encoder-decoder batches: the prompt as source, the answer as target (the keys of
    :class:`posenc.data.mt.MTCollator`, with ``size`` in place of ``index``)."""
    from posenc.data.mt import MTCollator

    batch = MTCollator(PAD, BOS, EOS)(examples)
    batch["size"] = batch.pop("index")
    return batch


def collate_eval(examples: Sequence[tuple[list[int], list[int], int]]) -> dict[str, Any]:
    """Evaluation batches of one size: ``prompt`` (B, P) for the decoder-only model
    (``BOS prompt SEP``), ``src`` (B, S) for the encoder-decoder (the bare prompt),
    ``answer`` (B, A) padded references, ``answer_len`` (B,) and ``size`` (B,)."""
    if len({len(p) for p, _, _ in examples}) != 1:
        raise ValueError("an evaluation batch must hold prompts of one length")
    a = max(len(ans) for _, ans, _ in examples)
    answer = torch.full((len(examples), a), PAD, dtype=torch.long)
    for row, (_, ans, _) in enumerate(examples):
        answer[row, : len(ans)] = torch.tensor(ans, dtype=torch.long)
    return {
        "prompt": torch.tensor([prompt_ids(p) for p, _, _ in examples]),
        "src": torch.tensor([p for p, _, _ in examples]),
        "answer": answer,
        "answer_len": torch.tensor([len(ans) for _, ans, _ in examples]),
        "size": torch.tensor([n for _, _, n in examples]),
    }


class Batches(Dataset):
    """Whole batches as items (each of one size), so a loader with ``batch_size=None`` and
    :class:`posenc.data.samplers.ShardSampler` splits them across ranks, each once."""

    def __init__(
        self,
        data: AlgoSet,
        batch_size: int,
        collate: Callable[[Sequence[tuple[list[int], list[int], int]]], dict],
    ) -> None:
        self.data, self.collate = data, collate
        self.batches = size_batches(data.sizes, batch_size)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.collate([self.data[j] for j in self.batches[i]])


class TrainingBatches(Dataset):
    """Training batches by step: item ``i`` is the batch of step ``start + i``, made of
    stream instances ``(start + i) * B .. (start + i + 1) * B - 1``, so a resumed run
    continues the stream where it stopped."""

    def __init__(
        self,
        stream: TrainingStream,
        batch_size: int,
        steps: int,
        start: int,
        collate: Callable[[Sequence[tuple[list[int], list[int], int]]], dict],
    ) -> None:
        self.stream, self.batch_size, self.collate = stream, batch_size, collate
        self.start, self.steps = start, max(steps - start, 1)

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> dict[str, Any]:
        first = (self.start + i) * self.batch_size
        return self.collate([self.stream[first + j] for j in range(self.batch_size)])


class AlgoDataModule(pl.LightningDataModule):
    """Training, validation and test data of one problem.

    Args:
        problem: ``task.problem``.
        shape: ``decoder`` or ``encdec`` (how batches are laid out).
        train_lengths: ``[lo, hi]`` training sizes.
        top: The largest test size.
        symbols: Letters of the sequence problems.
        reverse_digits: Addition with digits least-significant first.
        batch_size: Training instances per step.
        eval_batch_size: Evaluation instances per batch.
        steps: Training steps (the stream's length).
        val_per_size: Validation instances per training size.
        test_per_size: Test instances per size ``1 .. top`` (from the problem's smallest).
        seed: The training stream's seed.
    """

    def __init__(
        self,
        *,
        problem: str,
        shape: str,
        train_lengths: Sequence[int],
        top: int,
        symbols: int,
        reverse_digits: bool,
        batch_size: int,
        eval_batch_size: int,
        steps: int,
        val_per_size: int,
        test_per_size: int,
        seed: int,
    ) -> None:
        super().__init__()
        self.problem = PROBLEMS[problem]
        self.vocab = AlgoVocab(self.problem, symbols)
        self.shape = shape
        self.lo, self.hi = (int(x) for x in train_lengths)
        self.top = int(top)
        self.options = {"symbols": int(symbols), "reverse_digits": bool(reverse_digits)}
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.steps, self.seed = steps, seed
        self.val_per_size, self.test_per_size = val_per_size, test_per_size

    @property
    def collate(self) -> Callable[[Sequence[tuple[list[int], list[int], int]]], dict]:
        return collate_decoder if self.shape == "decoder" else collate_encdec

    def test_sizes(self) -> list[int]:
        return list(range(max(1, self.problem.min_size), self.top + 1))

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        trainer = getattr(self, "trainer", None)
        start = int(trainer.global_step) if trainer is not None else 0
        stream = TrainingStream(
            self.problem,
            self.vocab,
            self.lo,
            self.hi,
            self.steps * self.batch_size,
            self.seed,
            **self.options,
        )
        data = TrainingBatches(stream, self.batch_size, self.steps, start, self.collate)
        return torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)

    def _eval(
        self, split: str, sizes: list[int], per_size: int, collate: Callable
    ) -> torch.utils.data.DataLoader:
        from posenc.data.samplers import ShardSampler

        data = Batches(
            evaluation_set(self.problem, self.vocab, split, sizes, per_size, **self.options),
            self.eval_batch_size,
            collate,
        )
        return torch.utils.data.DataLoader(data, batch_size=None, sampler=ShardSampler(data))

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._eval("val", list(range(self.lo, self.hi + 1)), self.val_per_size, self.collate)

    def test_dataloader(self) -> torch.utils.data.DataLoader:
        return self._eval("test", self.test_sizes(), self.test_per_size, collate_eval)
