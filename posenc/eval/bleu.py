"""Corpus BLEU and chrF computed exactly the sacreBLEU way, overall and per source-length bucket.

Scores are computed by the ``sacrebleu`` package itself on detokenized text, so numbers are
comparable with published sacreBLEU numbers and :func:`signature` says exactly how they were
made. torchmetrics' ``SacreBLEUScore`` / ``CHRFScore`` were not used: they differ from
sacreBLEU (BLEU lacks the ``exp`` smoothing of zero n-gram counts, which matters for small
length buckets; chrF averages differently) and are about 50x slower.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache
from typing import TypedDict

from sacrebleu.metrics import BLEU, CHRF

from posenc.data.buckets import bucket_names, bucket_of, check_edges

__all__ = ["corpus_scores", "scores_by_bucket", "signature"]


class _BleuArgs(TypedDict):
    tokenize: str
    smooth_method: str
    lowercase: bool
    effective_order: bool


class _ChrfArgs(TypedDict):
    char_order: int
    word_order: int
    beta: int
    whitespace: bool
    lowercase: bool


# sacreBLEU's defaults, spelled out so a sacreBLEU upgrade that changed a default cannot
# silently change what "bleu" and "chrf" mean here.
_BLEU_ARGS: _BleuArgs = {
    "tokenize": "13a",
    "smooth_method": "exp",
    "lowercase": False,
    "effective_order": False,
}
_CHRF_ARGS: _ChrfArgs = {
    "char_order": 6,
    "word_order": 0,
    "beta": 2,
    "whitespace": False,
    "lowercase": False,
}


def _check_pairs(hyps: Sequence[str], refs: Sequence[str]) -> None:
    if isinstance(hyps, str) or isinstance(refs, str):
        raise TypeError(
            "hyps and refs must be lists of sentences, got a single str; wrap it in a list, "
            "e.g. corpus_scores([hyp], [ref])."
        )
    if len(hyps) != len(refs):
        raise ValueError(
            f"got {len(hyps)} hypotheses but {len(refs)} references; there must be exactly one "
            "reference per hypothesis, in the same order."
        )
    for name, items in (("hyps", hyps), ("refs", refs)):
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise TypeError(
                    f"{name}[{i}] is a {type(item).__name__}, expected a detokenized str; "
                    "decode token ids with the tokenizer before scoring."
                )
            if "\n" in item:
                # sacreBLEU scores one segment per line; an embedded newline would silently
                # shift every following hypothesis against the wrong reference in file output.
                raise ValueError(
                    f"{name}[{i}] contains a newline ({item!r}); each entry must be one "
                    "sentence. Replace newlines with spaces before scoring."
                )


def corpus_scores(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, float]:
    """Corpus-level BLEU and chrF of detokenized hypotheses against one reference each.

    BLEU uses sacreBLEU's 13a tokenization, mixed case and ``exp`` smoothing; chrF uses
    character n-grams up to order 6, no word n-grams, beta 2, whitespace ignored. Both
    aggregate n-gram statistics over the whole corpus (they are not sentence averages).

    Args:
        hyps: N system outputs, detokenized (plain text as a person would read it).
        refs: N references, raw text, aligned with ``hyps``.

    Returns:
        ``{"bleu": float, "chrf": float}``, both on the 0-100 scale.

    Raises:
        ValueError: Lengths differ, the corpus is empty, or an entry contains a newline.
        TypeError: An entry is not a str.
    """
    _check_pairs(hyps, refs)
    if len(hyps) == 0:
        raise ValueError(
            "cannot score an empty corpus (0 hypotheses); pass at least one sentence. "
            "scores_by_bucket reports empty buckets as NaN instead."
        )
    hyps, ref_stream = list(hyps), [list(refs)]
    bleu = BLEU(**_BLEU_ARGS).corpus_score(hyps, ref_stream).score
    chrf = CHRF(**_CHRF_ARGS).corpus_score(hyps, ref_stream).score
    return {"bleu": float(bleu), "chrf": float(chrf)}


@cache
def signature() -> str:
    """Describe exactly how :func:`corpus_scores` computes its numbers (sacreBLEU signatures).

    Returns:
        E.g. ``"BLEU: nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0; chrF2:
        nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:2.6.0"``.
    """
    # sacreBLEU only knows nrefs after scoring something, so score a one-word dummy corpus.
    bleu, chrf = BLEU(**_BLEU_ARGS), CHRF(**_CHRF_ARGS)
    bleu.corpus_score(["a"], [["a"]])
    chrf.corpus_score(["a"], [["a"]])
    return f"BLEU: {bleu.get_signature()}; chrF2: {chrf.get_signature()}"


def scores_by_bucket(
    hyps: Sequence[str],
    refs: Sequence[str],
    src_lengths: Sequence[int],
    edges: Sequence[int],
) -> dict[str, dict[str, float]]:
    """Corpus BLEU and chrF within each source-length bucket.

    Each sentence falls into exactly one bucket (see :func:`posenc.data.buckets.bucket_of`); each
    bucket is scored as its own corpus, so its BLEU is not an average of sentence BLEUs.

    Args:
        hyps: N detokenized system outputs.
        refs: N raw references, aligned with ``hyps``.
        src_lengths: N tokenized source lengths, aligned with ``hyps``.
        edges: Increasing bucket edges starting at 0, e.g. ``[0, 10, 20, 30, 40, 1000]``.

    Returns:
        One entry per bucket in edge order, e.g. ``{"len0-10": {"n": 312, "bleu": 41.2,
        "chrf": 63.0}, ..., "len40+": {...}}``. ``n`` counts the bucket's sentences (the n
        values sum to N); an empty bucket has ``n == 0`` and NaN scores.

    Raises:
        ValueError: Lengths of the inputs differ, or the edges are invalid.
    """
    _check_pairs(hyps, refs)
    if len(src_lengths) != len(hyps):
        raise ValueError(
            f"got {len(src_lengths)} source lengths for {len(hyps)} hypotheses; pass one "
            "tokenized source length per sentence, in the same order."
        )
    check_edges(edges)
    members: dict[str, list[int]] = {name: [] for name in bucket_names(edges)}
    for i, length in enumerate(src_lengths):
        members[bucket_of(length, edges)].append(i)
    out: dict[str, dict[str, float]] = {}
    for name, idx in members.items():
        if idx:
            scores = corpus_scores([hyps[i] for i in idx], [refs[i] for i in idx])
        else:
            scores = {"bleu": math.nan, "chrf": math.nan}
        out[name] = {"n": len(idx), **scores}
    return out
