"""The FlexAttention path equals the explicit path, for every scheme with a score term.

In torch 2.13 FlexAttention has a forward on a CPU but no backward, so values are
compared here, forward only; gradients are compared on a GPU (tests marked ``cuda``).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module

from posenc.encoders import build, registry
from posenc.encoders.base import AttnKind
from posenc.model import DecoderLM, EncoderDecoder, backends
from posenc.model.attention import Attention
from tests.conftest import BIDIRECTIONAL_YAMLS, ENCODER_YAMLS

H, D = 4, 8
#: Every scheme with a score term; Shaw's value term needs the probabilities, so its
#: flex form is the key term alone.
SCORED = {
    "alibi": {},
    "t5": {"num_buckets": 8, "max_distance": 12},
    "fire": {"threshold": 9.0},  # positions on both sides of L
    "shaw": {"max_distance": 3, "value": False},
    "xl": {},
    "deberta": {"max_distance": 8, "bucket_size": 4},
    "deberta_c2p": {"max_distance": 6, "bucket_size": 0, "p2c": False},
    "deberta_paper": {"max_distance": 8, "bucket_size": 4, "p2c_row": "paper"},
    "sandwich": {"dim": 32},  # a sinusoid wider than the head: larger terms
}
# (T, S, q0, k0): self-attention, offset positions, queries after a cache (T < S), and
# None for per-row (explicit) positions.
CASES = [(11, 11, 0, 0), (7, 7, 5, 5), (5, 13, 8, 0), (9, 9, None, None)]


def _enc(name: str, head_dim: int = D):
    return build(name.split("_")[0], d_model=H * head_dim, n_heads=H, n_layers=1, **SCORED[name])


def _positions(t: int, s: int, q0: int | None, k0: int | None):
    if q0 is None:  # per-row positions with gaps, as randomized positions give
        pos = torch.stack([torch.arange(t) * 2, torch.arange(t) * 3 + 1])
        return pos, pos, None
    return torch.arange(q0, q0 + t)[None], torch.arange(k0, k0 + s)[None], (q0, k0)


def dense_score_mod(score_mod, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """A ``score_mod``'s term for every ``(b, h, q_idx, kv_idx)`` of ``shape``, by
    broadcasting index tensors through it."""
    idx = [
        torch.arange(n).view([-1 if i == d else 1 for i in range(4)]) for d, n in enumerate(shape)
    ]
    return score_mod(torch.zeros(()), *idx).expand(shape)


@pytest.fixture(autouse=True)
def _quiet_eager_flex() -> None:
    warnings.filterwarnings("ignore", message=".*flex_attention.*")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", [AttnKind.CAUSAL, AttnKind.BIDIRECTIONAL])
@pytest.mark.parametrize("name", list(SCORED))
def test_score_mod_is_the_score_term(name: str, kind: AttnKind, case: tuple) -> None:
    """Read through every (b, h, q_idx, kv_idx), the score_mod adds what score_parts adds
    (on the pairs attention keeps: causal masks keys after the query)."""
    t, s, q0, k0 = case
    enc = _enc(name)
    hook = enc.for_attention(layer=0, kind=kind)
    q_pos, k_pos, starts = _positions(t, s, q0, k0)
    ctx = enc.context(q_pos, k_pos, kind, starts=starts, bound=None if starts else 64)
    b = 2
    q, k = torch.randn(b, H, t, D), torch.randn(b, H, k_pos.shape[-1], D)
    with torch.no_grad():
        ref = hook.score_bias(q, k, ctx).expand(b, H, t, k.shape[-2])
        got = dense_score_mod(hook.score_mod(q, k, ctx), ref.shape)
    keep = torch.ones_like(ref, dtype=torch.bool)
    if kind is AttnKind.CAUSAL:
        keep = (ctx.rel() >= 0)[:, None].expand_as(ref)
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", [AttnKind.CAUSAL, AttnKind.BIDIRECTIONAL])
@pytest.mark.parametrize("name", list(SCORED))
def test_flex_equals_explicit(name: str, kind: AttnKind, case: tuple) -> None:
    """One attention layer, forward: FlexAttention with its block mask (causality, key
    padding) against the explicit softmax, to float32 rounding."""
    t, s, q0, k0 = case
    enc = _enc(name)
    attn = Attention(
        d_model=H * D, n_heads=H, dropout=0.0, pos=enc.for_attention(layer=0, kind=kind)
    ).eval()
    q_pos, k_pos, starts = _positions(t, s, q0, k0)
    x = torch.randn(2, t, H * D)
    memory = torch.randn(2, k_pos.shape[-1], H * D)
    valid = torch.ones(2, k_pos.shape[-1], dtype=torch.bool)
    valid[1, -2:] = False
    ctx = enc.context(q_pos, k_pos, kind, starts=starts, bound=None if starts else 64)
    outs = []
    for backend in ("explicit", "flex"):
        attn.backend = backend
        with torch.no_grad():
            outs.append(attn(x, ctx, memory=memory, key_valid=valid))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)


def _flex_everywhere(model: torch.nn.Module, backend: str) -> None:
    for m in model.modules():
        if isinstance(m, Attention):
            m.backend = backend


@pytest.mark.parametrize("name", ENCODER_YAMLS)
def test_flex_model_equals_explicit_model(name: str) -> None:
    """Whole models, every encoder (schemes without a score term run SDPA either way),
    long enough for the CPU's query blocks."""
    lm = DecoderLM(vocab_size=11, encoder=name, d_model=H * D, n_heads=H, n_layers=2).eval()
    ids = torch.randint(0, 11, (2, 150))
    outs = []
    for backend in ("explicit", "flex"):
        _flex_everywhere(lm, backend)
        with torch.no_grad():
            outs.append(lm(ids))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", BIDIRECTIONAL_YAMLS)
def test_flex_translation_model_equals_explicit(name: str) -> None:
    mt = EncoderDecoder(
        src_vocab_size=13, tgt_vocab_size=13, encoder=name, d_model=H * D, n_heads=H, n_layers=1
    ).eval()
    src, tgt = torch.randint(0, 13, (2, 17)), torch.randint(0, 13, (2, 9))
    src_valid = torch.ones(2, 17, dtype=torch.bool)
    src_valid[0, 12:] = False
    outs = []
    for backend in ("explicit", "flex"):
        _flex_everywhere(mt, backend)
        with torch.no_grad():
            outs.append(mt(src, tgt, src_valid))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)


MODIFIERS = {"qk_norm": True, "logit_scale": "ssmax", "sinks": True}


@pytest.mark.parametrize("logit_scale", ["ssmax", "log_length"])
@pytest.mark.parametrize("name", ["none", "rope", "alibi", "t5", "shaw", "fire"])
def test_modifiers_equal_on_every_backend(name: str, logit_scale: str) -> None:
    """With QK-norm, a logit scale and sinks, SDPA (``auto`` on a CPU without a score
    term), the explicit softmax (with the CPU's query blocks past 128 queries) and
    FlexAttention (the scale in its ``score_mod``, the sink through its log-sum-exp)
    give the same model outputs; and a translator's, with source padding."""
    options = {**MODIFIERS, "logit_scale": logit_scale}
    lm = DecoderLM(
        vocab_size=11, encoder=name, d_model=H * D, n_heads=H, n_layers=2, **options
    ).eval()
    with torch.no_grad():  # sinks and s away from their initial values
        for layer in lm.stack.layers:
            layer.self_attn.logits.sink.normal_()
            if layer.self_attn.logits.s is not None:
                layer.self_attn.logits.s.uniform_(0.2, 1.0)
    ids = torch.randint(0, 11, (2, 150))
    outs = {}
    for backend in ("auto", "explicit", "flex"):
        _flex_everywhere(lm, backend)
        with torch.no_grad():
            outs[backend] = lm(ids)
    for backend in ("explicit", "flex"):
        torch.testing.assert_close(outs[backend], outs["auto"], atol=2e-5, rtol=2e-5)
    if name in BIDIRECTIONAL_YAMLS:
        mt = EncoderDecoder(
            src_vocab_size=13, tgt_vocab_size=13, encoder=name, d_model=H * D, n_heads=H,
            n_layers=1, **options,
        ).eval()  # fmt: skip
        src, tgt = torch.randint(0, 13, (2, 17)), torch.randint(0, 13, (2, 9))
        src_valid = torch.ones(2, 17, dtype=torch.bool)
        src_valid[0, 12:] = False
        for backend in ("auto", "explicit", "flex"):
            _flex_everywhere(mt, backend)
            with torch.no_grad():
                outs[backend] = mt(src, tgt, src_valid)
        for backend in ("explicit", "flex"):
            torch.testing.assert_close(outs[backend], outs["auto"], atol=2e-5, rtol=2e-5)


def _count_block_masks(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    calls: list[tuple] = []
    real = backends.create_block_mask

    def counted(*args, **kwargs):
        calls.append(args[1:5])
        return real(*args, **kwargs)

    monkeypatch.setattr(backends, "create_block_mask", counted)
    return calls


def test_one_block_mask_per_forward_and_per_decoding_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block mask depends on T, S, the causal shift and the key padding only: every
    layer of a pass shares one (4 layers, past the CPU's query blocks of score-term
    schemes, which flex does not use), and a cached step builds one for all layers."""
    calls = _count_block_masks(monkeypatch)
    lm = DecoderLM(vocab_size=11, encoder="alibi", d_model=H * D, n_heads=H, n_layers=4).eval()
    _flex_everywhere(lm, "flex")
    ids = torch.randint(0, 11, (2, 150))
    with torch.no_grad():
        lm(ids)
        assert len(calls) == 1
        cache = lm.new_cache(154)
        lm(ids, cache=cache)
        for i in range(4):
            lm(ids[:, i : i + 1], cache=cache)
    assert len(calls) == 1 + 5  # the prefill and each step: one mask each
    mt = EncoderDecoder(
        src_vocab_size=13, tgt_vocab_size=13, encoder="t5", d_model=H * D, n_heads=H, n_layers=3
    ).eval()
    _flex_everywhere(mt, "flex")
    calls.clear()
    src_valid = torch.ones(2, 17, dtype=torch.bool)
    src_valid[0, 12:] = False
    with torch.no_grad():
        mt(torch.randint(0, 13, (2, 17)), torch.randint(0, 13, (2, 9)), src_valid)
    # 3 layers each: encoder self-attention (padding), decoder self-attention (causal),
    # cross-attention (source padding), one mask each
    assert sorted(calls, key=str) == sorted(
        [(2, None, 17, 17), (None, None, 9, 9), (2, None, 9, 17)], key=str
    )


def test_flex_runs_compiled_on_the_devices_that_compile_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where FlexAttention runs for real (``COMPILED_FLEX_DEVICES``, CUDA), it runs through
    ``torch.compile``, compiled once at first use: here the CPU is made such a device,
    and the compiled kernel (no "unfused" warning) gives the explicit path's values.
    ``flex_eager`` keeps the unfused reference kernel for debugging."""
    monkeypatch.setattr(backends, "COMPILED_FLEX_DEVICES", {"cpu"})
    monkeypatch.setattr(backends, "_compiled_flex", {})
    compiles, calls = [], []
    real_compile = torch.compile

    def spy_compile(fn, *args, **kwargs):
        compiled = real_compile(fn, *args, **kwargs)
        if not fn.__name__.startswith("posenc_flex_attention"):  # (eager flex compiles its own)
            return compiled
        compiles.append(fn)
        return lambda *a, **k: calls.append(1) or compiled(*a, **k)

    monkeypatch.setattr(torch, "compile", spy_compile)
    enc = _enc("alibi")
    attn = Attention(
        d_model=H * D, n_heads=H, dropout=0.0, pos=enc.for_attention(layer=0, kind=AttnKind.CAUSAL)
    ).eval()
    pos = torch.arange(32)[None]
    x = torch.randn(2, 32, H * D)
    outs, used = {}, {}
    for backend in ("explicit", "flex", "flex", "flex_eager"):
        attn.backend = backend
        # torch warns once per process: show it again
        monkeypatch.setattr(flex_module, "_WARNINGS_SHOWN", set(), raising=False)
        before = len(calls)
        with warnings.catch_warnings(record=True) as seen, torch.no_grad():
            warnings.simplefilter("always")
            outs[backend] = attn(x, enc.context(pos, pos, AttnKind.CAUSAL, starts=(0, 0)))
        used[backend] = len(calls) - before
        unfused = any("without torch.compile" in str(w.message) for w in seen)
        assert unfused == (backend == "flex_eager"), backend
    assert used == {"explicit": 0, "flex": 1, "flex_eager": 0}
    assert len(compiles) == 1  # built once
    for backend in ("flex", "flex_eager"):
        torch.testing.assert_close(outs[backend], outs["explicit"], atol=2e-5, rtol=2e-5)


def test_compiled_flex_compiles_per_scheme_not_per_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """One compiled kernel per scheme (its ``score_mod``'s code and captured constants),
    whose lengths turn dynamic at the second length: passes at four lengths compile
    nothing after the second, as uncached generation (a new length each step) needs.
    Shaw's clip distance and then T5's bucket count, each captured as an int, compile
    (one kernel for both made dynamo turn the second int into a symbol, which
    Inductor's FlexAttention lowering cannot compile), and both equal the explicit path."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(backends, "COMPILED_FLEX_DEVICES", {"cpu"})
    monkeypatch.setattr(backends, "_compiled_flex", {})
    for name in ("shaw", "t5", "xl"):
        factory = functools.partial(registry.get(name), **SCORED[name])
        lm = DecoderLM(vocab_size=11, encoder=factory, d_model=H * D, n_heads=H, n_layers=1)
        lm.eval()
        new_graphs = []
        for t in (20, 23, 26, 29):
            ids = torch.randint(0, 11, (1, t))
            outs = {}
            for backend in ("explicit", "flex"):
                _flex_everywhere(lm, backend)
                before = counters["stats"]["unique_graphs"]
                with torch.no_grad():
                    outs[backend] = lm(ids)
            new_graphs.append(counters["stats"]["unique_graphs"] - before)
            torch.testing.assert_close(outs["flex"], outs["explicit"], atol=2e-5, rtol=2e-5)
        assert new_graphs[0] > 0 and new_graphs[2:] == [0, 0], (name, new_graphs)
    assert len(backends._compiled_flex) == 3


def test_a_constant_that_keeps_changing_gets_a_bounded_number_of_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``score_mod`` whose captured int changes at every call (bidirectional XL's smallest
    distance changes with the length) gets ``FLEX_SPECIALIZATIONS`` kernels of its own, then
    one shared kernel for every other value, which specializes ints as it is called; another
    ``score_mod`` still gets its own. (Kernels compile at their first call: none runs here.)"""
    monkeypatch.setattr(backends, "_compiled_flex", {})

    def shifted(n: int):
        return lambda score, b, h, i, j: score + (i - j + n)

    kernels = [backends.compiled_flex_attention(shifted(n)) for n in range(12)]
    limit = backends.FLEX_SPECIALIZATIONS
    assert len({id(k) for k in kernels[:limit]}) == limit
    assert len({id(k) for k in kernels[limit:]}) == 1 and kernels[limit] not in kernels[:limit]
    assert backends.compiled_flex_attention(shifted(3)) is kernels[3]  # a value seen: its own
    other = backends.compiled_flex_attention(lambda score, b, h, i, j: score * 2)
    assert other not in kernels


def test_flex_inside_a_compiled_model_is_one_graph() -> None:
    """Inside ``torch.compile(model)`` FlexAttention is traced into the model's graph
    (no nested compile, no graph break), for a forward pass and a cached step."""
    lm = DecoderLM(vocab_size=11, encoder="t5", d_model=H * D, n_heads=H, n_layers=2).eval()
    _flex_everywhere(lm, "flex")
    torch._dynamo.reset()
    compiled = torch.compile(lm, fullgraph=True, backend="eager", dynamic=False)
    ids = torch.randint(0, 11, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), lm(ids), atol=2e-5, rtol=2e-5)
        cache = lm.new_cache(21)
        compiled(ids, cache=cache)
        step = compiled(ids[:, :1], cache=cache)
        full = lm(torch.cat((ids, ids[:, :1]), 1))
    torch.testing.assert_close(step[:, 0], full[:, -1], atol=2e-5, rtol=2e-5)


# ------------------------------------------------ which path: decided without a GPU
class _OnCuda:
    """Stands in for a CUDA query tensor: use_flex reads only its device and shape."""

    def __init__(self, head_dim: int) -> None:
        self.device = torch.device("cuda")
        self.shape = (1, H, 8, head_dim)


@pytest.mark.parametrize("name", sorted({n.split("_")[0] for n in SCORED}))
def test_auto_path_on_a_gpu(name: str) -> None:
    """On a GPU, auto takes FlexAttention for a score term without a value term when
    no gradient is recorded (evaluation, decoding), heads of at least the kernel's
    smallest dim; training takes the explicit path (flex_trains False: measured slower
    through FlexAttention on an H200 for every scheme tried)."""
    pos = build(name, d_model=H * 16, n_heads=H, n_layers=1, **SCORED[name]).for_attention(
        layer=0, kind=AttnKind.CAUSAL
    )
    q = _OnCuda(16)
    with torch.no_grad():  # evaluation and decoding
        assert backends.use_flex("auto", q, pos, 0.0)
        assert not backends.use_flex("auto", _OnCuda(8), pos, 0.0)  # head dim 8 < 16
        assert not backends.use_flex("auto", q, pos, 0.1)  # dropout: explicit
        assert not backends.use_flex("explicit", q, pos, 0.0)
    with torch.enable_grad():
        assert backends.use_flex("auto", q, pos, 0.0) is pos.flex_trains
        assert backends.use_flex("flex", q, pos, 0.0)  # forced
    assert pos.flex_trains is False


def test_flex_tiles_reach_the_gpu_kernel_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """``FLEX_KERNEL_OPTIONS`` (bench.py --flex-tiles) goes to the compiled GPU kernel as
    ``kernel_options``; a CPU call never gets them (its kernel has no such tiles), and
    its output is unchanged."""
    calls: list[dict] = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return flex_module.flex_attention(*args, **kwargs)

    monkeypatch.setattr(backends, "flex_attention", spy)
    q, k, v = (torch.randn(1, 2, 16, 16) for _ in range(3))
    plain = backends.flex_attend(q, k, v, None, scale=0.25, mask=None, eager=True)
    monkeypatch.setitem(backends.FLEX_KERNEL_OPTIONS, "BLOCK_M", 64)
    tiled = backends.flex_attend(q, k, v, None, scale=0.25, mask=None, eager=True)
    assert [("kernel_options" in c) for c in calls] == [False, False]
    torch.testing.assert_close(tiled, plain)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    backends.flex_attend(q, k, v, None, scale=0.25, mask=None, eager=True)
    assert calls[-1]["kernel_options"] == {"BLOCK_M": 64}


# ------------------------------------------------------------------ on a GPU (skipped here)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


#: The GPU kernel's smallest head dim (backends.FLEX_MIN_HEAD_DIM).
D_CUDA = 16
#: FIRE's learned scalars as FlexAttention captures: torch 2.11's backward lowering
#: fails on them (an AssertionError in process_joint_outputs, seen on an H200); FIRE
#: trains through the explicit path (flex_trains), so only a forced flex fails.
NO_FLEX_BACKWARD = {"fire"}


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(reason="no flex backward", strict=False))
        if n in NO_FLEX_BACKWARD
        else n
        for n in SCORED
    ],
)
def test_flex_gradients_equal_explicit_on_cuda(name: str) -> None:
    enc = _enc(name, D_CUDA).cuda()
    attn = Attention(
        d_model=H * D_CUDA,
        n_heads=H,
        dropout=0.0,
        pos=enc.for_attention(layer=0, kind=AttnKind.CAUSAL),
    ).cuda()
    pos = torch.arange(64, device="cuda")[None]
    x = torch.randn(2, 64, H * D_CUDA, device="cuda", requires_grad=True)
    results = []
    for backend in ("explicit", "flex"):
        attn.backend = backend
        out = attn(x, enc.context(pos, pos, AttnKind.CAUSAL, starts=(0, 0)))
        params = [x, *attn.parameters(), *enc.parameters()]
        grads = torch.autograd.grad(out.square().sum(), params, allow_unused=True)
        results.append([out, *[g for g in grads if g is not None]])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("name", ENCODER_YAMLS)
def test_bf16_training_step_on_cuda(name: str) -> None:
    model = DecoderLM(vocab_size=50, encoder=name, d_model=64, n_heads=4, n_layers=2).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 50, (4, 256), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(
            model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten()
        )
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)


@pytest.mark.cuda
@cuda
def test_default_flex_on_cuda_is_compiled_and_writes_no_scores() -> None:
    """On a GPU the default path of a score-term scheme is the compiled FlexAttention:
    no "unfused" warning, and a forward at T = 4096 allocates far less than one
    ``(B, H, T, S)`` float32 score matrix would take (the eager kernel writes it)."""
    lm = DecoderLM(vocab_size=50, encoder="alibi", d_model=64, n_heads=4, n_layers=2).cuda()
    ids = torch.randint(0, 50, (1, 4096), device="cuda")
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        lm.eval()(ids)  # compiles
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        lm(ids)
        torch.cuda.synchronize()
    assert not any("without torch.compile" in str(w.message) for w in seen)
    scores = 4 * 4096 * 4096 * 4  # H T S float32 bytes
    assert torch.cuda.max_memory_allocated() - before < scores / 4


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("name", ["alibi", "t5", "fire", "xl", "deberta", "rope"])
def test_cached_decoding_on_cuda_equals_full_forward(name: str) -> None:
    """The static cache with the compiled FlexAttention (or SDPA) on a GPU: a prefill
    and single-token steps give a full pass's logits."""
    lm = DecoderLM(vocab_size=50, encoder=name, d_model=64, n_heads=4, n_layers=2).cuda().eval()
    ids = torch.randint(0, 50, (2, 48), device="cuda")
    with torch.no_grad():
        cache = lm.new_cache(48)
        got = [lm(ids[:, :16], cache=cache)] + [
            lm(ids[:, i : i + 1], cache=cache) for i in range(16, 48)
        ]
        full = lm(ids)
    torch.testing.assert_close(torch.cat(got, 1), full, atol=1e-4, rtol=1e-4)
