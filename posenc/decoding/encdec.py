"""Greedy and beam-search decoding for :class:`~posenc.model.EncoderDecoder`.

Notation: B sentences, K beams, S source length, T decoded prefix length (BOS included),
V vocabulary, C d_model.

Each step feeds only the newest token and attends to the earlier ones through the
decoder's key/value cache (:mod:`posenc.model.cache`), which every encoder supports and
which gives the logits of a full pass over the prefix (tests/model/test_cache.py);
``use_cache=False`` re-runs the decoder over the whole prefix instead. Sentences leave the
batch as soon as they finish (and the cache keeps their rows in step), so long sentences
do not keep short ones busy.

Lengths: ``max_len`` counts generated tokens *without* EOS. A hypothesis that has produced
``max_len`` tokens is forced to emit EOS, so no output is longer than ``max_len`` tokens.
Scores are sums of token log-probabilities, EOS included; PAD and BOS are never generated.

Both loops raise :class:`posenc.stop.StopRequested` at the next step once
:func:`posenc.stop.request_stop` is called (e.g. on SIGTERM).

Length penalty (beam search only): the GNMT one (Wu et al. 2016, eq. 14),
``lp(Y) = ((5 + |Y|) / 6) ** alpha`` with ``|Y|`` the generated tokens including EOS; finished
hypotheses are ranked by ``score / lp``. ``alpha = 0`` ranks by raw log-probability.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from posenc.model import EncoderDecoder
from posenc.model.cache import KVCache
from posenc.stop import check as check_stop

__all__ = ["Decoded", "beam_search", "gnmt_penalty", "greedy", "output_limits"]


class Decoded(NamedTuple):
    """Decoder outputs in input order.

    Attributes:
        tokens: One id list per sentence, without BOS and EOS.
        scores: ``(B,)`` sum of the log-probabilities of the output tokens and EOS.
    """

    tokens: list[list[int]]
    scores: Tensor


def output_limits(
    src_valid: Tensor, *, max_len_a: float, max_len_b: int, cap: int | None = None
) -> Tensor:
    """Per-sentence output budget ``floor(max_len_a * src_len + max_len_b)``.

    Args:
        src_valid: ``(B, S)`` True for real source tokens.
        max_len_a: Tokens allowed per source token (>= 0).
        max_len_b: Tokens allowed on top (>= 0).
        cap: Upper bound, e.g. the longest decoder input an absolute encoder can encode
            minus one for BOS; None for none.

    Returns:
        ``(B,)`` long, at least 1.

    Raises:
        ValueError: A negative ``max_len_a`` / ``max_len_b`` or a ``cap`` below 1.
    """
    if max_len_a < 0 or max_len_b < 0:
        raise ValueError(
            f"max_len_a={max_len_a} and max_len_b={max_len_b} must both be >= 0 "
            "(output budget = max_len_a * source length + max_len_b)."
        )
    if cap is not None and cap < 1:
        raise ValueError(f"cap={cap} must be >= 1 or None.")
    src_len = src_valid.sum(-1).double()
    limit = (max_len_a * src_len + max_len_b).floor().long().clamp(min=1)
    return limit if cap is None else limit.clamp(max=cap)


def gnmt_penalty(length: Tensor | int, alpha: float) -> Tensor:
    """GNMT length penalty ``((5 + length) / 6) ** alpha``; 1 for ``alpha == 0``."""
    length = torch.as_tensor(length, dtype=torch.float64)
    return ((5.0 + length) / 6.0) ** alpha


def _limits(max_len: int | Tensor, b: int, device: torch.device) -> Tensor:
    limit = torch.as_tensor(max_len, dtype=torch.long, device=device).expand(b).clone()
    if (limit < 0).any():
        raise ValueError(f"max_len must be >= 0 for every sentence, got {limit.tolist()}.")
    return limit


def cache_size(limit: Tensor) -> int:
    """Decoder inputs a static cache must hold for budgets ``limit (B,)``: BOS and up to
    ``max(limit)`` generated tokens fed back (EOS, forced at the budget, never is)."""
    return 1 + int(limit.max()) if limit.numel() else 1


def _next_log_probs(
    model: EncoderDecoder,
    prefix: Tensor,
    memory: Tensor,
    src_valid: Tensor | None,
    limit: Tensor,
    *,
    bos: int,
    eos: int,
    pad: int,
    cache: KVCache | None = None,
) -> Tensor:
    """Log-probabilities ``(N, V)`` of the token after each prefix ``(N, T)``.

    PAD and BOS are ruled out; rows whose prefix already holds ``limit`` generated tokens
    may only continue with EOS. With a ``cache``, only the tokens it has not seen run.
    """
    if cache is None:
        logits = model.decode(prefix, memory, src_valid=src_valid)[:, -1]  # (N, V)
    else:
        new = prefix[:, cache.length :]
        logits = model.decode(new, memory, src_valid=src_valid, cache=cache)[:, -1]
    logp = logits.float().log_softmax(-1)
    logp[:, [pad, bos]] = float("-inf")
    full = (prefix.shape[1] - 1) >= limit  # (N,) generated tokens == budget
    if full.any():
        # Keep the model's own EOS log-prob so scores stay the model's scores.
        eos_logp = logp[full, eos]
        logp[full] = float("-inf")
        logp[full, eos] = eos_logp
    return logp


def _check_ids(bos: int, eos: int, pad: int) -> None:
    if len({bos, eos, pad}) != 3:
        raise ValueError(f"bos={bos}, eos={eos} and pad={pad} must be three different ids.")


@torch.no_grad()
def greedy(
    model: EncoderDecoder,
    src: Tensor,
    src_valid: Tensor | None,
    *,
    bos: int,
    eos: int,
    max_len: int | Tensor,
    pad: int = 0,
    use_cache: bool = True,
) -> Decoded:
    """Pick the most probable next token until EOS or the length budget.

    Put the model in eval mode first (dropout would make the output random).

    Args:
        model: The translator.
        src: ``(B, S)`` source ids.
        src_valid: ``(B, S)`` True for real source tokens, or None for no padding.
        bos: Id that starts every decoder input.
        eos: Id that ends a hypothesis.
        max_len: Most tokens to generate, EOS not counted: an int or ``(B,)`` per sentence
            (see :func:`output_limits`).
        pad: Padding id (never generated).
        use_cache: Decode with the key/value cache (the same output, faster).

    Returns:
        :class:`Decoded` in input order.

    Raises:
        StopRequested: :func:`posenc.stop.request_stop` was called while decoding.
    """
    _check_ids(bos, eos, pad)
    b, device = src.shape[0], src.device
    limit = _limits(max_len, b, device)
    cache = model.new_cache(cache_size(limit)) if use_cache else None
    memory = model.encode(src, src_valid)  # (B, S, C)
    alive = torch.arange(b, device=device)  # input row of each remaining row
    prefix = torch.full((b, 1), bos, dtype=torch.long, device=device)  # (b, T)
    score = torch.zeros(b, dtype=torch.float64, device=device)
    tokens: list[list[int]] = [[] for _ in range(b)]
    scores = torch.zeros(b, dtype=torch.float64, device=device)
    while alive.numel():
        check_stop("greedy decoding")
        logp = _next_log_probs(
            model, prefix, memory, src_valid, limit, bos=bos, eos=eos, pad=pad, cache=cache
        )
        # topk rather than argmax: beam search ranks with topk, so ties break the same way.
        best, tok = logp.topk(1, dim=-1)  # (b, 1)
        score = score + best[:, 0].double()
        prefix = torch.cat([prefix, tok], dim=1)
        done = tok[:, 0] == eos
        for row in done.nonzero()[:, 0].tolist():
            i = int(alive[row])
            tokens[i] = prefix[row, 1:-1].tolist()
            scores[i] = score[row]
        keep = ~done
        alive, prefix, score, limit = alive[keep], prefix[keep], score[keep], limit[keep]
        memory = memory[keep]
        if cache is not None:
            cache.select(keep.nonzero()[:, 0])
        src_valid = None if src_valid is None else src_valid[keep]
    return Decoded(tokens, scores)


@torch.no_grad()
def beam_search(
    model: EncoderDecoder,
    src: Tensor,
    src_valid: Tensor | None,
    *,
    beam_size: int,
    length_penalty: float,
    bos: int,
    eos: int,
    max_len: int | Tensor,
    pad: int = 0,
    use_cache: bool = True,
) -> Decoded:
    """Batched beam search with the GNMT length penalty (see the module docstring).

    Each step extends every live hypothesis by every token and takes the best ``2K`` of the
    ``K * V`` candidates of each sentence. EOS candidates among the best ``K`` become finished
    hypotheses; the best ``K`` non-EOS candidates form the next beam. A sentence is done once it
    has ``K`` finished hypotheses (or its budget is used up, which forces EOS); its output is
    the finished hypothesis with the best ``score / lp``. With ``K = 1`` this is exactly
    :func:`greedy`.

    Put the model in eval mode first.

    Args:
        model: The translator.
        src: ``(B, S)`` source ids.
        src_valid: ``(B, S)`` True for real source tokens, or None for no padding.
        beam_size: K >= 1.
        length_penalty: GNMT alpha >= 0 (0: rank by raw log-probability).
        bos: Id that starts every decoder input.
        eos: Id that ends a hypothesis.
        max_len: Most tokens to generate, EOS not counted: an int or ``(B,)`` per sentence.
        pad: Padding id (never generated).
        use_cache: Decode with the key/value cache (the same output, faster).

    Returns:
        :class:`Decoded` in input order; ``scores`` are raw log-probabilities (no penalty).

    Raises:
        ValueError: ``beam_size < 1`` or ``length_penalty < 0``.
        StopRequested: :func:`posenc.stop.request_stop` was called while decoding.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size={beam_size} must be >= 1 (1 is greedy decoding).")
    if length_penalty < 0:
        raise ValueError(f"length_penalty={length_penalty} must be >= 0 (GNMT alpha).")
    _check_ids(bos, eos, pad)
    b, k, device = src.shape[0], beam_size, src.device
    limit = _limits(max_len, b, device)
    cache = model.new_cache(cache_size(limit)) if use_cache else None
    memory = model.encode(src, src_valid).repeat_interleave(k, dim=0)  # (B*K, S, C)
    valid = None if src_valid is None else src_valid.repeat_interleave(k, dim=0)
    alive = torch.arange(b, device=device)
    prefix = torch.full((b * k, 1), bos, dtype=torch.long, device=device)  # (b*K, T)
    # Only beam 0 is live at the start, so the first step does not pick K copies of one token.
    score = torch.full((b, k), float("-inf"), dtype=torch.float64, device=device)
    score[:, 0] = 0.0
    # Per input sentence: finished (penalised score, raw score, tokens).
    finished: list[list[tuple[float, float, list[int]]]] = [[] for _ in range(b)]
    while alive.numel():
        check_stop("beam search")
        n, t = alive.numel(), prefix.shape[1]
        logp = _next_log_probs(
            model,
            prefix,
            memory,
            valid,
            limit.repeat_interleave(k),
            bos=bos,
            eos=eos,
            pad=pad,
            cache=cache,
        )
        v = logp.shape[-1]
        cand = (score[:, :, None] + logp.view(n, k, v).double()).view(n, k * v)
        top, idx = cand.topk(min(2 * k, k * v), dim=-1)  # (n, 2K), best first
        beam, tok = idx // v, idx % v
        is_eos = tok == eos

        # Finish EOS candidates ranked within the best K (finite: from a live hypothesis).
        lp = float(gnmt_penalty(t, length_penalty))
        hits = (is_eos[:, :k] & top[:, :k].isfinite()).nonzero().tolist()
        for row, j in hits:
            src_row = row * k + int(beam[row, j])
            raw = float(top[row, j])
            finished[int(alive[row])].append((raw / lp, raw, prefix[src_row, 1:].tolist()))
        n_fin = torch.tensor([len(finished[int(i)]) for i in alive], device=device)
        done = (n_fin >= k) | (t - 1 >= limit)  # budget used: EOS was forced this step

        # Next beam: the best K non-EOS candidates (there are >= K among the best 2K).
        rank = torch.where(is_eos, torch.full_like(top, float("-inf")), top)
        rank_top, pick = rank.topk(k, dim=-1)  # (n, K)
        rows = torch.arange(n, device=device)[:, None] * k + beam.gather(1, pick)  # (n, K)
        prefix = torch.cat([prefix[rows.flatten()], tok.gather(1, pick).view(-1, 1)], dim=1)
        score = rank_top

        keep = ~done
        keep_rows = keep.repeat_interleave(k)
        alive, score, limit = alive[keep], score[keep], limit[keep]
        prefix, memory = prefix[keep_rows], memory[keep_rows]
        valid = None if valid is None else valid[keep_rows]
        if cache is not None:  # each new hypothesis continues its parent's cache
            cache.select(rows.flatten()[keep_rows])

    tokens: list[list[int]] = []
    scores = torch.empty(b, dtype=torch.float64, device=device)
    for i, hyps in enumerate(finished):
        _, raw, ids = max(hyps, key=lambda h: h[0])
        tokens.append(ids)
        scores[i] = raw
    return Decoded(tokens, scores)
