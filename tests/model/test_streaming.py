"""StreamingLLM (Xiao et al. 2024) at evaluation time: the paper's cache, its positions
re-indexed inside the cache, and its refusals.

The reference for a one-layer model is the paper's own procedure, run through the plain
model: the tokens a query keeps (the first ``sinks`` and the last ``window``, itself
included) fed alone at positions ``0 .. n-1``. With one layer nothing else reaches the
query's output, so the streaming pass must give those logits for every query.
"""

from __future__ import annotations

import math

import pytest
import torch

from posenc.encoders.base import AttnKind
from posenc.model import DecoderLM
from posenc.model import streaming as streaming_module
from posenc.model.streaming import STREAMING, Streaming, attach, refusal, sizes_problem
from tests.model.test_cache import SETTINGS, lm

#: Schemes it applies to: NoPE, a q/k transform, score terms, a decay about a centre, a
#: content-position term (DeBERTa) and a mix of RoPE and NoPE layers.
STREAMABLE = ["none", "rope", "alibi", "t5", "kerple", "sandwich", "xl", "xl+fold", "deberta"]
STREAMABLE += ["xpos", "mix"]
#: Each case's encoder options (Transformer-XL's folded form: one wider dot product).
CASE_SETTINGS = {**SETTINGS, "xl+fold": {"fold": True}}
#: RoPE's and xPos's float32 angle and decay tables round differently at the re-indexed
#: positions than at the text's; the rest agree to float64 rounding.
LOOSE = {"rope": 1e-6, "xpos": 1e-6, "mix": 1e-6}
SETTING = Streaming(sinks=2, window=3)
T = 12


def kept(i: int, setting: Streaming) -> list[int]:
    """The tokens in the paper's cache when query ``i`` is decoded."""
    sinks = list(range(min(setting.sinks, i + 1)))
    return sinks + list(range(max(setting.sinks, i - setting.window + 1), i + 1))


@pytest.mark.parametrize("name", STREAMABLE)
def test_a_full_pass_is_the_papers_cache_for_every_query(name: str) -> None:
    """One layer: each query's logits equal those of the plain model run on the tokens it
    keeps alone, at positions 0 .. n-1 (the paper's re-indexing); past the cache's span
    they differ from the plain full pass (the eviction mattered)."""
    torch.manual_seed(0)
    model = lm(name, CASE_SETTINGS.get(name, {}), n_layers=1)
    ids = torch.randint(0, 17, (2, T))
    with torch.no_grad():
        plain = model(ids)
        with model.streaming(SETTING):
            got = model(ids)
        want = torch.stack([model(ids[:, kept(i, SETTING)])[:, -1] for i in range(T)], dim=1)
    assert (got - want).abs().max() <= LOOSE.get(name, 1e-9)
    span = SETTING.span
    assert (got[:, :span] - plain[:, :span]).abs().max() <= LOOSE.get(name, 1e-9)
    if name != "none":  # NoPE's mask alone also changes the later queries
        assert (got[:, span:] - plain[:, span:]).abs().max() > 1e-3


def test_nothing_between_the_sinks_and_the_window_reaches_a_query() -> None:
    """A middle token changed: the queries that evicted it keep their logits exactly;
    with L layers, information travels at most L * (window - 1) tokens through the
    window, so a query further away than that is untouched too."""
    torch.manual_seed(0)
    ids = torch.randint(0, 17, (1, 20))
    other = ids.clone()
    m = 6
    other[0, m] = (ids[0, m] + 1) % 17
    for layers in (1, 2):
        model = lm("rope", {}, n_layers=layers)
        with torch.no_grad(), model.streaming(SETTING):
            diff = (model(ids) - model(other)).abs().amax(-1)[0]  # (T,)
        reach = m + layers * (SETTING.window - 1)
        assert diff[:m].max() == 0  # causal
        assert diff[m : reach + 1].min() > 1e-3  # in the window (of a window)
        assert diff[reach + 1 :].max() == 0, layers  # evicted


def test_the_sinks_are_scored_at_their_cache_positions() -> None:
    """The positions the sinks' context holds: queries at ``min(i, span - 1)``, keys at
    ``0 .. sinks-1`` (the paper: a cache [0, 1, 2, 3, 6, 7, 8] decoding token 9 puts
    the query at 7)."""
    model = DecoderLM(vocab_size=11, encoder="rope", d_model=8, n_heads=1, n_layers=1)
    positions = torch.arange(10)[None]
    ctx = model.encoder.context(positions, positions, AttnKind.CAUSAL, starts=(0, 0), bound=10)
    attach(ctx, model.encoder, Streaming(4, 4), positions, 10)
    setting, sinks = ctx[STREAMING]
    assert setting == Streaming(4, 4) and sinks is not None
    assert sinks.q_pos.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 7, 7]]
    assert sinks.k_pos.tolist() == [[0, 1, 2, 3]]


def rope(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE by hand: pairs (x[2p], x[2p+1]) turned by ``pos * base^(-2p/D)``;
    ``x (..., T, D)``, ``pos (T,)``."""
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = pos[:, None].double() * theta  # (T, D/2)
    cos, sin = angle.cos(), angle.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return out.flatten(-2)


def test_rope_attention_by_hand() -> None:
    """One head, the attention module's output against the paper's formula written out:
    query i rotated at its cache position ``min(i, span-1)`` against the sinks at
    ``0 .. sinks-1``, and at the cache position ``span - 1 - (i - j)`` of each window key
    j (so the window keeps the text's distances), one softmax over both."""
    torch.manual_seed(0)
    model = lm("rope", {}, d_model=8, n_heads=1, n_layers=1)
    attn = model.stack.layers[0].self_attn
    setting, t = Streaming(2, 3), 9
    x = torch.randn(1, t, 8, dtype=torch.float64)
    positions = torch.arange(t)[None]
    ctx = model.encoder.context(positions, positions, AttnKind.CAUSAL, starts=(0, 0), bound=t)
    attach(ctx, model.encoder, setting, positions, t)
    with torch.no_grad():
        got = attn(x, ctx)[0]  # (T, C)
        q, k, v = (p(x)[0] for p in (attn.q_proj, attn.k_proj, attn.v_proj))  # (T, D)
        rows = []
        for i in range(t):
            keys = kept(i, setting)
            here = min(i, setting.span - 1)
            cache_pos = torch.tensor([*range(len(keys))])  # 0 .. n-1, the query last
            assert cache_pos[-1] == here
            q_i = rope(q[i : i + 1], torch.tensor([here]))
            k_i = rope(k[keys], cache_pos)
            probs = ((q_i @ k_i.T) / math.sqrt(8)).softmax(-1)
            rows.append(attn.out_proj(probs @ v[keys]))
        want = torch.cat(rows)
    assert (got - want).abs().max() <= 1e-6  # float32 angle tables in the model


def test_query_blocks_give_the_same_output(monkeypatch: pytest.MonkeyPatch) -> None:
    model = lm("alibi", {}, n_layers=2)
    ids = torch.randint(0, 17, (2, T))
    with torch.no_grad(), model.streaming(SETTING):
        whole = model(ids)
        monkeypatch.setattr(streaming_module, "BLOCK_BYTES", 1)  # one query at a time
        blocked = model(ids)
    assert (whole - blocked).abs().max() <= 1e-12


def _both_ways(monkeypatch: pytest.MonkeyPatch, run) -> tuple[torch.Tensor, torch.Tensor]:
    """``run()`` with keys cut to those each block of queries sees, in blocks of the
    cache's span, and with every block over all keys."""
    monkeypatch.setattr(streaming_module, "MIN_QUERY_BLOCK", 1)  # blocks of sinks + window
    sliced = run()
    monkeypatch.setattr(streaming_module, "SLICE_KEYS", False)
    every = run()
    monkeypatch.setattr(streaming_module, "SLICE_KEYS", True)
    return sliced, every


@pytest.mark.parametrize("name", STREAMABLE)
def test_cutting_keys_to_the_visible_ones_changes_nothing(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two layers in float64, 23 queries in blocks of 5 (the span), a left-padded row:
    scoring each block against its sinks and window slice only gives the outputs of
    scoring it against every key, to float64 rounding (a padded query, which sees no
    real key, is NaN both ways)."""
    torch.manual_seed(0)
    model = lm(name, CASE_SETTINGS.get(name, {}), n_layers=2).double()
    ids = torch.randint(0, 17, (2, 23))
    valid = torch.ones(2, 23, dtype=torch.bool)
    valid[1, :3] = False

    def run() -> torch.Tensor:
        with torch.no_grad(), model.streaming(SETTING):
            return model.stack(model.embed(ids), valid=valid)

    sliced, every = _both_ways(monkeypatch, run)
    torch.testing.assert_close(sliced, every, rtol=0, atol=1e-12, equal_nan=True)
    assert not sliced[0].isnan().any()


@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "xl+fold", "mix"])
def test_fewer_queries_than_keys_at_an_offset(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """T = 7 queries at the end of S = 20 keys (an int shift of 13), one padded key: the
    cut keys give the all-keys result, and so does a tensor shift (a static cache's
    slot, which always takes every key)."""
    torch.manual_seed(0)
    model = lm(name, CASE_SETTINGS.get(name, {}), n_layers=1).double()
    attn = model.stack.layers[0].self_attn
    t, s = 7, 20
    q, k, v = torch.randn(3, 2, 4, s, 8, dtype=torch.float64).unbind(0)
    q = q[:, :, s - t :]
    valid = torch.ones(2, s, dtype=torch.bool)
    valid[0, 9] = False
    k_pos = torch.arange(s)[None]
    ctx = model.encoder.context(k_pos[:, s - t :], k_pos, AttnKind.CAUSAL, starts=(s - t, 0))
    attach(ctx, model.encoder, SETTING, k_pos, s)
    layer_ctx = attn.pos.with_input(torch.zeros(2, t, 32), ctx, key_valid=valid, cache=None)

    def run(shift: int | torch.Tensor = s - t) -> torch.Tensor:
        stream = ctx[STREAMING]
        return streaming_module.streaming_attend(
            attn.pos, q, k, v, layer_ctx, stream, shift=shift, key_valid=valid
        )

    sliced, every = _both_ways(monkeypatch, run)
    torch.testing.assert_close(sliced, every, rtol=0, atol=1e-12)
    torch.testing.assert_close(run(torch.tensor(s - t)), every, rtol=0, atol=1e-12)


def test_a_block_scores_only_the_keys_it_can_see(monkeypatch: pytest.MonkeyPatch) -> None:
    """The score tensors' query-key pairs over 64 queries: each query scores at most
    sinks + window + block keys when cut, against sinks + S without the cut."""
    model = lm("rope", {}, n_layers=1)
    ids = torch.randint(0, 17, (1, 64))
    pairs: list[int] = []
    logits = streaming_module._logits

    def counted(pos, q, k, ctx):  # the scores of one block: (B, H, T', S')
        pairs.append(q.shape[-2] * k.shape[-2])
        return logits(pos, q, k, ctx)

    monkeypatch.setattr(streaming_module, "_logits", counted)

    def run() -> torch.Tensor:
        pairs.clear()
        with torch.no_grad(), model.streaming(SETTING):
            model(ids)
        return torch.tensor(sum(pairs))

    sliced, every = _both_ways(monkeypatch, run)
    block = SETTING.span  # MIN_QUERY_BLOCK 1: blocks of the span
    assert every == 64 * (SETTING.sinks + 64)
    assert sliced <= 64 * (SETTING.sinks + SETTING.window + block)
    assert sliced * 5 < every


def test_the_setting_is_restored_after_the_block() -> None:
    model = lm("rope", {}, n_layers=1)
    with model.streaming(SETTING):
        assert model.stack.streaming == SETTING
    assert model.stack.streaming is None


@pytest.mark.parametrize(
    ("sinks", "window", "seq_len", "says"),
    [
        (-1, 3, None, "sinks=-1: must be an integer >= 0"),
        (True, 3, None, "sinks=True: must be an integer >= 0"),
        (4, 0, None, "window=0: must be an integer >= 1"),
        (4, 2.5, None, "window=2.5: must be an integer >= 1"),
        (4, 13, 16, "= 17: more than the training length 16"),
    ],
)
def test_bad_sizes_are_one_line(sinks, window, seq_len, says: str) -> None:
    problem = sizes_problem(sinks, window, seq_len)
    assert problem is not None and says in problem and "\n" not in problem
    model = lm("rope", {}, n_layers=1)
    if seq_len is None:
        setting = Streaming(sinks, window)
        with (
            pytest.raises(ValueError, match="streaming: streaming ") as err,
            model.streaming(setting),
        ):
            pass
        assert "\n" not in str(err.value)
    assert sizes_problem(4, 12, 16) is None and sizes_problem(0, 1) is None


@pytest.mark.parametrize(
    ("name", "options", "says"),
    [
        ("learned", {}, "not a function of the query-key distance alone"),
        ("sinusoidal", {}, "not a function of the query-key distance alone"),
        ("fire", {}, "not a function of the query-key distance alone"),
        ("fox", {}, "positions come from the content"),
        ("shaw", {}, "computes its own attention weights or a value term"),
        ("stickbreak", {}, "positions come from the content"),
        ("rope", {"window": 4}, "model.window"),
        ("rope", {"sinks": True}, "model.sinks"),
    ],
)
def test_schemes_it_cannot_reindex_are_refused(name: str, options: dict, says: str) -> None:
    model = DecoderLM(vocab_size=11, encoder=name, d_model=16, n_heads=2, n_layers=1, **options)
    problem = refusal(model)
    assert problem is not None and says in problem and "\n" not in problem
    with pytest.raises(ValueError, match=says), model.streaming(SETTING):
        pass


def test_dynamic_ntk_is_refused() -> None:
    from tests.model.test_cache import ROPE_SCALINGS

    model = lm("rope", ROPE_SCALINGS["dynamic_ntk"], n_layers=1)
    assert "length of the whole pass" in (refusal(model) or "")


@pytest.mark.parametrize("name", STREAMABLE)
def test_streamable_schemes_are_not_refused(name: str) -> None:
    assert refusal(lm(name, CASE_SETTINGS.get(name, {}), n_layers=1)) is None
