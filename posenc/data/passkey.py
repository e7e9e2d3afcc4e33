"""Passkey retrieval (Mohtashami & Jaggi 2023): a random key hidden at a chosen depth in
filler text; after a fixed question the model must write the key.

Notation: L instance length (tokens), F filler tokens, K key tokens, B batch.

An instance is exactly L tokens::

    filler[:d] + "The pass key is $" + key + ". " + filler[d:] + QUESTION + key

- **key**: ``key_len`` random lowercase letters (TinyShakespeare's characters hold almost
  no digits, and every letter is in any English vocabulary); chance is 26^-key_len.
- **filler**: one contiguous window of F = L - (needle + question + key) tokens of real
  text from a split's token stream (the test split for evaluation, the train split for
  the training mix), so the haystack is text the model was trained to read. The needle
  interrupts it at ``d = round(depth * F)``: depth 0 puts the needle first, depth 1
  right before the question.
- **question**: ``"\\nWhat is the pass key? The pass key is $"``; the prompt is
  everything before the trailing key, the answer is the key's K tokens.
- **the "$"** before the key, in the needle and after the question, makes finding it a
  one-token match (an induction head: attend to the token after the earlier "$"; "$"
  occurs once in all of TinyShakespeare) instead of a match of the 16 characters
  "The pass key is ".

The last answer token is predicted from position L - 2, so an instance of length L uses
the same positions as a perplexity window of L tokens (``learned`` runs up to max_len).
Everything is built on token ids, so any tokenizer works (K may then vary per key).
The training mix (:mod:`posenc.data.lm`) and the evaluation (:mod:`posenc.eval.passkey`)
build their instances here; the mix appends one token (the needle tail's ".") to an
instance of ``seq_len`` tokens, so its answers sit where a 1x instance's do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from posenc.data.tokenizers import Tokenizer

NEEDLE_HEAD = "The pass key is $"
NEEDLE_TAIL = ". "
QUESTION = "\nWhat is the pass key? The pass key is $"
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
DOC = (
    f"passkey@L: instances of exactly L tokens, filler[:d] + {NEEDLE_HEAD!r} + key + "
    f"{NEEDLE_TAIL!r} + filler[d:] + {QUESTION!r} + key, with a key of key_len random "
    "lowercase letters, filler a contiguous window of the split's text, d = round(depth * "
    "filler length); accuracy = exact match of the greedy (KV-cached) continuation of the "
    "prompt with the key"
)


@dataclass(frozen=True)
class Passkey:
    """One instance.

    Attributes:
        tokens: ``(L,)`` int64: the prompt, then the answer (the key's tokens).
        answer_len: K, the key's token count.
        key: The key's text.
        depth: The requested depth in [0, 1].
        needle_start: Index of the needle's first token (``round(depth * F)``).
        key_start: Index of the key's first token inside the needle.
    """

    tokens: Tensor
    answer_len: int
    key: str
    depth: float
    needle_start: int
    key_start: int

    @property
    def prompt(self) -> Tensor:
        """``(L - K,)``: everything before the answer."""
        return self.tokens[: -self.answer_len]

    @property
    def answer(self) -> Tensor:
        """``(K,)``: the key's tokens."""
        return self.tokens[-self.answer_len :]


def seeded(*parts: int) -> torch.Generator:
    """A CPU generator seeded by a tuple of integers (the same tuple, the same draws)."""
    seed = 0
    for p in parts:
        seed = (seed * 1_000_003 + int(p)) % (1 << 63)
    return torch.Generator().manual_seed(seed)


class PasskeyFormat:
    """The fixed texts of the task, encoded once with the run's tokenizer.

    Args:
        tokenizer: The LM's tokenizer.
        key_len: Letters per key (>= 1).

    Raises:
        ValueError: ``key_len < 1``, or the tokenizer cannot encode the format's text
            (a character vocabulary without these characters).
    """

    def __init__(self, tokenizer: Tokenizer, key_len: int) -> None:
        if isinstance(key_len, bool) or not isinstance(key_len, int) or key_len < 1:
            raise ValueError(f"key_len must be a positive int, got {key_len!r}")
        self.tokenizer = tokenizer
        self.key_len = key_len
        unknown = sorted(
            {
                c
                for c in NEEDLE_HEAD + NEEDLE_TAIL + QUESTION + ALPHABET
                if tokenizer.unk_id in tokenizer.encode(c)
            }
        )
        if unknown:
            raise ValueError(
                f"the tokenizer cannot encode {''.join(unknown)!r}, which the passkey format "
                f"needs ({QUESTION!r}, lowercase keys); train it on text with these characters"
            )
        self.head = tokenizer.encode(NEEDLE_HEAD)
        self.tail = tokenizer.encode(NEEDLE_TAIL)
        self.question = tokenizer.encode(QUESTION)
        # At most this many tokens for a key (K = key_len with a character tokenizer).
        self.max_key_tokens = key_len * max(len(tokenizer.encode(c)) for c in ALPHABET)

    def min_length(self) -> int:
        """The shortest instance length with at least one filler token, for any key."""
        return len(self.head) + len(self.tail) + len(self.question) + 2 * self.max_key_tokens + 1

    def sample(
        self, stream: Tensor, length: int, depths: Sequence[float], gen: torch.Generator
    ) -> list[Passkey]:
        """One key and one filler window, placed at each of ``depths``.

        Draws the key's letters, then the filler's start offset, from ``gen``.

        Args:
            stream: ``(n,)`` token stream of the split the filler comes from.
            length: L, the instance length.
            depths: Relative depths of the needle, each in [0, 1].
            gen: Random generator (e.g. :func:`seeded`).

        Returns:
            One instance per depth, all with the same key and filler.

        Raises:
            ValueError: L leaves no room for filler, the stream is shorter than the filler,
                or a depth is outside [0, 1].
        """
        letters = torch.randint(len(ALPHABET), (self.key_len,), generator=gen).tolist()
        key = "".join(ALPHABET[i] for i in letters)
        key_ids = self.tokenizer.encode(key)
        fixed = len(self.head) + 2 * len(key_ids) + len(self.tail) + len(self.question)
        filler_len = length - fixed
        if filler_len < 1:
            raise ValueError(
                f"a passkey instance of {length} tokens has no room for filler: the needle, "
                f"question and key take {fixed}; evaluate at lengths >= {self.min_length()}"
            )
        if stream.numel() < filler_len:
            raise ValueError(
                f"the filler stream has {stream.numel()} tokens, fewer than the {filler_len} "
                f"a passkey instance of length {length} needs"
            )
        start = int(torch.randint(stream.numel() - filler_len + 1, (), generator=gen))
        filler = stream[start : start + filler_len].to(torch.long)
        key_t = torch.tensor(key_ids, dtype=torch.long)
        needle = torch.cat(
            (
                torch.tensor(self.head, dtype=torch.long),
                key_t,
                torch.tensor(self.tail, dtype=torch.long),
            )
        )
        question = torch.tensor(self.question, dtype=torch.long)
        out = []
        for depth in depths:
            if not 0.0 <= depth <= 1.0:
                raise ValueError(f"depth must be in [0, 1], got {depth!r}")
            d = math.floor(depth * filler_len + 0.5)
            tokens = torch.cat((filler[:d], needle, filler[d:], question, key_t))
            out.append(Passkey(tokens, len(key_ids), key, float(depth), d, d + len(self.head)))
        return out

    def grid(
        self, stream: Tensor, length: int, depths: Sequence[float], samples: int, seed: int
    ) -> list[list[Passkey]]:
        """``samples`` keys at every depth: ``[i][j]`` is key i at ``depths[j]``.

        Instance i depends only on ``(seed, length, i)``, so every depth (and every run
        with the same seed) sees the same keys and filler windows.
        """
        return [
            self.sample(stream, length, depths, seeded(seed, length, i)) for i in range(samples)
        ]


def passkey_problems(
    lengths: Sequence[int],
    min_length: int,
    split_tokens: dict[str, int],
    eval_splits: Sequence[str],
    mix: float,
    seq_len: int,
) -> list[str]:
    """Problems with passkey lengths once the data is tokenized (the format's size in
    tokens depends on the tokenizer), a line each.

    Args:
        lengths: The passkey evaluation lengths.
        min_length: The shortest instance the format allows (:meth:`PasskeyFormat.min_length`).
        split_tokens: Tokens per split (filler comes from the evaluated splits, the
            training mix's from ``train``, its validation's from ``val``).
        eval_splits: The evaluated splits (``task.eval.splits``).
        mix: ``task.passkey_mix`` of a run that trains (0 for one that only evaluates).
        seq_len: ``task.seq_len``.
    """
    problems = []
    short = [n for n in lengths if n < min_length]
    if short:
        problems.append(
            f"task.eval.passkey.multipliers give lengths {short}, shorter than the "
            f"{min_length} tokens a passkey instance needs (needle, question, key, filler); "
            f"drop those multipliers or raise task.seq_len"
        )
    for split in eval_splits if lengths else []:
        if split_tokens[split] < max(lengths):
            problems.append(
                f"task.eval.passkey.multipliers give length {max(lengths)}, longer than the "
                f"{split!r} split ({split_tokens[split]} tokens) the filler comes from"
            )
    if mix and seq_len < min_length:
        problems.append(
            f"task.passkey_mix={mix}: training passkey instances of task.seq_len = "
            f"{seq_len} tokens are shorter than the {min_length} the format needs; raise "
            f"task.seq_len or set task.passkey_mix=0"
        )
    if mix and split_tokens.get("val", 0) < seq_len:
        problems.append(
            f"task.passkey_mix={mix}: validation checks retrieval at task.seq_len="
            f"{seq_len} with filler from the 'val' split, which has only "
            f"{split_tokens.get('val', 0)} tokens; lower task.seq_len or give the data a "
            f"longer validation split"
        )
    return problems
