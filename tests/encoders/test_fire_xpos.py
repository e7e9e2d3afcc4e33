"""FIRE (Li et al. 2024) and xPos (Sun et al. 2023) against per-pair references written
directly from the papers' formulas, with loops over (query, key) pairs in float64."""

from __future__ import annotations

import math

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from posenc.encoders.base import AttentionContext, AttentionPositional, AttnKind
from posenc.encoders.fire import Fire, FireFunction
from posenc.encoders.rope import RoPE
from posenc.encoders.xpos import XPos
from posenc.model import DecoderLM, EncoderDecoder
from tests.conftest import ROOT, heads, identity_attention, merge, softmax_attend

C, H = 16, 2
Dh = C // H
KINDS = [AttnKind.CAUSAL, AttnKind.BIDIRECTIONAL]


# --------------------------------------------------------------------------- FIRE


def fire_bias_by_hand(fire: FireFunction, i: int, j: int, causal: bool) -> list[float]:
    """Li et al. eq. 3-4 with progressive interpolation, for one pair, per head:
    f(psi(i - j) / psi(max(L, i))) with psi(x) = log(c x + 1); posenc's bidirectional
    variant feeds sign(i - j) psi(|i - j|) / psi(max(L, i, j))."""
    c, big_l = fire.c.item(), fire.threshold.item()

    def psi(x: float) -> float:
        return math.log(c * x + 1)

    if causal:
        u = psi(max(i - j, 0)) / psi(max(big_l, i))  # j > i is masked; any finite value
    else:
        sign = (i > j) - (i < j)
        u = sign * psi(abs(i - j)) / psi(max(big_l, i, j))
    w1, b1 = fire.w1[:, 0].tolist(), fire.b1.tolist()
    hidden = [max(0.0, w * u + b) for w, b in zip(w1, b1, strict=True)]  # ReLU
    return [
        sum(w * z for w, z in zip(row, hidden, strict=True)) + b
        for row, b in zip(fire.w2.tolist(), fire.b2.tolist(), strict=True)
    ]


def fire_bias_reference(fire: FireFunction, qp, kp, causal: bool) -> torch.Tensor:
    """``(B, H, T, S)`` float64 from per-pair loops; qp ``(B, T)``, kp ``(B, S)``."""
    b, t, s = qp.shape[0], qp.shape[1], kp.shape[1]
    out = torch.empty(b, H, t, s, dtype=torch.float64)
    for r in range(b):
        for i in range(t):
            for j in range(s):
                vals = fire_bias_by_hand(fire, int(qp[r, i]), int(kp[r, j]), causal)
                out[r, :, i, j] = torch.tensor(vals, dtype=torch.float64)
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("block", [None, 1, 4])
def test_fire_attention_matches_the_formula(kind: AttnKind, per_layer: bool, block) -> None:
    # L = 6 with positions 3..11: the first queries are below the threshold, the rest past it.
    enc = Fire(d_model=C, n_heads=H, n_layers=2, threshold=6.0, init_c=0.7, per_layer=per_layer)
    attn = identity_attention(enc, kind, layer=1)
    fire = attn.pos.fire if per_layer else enc.fire
    assert isinstance(fire, FireFunction)
    if block is not None:  # force blocks of `block` queries: bias from the sliced context
        attn.max_score_bytes = 2 * H * 9 * 4 * block
        assert attn.query_block(2, H, 9, 9, 4) == block
    x = torch.randn(2, 9, C)
    qp = torch.stack([torch.arange(3, 12), torch.tensor([0, 2, 3, 7, 8, 9, 15, 16, 30])])
    with torch.no_grad():
        out = attn(x, enc.context(qp, qp, kind))
        q = heads(x, H).double()  # identity projections: q = k = v, (B, H, T, D)
        scores = q @ q.transpose(-1, -2) / math.sqrt(Dh)
        scores = scores + fire_bias_reference(fire, qp, qp, kind is AttnKind.CAUSAL)
        ref = softmax_attend(scores, q, kind is AttnKind.CAUSAL)
    torch.testing.assert_close(out.double(), merge(ref), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_fire_distance_table_path_equals_the_per_pair_mlp(kind: AttnKind) -> None:
    """Below L the bias is computed once per distance and gathered; it must equal the
    per-pair MLP (values and gradients), including per-row positions with gaps."""
    fire = Fire(d_model=C, n_heads=H, n_layers=1, threshold=40.0, init_c=0.6).fire
    # Positions up to 39 < L = 40 (at i = L exactly, max(L, i) has a tie and the per-pair
    # path's torch.maximum splits the gradient of L; both are valid subgradients).
    qp = torch.stack(
        [torch.arange(3, 15), torch.tensor([0, 1, 4, 9, 10, 11, 20, 21, 22, 30, 38, 39])]
    )
    ctx = AttentionContext(q_pos=qp, k_pos=qp, kind=kind, bound=40)
    assert fire._below_threshold(ctx)  # every normaliser is psi(L)
    fast = fire(ctx)
    slow = fire.mlp(fire.inputs(ctx))
    torch.testing.assert_close(fast, slow, atol=1e-6, rtol=1e-6)
    weights = torch.randn_like(fast)
    grads = [
        torch.autograd.grad((b * weights).sum(), list(fire.parameters())) for b in (fast, slow)
    ]
    for g_fast, g_slow in zip(*grads, strict=True):
        torch.testing.assert_close(g_fast, g_slow, atol=1e-4, rtol=1e-4)
    # One position past L (and, bidirectionally, one key past it) leaves the fast path.
    past = AttentionContext(q_pos=qp + 2, k_pos=qp + 2, kind=kind, bound=42)
    assert not fire._below_threshold(past)


@pytest.mark.parametrize("start", [30, 37, 41])
def test_fire_rows_below_threshold_use_the_table(start: int) -> None:
    """Causal queries straddling L = 40.5: the rows at or below L take the per-distance
    table and the rest the per-pair MLP; together they equal the per-pair MLP for every
    row (values and gradients, L's included)."""
    fire = Fire(d_model=C, n_heads=H, n_layers=1, threshold=40.5, init_c=0.6).fire
    q_pos, k_pos = torch.arange(start, start + 8)[None], torch.arange(start + 8)[None]
    ctx = AttentionContext(
        q_pos=q_pos, k_pos=k_pos, kind=AttnKind.CAUSAL, starts=(start, 0), bound=start + 8
    )
    assert fire._rows_below_threshold(ctx) == {30: 0, 37: 4, 41: 0}[start]
    calls = []
    table = fire._by_distance
    fire._by_distance = lambda c: calls.append(c.q_pos.shape[-1]) or table(c)
    fast = fire(ctx)
    assert calls == ([] if start == 41 else [8] if start == 30 else [4])
    # No per-pair gather (its backward took 3.6 s of a 3.7 s step at 4x4096 on a GPU).
    assert "IndexBackward0" not in backward_ops(fast)
    slow = fire.mlp(fire.inputs(ctx))
    keep = torch.arange(start + 8)[None, :] <= q_pos[0, :, None]  # unmasked pairs
    torch.testing.assert_close(fast * keep, slow * keep, atol=1e-6, rtol=1e-6)
    weights = torch.randn_like(fast) * keep
    grads = [
        torch.autograd.grad((b * weights).sum(), list(fire.parameters())) for b in (fast, slow)
    ]
    for g_fast, g_slow in zip(*grads, strict=True):
        torch.testing.assert_close(g_fast, g_slow, atol=1e-4, rtol=1e-4)


def backward_ops(t: torch.Tensor) -> set[str]:
    """The names of every backward node that produced ``t``."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo.extend(f for f, _ in fn.next_functions)
    return {type(fn).__name__ for fn in seen}


def identity_fire(threshold: float = 4.0) -> Fire:
    """FIRE with c = 1, L = threshold and a hand-set MLP that is the identity:
    width 2, f(u) = relu(u) - relu(-u) = u, the same for both heads."""
    enc = Fire(d_model=C, n_heads=H, n_layers=1, mlp_width=2, threshold=threshold)
    with torch.no_grad():
        enc.fire.log_c.zero_()
        enc.fire.log_threshold.fill_(math.log(threshold))
        enc.fire.w1.copy_(torch.tensor([[1.0], [-1.0]]))
        enc.fire.b1.zero_()
        enc.fire.w2.copy_(torch.tensor([[1.0, -1.0]] * H))
        enc.fire.b2.zero_()
    return enc


def fire_bias(enc: Fire, qp, kp, kind: AttnKind) -> torch.Tensor:
    hook = enc.for_attention(layer=0, kind=kind)
    q, k = torch.randn(1, H, qp.shape[-1], Dh), torch.randn(1, H, kp.shape[-1], Dh)
    with torch.no_grad():
        return hook.score_bias(q, k, enc.context(qp, kp, kind))


def test_fire_pinned_values() -> None:
    enc = identity_fire(threshold=4.0)  # c = 1, L = 4, f = identity
    qp, kp = torch.tensor([[2, 10]]), torch.tensor([[0, 3, 10]])
    causal = fire_bias(enc, qp, kp, AttnKind.CAUSAL)[0, 0]  # (T, S), head 0
    # i = 10, j = 3: log(7 + 1) / log(max(4, 10) + 1).
    assert causal[1, 1].item() == pytest.approx(math.log(8) / math.log(11), abs=1e-6)
    # i = 2 < L, j = 0: the normaliser is psi(L) = log(5).
    assert causal[0, 0].item() == pytest.approx(math.log(3) / math.log(5), abs=1e-6)
    assert causal[1, 2].item() == 0.0  # i = j
    bidir = fire_bias(enc, kp, qp, AttnKind.BIDIRECTIONAL)[0, 0]  # queries 0, 3, 10
    # i = 3, j = 10: -psi(7) / psi(max(4, 3, 10)); i = 0, j = 2: -psi(2) / psi(L).
    assert bidir[1, 1].item() == pytest.approx(-math.log(8) / math.log(11), abs=1e-6)
    assert bidir[0, 0].item() == pytest.approx(-math.log(3) / math.log(5), abs=1e-6)
    assert bidir[2, 0].item() == pytest.approx(math.log(9) / math.log(11), abs=1e-6)
    # Both heads share the hand-set MLP.
    torch.testing.assert_close(fire_bias(enc, qp, kp, AttnKind.CAUSAL)[0, 1], causal)


@pytest.mark.parametrize("kind", KINDS)
def test_fire_shift_invariant_below_threshold_only(kind: AttnKind) -> None:
    enc = Fire(d_model=C, n_heads=H, n_layers=1, threshold=64.0)
    pos = torch.arange(10)[None]
    base = fire_bias(enc, pos, pos, kind)
    # All positions stay below L = 64: the bias depends on i - j only.
    torch.testing.assert_close(fire_bias(enc, pos + 40, pos + 40, kind), base)
    # Queries past L: distances are divided by psi(i) > psi(L), so the bias changes.
    assert not torch.allclose(fire_bias(enc, pos + 100, pos + 100, kind), base, atol=1e-4)
    assert Fire.relative is False


def test_fire_long_inputs_stay_in_the_unit_interval() -> None:
    # Progressive interpolation: past L, causal inputs psi(i - j) / psi(i) lie in [0, 1].
    enc = Fire(d_model=C, n_heads=H, n_layers=1, threshold=8.0)
    ctx = enc.context(torch.arange(5000, 5004)[None], torch.arange(0, 5004)[None], AttnKind.CAUSAL)
    with torch.no_grad():
        u = enc.fire.inputs(ctx)
    assert u.min() >= 0 and u.max() <= 1 and u[0, 0, 0] == pytest.approx(1.0, abs=1e-3)


def test_fire_sharing_and_gradients() -> None:
    shared = Fire(d_model=C, n_heads=H, n_layers=3)
    hooks = [shared.for_attention(layer=i, kind=AttnKind.CAUSAL) for i in range(3)]
    assert all(not list(h.parameters()) for h in hooks)
    own = Fire(d_model=C, n_heads=H, n_layers=3, per_layer=True)
    assert not list(own.parameters())
    hooks = [own.for_attention(layer=i, kind=AttnKind.CAUSAL) for i in range(3)]
    assert hooks[0].fire is not hooks[1].fire
    # Every FIRE parameter learns (c and L included), with the model's own weight init.
    model = DecoderLM(vocab_size=20, encoder=Fire, n_layers=2, d_model=C, n_heads=H)
    model(torch.randint(0, 20, (2, 12))).logsumexp(-1).mean().backward()
    for name, p in model.stack.encoder.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert model.stack.encoder.fire.b1.abs().max() > 0.1  # not re-initialised to zero


def test_fire_cross_attention_is_plain() -> None:
    hook = Fire(d_model=C, n_heads=H, n_layers=1).for_attention(layer=0, kind=AttnKind.CROSS)
    assert type(hook) is AttentionPositional


def compose_encoder(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides)).encoder


def test_fire_yaml_threshold_follows_the_task() -> None:
    alone = OmegaConf.load(ROOT / "conf" / "encoder" / "fire.yaml")
    assert alone.threshold == 512
    lm = compose_encoder("encoder=fire", "task=lm", "task.seq_len=96")
    assert lm.threshold == 96
    mt = compose_encoder("encoder=fire", "task=mt", "task.max_len=200")
    assert mt.threshold == 200
    enc = instantiate(OmegaConf.to_container(lm, resolve=True))(d_model=C, n_heads=H, n_layers=1)
    assert enc.fire.threshold.item() == pytest.approx(96)


# --------------------------------------------------------------------------- xPos


def pairs(d: int, layout: str) -> list[tuple[int, int]]:
    """Dims of rotated pair i: (2i, 2i+1) interleaved, (i, i + d/2) half."""
    if layout == "interleaved":
        return [(2 * i, 2 * i + 1) for i in range(d // 2)]
    return [(i, i + d // 2) for i in range(d // 2)]


def xpos_score_by_hand(
    q, k, n: int, m: int, layout: str, gamma: float = 0.4, scale_base: float = 512.0
) -> float:
    """Sun et al. 2023, section 3.2: sum over pairs i of
    zeta_i^((n - m) / scale_base) * <R(n theta_i) q_i, R(m theta_i) k_i>,
    zeta_i = (2i/d + gamma) / (1 + gamma), theta_i = 10000^(-2i/d)."""
    d = len(q)
    total = 0.0
    for i, (a, b) in enumerate(pairs(d, layout)):
        theta = 10000.0 ** (-2 * i / d)
        zeta = (2 * i / d + gamma) / (1 + gamma)
        qa, qb = rot2(float(q[a]), float(q[b]), n * theta)
        ka, kb = rot2(float(k[a]), float(k[b]), m * theta)
        total += zeta ** ((n - m) / scale_base) * (qa * ka + qb * kb)
    return total


def rot2(x: float, y: float, angle: float) -> tuple[float, float]:
    return x * math.cos(angle) - y * math.sin(angle), x * math.sin(angle) + y * math.cos(angle)


def xpos_reference(q, k, qp, kp, layout: str, scale_base: float) -> torch.Tensor:
    """``(B, H, T, S)`` unscaled scores from per-pair loops; qp ``(B, T)``, kp ``(B, S)``."""
    b, h, t, s = q.shape[0], q.shape[1], qp.shape[1], kp.shape[1]
    out = torch.empty(b, h, t, s, dtype=torch.float64)
    for r in range(b):
        for hh in range(h):
            for i in range(t):
                for j in range(s):
                    out[r, hh, i, j] = xpos_score_by_hand(
                        q[r, hh, i],
                        k[r, hh, j],
                        int(qp[r, i]),
                        int(kp[r, j]),
                        layout,
                        scale_base=scale_base,
                    )
    return out


def xpos_scores(enc, q, k, qp, kp) -> torch.Tensor:
    """The content scores q'k'^T (unscaled) after the encoder's transform, ``(B, H, T, S)``."""
    hook = enc.for_attention(layer=0, kind=AttnKind.CAUSAL)
    with torch.no_grad():
        q2, k2 = hook.transform_qk(q, k, enc.context(qp, kp, AttnKind.CAUSAL))
    return q2.float() @ k2.float().transpose(-1, -2)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_xpos_scores_match_the_formula(layout: str) -> None:
    enc = XPos(d_model=C, n_heads=H, n_layers=1, layout=layout, scale_base=16.0)
    # Queries: the last 3 of 7 keys (a cache), per-row positions; all pairs, masked or not.
    kp = torch.stack([torch.arange(5, 12), torch.tensor([0, 4, 9, 10, 20, 33, 40])])
    qp = kp[:, -3:]
    q, k = torch.randn(2, H, 3, Dh), torch.randn(2, H, 7, Dh)
    got = xpos_scores(enc, q, k, qp, kp)
    ref = xpos_reference(q, k, qp, kp, layout, scale_base=16.0).float()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_xpos_pinned_value() -> None:
    # D = 2: one pair, theta_0 = 1, zeta_0 = 0.4 / 1.4 = 2/7. q = k = (1, 0), n - m = 512:
    # score = (2/7)^(512/512) * cos(512 rad).
    enc = XPos(d_model=2, n_heads=1, n_layers=1)
    e = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)
    got = xpos_scores(enc, e, e, torch.tensor([[612]]), torch.tensor([[100]]))
    assert got.item() == pytest.approx(2 / 7 * math.cos(512), abs=1e-5)


def test_xpos_attention_output() -> None:
    enc = XPos(d_model=C, n_heads=H, n_layers=1, scale_base=8.0)
    attn = identity_attention(enc, AttnKind.CAUSAL)
    x = torch.randn(1, 6, C)
    pos = torch.arange(3, 9)[None]
    with torch.no_grad():
        out = attn(x, enc.context(pos, pos, AttnKind.CAUSAL))
    q = heads(x, H)
    scores = xpos_reference(q, q, pos, pos, "interleaved", scale_base=8.0) / math.sqrt(Dh)
    ref = softmax_attend(scores.float(), q, causal=True)
    torch.testing.assert_close(out, merge(ref), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_xpos_score_depends_only_on_relative_position(layout: str) -> None:
    # scale_base 64: uncentred, the key factor at m = 5000 would be
    # zeta_0^(-5000/64) = exp(97.9), past float32's largest number.
    enc = XPos(d_model=C, n_heads=H, n_layers=1, layout=layout, scale_base=64.0)
    zeta0 = torch.tensor(0.4 / 1.4)
    assert torch.isinf(zeta0 ** torch.tensor(-5000 / 64.0))
    q, k = torch.randn(1, H, 8, Dh), torch.randn(1, H, 8, Dh)
    pos = torch.arange(8)[None]
    base = xpos_scores(enc, q, k, pos, pos)
    for shift in (1, 37, 5000):
        got = xpos_scores(enc, q, k, pos + shift, pos + shift)
        assert torch.isfinite(got).all()
        # float32 angles at ~5000 rad are good to ~1e-4 rad relative (as in RoPE).
        torch.testing.assert_close(got, base, atol=5e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_xpos_without_decay_is_rope(layout: str) -> None:
    enc = XPos(d_model=C, n_heads=H, n_layers=1, layout=layout, scale_base=1e12)
    rope = RoPE(d_model=C, n_heads=H, n_layers=1, layout=layout)
    q, k = torch.randn(1, H, 5, Dh), torch.randn(1, H, 5, Dh)
    pos = torch.arange(100, 105)[None]
    ctx = rope.context(pos, pos, AttnKind.CAUSAL)
    rq, rk = rope.for_attention(layer=0, kind=AttnKind.CAUSAL).transform_qk(q, k, ctx)
    torch.testing.assert_close(xpos_scores(enc, q, k, pos, pos), rq @ rk.transpose(-1, -2))


def test_xpos_decays_with_distance() -> None:
    # q = k with all weight in the slowest pair (angle ~ 0): the score is ~zeta^(dist/B).
    enc = XPos(d_model=C, n_heads=H, n_layers=1, scale_base=32.0)
    e = torch.zeros(1, H, 1, Dh)
    e[..., Dh - 2] = 1.0  # interleaved pair 3: theta = 10000^(-3/4), zeta = (0.75+0.4)/1.4
    scores = [
        xpos_scores(enc, e, e, torch.tensor([[d]]), torch.tensor([[0]]))[0, 0, 0, 0]
        for d in (0, 32, 64)
    ]
    zeta = (0.75 + 0.4) / 1.4
    want = [math.cos(d * 10000**-0.75) * zeta ** (d / 32) for d in (0, 32, 64)]
    torch.testing.assert_close(
        torch.stack(scores).double(), torch.tensor(want, dtype=torch.float64), atol=1e-5, rtol=1e-5
    )
    assert scores[0] > scores[1] > scores[2]


def test_xpos_refuses_bidirectional_attention() -> None:
    enc = XPos(d_model=C, n_heads=H, n_layers=1)
    match = r"causal only: bidirectional.*only for keys at or before the query.*task=lm.*rope"
    with pytest.raises(ValueError, match=match):
        enc.for_attention(layer=0, kind=AttnKind.BIDIRECTIONAL)
    with pytest.raises(ValueError, match=match):
        enc.context(torch.arange(4)[None], torch.arange(4)[None], AttnKind.BIDIRECTIONAL)
    with pytest.raises(ValueError, match=match):
        EncoderDecoder(src_vocab_size=20, tgt_vocab_size=20, encoder=XPos, d_model=C, n_heads=H)
    assert type(enc.for_attention(layer=0, kind=AttnKind.CROSS)) is AttentionPositional


def test_xpos_bf16_close_to_float32() -> None:
    enc = XPos(d_model=64, n_heads=2, n_layers=1).to(torch.bfloat16)  # no buffers to round
    q, k = torch.randn(1, 2, 4, 32), torch.randn(1, 2, 8, 32)
    kp = torch.arange(4093, 4101)[None]
    qp = kp[:, -4:]
    hook = enc.for_attention(layer=0, kind=AttnKind.CAUSAL)
    ref_q, ref_k = hook.transform_qk(q, k, enc.context(qp, kp, AttnKind.CAUSAL))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ctx = enc.context(qp, kp, AttnKind.CAUSAL)
        q2, k2 = hook.transform_qk(q.bfloat16(), k.bfloat16(), ctx)
    assert ctx.extra["q_cos"].dtype == torch.float32 and q2.dtype == torch.bfloat16
    # A few bf16 ulps of the largest value (angles and decay factors formed in bf16
    # would be off by whole radians and by percents).
    assert (q2.float() - ref_q).abs().max() < 3 * 2**-8 * ref_q.abs().max()
    assert (k2.float() - ref_k).abs().max() < 3 * 2**-8 * ref_k.abs().max()
    ref = ref_q @ ref_k.transpose(-1, -2)
    got = q2.float() @ k2.float().transpose(-1, -2)
    assert (got - ref).abs().max() < 0.02 * ref.abs().max()


def test_xpos_yaml_builds_with_the_paper_defaults() -> None:
    enc = instantiate(OmegaConf.load(ROOT / "conf" / "encoder" / "xpos.yaml"))(
        d_model=C, n_heads=H, n_layers=1
    )
    assert isinstance(enc, XPos) and enc.relative
    assert (enc.gamma, enc.scale_base, enc.base, enc.layout) == (0.4, 512.0, 1e4, "interleaved")


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (Fire, dict(mlp_width=0), "mlp_width must be >= 1, got 0"),
        (Fire, dict(threshold=0.0), r"threshold \(the initial L\) must be > 0, got 0.0"),
        (Fire, dict(threshold=-5), "must be > 0, got -5"),
        (Fire, dict(init_c=0.0), "init_c must be > 0"),
        (XPos, dict(d_model=6, n_heads=2), "= 3 must be even"),
        (XPos, dict(gamma=0.0), "gamma must be > 0"),
        (XPos, dict(gamma=-0.4), "gamma must be > 0"),
        (XPos, dict(scale_base=0.0), "scale_base must be > 0, got 0.0"),
        (XPos, dict(scale_base=-512), "scale_base must be > 0"),
        (XPos, dict(layout="neox"), "allowed: interleaved, half"),
        (XPos, dict(base=1.0), "base must be > 1"),
    ],
)
def test_bad_settings_are_clear_errors(cls, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls(**(dict(d_model=C, n_heads=H, n_layers=1) | kwargs))
