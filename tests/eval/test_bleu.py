"""BLEU/chrF: exact values against an independent implementation of the published formulas."""

from __future__ import annotations

import gzip
import math
import random
from collections import Counter
from pathlib import Path

import pytest

from posenc.data.buckets import bucket_names, bucket_of
from posenc.data.download import data_dir
from posenc.eval.bleu import corpus_scores, scores_by_bucket, signature


def _ngrams(items: list[str] | str, n: int) -> Counter:
    return Counter(tuple(items[i : i + n]) for i in range(len(items) - n + 1))


def hand_bleu(hyps: list[str], refs: list[str]) -> float:
    """Corpus BLEU (Papineni et al. 2002) with sacreBLEU's ``exp`` smoothing.

    Inputs must already be tokenized with single spaces, so 13a tokenization is the identity.
    Clipped n-gram matches and totals are summed over the corpus; the k-th order whose match
    count is zero gets precision 1 / (2^k * total).
    """
    matches, totals = [0] * 4, [0] * 4
    hyp_len = ref_len = 0
    for hyp, ref in zip(hyps, refs, strict=True):
        h, r = hyp.split(), ref.split()
        hyp_len, ref_len = hyp_len + len(h), ref_len + len(r)
        for n in range(1, 5):
            hc, rc = _ngrams(h, n), _ngrams(r, n)
            matches[n - 1] += sum(min(c, rc[g]) for g, c in hc.items())
            totals[n - 1] += max(len(h) - n + 1, 0)
    log_p, zeros = 0.0, 0
    for m, t in zip(matches, totals, strict=True):
        if m == 0:
            zeros += 1
            log_p += math.log(1 / (2**zeros * t))
        else:
            log_p += math.log(m / t)
    bp = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / hyp_len)
    return 100 * bp * math.exp(log_p / 4)


def hand_chrf(hyps: list[str], refs: list[str], order: int = 6, beta: float = 2.0) -> float:
    """Corpus chrF (Popovic 2015): whitespace removed, character n-gram precision and recall
    summed over the corpus per order, averaged over the orders present on both sides, then
    combined into an F-beta score."""
    hyp_tot, ref_tot, match = [0] * order, [0] * order, [0] * order
    for hyp, ref in zip(hyps, refs, strict=True):
        h, r = "".join(hyp.split()), "".join(ref.split())
        for n in range(1, order + 1):
            hc, rc = _ngrams(h, n), _ngrams(r, n)
            hyp_tot[n - 1] += sum(hc.values())
            ref_tot[n - 1] += sum(rc.values())
            match[n - 1] += sum(min(c, rc[g]) for g, c in hc.items())
    used = [i for i in range(order) if hyp_tot[i] > 0 and ref_tot[i] > 0]
    p = sum(match[i] / hyp_tot[i] for i in used) / len(used)
    r = sum(match[i] / ref_tot[i] for i in used) / len(used)
    if p + r == 0:
        return 0.0
    return 100 * (1 + beta**2) * p * r / (beta**2 * p + r)


def _read(name: str) -> list[str]:
    path = Path(data_dir()) / "multi30k" / name
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().split("\n")[:-1]


def test_references_against_themselves_score_100() -> None:
    refs = _read("test_2016_flickr.de.gz")
    assert len(refs) == 1000
    scores = corpus_scores(refs, refs)
    assert scores == {"bleu": pytest.approx(100.0), "chrf": pytest.approx(100.0)}


def test_bleu_matches_hand_computed_values() -> None:
    # 1-4-gram precisions 5/6, 3/5, 1/4 and 0/3 -> smoothed 1/(2*3); no brevity penalty.
    hyp, ref = "the cat sat on the mat", "the cat is on the mat"
    expected = 100 * (5 / 6 * 3 / 5 * 1 / 4 * 1 / 6) ** 0.25
    assert hand_bleu([hyp], [ref]) == pytest.approx(expected, abs=1e-12)
    assert corpus_scores([hyp], [ref])["bleu"] == pytest.approx(expected, abs=1e-9)

    # Short hypothesis: brevity penalty exp(1 - 8/6) on top of precisions 1, 4/5, 3/4, 2/3.
    hyp, ref = "the cat sat on the mat", "the cat sat on the red mat today"
    expected = 100 * math.exp(1 - 8 / 6) * (1 * 4 / 5 * 3 / 4 * 2 / 3) ** 0.25
    assert hand_bleu([hyp], [ref]) == pytest.approx(expected, abs=1e-12)
    assert corpus_scores([hyp], [ref])["bleu"] == pytest.approx(expected, abs=1e-9)


def test_bleu_applies_13a_tokenization_and_exp_smoothing() -> None:
    # 13a splits off the comma and "!", giving "Hello , world !" vs "Hello world !":
    # precisions 3/4, 1/3, then zero matches smoothed to 1/(2*2) and 1/(4*1).
    expected = 100 * (3 / 4 * 1 / 3 * 1 / 4 * 1 / 4) ** 0.25
    assert expected == pytest.approx(100 / math.sqrt(8))
    assert hand_bleu(["Hello , world !"], ["Hello world !"]) == pytest.approx(expected)
    assert corpus_scores(["Hello, world!"], ["Hello world!"])["bleu"] == pytest.approx(expected)
    # Mixed case: changing case costs matches.
    assert corpus_scores(["hello world"], ["Hello world"])["bleu"] < 100


def test_corpus_bleu_pools_statistics_over_sentences() -> None:
    hyps = ["a man rides a red bike .", "two dogs play in the snow .", "a child eats ."]
    refs = ["a man is riding a red bicycle .", "two dogs are playing in snow .", "a kid eats ."]
    expected = hand_bleu(hyps, refs)
    sentence_mean = sum(hand_bleu([h], [r]) for h, r in zip(hyps, refs, strict=True)) / 3
    assert abs(expected - sentence_mean) > 1  # pooled, not averaged
    assert corpus_scores(hyps, refs)["bleu"] == pytest.approx(expected, abs=1e-9)


def test_chrf_matches_hand_computed_values() -> None:
    # "ab" vs "abc": 1-grams P=1, R=2/3; 2-grams P=1, R=1/2; higher orders absent from the
    # hypothesis. avg P=1, avg R=7/12, F2 = 5PR / (4P + R) = 7/11.
    assert hand_chrf(["ab"], ["abc"]) == pytest.approx(700 / 11)
    assert corpus_scores(["ab"], ["abc"])["chrf"] == pytest.approx(700 / 11, abs=1e-9)

    hyps = ["Ein Mann fährt ein rotes Fahrrad.", "Zwei Hunde spielen im Schnee."]
    refs = ["Ein Mann fährt auf einem roten Rad.", "Zwei Hunde spielen draußen im Schnee."]
    assert corpus_scores(hyps, refs)["chrf"] == pytest.approx(hand_chrf(hyps, refs), abs=1e-9)


def test_scores_on_real_data_match_hand_formulas() -> None:
    # Space-tokenized, lower-cased German references with word drops and swaps as hypotheses;
    # the sentences contain no characters that 13a would split further.
    rng = random.Random(0)
    refs = []
    for line in _read("val.de.gz")[:200]:
        words = "".join(c if c.isalpha() or c == " " else " " for c in line.lower()).split()
        refs.append(" ".join(words))
    hyps = []
    for ref in refs:
        words = [w for w in ref.split() if rng.random() > 0.15]
        if len(words) > 3 and rng.random() < 0.3:
            words[0], words[1] = words[1], words[0]
        hyps.append(" ".join(words))
    scores = corpus_scores(hyps, refs)
    assert scores["bleu"] == pytest.approx(hand_bleu(hyps, refs), abs=1e-9)
    assert scores["chrf"] == pytest.approx(hand_chrf(hyps, refs), abs=1e-9)
    assert 20 < scores["bleu"] < 90


def test_signature_names_the_settings() -> None:
    sig = signature()
    for part in (
        "BLEU",
        "nrefs:1",
        "case:mixed",
        "tok:13a",
        "smooth:exp",
        "chrF2",
        "nc:6",
        "nw:0",
        "space:no",
        "version:",
    ):
        assert part in sig


def test_scores_by_bucket_cover_every_sentence_once() -> None:
    refs = _read("test_2016_flickr.de.gz")
    srcs = _read("test_2016_flickr.en.gz")
    hyps = [" ".join(r.split()[:-1]) for r in refs]  # drop each last word
    lengths = [len(s.split()) for s in srcs]
    edges = [0, 10, 15, 20, 1000]
    out = scores_by_bucket(hyps, refs, lengths, edges)
    assert list(out) == bucket_names(edges) == ["len0-10", "len10-15", "len15-20", "len20+"]
    assert sum(b["n"] for b in out.values()) == len(refs) == 1000
    for name, b in out.items():
        idx = [i for i, n in enumerate(lengths) if bucket_of(n, edges) == name]
        assert b["n"] == len(idx) > 0
        sub = corpus_scores([hyps[i] for i in idx], [refs[i] for i in idx])
        assert b["bleu"] == pytest.approx(sub["bleu"]) and b["chrf"] == pytest.approx(sub["chrf"])


def test_empty_bucket_has_zero_count_and_nan_scores() -> None:
    out = scores_by_bucket(["a b", "c d e f"], ["a b", "c d e f"], [3, 50], [0, 10, 20, 30])
    assert [b["n"] for b in out.values()] == [1, 0, 1]
    assert math.isnan(out["len10-20"]["bleu"]) and math.isnan(out["len10-20"]["chrf"])
    assert out["len20+"]["bleu"] == pytest.approx(100.0)


def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        corpus_scores(["a", "b"], ["a"])
    with pytest.raises(TypeError, match="single str"):
        corpus_scores("a", "a")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty corpus"):
        corpus_scores([], [])
    with pytest.raises(ValueError, match="newline"):
        corpus_scores(["a\nb"], ["a b"])
    with pytest.raises(ValueError, match="1 source lengths for 2 hypotheses"):
        scores_by_bucket(["a", "b"], ["a", "b"], [1], [0, 10])
    with pytest.raises(ValueError, match="start at 0"):
        scores_by_bucket(["a"], ["a"], [1], [5, 10])
