"""PaTH attention (Yang et al. 2025): scores from the paper's product of Householder-like
matrices, built one matrix at a time; the reflections from the block input by hand;
padding; causality; what the reflections do (none: plain attention; a reflection keeps
a key's length); the forget gate inside the scale; the settings' refusals. Cached
decoding (token by token, in chunks, left-padded, beam-reordered) is checked with every
encoder in tests/model/test_cache.py, compilation in tests/model/test_compile.py."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from posenc.encoders import build, path
from posenc.encoders.base import AttnKind
from posenc.encoders.path import L2_EPS, path_scores
from posenc.model import DecoderLM, EncoderDecoder
from posenc.model.backends import attend

B, H, T, D = 2, 2, 5, 3


def tensors(seed: int = 0) -> tuple[Tensor, ...]:
    """q, k, v ``(B, H, T, D)``, unit vectors w, beta in (0, 2) ``(B, H, T)``, gates."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, w = (torch.randn(B, H, T, D, generator=gen, dtype=torch.float64) for _ in range(4))
    w = w / w.norm(dim=-1, keepdim=True)
    beta = 2 * torch.rand(B, H, T, generator=gen, dtype=torch.float64)
    log_f = F.logsigmoid(torch.randn(B, H, T, generator=gen, dtype=torch.float64))
    return q, k, v, w, beta, log_f


def run(q, k, v, w, beta, *, pad=None, log_f=None) -> Tensor:
    """The scheme's attention through the contract's :func:`attend`, with the
    reflections (and gates) given instead of computed from a block input."""
    enc = build("path", d_model=H * D, n_heads=H, n_layers=1, forget_gate=log_f is not None)
    hook = enc.for_attention(layer=0, kind=AttnKind.CAUSAL)
    t = q.shape[-2]
    valid, pos = None, torch.arange(t)[None]
    if pad is not None:
        shifted = torch.arange(t)[None] - torch.tensor(pad)[:, None]
        valid, pos = shifted >= 0, shifted.clamp(min=0)
    ctx = enc.context(pos, pos, AttnKind.CAUSAL)
    ctx.put(path.W, w)
    ctx.put(path.BETA, beta)
    if log_f is not None:
        g = log_f.cumsum(-1)
        ctx.put(path.GATE_Q, g)
        ctx.put(path.GATE_K, g)
    return attend(hook, q, k, v, ctx, key_valid=valid, shift=0, p_drop=0.0)


def reference(q, k, v, w, beta, *, first=(0, 0), log_f=None) -> Tensor:
    """The paper's formula: ``z_ij = q_i^T H_i ... H_{j+1} k_j / sqrt(D)`` with
    ``H_t = I - beta_t w_t w_t^T`` as D x D matrices, multiplied one at a time, plus
    (PaTH-FoX) ``sum_{j < t <= i} log f_t`` before the scale; softmax over the keys
    ``first[b] <= j <= i`` of row b. Padding queries: zeros."""
    out = torch.zeros_like(q)
    eye = torch.eye(D, dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            for i in range(first[b], T):
                logits = []
                for j in range(first[b], i + 1):
                    prod = eye.clone()
                    for t in range(i, j, -1):  # H_i H_{i-1} ... H_{j+1}
                        wt = w[b, h, t]
                        prod = prod @ (eye - beta[b, h, t] * torch.outer(wt, wt))
                    z = float(q[b, h, i] @ prod @ k[b, h, j])
                    if log_f is not None:
                        z += float(log_f[b, h, j + 1 : i + 1].sum())
                    logits.append(z / math.sqrt(D))
                p = torch.tensor(logits, dtype=q.dtype).softmax(-1)
                out[b, h, i] = p @ v[b, h, first[b] : i + 1]
    return out


def test_scores_equal_the_papers_product_of_matrices() -> None:
    q, k, v, w, beta, _ = tensors()
    got = run(q, k, v, w, beta)
    assert (got - reference(q, k, v, w, beta)).abs().max() < 1e-12
    # the reflections matter here: plain causal attention is far off
    plain = run(q, k, v, w, torch.zeros_like(beta))
    assert (got - plain).abs().max() > 1e-2


def test_no_reflection_is_plain_causal_attention() -> None:
    q, k, v, w, beta, _ = tensors(1)
    got = run(q, k, v, w, torch.zeros_like(beta))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
    assert (got - want).abs().max() < 1e-12


def test_a_full_reflection_keeps_the_length_of_every_key() -> None:
    """beta = 2: every H_t is a reflection (orthogonal), so each rewritten key keeps its
    length; with beta = 1 (a projection) the keys shrink."""
    q, k, _, w, _, _ = tensors(2)
    before = torch.ones(T, T, dtype=torch.bool).tril(-1)
    for value, same in ((2.0, True), (1.0, False)):
        _, keys = path_scores(q, k, w, torch.full((B, H, T), value, dtype=q.dtype), before)
        lengths_kept = torch.allclose(keys.norm(dim=-1), k.norm(dim=-1), rtol=0, atol=1e-12)
        assert lengths_kept == same
    # the last key is before no token: never rewritten
    assert torch.equal(keys[:, :, -1], k[:, :, -1])


def test_forget_gate_adds_the_log_gates_inside_the_scale() -> None:
    q, k, v, w, beta, log_f = tensors(3)
    got = run(q, k, v, w, beta, log_f=log_f)
    assert (got - reference(q, k, v, w, beta, log_f=log_f)).abs().max() < 1e-12


def test_left_padded_rows_equal_the_formula_from_their_first_real_token() -> None:
    q, k, v, w, beta, _ = tensors(4)
    pad = [2, 0]
    # what the block input gives a padding token: no reflection
    beta = beta.clone()
    beta[0, :, :2] = 0.0
    got = run(q, k, v, w, beta, pad=pad)
    assert (got - reference(q, k, v, w, beta, first=(2, 0))).abs().max() < 1e-12
    alone = run(*(x[:1, :, 2:] for x in (q, k, v, w, beta)))
    assert (got[0, :, 2:] - alone[0]).abs().max() < 1e-12
    assert torch.equal(got[0, :, :2], torch.zeros(H, 2, D, dtype=q.dtype))


def test_reflections_from_the_block_input_by_hand() -> None:
    """w_t = l2norm(silu(conv(W2 W1 x)))_h, beta_t = 2 sigmoid(b . x_t + c), with the
    causal width-3 convolution written out as a sum over the token and the two before;
    padding tokens give no convolution input and beta 0."""
    torch.manual_seed(5)
    c, h, t = 8, 2, 6
    enc = build("path", d_model=c, n_heads=h, n_layers=1)
    hook = enc.for_attention(layer=0, kind=AttnKind.CAUSAL).double()
    for p in hook.parameters():  # unit-scale weights, so every term counts
        torch.nn.init.normal_(p)
    x = torch.randn(1, t, c, dtype=torch.float64)
    valid = torch.tensor([[False, True, True, True, True, True]])
    pos = torch.arange(t)[None]
    ctx = hook.with_input(x, enc.context(pos, pos, AttnKind.CAUSAL), key_valid=valid)
    w1, w2 = hook.w_proj[0].weight, hook.w_proj[1].weight
    conv = hook.conv.weight[:, 0, :]  # (C, 3): tap 2 is the token itself
    u = (x[0] @ w1.T @ w2.T) * valid[0, :, None]  # (T, C); padding: 0
    for s in range(t):
        pre = sum(conv[:, 2 - m] * u[s - m] for m in range(3) if s - m >= 0)
        want = F.silu(pre).view(h, c // h)
        want = want / torch.sqrt((want**2).sum(-1, keepdim=True) + L2_EPS)
        assert torch.allclose(ctx.extra["path_w"][0, :, s], want, rtol=0, atol=1e-12)
        b = 2 * torch.sigmoid(hook.beta_proj.weight @ x[0, s] + hook.beta_proj.bias)
        want_beta = b if valid[0, s] else torch.zeros_like(b)
        assert torch.allclose(ctx.extra["path_beta"][0, :, s], want_beta, rtol=0, atol=1e-12)


def test_nothing_leaks_past_the_causal_mask() -> None:
    q, k, v, w, beta, _ = tensors(6)
    q2, k2, v2, w2, beta2 = (x.clone() for x in (q, k, v, w, beta))
    for x in (q2, k2, v2, w2):  # later tokens change as queries, keys, values, reflections
        x[:, :, 3:] += 1.0
    beta2[:, :, 3:] = 1.9 - beta2[:, :, 3:] * 0.5
    a, b = run(q, k, v, w, beta), run(q2, k2, v2, w2, beta2)
    assert torch.equal(a[:, :, :3], b[:, :, :3])
    assert not torch.allclose(a[:, :, 3:], b[:, :, 3:])
    # a DecoderLM (the scheme in every layer, its convolution included)
    model = DecoderLM(vocab_size=13, encoder="path", d_model=8, n_heads=2, n_layers=2)
    model = model.double().eval()
    ids = torch.randint(0, 13, (2, 9))
    changed = ids.clone()
    changed[:, 6:] = (ids[:, 6:] + 1) % 13
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[:, :6], model(changed)[:, :6], rtol=0, atol=0)


def test_the_cache_keeps_rewritten_keys_and_convolution_inputs_per_row() -> None:
    """Batch first (beam search reorders dim 0): the rewritten keys ``(B, H, S, D)``,
    the convolution's inputs ``(B, S, C)``; after a step, the kept keys are the
    projected keys rewritten by every token so far, as :func:`path_scores` leaves them
    after a full pass, and the empty slots stay zero."""
    model = DecoderLM(vocab_size=13, encoder="path", d_model=8, n_heads=2, n_layers=1)
    model = model.double().eval()
    ids = torch.randint(0, 13, (3, 4))
    with torch.no_grad():
        cache = model.new_cache(10)
        model(ids, cache=cache)
    bufs = cache.layers[0].buffers
    assert bufs["path_keys"].shape == (3, 2, 10, 4) and bufs["path_u"].shape == (3, 10, 8)
    keys = bufs["keys"][:, :, :4]  # as projected (PaTH does not transform keys)
    x = _layer_input(model, ids)
    attn = _attention(model)
    ctx = attn.pos.with_input(x, _context(ids.shape[1]), key_valid=None)
    q = attn.q_proj(x).unflatten(-1, (2, 4)).transpose(1, 2)
    before = torch.ones(4, 4, dtype=torch.bool).tril(-1)
    _, want = path_scores(q, keys, ctx.extra["path_w"], ctx.extra["path_beta"], before)
    torch.testing.assert_close(bufs["path_keys"][:, :, :4], want, rtol=0, atol=1e-12)
    assert torch.equal(want[:, :, 3], keys[:, :, 3])  # the last token's own key: untouched
    assert not torch.allclose(want[:, :, :3], keys[:, :, :3])
    assert not bufs["path_keys"][:, :, 4:].any()


def _attention(model: DecoderLM):
    """The first layer's self-attention module."""
    return next(m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "pos"))


def _layer_input(model: DecoderLM, ids: Tensor) -> Tensor:
    """What the first layer's attention sees (its normalised input), by a forward hook."""
    seen = {}
    attn = _attention(model)

    def keep(module: torch.nn.Module, args: tuple) -> None:
        seen.setdefault("x", args[0])

    handle = attn.register_forward_pre_hook(keep)
    with torch.no_grad():
        model(ids)
    handle.remove()
    return seen["x"]


def _context(t: int):
    enc = build("path", d_model=8, n_heads=2, n_layers=1)
    pos = torch.arange(t)[None]
    return enc.context(pos, pos, AttnKind.CAUSAL)


def rewrite_one_token_at_a_time(q, keys, w, beta, before) -> tuple[Tensor, Tensor]:
    """The recursion the chunked form solves: ``k_j <- H_t k_j`` for every key before
    token t, and row t of the scores read right after token t's reflection."""
    rows = []
    for t in range(q.shape[-2]):
        wt = w[:, :, t]  # (B, H, D)
        coef = (keys @ wt[..., None]).squeeze(-1) * beta[:, :, t, None] * before[t]
        keys = keys - coef[..., None] * wt[:, :, None, :]
        rows.append(keys @ q[:, :, t, :, None])
    return torch.cat(rows, -1).transpose(-1, -2), keys


@pytest.mark.parametrize("chunk", [4, 64])
@pytest.mark.parametrize("cached", [0, 6])
@pytest.mark.parametrize("full_pass", [False, True])
def test_chunks_give_the_values_and_gradients_of_one_token_at_a_time(
    monkeypatch: pytest.MonkeyPatch, chunk: int, cached: int, full_pass: bool
) -> None:
    """Chunks of new tokens (the triangular solve) against the token-by-token rewrite,
    float64: every score a query sees, rewritten keys and every gradient, with T not a
    multiple of the chunk and with ``cached`` keys before the new tokens (a decoding
    step). ``full_pass``: the shift given as an int, so each chunk reads only the keys
    up to its last token's own; only the scores a query sees are compared (past its own
    key the causal mask hides them)."""
    monkeypatch.setattr(path, "CHUNK", chunk)
    gen = torch.Generator().manual_seed(7)
    b, h, t, d = 2, 2, 11, 3
    q, w = (torch.randn(b, h, t, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k = torch.randn(b, h, cached + t, d, generator=gen, dtype=torch.float64)
    w = w / w.norm(dim=-1, keepdim=True)
    beta = 2 * torch.rand(b, h, t, generator=gen, dtype=torch.float64)
    before = torch.arange(cached + t)[None, :] < torch.arange(cached, cached + t)[:, None]
    seen = torch.arange(cached + t)[None, :] <= torch.arange(cached, cached + t)[:, None]
    chunked = partial(path.path_scores, shift=cached if full_pass else None)
    grads = []
    for fn in (rewrite_one_token_at_a_time, chunked):
        leaves = [x.clone().requires_grad_() for x in (q, k, w, beta)]
        z, keys = fn(*leaves, before)
        z = z.masked_fill(~seen, 0.0)
        (z.sin().sum() + keys.cos().sum()).backward()
        grads.append((z.detach(), keys.detach(), *(x.grad for x in leaves)))
    for plain, chunked in zip(*grads, strict=True):
        torch.testing.assert_close(chunked, plain, rtol=0, atol=1e-12)


def test_the_forget_gate_from_the_block_input_by_hand() -> None:
    """PaTH-FoX: G_i = sum_{t<=i} logsigmoid(g . x_t + e), padding adding nothing."""
    torch.manual_seed(8)
    c, h, t = 8, 2, 5
    enc = build("path", d_model=c, n_heads=h, n_layers=1, forget_gate=True)
    hook = enc.for_attention(layer=0, kind=AttnKind.CAUSAL).double()
    x = torch.randn(1, t, c, dtype=torch.float64)
    valid = torch.tensor([[False, False, True, True, True]])
    pos = torch.arange(t)[None]
    ctx = hook.with_input(x, enc.context(pos, pos, AttnKind.CAUSAL), key_valid=valid)
    g = hook.gate_proj
    for i in range(t):
        want = sum(F.logsigmoid(g.weight @ x[0, s] + g.bias) for s in range(i + 1) if valid[0, s])
        want = want if isinstance(want, Tensor) else torch.zeros(h, dtype=x.dtype)
        torch.testing.assert_close(ctx.extra["path_gate_q"][0, :, i], want, rtol=0, atol=1e-12)


def test_the_authors_initialisation_in_a_model() -> None:
    """Weights N(0, 0.02) (the convolution's too), biases 0, as the authors'
    ``_init_weights``: the model's initialisation gives the Linears, the scheme the
    convolution."""
    torch.manual_seed(9)
    model = DecoderLM(vocab_size=13, encoder="path", d_model=64, n_heads=4, n_layers=2)
    for layer in [m for m in model.modules() if type(m).__name__ == "_PaTH"]:
        for weight in (layer.conv.weight, layer.w_proj[0].weight, layer.w_proj[1].weight):
            assert abs(weight.std().item() - 0.02) < 0.004, weight.shape
        assert layer.beta_proj.weight.std().item() == pytest.approx(0.02, abs=0.004)
        assert not layer.beta_proj.bias.any()


def test_bad_settings_and_bidirectional_attention_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="path: w_rank must be a positive integer or null"):
        build("path", d_model=8, n_heads=2, n_layers=1, w_rank=0)
    with pytest.raises(ValueError, match="path: conv_size must be an integer >= 0"):
        build("path", d_model=8, n_heads=2, n_layers=1, conv_size=-1)
    enc = build("path", d_model=8, n_heads=2, n_layers=1)
    with pytest.raises(ValueError, match="path is causal only: bidirectional"):
        enc.for_attention(layer=0, kind=AttnKind.BIDIRECTIONAL)
    with pytest.raises(ValueError, match="another encoder for task=mt"):
        EncoderDecoder(src_vocab_size=9, tgt_vocab_size=9, encoder="path", d_model=8,
                       n_heads=2, n_layers=1)  # fmt: skip
