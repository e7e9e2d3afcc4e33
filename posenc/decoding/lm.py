"""Text generation from a decoder-only LM: greedy, temperature and top-k sampling.

Notation: B prompts, P prompt length, N new tokens, V vocabulary.

With the key/value cache (the default) the prompt runs once and each step feeds only the
newest token; ``use_cache=False`` re-runs the model over the whole sequence at every step
(the reference, and the baseline of ``experiments/bench.py --sections decode``). Both
give the same tokens for the same seed (tested). Positions continue past the training
length as far as the encoder allows (learned absolute positions stop at ``max_len``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posenc.decoding.graphs import GraphedStep
from posenc.model import DecoderLM
from posenc.model.streaming import Streaming
from posenc.stop import check as check_stop


def next_token(logits: Tensor, *, temperature: float, top_k: int | None, generator=None) -> Tensor:
    """Pick one token per row from ``logits (B, V)``: the argmax at temperature 0, else a
    sample from the softmax of ``logits / temperature`` over the ``top_k`` best."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(
    model: DecoderLM,
    prompt: Tensor,
    new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    pad: Tensor | None = None,
    streaming: Streaming | None = None,
    graphs: bool | None = None,
    progress: Callable[[int], None] | None = None,
) -> Tensor:
    """Continue each prompt by ``new_tokens`` tokens.

    Put the model in eval mode first.

    Args:
        model: The LM.
        prompt: ``(B, P)`` token ids, P >= 1.
        new_tokens: N >= 0.
        temperature: 0 for greedy decoding; else the sampling temperature.
        top_k: Sample among the k most probable tokens (None: all).
        seed: Seed of the sampling generator (None: torch's global one).
        use_cache: Decode with the key/value cache.
        pad: ``(B,)`` left padding of prompts of different lengths (each row's positions
            then start at its first real token; padding is never attended). Needs the
            cache.
        streaming: StreamingLLM's sinks and window (:mod:`posenc.model.streaming`): each
            step sees the first ``sinks`` tokens and the last ``window``, at positions
            re-indexed inside that cache; the same tokens with and without the cache.
            None: every token seen.
        graphs: Replay the cached single-token step from a CUDA graph
            (:mod:`posenc.decoding.graphs`; the same tokens, one launch per token).
            None: on a CUDA device with the cache. A scheme whose step cannot be
            replayed decodes eagerly.
        progress: Called with the number of tokens generated so far after each step (a
            host-side count: it reads no tensor).

    Returns:
        ``(B, P + N)``: the prompts and their continuations.

    Raises:
        ValueError: An empty prompt, a negative count or temperature, ``top_k < 1``;
            ``streaming`` with left-padded prompts (the sinks are each row's first tokens,
            at different slots) or with a model it cannot apply to.
        StopRequested: :func:`posenc.stop.request_stop` was called during generation.
    """
    if graphs is None:
        graphs = use_cache and prompt.device.type == "cuda"
    if graphs and (not use_cache or prompt.device.type != "cuda"):
        raise ValueError(
            f"graphs=True replays the cached step on a CUDA device; got use_cache={use_cache} "
            f"on {prompt.device.type}: pass graphs=None (automatic) or False"
        )
    if prompt.dim() != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be (B, P) token ids with P >= 1, got {tuple(prompt.shape)}")
    if new_tokens < 0 or temperature < 0 or (top_k is not None and top_k < 1):
        raise ValueError(
            f"need new_tokens >= 0, temperature >= 0 and top_k >= 1 or None; got {new_tokens}, "
            f"{temperature}, {top_k}"
        )
    model.encoder.check_length(prompt.shape[1] + new_tokens)
    gen = None
    if seed is not None:
        gen = torch.Generator(device=prompt.device).manual_seed(seed)
    if pad is not None and not use_cache:
        raise ValueError("left-padded prompts (pad=...) are decoded with the cache only")
    if pad is not None and streaming is not None:
        raise ValueError(
            "streaming=... takes prompts of one length (no pad=...): the sinks are the first "
            "tokens of every row; decode rows of different lengths one at a time"
        )
    args = (model, prompt, new_tokens, temperature, top_k, gen, use_cache, pad, graphs, progress)
    if streaming is None:  # any model that decodes (a test's stand-in too)
        return _continue(*args)
    with model.streaming(streaming):
        return _continue(*args)


def _continue(
    model: DecoderLM,
    prompt: Tensor,
    new_tokens: int,
    temperature: float,
    top_k: int | None,
    gen: torch.Generator | None,
    use_cache: bool,
    pad: Tensor | None,
    graphs: bool,
    progress: Callable[[int], None] | None,
) -> Tensor:
    """:func:`generate`'s loop, its arguments checked."""
    out = prompt
    # The static cache holds the prompt and every token fed back (the last one is not).
    cache = model.new_cache(prompt.shape[1] + max(new_tokens - 1, 0), pad) if use_cache else None

    def cached(ids: Tensor) -> Tensor:
        return model(ids, cache=cache)[:, -1]

    # The prompt's step has its own shape (eager); the one-token steps may replay a graph.
    step: Callable[[Tensor], Tensor] = cached
    if cache is not None and graphs:
        step = GraphedStep(cached, cache)
    step_in = prompt
    for n in range(new_tokens):
        check_stop("generation")
        if cache is None:
            logits = model(out)[:, -1]
        else:
            logits = cached(step_in) if n == 0 else step(step_in)
        tok = next_token(logits, temperature=temperature, top_k=top_k, generator=gen)[:, None]
        out = torch.cat((out, tok), dim=1)
        step_in = tok
        if progress is not None:
            progress(n + 1)
    return out
