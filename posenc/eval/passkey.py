"""Passkey retrieval's scoring (Mohtashami & Jaggi 2023): greedy continuation of each
instance's prompt (:mod:`posenc.data.passkey` builds the instances), exact match with
the key, accuracy by length and depth.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from posenc.data.passkey import DOC, Passkey, PasskeyFormat
from posenc.decoding.lm import generate
from posenc.progress import ticker

if TYPE_CHECKING:
    from posenc.model import DecoderLM

__all__ = ["DOC", "accuracy_grid", "correct", "evaluate_length", "greedy"]

Decode = Callable[[Tensor, int], Tensor]


def greedy(model: DecoderLM) -> Decode:
    """Greedy decoding with the key/value cache: ``(B, P), N -> (B, N)`` new tokens."""

    def decode(prompts: Tensor, new_tokens: int) -> Tensor:
        out = generate(model, prompts, new_tokens, temperature=0)
        return out[:, prompts.shape[1] :]

    return decode


def correct(
    decode: Decode,
    instances: Sequence[Passkey],
    *,
    batch_size: int,
    device: torch.device | str = "cpu",
    progress: Callable[[int], None] | None = None,
) -> list[bool]:
    """Whether each instance's continuation is exactly its key.

    Instances with equal prompt and answer lengths share a batch (no padding).

    Args:
        decode: ``(prompts (B, P), K) -> (B, K)`` tokens, e.g. :func:`greedy`.
        instances: The instances.
        batch_size: Instances per call of ``decode``.
        device: Where the prompts go.
        progress: Called with the number of instances done after every batch.

    Returns:
        One bool per instance, in order.
    """
    groups: dict[tuple[int, int], list[int]] = {}
    for i, inst in enumerate(instances):
        groups.setdefault((inst.tokens.numel(), inst.answer_len), []).append(i)
    hits = [False] * len(instances)
    done = 0
    for (_, k), idx in groups.items():
        for b in range(0, len(idx), batch_size):
            chunk = idx[b : b + batch_size]
            prompts = torch.stack([instances[i].prompt for i in chunk]).to(device)
            answers = torch.stack([instances[i].answer for i in chunk]).to(device)
            out = decode(prompts, k)
            match = (out == answers).all(dim=1).cpu()  # host read: the eval loop, not a forward
            for i, ok in zip(chunk, match.tolist(), strict=True):
                hits[i] = bool(ok)
            done += len(chunk)
            if progress is not None:
                progress(done)
    return hits


def accuracy_grid(hits: Sequence[Sequence[bool]]) -> list[float]:
    """Accuracy by depth from ``hits[i][j]`` (key i at depth j)."""
    n = len(hits)
    return [sum(row[j] for row in hits) / n for j in range(len(hits[0]))] if n else []


def evaluate_length(
    decode: Decode,
    fmt: PasskeyFormat,
    stream: Tensor,
    length: int,
    depths: Sequence[float],
    *,
    samples: int,
    seed: int,
    batch_size: int,
    device: torch.device | str = "cpu",
    log: Callable[[str], None] | None = None,
) -> list[float]:
    """Accuracy at each depth for instances of one length (``samples`` keys per depth).

    Args:
        log: Receives a progress line at most every 10 s and when the length is done.
    """
    grid = fmt.grid(stream, length, depths, samples, seed)
    flat = [inst for row in grid for inst in row]
    progress = (
        ticker(len(flat), "instances", lambda line: log(f"passkey L={length}: {line}"))
        if log is not None
        else None
    )

    hits = correct(decode, flat, batch_size=batch_size, device=device, progress=progress)
    per_key = [hits[i * len(depths) : (i + 1) * len(depths)] for i in range(samples)]
    return accuracy_grid(per_key)
