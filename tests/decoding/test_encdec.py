"""Greedy and beam search: equivalences, optimality on an exhaustible space, EOS and budgets."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor

from posenc.decoding.encdec import beam_search, gnmt_penalty, greedy, output_limits
from posenc.model import EncoderDecoder
from tests.conftest import BIDIRECTIONAL_YAMLS

PAD, BOS, EOS = 0, 1, 2


def _model(encoder: str = "rope", vocab: int = 12, seed: int = 0) -> EncoderDecoder:
    """A random translator whose outputs depend on source and prefix.

    With the training initialisation a random model repeats one token whatever the input,
    which would make the comparisons below trivial; N(0, 0.5) weights give varied outputs.
    """
    torch.manual_seed(seed)
    model = EncoderDecoder(
        src_vocab_size=vocab,
        tgt_vocab_size=vocab,
        encoder=encoder,
        n_layers=1,
        d_model=16,
        n_heads=2,
        d_ff=32,
        dropout=0.0,
    )
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model.eval()


def _batch(vocab: int, lengths: list[int], seed: int = 0) -> tuple[Tensor, Tensor]:
    """Random sources ``(B, S)`` right-padded to the longest, and their ``(B, S)`` mask."""
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    src = torch.randint(3, vocab, (len(lengths), s), generator=g)
    valid = torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]
    return src.masked_fill(~valid, PAD), valid


@torch.no_grad()
def _teacher_forced_score(
    model: EncoderDecoder, src: Tensor, valid: Tensor, hyps: list[list[int]]
) -> Tensor:
    """Sum of log p(token | prefix) over each hypothesis and its EOS, one sentence per row."""
    out = []
    for row, ids in enumerate(hyps):
        tgt_in = torch.tensor([[BOS, *ids]])
        tgt_out = torch.tensor([[*ids, EOS]])
        logp = model(src[row : row + 1], tgt_in, valid[row : row + 1]).float().log_softmax(-1)
        out.append(logp.gather(-1, tgt_out[..., None]).sum().double())
    return torch.stack(out)


@pytest.mark.parametrize("encoder", ["rope", "shaw", "learned", "xl"])
def test_beam_size_one_is_greedy(encoder: str) -> None:
    model = _model(encoder)
    src, valid = _batch(12, [5, 2, 7, 4])
    limit = output_limits(valid, max_len_a=1.5, max_len_b=3)
    g = greedy(model, src, valid, bos=BOS, eos=EOS, max_len=limit)
    b = beam_search(
        model, src, valid, beam_size=1, length_penalty=0.6, bos=BOS, eos=EOS, max_len=limit
    )
    assert g.tokens == b.tokens
    torch.testing.assert_close(g.scores, b.scores)


def test_scores_are_the_models_log_probs_of_the_outputs() -> None:
    """Catches beam bookkeeping errors: a reordered prefix would not score as reported."""
    model = _model("shaw")
    src, valid = _batch(12, [4, 7, 2])
    for k in (1, 3, 5):
        out = beam_search(
            model, src, valid, beam_size=k, length_penalty=0.6, bos=BOS, eos=EOS, max_len=6
        )
        assert all(EOS not in ids and BOS not in ids and PAD not in ids for ids in out.tokens)
        ref = _teacher_forced_score(model, src, valid, out.tokens)
        torch.testing.assert_close(out.scores, ref, atol=1e-4, rtol=0)


def test_huge_beam_finds_the_exact_best_hypothesis() -> None:
    """Vocabulary {3, 4, 5} and at most 3 tokens: 40 hypotheses, all of which a beam of 64
    keeps, so beam search must return the brute-force optimum."""
    model = _model(vocab=6, seed=3)
    src, valid = _batch(6, [4], seed=3)
    hyps = [list(p) for n in range(4) for p in itertools.product((3, 4, 5), repeat=n)]
    scores = _teacher_forced_score(
        model, src.expand(len(hyps), -1), valid.expand(len(hyps), -1), hyps
    )
    best = int(scores.argmax())
    out = beam_search(
        model, src, valid, beam_size=64, length_penalty=0.0, bos=BOS, eos=EOS, max_len=3
    )
    assert out.tokens == [hyps[best]]
    torch.testing.assert_close(out.scores[0], scores[best], atol=1e-4, rtol=0)
    # With a length penalty the ranking is by score / lp over the same 40 hypotheses.
    lp = gnmt_penalty(torch.tensor([len(h) + 1 for h in hyps]), 1.0)
    best_lp = int((scores / lp).argmax())
    out = beam_search(
        model, src, valid, beam_size=64, length_penalty=1.0, bos=BOS, eos=EOS, max_len=3
    )
    assert out.tokens == [hyps[best_lp]]


class _Count:
    """Stand-in cache of :class:`_Scripted`: the decoded length and row selection."""

    def __init__(self) -> None:
        self.length = 0

    def select(self, rows: Tensor) -> None:
        pass


class _Scripted(torch.nn.Module):
    """Stand-in translator: the next token is ``script[step]`` (EOS after the script)."""

    def __init__(self, script: list[int], vocab: int = 8) -> None:
        super().__init__()
        self.script, self.vocab = script, vocab

    def encode(self, src: Tensor, src_valid: Tensor | None = None) -> Tensor:
        return torch.zeros(src.shape[0], src.shape[1], 4)

    def new_cache(self, size: int) -> _Count:
        return _Count()  # counts the decoded positions only

    def decode(
        self,
        tgt_in: Tensor,
        memory: Tensor,
        *,
        src_valid: Tensor | None = None,
        cache: _Count | None = None,
    ) -> Tensor:
        n, t = tgt_in.shape
        if cache is not None:
            cache.length += t
            t = cache.length
        step = t - 1
        nxt = self.script[step] if step < len(self.script) else EOS
        logits = torch.zeros(n, t, self.vocab)
        logits[:, -1, nxt] = 10.0
        return logits


@pytest.mark.parametrize("k", [1, 3])
def test_decoding_stops_at_eos(k: int) -> None:
    model = _Scripted([5, 6, EOS, 7, 7])
    src, valid = torch.full((2, 3), 4), torch.ones(2, 3, dtype=torch.bool)
    out = beam_search(
        model, src, valid, beam_size=k, length_penalty=0.0, bos=BOS, eos=EOS, max_len=20
    )
    assert out.tokens == [[5, 6], [5, 6]]
    assert greedy(model, src, valid, bos=BOS, eos=EOS, max_len=20).tokens == [[5, 6], [5, 6]]


@pytest.mark.parametrize("k", [1, 3])
def test_decoding_respects_per_sentence_budgets(k: int) -> None:
    model = _Scripted([5] * 50)  # never wants to stop
    src, valid = _batch(8, [3, 1, 6])
    limit = output_limits(valid, max_len_a=1.0, max_len_b=2)
    assert limit.tolist() == [5, 3, 8]
    for out in (
        greedy(model, src, valid, bos=BOS, eos=EOS, max_len=limit),
        beam_search(
            model, src, valid, beam_size=k, length_penalty=0.6, bos=BOS, eos=EOS, max_len=limit
        ),
    ):
        assert [len(ids) for ids in out.tokens] == [5, 3, 8]
    assert output_limits(valid, max_len_a=2.0, max_len_b=10, cap=9).tolist() == [9, 9, 9]


def test_bad_arguments_are_refused() -> None:
    model = _Scripted([])
    src = torch.full((1, 2), 4)
    with pytest.raises(ValueError, match="beam_size=0"):
        beam_search(model, src, None, beam_size=0, length_penalty=0.0, bos=BOS, eos=EOS, max_len=3)
    with pytest.raises(ValueError, match="length_penalty=-1"):
        beam_search(model, src, None, beam_size=2, length_penalty=-1, bos=BOS, eos=EOS, max_len=3)
    with pytest.raises(ValueError, match="max_len_a=-1"):
        output_limits(torch.ones(1, 2, dtype=torch.bool), max_len_a=-1, max_len_b=0)


@pytest.mark.parametrize("k", [1, 3])
def test_batched_decoding_equals_one_sentence_at_a_time(k: int) -> None:
    """Padding and sentences leaving the batch early must not change anyone's output."""
    model = _model("xl")
    src, valid = _batch(12, [6, 2, 8, 4])
    batch = beam_search(
        model, src, valid, beam_size=k, length_penalty=0.6, bos=BOS, eos=EOS, max_len=7
    )
    for i, n in enumerate([6, 2, 8, 4]):
        alone = beam_search(
            model,
            src[i : i + 1, :n],
            None,
            beam_size=k,
            length_penalty=0.6,
            bos=BOS,
            eos=EOS,
            max_len=7,
        )
        assert alone.tokens == [batch.tokens[i]]
        torch.testing.assert_close(alone.scores, batch.scores[i : i + 1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("encoder", BIDIRECTIONAL_YAMLS)
@pytest.mark.parametrize("k", [1, 3])
def test_cached_decoding_gives_the_uncached_output(encoder: str, k: int) -> None:
    """Greedy and beam search with the key/value cache (rows dropped as sentences finish,
    reordered as beams change parents) give the uncached tokens and scores."""
    model = _model(encoder, vocab=12)
    with torch.no_grad():  # EOS logit 0: hypotheses grow before they end
        model.tgt_embed.weight[EOS] = 0.0
    src, valid = _batch(12, [6, 3, 9, 1, 5])
    limit = output_limits(valid, max_len_a=1.5, max_len_b=4)
    kw = dict(bos=BOS, eos=EOS, max_len=limit)
    runs = [
        greedy(model, src, valid, use_cache=c, **kw)
        if k == 1
        else beam_search(model, src, valid, beam_size=k, length_penalty=2.0, use_cache=c, **kw)
        for c in (True, False)
    ]
    assert runs[0].tokens == runs[1].tokens
    assert sum(map(len, runs[0].tokens)) >= 5  # something was generated
    torch.testing.assert_close(runs[0].scores, runs[1].scores, atol=1e-6, rtol=1e-6)
