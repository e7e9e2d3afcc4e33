"""Cached decoding equals a full forward pass, for every encoder.

The most reported silent bugs of positional-encoding code live here (RoPE keys rotated at
the wrong offset, a relative bias for the wrong query row, dynamic NTK's base changing as
the sequence grows), so every scheme and every RoPE scaling method is checked: the
logits of token-by-token decoding with a key/value cache equal those of one forward pass
over the same tokens, up to 3x the training length.
"""

from __future__ import annotations

import functools

import pytest
import torch

from posenc.encoders import get
from posenc.model import DecoderLM, EncoderDecoder
from tests.conftest import BIDIRECTIONAL_YAMLS, ENCODER_YAMLS

L = 8  # the "training length" of these tests
N = 3 * L
SIZES = dict(d_model=32, n_heads=4, n_layers=2, dropout=0.0)
#: Settings that make each scheme's long-range behaviour matter within N tokens.
SETTINGS = {
    "fire": {"threshold": float(L)},  # positions on both sides of L
    "shaw": {"max_distance": 3},
    "t5": {"num_buckets": 8, "max_distance": 12},
    "deberta": {"max_distance": 6, "bucket_size": 4},
    "xpos": {"scale_base": 16.0},
}
ROPE_SCALINGS = {
    "linear": {"scaling": "linear", "scaling_factor": 2.0},
    "ntk": {"scaling": "ntk", "scaling_factor": 2.0},
    "dynamic_ntk": {"scaling": "dynamic_ntk", "scaling_factor": 2.0, "original_length": L},
    "yarn": {"scaling": "yarn", "scaling_factor": 4.0, "original_length": L},
}
CASES = [(n, SETTINGS.get(n, {})) for n in ENCODER_YAMLS]
CASES += [(f"rope+{m}", kw) for m, kw in ROPE_SCALINGS.items()]
# The non-default conventions (#24): DeBERTa's p2c at the paper's row; YaRN partial rotation
# with either temperature, and the paper's ramp.
CASES += [
    ("deberta+p2c_paper", {**SETTINGS["deberta"], "p2c_row": "paper"}),
    ("rope+yarn_partial", {**ROPE_SCALINGS["yarn"], "fraction": 0.5}),
    ("rope+yarn_paper_score", {**ROPE_SCALINGS["yarn"], "fraction": 0.5, "yarn_ramp": "paper",
                               "yarn_temper": "score"}),
]


def _factory(name: str, settings: dict):
    return functools.partial(get(name.split("+")[0]), **settings)


def _cached_and_full(
    model: DecoderLM, ids: torch.Tensor, chunks: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of cached decoding in ``chunks`` of tokens, and of a full forward pass
    over each chunk's whole prefix (dynamic NTK's base follows the prefix's length)."""
    cache, got, want, i = model.new_cache(), [], [], 0
    for n in chunks:
        got.append(model(ids[:, i : i + n], cache=cache))
        want.append(model(ids[:, : i + n])[:, i:])
        i += n
    assert cache.length == i == ids.shape[1]
    return torch.cat(got, dim=1), torch.cat(want, dim=1)


@pytest.mark.parametrize(("name", "settings"), CASES, ids=[c[0] for c in CASES])
def test_lm_cached_decoding_equals_full_forward(name: str, settings: dict) -> None:
    model = DecoderLM(vocab_size=17, encoder=_factory(name, settings), **SIZES).eval()
    ids = torch.randint(0, 17, (2, N))
    with torch.no_grad():
        for chunks in ([1] * N, [5] + [1] * (N - 5), [L, 3, L + 5 - 3, 1, L - 6]):
            got, want = _cached_and_full(model, ids, chunks)
            assert (got - want).abs().max() <= 1e-5, chunks
        if "dynamic" not in name:  # causal: a prefix's logits are the whole pass's
            assert (want - model(ids)).abs().max() <= 1e-5


def test_dynamic_ntk_cache_transforms_every_key_again() -> None:
    """Dynamic NTK's base follows the length: a cache that kept keys rotated at an
    earlier length would differ from the full pass once the sequence passes L. The cache
    keeps the projected keys and rotates all of them at each step (documented in
    posenc/model/cache.py); the plain RoPE cache keeps rotated keys only."""
    dyn = DecoderLM(vocab_size=17, encoder=_factory("rope", ROPE_SCALINGS["dynamic_ntk"]),
                    **SIZES).eval()
    plain = DecoderLM(vocab_size=17, encoder="rope", **SIZES).eval()
    ids = torch.randint(0, 17, (1, N))
    with torch.no_grad():
        for model, kept in ((dyn, False), (plain, True)):
            cache = model.new_cache()
            model(ids[:, :L], cache=cache)
            model(ids[:, L : L + 1], cache=cache)
            layer = cache.layers[0]
            assert (layer.keys is not None) == kept and (layer.raw is None) == kept
            stored = layer.keys if kept else layer.raw
            assert stored.shape[-2] == L + 1


@pytest.mark.parametrize("name", BIDIRECTIONAL_YAMLS)
def test_translation_decoder_cache_equals_full_decode(name: str) -> None:
    model = EncoderDecoder(src_vocab_size=19, tgt_vocab_size=19,
                           encoder=_factory(name, SETTINGS.get(name, {})), **SIZES).eval()
    src, tgt = torch.randint(0, 19, (3, 11)), torch.randint(0, 19, (3, 2 * L))
    src_valid = torch.ones(3, 11, dtype=torch.bool)
    src_valid[1, 7:] = False
    with torch.no_grad():
        memory = model.encode(src, src_valid)
        full = model.decode(tgt, memory, src_valid=src_valid)
        cache, steps = model.new_cache(), []
        for i in range(tgt.shape[1]):
            steps.append(model.decode(tgt[:, i : i + 1], memory, src_valid=src_valid, cache=cache))
        assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-5


def test_cache_rows_follow_select() -> None:
    """Dropping and reordering rows (finished sentences, beam reorders) keeps each row's
    cache with it."""
    model = DecoderLM(vocab_size=17, encoder="shaw", **SIZES).eval()
    ids = torch.randint(0, 17, (3, 9))
    with torch.no_grad():
        full = model(ids[[2, 0]])
        cache = model.new_cache()
        model(ids[:, :6], cache=cache)
        cache.select(torch.tensor([2, 0]))
        got = model(ids[[2, 0], 6:], cache=cache)
    assert (got - full[:, 6:]).abs().max() <= 1e-5


@pytest.mark.parametrize(("name", "settings"), CASES, ids=[c[0] for c in CASES])
def test_left_padded_prompts_decode_as_each_alone(name: str, settings: dict) -> None:
    """Prompts of lengths 3, 7 and 5 left-padded into one batch (``cache.pad``): every
    row's cached logits equal those of its prompt decoded alone, with no padding."""
    model = DecoderLM(vocab_size=17, encoder=_factory(name, settings), **SIZES).eval()
    lengths, steps = [3, 7, 5], 6
    seqs = [torch.randint(0, 17, (n + steps,)) for n in lengths]
    width = max(lengths)
    pad = torch.tensor([width - n for n in lengths])
    prompt = torch.stack([torch.cat((torch.zeros(p, dtype=torch.long), s[:n]))
                          for p, n, s in zip(pad.tolist(), lengths, seqs, strict=True)])
    with torch.no_grad():
        cache = model.new_cache(pad)
        got = [model(prompt, cache=cache)[:, -1:]]
        for i in range(steps):
            nxt = torch.stack([s[n + i] for n, s in zip(lengths, seqs, strict=True)])[:, None]
            got.append(model(nxt, cache=cache))
        got = torch.cat(got, dim=1)  # (3, 1 + steps, V): last prompt token, then each step
        for row, (n, s) in enumerate(zip(lengths, seqs, strict=True)):
            # each position from a full pass over its own prefix (dynamic NTK's base
            # follows the prefix's length)
            alone = torch.stack([model(s[None, : n + i])[0, -1] for i in range(steps + 1)])
            assert (got[row] - alone).abs().max() <= 1e-5, row
