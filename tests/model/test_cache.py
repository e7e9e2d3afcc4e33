"""Cached decoding equals a full forward pass, for every encoder.

The most reported silent bugs of positional-encoding code live here (RoPE keys rotated at
the wrong offset, a relative bias for the wrong query row, dynamic NTK's base changing as
the sequence grows), so every scheme and every RoPE scaling method is checked: the
logits of decoding with the static key/value cache, token by token and in uneven
chunks, with left padding and with beam-search reordering, equal those of one forward
pass over the same prefix, up to 3x the training length.

The models are sensitive: float64, two layers and unit-scale weights
(:func:`unit_scale`). With the small default initialisation a layer barely changes its
input, so a cache that kept stale keys in the second layer (dynamic NTK's, #34) passed
with a tolerance of 1e-5 while its logits were 0.04 off with these weights.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from posenc.encoders import get
from posenc.model import DecoderLM, EncoderDecoder
from posenc.model.cache import INPUTS
from posenc.model.streaming import Streaming
from tests.conftest import BIDIRECTIONAL_YAMLS, ENCODER_YAMLS

L = 8  # the "training length" of these tests
N = 3 * L
SIZES = dict(d_model=32, n_heads=4, n_layers=2, dropout=0.0)
#: float64 with unit-scale weights: anything but rounding is far above this.
TOL = 1e-9
#: xPos's decay factors are float32 tables (as RoPE's angles) taken about a centre that
#: follows the pass's keys; the centre cancels in every score, but the rounding of the
#: factors does not, so a layer's output for a token differs by float32 rounding
#: (~1e-8 here) between the step that cached it and a longer full pass.
LOOSE = {"xpos": 1e-6}


def tol(name: str) -> float:
    return LOOSE.get(name.split("+")[0], TOL)


#: Settings that make each scheme's long-range behaviour matter within N tokens.
SETTINGS = {
    "fire": {"threshold": float(L)},  # positions on both sides of L
    "shaw": {"max_distance": 3},
    "t5": {"num_buckets": 8, "max_distance": 12},
    "deberta": {"max_distance": 6, "bucket_size": 4},
    "xpos": {"scale_base": 16.0},
    # two members, each with its own context entries (T5's tables, RoPE's angles)
    "mix": {"layers": [{"name": "t5", "num_buckets": 8, "max_distance": 12}, "rope"]},
}
ROPE_SCALINGS = {
    "linear": {"scaling": "linear", "scaling_factor": 2.0},
    "ntk": {"scaling": "ntk", "scaling_factor": 2.0},
    "dynamic_ntk": {"scaling": "dynamic_ntk", "scaling_factor": 2.0, "original_length": L},
    "yarn": {"scaling": "yarn", "scaling_factor": 4.0, "original_length": L},
    "llama3": {"scaling": "llama3", "scaling_factor": 4.0, "original_length": L},
}
DEBERTA, DYNAMIC = SETTINGS["deberta"], ROPE_SCALINGS["dynamic_ntk"]
CASES = [(n, SETTINGS.get(n, {})) for n in ENCODER_YAMLS]
CASES += [(f"rope+{m}", kw) for m, kw in ROPE_SCALINGS.items()]
# The non-default conventions (#24): DeBERTa's p2c at the paper's row; YaRN partial rotation
# with either temperature, and the paper's ramp; Shaw without its value term (FlexAttention's
# form of it on a GPU).
CASES += [
    ("deberta+p2c_paper", {**SETTINGS["deberta"], "p2c_row": "paper"}),
    ("rope+yarn_partial", {**ROPE_SCALINGS["yarn"], "fraction": 0.5}),
    (
        "rope+yarn_paper_score",
        {**ROPE_SCALINGS["yarn"], "fraction": 0.5, "yarn_ramp": "paper", "yarn_temper": "score"},
    ),
    ("shaw+no_value", {**SETTINGS["shaw"], "value": False}),
    # PaTH with FoX's gate (PaTH-FoX), and with neither convolution nor low-rank w
    ("path+forget_gate", {"forget_gate": True}),
    ("path+plain_w", {"conv_size": 0, "w_rank": None}),
    # stick-breaking's earlier remainder; FoX with spread gate biases, and its Pro block
    ("stickbreak+value", {"remainder": "value"}),
    # p-RoPE; LongRoPE, whose factor lists switch when the keys pass L (head_dim 8: 4 pairs),
    # so a cached step past L must see every key under the long factors
    ("rope+p", {"p": 0.5}),
    (
        "rope+longrope",
        {
            "scaling": "longrope",
            "scaling_factor": 4.0,
            "original_length": L,
            "short_factor": [1.0, 1.2, 1.5, 2.0],
            "long_factor": [1.0, 2.0, 4.0, 8.0],
        },
    ),
    # Transformer-XL's position term folded into the content score (a wider key cached)
    ("xl+fold", {"fold": True}),
    # DAPE's MLP on each base (FIRE past its threshold), and on a stack-shared KERPLE
    ("dape+alibi", {"base": "alibi"}),
    ("dape+fire", {"base": "fire", "base_options": {"threshold": float(L)}}),
    ("dape+shared", {"per_layer": False}),
    ("fox+spread", {"bias_init": "spread"}),
    ("fox+pro", {"pro": True}),
    # mixes: a pass-dependent layer beside a plain one, two RoPE bases, a token-reading
    # layer (FoX's gates) beside RoPE; head splits with a score term, a value term and a
    # content scale of their own (DeBERTa's), and a pass-dependent group
    ("mix+dynamic_ntk", {"layers": [{"name": "rope", **ROPE_SCALINGS["dynamic_ntk"]}, "none"]}),
    ("mix+bases", {"layers": ["rope", {"name": "rope", "base": 100.0}]}),
    ("mix+fox", {"layers": ["fox", "rope"]}),
    ("mix+heads", {"layers": None, "heads": ["rope", {"name": "t5", **SETTINGS["t5"]}]}),
    ("mix+heads_shaw", {"layers": None, "heads": [{"name": "shaw", **SETTINGS["shaw"]}, "none"]}),
    ("mix+heads_deberta", {"layers": None, "heads": ["rope", {"name": "deberta", **DEBERTA}]}),
    ("mix+heads_ntk", {"layers": None, "heads": [{"name": "rope", **DYNAMIC}, "alibi"]}),
]
IDS = [c[0] for c in CASES]


def _factory(name: str, settings: dict):
    return functools.partial(get(name.split("+")[0]), **settings)


def unit_scale(model: nn.Module, seed: int = 1) -> nn.Module:
    """``model`` in float64 with weights of unit scale: every matrix ``N(0, 1/fan_in)``
    (rows of tables alike), every vector ``N(0, 1/4)``; LayerNorms and 0-d parameters
    (FIRE's c and L) keep their values. Each layer then changes its input by about as
    much as the input itself, so an error in any layer's cached state shows."""
    gen = torch.Generator().manual_seed(seed)
    keep = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    with torch.no_grad():
        for p in model.parameters():
            if id(p) in keep or p.dim() == 0:
                continue
            std = p.shape[-1] ** -0.5 if p.dim() >= 2 else 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.double().eval()


def lm(name: str, settings: dict, vocab: int = 17, **sizes) -> DecoderLM:
    return unit_scale(
        DecoderLM(vocab_size=vocab, encoder=_factory(name, settings), **{**SIZES, **sizes})
    )


def prefix_logits(model: DecoderLM, ids: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """Full-pass logits ``(B, T, V)`` of each chunk of ``ids`` starting at ``starts``, from
    a pass over the chunk's whole prefix: one pass for all (causal attention), or one
    per chunk when the scheme depends on the pass's length (dynamic NTK)."""
    if not model.encoder.pass_dependent:
        return model(ids)
    stops = [*starts[1:], ids.shape[1]]
    return torch.cat([model(ids[:, :b])[:, a:] for a, b in zip(starts, stops, strict=True)], 1)


def _cached_and_full(
    model: DecoderLM, ids: torch.Tensor, chunks: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of cached decoding in ``chunks`` of tokens, and of full forward passes
    over each chunk's whole prefix."""
    cache, got, i, starts = model.new_cache(ids.shape[1]), [], 0, []
    for n in chunks:
        got.append(model(ids[:, i : i + n], cache=cache))
        starts.append(i)
        i += n
    assert cache.length == i == ids.shape[1]
    return torch.cat(got, dim=1), prefix_logits(model, ids, starts)


@pytest.mark.parametrize(("name", "settings"), CASES, ids=IDS)
def test_lm_cached_decoding_equals_full_forward(name: str, settings: dict) -> None:
    model = lm(name, settings)
    ids = torch.randint(0, 17, (2, N))
    with torch.no_grad():
        for chunks in ([1] * N, [L, 3, L + 5 - 3, 1, L - 6]):
            got, want = _cached_and_full(model, ids, chunks)
            assert (got - want).abs().max() <= tol(name), chunks


@pytest.mark.parametrize(("name", "settings"), CASES, ids=IDS)
def test_beam_reordering_keeps_each_rows_cache(name: str, settings: dict) -> None:
    """Beam search's reorders (rows dropped, repeated, permuted; ``cache.select``) in the
    middle of decoding: every row continues its parent's cache, so its logits are those
    of a full pass over its own prefix."""
    model = lm(name, settings)
    ids = torch.randint(0, 17, (3, N))
    rows = torch.tensor([2, 0, 2, 1])  # a beam step: row 2 twice, row 1 last
    with torch.no_grad():
        cache = model.new_cache(N)
        model(ids[:, : L + 2], cache=cache)  # past L: dynamic NTK's base has moved
        cache.select(rows)
        beams = ids[rows]
        beams[:, L + 2 :] = torch.randint(0, 17, (4, N - L - 2))  # each beam's own tokens
        got = torch.cat([model(beams[:, i : i + 1], cache=cache) for i in range(L + 2, N)], 1)
        want = prefix_logits(model, beams, list(range(N)))[:, L + 2 :]
    assert (got - want).abs().max() <= tol(name)


@pytest.mark.parametrize(("name", "settings"), CASES, ids=IDS)
def test_left_padded_prompts_decode_as_each_alone(name: str, settings: dict) -> None:
    """Prompts of lengths 3, 7 and 5 left-padded into one batch (``cache.pad``): every
    row's cached logits equal those of its prompt decoded alone, with no padding."""
    assert left_padded_error(lm(name, settings)) <= tol(name)


def left_padded_error(model: DecoderLM) -> float:
    """The largest difference between each left-padded row's cached logits and those of
    its prompt decoded alone (:func:`test_left_padded_prompts_decode_as_each_alone`)."""
    lengths, steps = [3, 7, 5], 6
    seqs = [torch.randint(0, 17, (n + steps,)) for n in lengths]
    width = max(lengths)
    pad = torch.tensor([width - n for n in lengths])
    prompt = torch.stack(
        [
            torch.cat((torch.zeros(p, dtype=torch.long), s[:n]))
            for p, n, s in zip(pad.tolist(), lengths, seqs, strict=True)
        ]
    )
    err = 0.0
    with torch.no_grad():
        cache = model.new_cache(width + steps, pad)
        got = [model(prompt, cache=cache)[:, -1:]]
        for i in range(steps):
            nxt = torch.stack([s[n + i] for n, s in zip(lengths, seqs, strict=True)])[:, None]
            got.append(model(nxt, cache=cache))
        got = torch.cat(got, dim=1)  # (3, 1 + steps, V): last prompt token, then each step
        for row, (n, s) in enumerate(zip(lengths, seqs, strict=True)):
            # each position from a full pass over its own prefix (dynamic NTK's base
            # follows the prefix's length)
            alone = torch.stack([model(s[None, : n + i])[0, -1] for i in range(steps + 1)])
            err = max(err, float((got[row] - alone).abs().max()))
    return err


@pytest.mark.parametrize("name", BIDIRECTIONAL_YAMLS)
def test_translation_decoder_cache_equals_full_decode(name: str) -> None:
    """The decoder's cache with cross-attention, source padding and a beam reorder."""
    check_translation_cache(name)


def check_translation_cache(name: str, **options) -> None:
    """:func:`test_translation_decoder_cache_equals_full_decode` for a translator built
    with model ``options``."""
    model = unit_scale(
        EncoderDecoder(
            src_vocab_size=19,
            tgt_vocab_size=19,
            encoder=_factory(name, SETTINGS.get(name, {})),
            **SIZES,
            **options,
        )
    )
    src, tgt = torch.randint(0, 19, (3, 11)), torch.randint(0, 19, (3, 2 * L))
    src_valid = torch.ones(3, 11, dtype=torch.bool)
    src_valid[1, 7:] = False
    rows = torch.tensor([1, 1, 0])
    with torch.no_grad():
        memory = model.encode(src, src_valid)
        full = model.decode(tgt, memory, src_valid=src_valid)
        cache, steps = model.new_cache(2 * L), []
        for i in range(L):
            steps.append(model.decode(tgt[:, i : i + 1], memory, src_valid=src_valid, cache=cache))
        assert (torch.cat(steps, dim=1) - full[:, :L]).abs().max() <= TOL
        cache.select(rows)
        memory, src_valid, tgt = memory[rows], src_valid[rows], tgt[rows]
        full = model.decode(tgt, memory, src_valid=src_valid)
        steps = [
            model.decode(tgt[:, i : i + 1], memory, src_valid=src_valid, cache=cache)
            for i in range(L, 2 * L)
        ]
        assert (torch.cat(steps, dim=1) - full[:, L:]).abs().max() <= TOL


def test_dynamic_ntk_cached_steps_equal_full_passes_past_the_original_length() -> None:
    """#34's reproduction: a two-layer dynamic-NTK model, 16 tokens prefilled, then one at
    a time. Each step's logits equal a full pass over its prefix, whose base follows the
    prefix's length: the cache keeps the stack's inputs and runs them again (a kept key
    of layer 2 was computed from hidden states under an earlier length's base)."""
    rope = functools.partial(
        get("rope"), scaling="dynamic_ntk", scaling_factor=2.0, original_length=16
    )
    model = unit_scale(DecoderLM(vocab_size=29, encoder=rope, d_model=64, n_heads=4, n_layers=2))
    ids = torch.randint(0, 29, (1, 40))
    with torch.no_grad():
        cache = model.new_cache(40)
        model(ids[:, :16], cache=cache)
        for t in range(17, 41):
            got = model(ids[:, t - 1 : t], cache=cache)[0, -1]
            want = model(ids[:, :t])[0, -1]
            assert (got - want).abs().max() <= TOL, t
    assert cache.inputs.get(INPUTS) is not None  # the stack's inputs, kept
    assert all(not layer.buffers for layer in cache.layers)  # no layer state to go stale


def test_cache_keeps_rotated_keys_once_and_projected_keys_only_when_needed() -> None:
    """RoPE's cache keeps rotated keys only (each rotated once, at its slot); xPos, whose
    key transform follows the pass, keeps projected keys and rotates them every step;
    every buffer has the cache's size along its key axis."""
    for name, kept in (("rope", {"keys", "values"}), ("xpos", {"raw", "values"})):
        model = lm(name, {})
        with torch.no_grad():
            cache = model.new_cache(20)
            model(torch.randint(0, 17, (2, 5)), cache=cache)
        layer = cache.layers[0]
        assert set(layer.buffers) == kept, name
        assert all(b.shape[-2] == 20 for b in layer.buffers.values())
        assert cache.length == 5


def test_cache_size_is_checked() -> None:
    model = DecoderLM(vocab_size=17, encoder="learned", **SIZES)
    for bad in (0, -3, 2.5, None):
        with pytest.raises(ValueError, match="cache size"):
            model.new_cache(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_len"):
        model.new_cache(model.encoder.max_length + 1)


#: The attention modifiers, all on: over schemes with nothing to add, a q/k transform, a
#: pass-dependent transform, score terms, a value term and gates from the tokens.
MODIFIED = ["none", "rope", "rope+dynamic_ntk", "alibi", "t5", "shaw", "fox", "cope"]


@pytest.mark.parametrize("logit_scale", ["ssmax", "log_length"])
@pytest.mark.parametrize("name", MODIFIED)
def test_modifiers_cached_decoding_equals_full_forward(name: str, logit_scale: str) -> None:
    """QK-norm, a logit scale (whose n is each query's key count: the cache's slot, less
    a row's left padding) and sinks: cached decoding token by token, in uneven chunks and
    with left padding equals full passes."""
    settings = {**SETTINGS.get(name, {}), **ROPE_SCALINGS.get(name.partition("+")[2], {})}
    options = {"qk_norm": True, "logit_scale": logit_scale, "sinks": True}
    model = lm(name, settings, **options)
    ids = torch.randint(0, 17, (2, N))
    with torch.no_grad():
        for chunks in ([1] * N, [L, 3, L + 5 - 3, 1, L - 6]):
            got, want = _cached_and_full(model, ids, chunks)
            assert (got - want).abs().max() <= tol(name), chunks
    assert left_padded_error(model) <= tol(name)
    if name in BIDIRECTIONAL_YAMLS:
        check_translation_cache(name, **options)


#: Schemes for the sliding window: nothing to add, a q/k transform, a pass-dependent one,
#: score terms, a value term, gates from the tokens, a head split.
WINDOWED = ["none", "rope", "rope+dynamic_ntk", "alibi", "t5", "shaw", "fox", "mix"]


@pytest.mark.parametrize("modifiers", [False, True], ids=["window", "window+modifiers"])
@pytest.mark.parametrize("name", WINDOWED)
def test_windowed_cached_decoding_equals_full_forward(name: str, modifiers: bool) -> None:
    """A local layer (a window of 5 tokens) and a global one, alone and with QK-norm,
    SSMax and sinks: cached decoding token by token, in uneven chunks and with left
    padding equals full passes, whose windows reach back less far than the cache."""
    settings = {**SETTINGS.get(name, {}), **ROPE_SCALINGS.get(name.partition("+")[2], {})}
    options = {"qk_norm": True, "logit_scale": "ssmax", "sinks": True} if modifiers else {}
    model = lm(name, settings, window=5, window_layers=["local", "global"], **options)
    assert [b.self_attn.window for b in model.stack.layers] == [5, None]
    ids = torch.randint(0, 17, (2, N))
    with torch.no_grad():
        for chunks in ([1] * N, [L, 3, L + 5 - 3, 1, L - 6]):
            got, want = _cached_and_full(model, ids, chunks)
            assert (got - want).abs().max() <= tol(name), chunks
        windowed = model(ids)
        model.stack.layers[0].self_attn.window = None
        assert (model(ids) - windowed).abs().max() > 1e-3  # the window mattered
        model.stack.layers[0].self_attn.window = 5
    assert left_padded_error(model) <= tol(name)


#: StreamingLLM's schemes: NoPE, a q/k transform, score terms, a content-position term,
#: a decay about the pass's centre, and a mix of two members' contexts.
STREAMED = ["none", "rope", "alibi", "t5", "deberta", "xpos", "mix"]


@pytest.mark.parametrize("name", STREAMED)
def test_streaming_cached_decoding_equals_full_forward(name: str) -> None:
    """StreamingLLM (2 sinks, a window of 5) in two layers: cached decoding token by token
    and in uneven chunks equals full passes with the streaming mask, up to 3x the
    training length, where the middle has long been evicted (and it mattered)."""
    model = lm(name, SETTINGS.get(name, {}))
    ids = torch.randint(0, 17, (2, N))
    with torch.no_grad():
        plain = model(ids)
        with model.streaming(Streaming(sinks=2, window=5)):
            for chunks in ([1] * N, [L, 3, L + 5 - 3, 1, L - 6]):
                got, want = _cached_and_full(model, ids, chunks)
                assert (got - want).abs().max() <= tol(name), chunks
    assert (want - plain).abs().max() > 1e-3
