"""RoPE against the formulas of Su et al. 2021 (RoFormer), section 3.4."""

from __future__ import annotations

import math

import pytest
import torch

from posenc.encoders.base import AttnKind
from posenc.encoders.rope import RoPE, apply_rope, rope_factors, rope_frequencies

D = 8


def rotate(
    x: torch.Tensor, positions: torch.Tensor, layout: str = "interleaved", base: float = 10000.0
) -> torch.Tensor:
    """posenc's elementwise form, for x (T, D) at integer positions (T,)."""
    angle = positions.double()[:, None] * rope_frequencies(x.shape[-1], base).double()
    cos, sin = angle.cos()[None, None].float(), angle.sin()[None, None].float()
    return apply_rope(x[None, None], cos, sin, layout)[0, 0]


def elementwise_reference(x: torch.Tensor, positions: torch.Tensor, layout: str) -> torch.Tensor:
    """The textbook form, eq. (34): x1*cos - x2*sin, x1*sin + x2*cos per pair, float64."""
    d = x.shape[-1]
    angle = positions.double()[:, None] * rope_frequencies(d).double()
    cos, sin = angle.cos(), angle.sin()
    x = x.double()
    if layout == "interleaved":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_fast_path_equals_the_textbook_form(layout: str) -> None:
    x = torch.randn(7, D)
    pos = torch.tensor([0, 1, 2, 50, 999, 4096, 65535])
    torch.testing.assert_close(
        rotate(x, pos, layout).double(), elementwise_reference(x, pos, layout), atol=1e-5, rtol=1e-5
    )
    # On the strided (B, H, T, D) views attention hands over, as well.
    q = torch.randn(2, 5, 3, D).transpose(1, 2)  # (B, H=3, T=5, D), non-contiguous
    ang = torch.arange(5).double()[:, None] * rope_frequencies(D).double()
    out = apply_rope(q, ang.cos().float()[None, None], ang.sin().float()[None, None], layout)
    for h in range(3):
        torch.testing.assert_close(
            out[1, h].double(),
            elementwise_reference(q[1, h], torch.arange(5), layout),
            atol=1e-5,
            rtol=1e-5,
        )


def dense_matrix(m: int, d: int, base: float = 10000.0) -> torch.Tensor:
    """Eq. (15): block-diagonal R_m with 2x2 rotations by m * theta_i, theta_i = base^(-2i/d)."""
    r = torch.zeros(d, d, dtype=torch.float64)
    for i in range(d // 2):
        a = m * base ** (-2 * i / d)
        r[2 * i, 2 * i], r[2 * i, 2 * i + 1] = math.cos(a), -math.sin(a)
        r[2 * i + 1, 2 * i], r[2 * i + 1, 2 * i + 1] = math.sin(a), math.cos(a)
    return r


def complex_form(x: torch.Tensor, m: int, base: float = 10000.0) -> torch.Tensor:
    """Eq. (12)-(13): pairs as complex numbers times exp(i m theta)."""
    d = x.shape[-1]
    z = torch.view_as_complex(x.double().reshape(-1, 2).contiguous())
    theta = torch.tensor([base ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    return torch.view_as_real(z * torch.polar(torch.ones_like(theta), m * theta)).flatten()


def test_hand_computed_values() -> None:
    # d=4, position 1: theta = (1, 10000^-0.5 = 0.01). Pair (1, 0) turns by 1 rad,
    # pair (0, 1) by 0.01 rad.
    x = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    out = rotate(x, torch.tensor([1]))[0]
    want = torch.tensor([math.cos(1), math.sin(1), -math.sin(0.01), math.cos(0.01)])
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("m", [0, 1, 7, 300, 4095])
def test_dense_elementwise_complex_are_one_map(m: int) -> None:
    x = torch.randn(D, dtype=torch.float64)
    dense = dense_matrix(m, D) @ x
    elementwise = rotate(x.float()[None], torch.tensor([m]))[0].double()
    torch.testing.assert_close(elementwise, dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(complex_form(x, m), dense)


def test_interleaved_and_half_equal_up_to_permutation() -> None:
    x = torch.randn(5, D)
    pos = torch.tensor([0, 3, 9, 100, 2000])
    # Interleaved pair i = dims (2i, 2i+1); half pair i = dims (i, i + D/2).
    perm = torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])
    inter = rotate(x, pos, "interleaved")
    half = rotate(x[:, perm], pos, "half")
    torch.testing.assert_close(half, inter[:, perm])
    # And mixing them up is a different map (the classic bug).
    assert not torch.allclose(rotate(x, pos, "half"), inter, atol=1e-3)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rotation_keeps_norms(layout: str) -> None:
    x = torch.randn(50, D)
    out = rotate(x, torch.arange(0, 5000, 100), layout)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_score_depends_only_on_relative_position(layout: str) -> None:
    q, k = torch.randn(D), torch.randn(D)
    for m, n in [(0, 5), (3, 8), (100, 105), (1000, 1005), (2, 2), (40, 1040)]:
        # <R_m q, R_n k> = <q, R_(n-m) k>
        lhs = (
            rotate(q[None], torch.tensor([m]), layout)
            @ rotate(k[None], torch.tensor([n]), layout).T
        )
        rhs = q[None] @ rotate(k[None], torch.tensor([n - m]), layout).T
        torch.testing.assert_close(lhs, rhs, atol=1e-4, rtol=1e-4)
    # Same offset, same score, wherever the pair sits.
    s = [
        rotate(q[None], torch.tensor([m]), layout)
        @ rotate(k[None], torch.tensor([m + 4]), layout).T
        for m in (0, 10, 999)
    ]
    torch.testing.assert_close(s[0], s[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s[0], s[2], atol=1e-4, rtol=1e-4)


def relative_upper_bound(distance: int, d: int = 128, base: float = 10000.0) -> float:
    """Section 3.4.3: (1/(d/2)) * sum_i |S_i| with S_j = sum_{k<j} exp(i * distance * theta_k)."""
    theta = torch.tensor([base ** (-2 * k / d) for k in range(d // 2)], dtype=torch.float64)
    s = torch.cumsum(torch.polar(torch.ones_like(theta), distance * theta), 0)
    return float(s.abs().mean())


def test_long_term_decay_of_the_bound() -> None:
    # At distance 0 every term is 1, so |S_j| = j and the mean is (d/2 + 1) / 2.
    assert relative_upper_bound(0) == pytest.approx((64 + 1) / 2)
    # The bound oscillates but its envelope decays (Figure 2 of the paper): compare
    # averages over log-spaced distance windows.
    windows = [(0, 4), (4, 16), (16, 64), (64, 256), (256, 1024)]
    means = [sum(relative_upper_bound(r) for r in range(a, b)) / (b - a) for a, b in windows]
    assert all(x > y for x, y in zip(means, means[1:], strict=False)), means


def test_bf16_autocast_at_position_4096_matches_float32() -> None:
    enc = RoPE(d_model=64, n_heads=2, n_layers=1)
    x = torch.randn(1, 2, 4, 32)
    pos = torch.arange(4093, 4097)[None]
    ctx = enc.context(pos, pos, AttnKind.CAUSAL)
    hook = enc.for_attention(layer=0, kind=AttnKind.CAUSAL)
    ref, _ = hook.transform_qk(x, x, ctx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ctx16 = enc.context(pos, pos, AttnKind.CAUSAL)
        out, _ = hook.transform_qk(x.bfloat16(), x.bfloat16(), ctx16)
    assert ctx16.extra["q_cos"].dtype == torch.float32
    assert out.dtype == torch.bfloat16
    err = (out.float() - ref).abs().max().item()
    assert err < 3 * 2**-8 * x.abs().max().item()  # a few bf16 ulps of the largest value
    # The failure this guards against: angles formed in bf16 are off by whole radians.
    bad_angle = pos[0].bfloat16()[:, None] * rope_frequencies(32).bfloat16()
    assert (bad_angle.float() - pos[0].float()[:, None] * rope_frequencies(32)).abs().max() > 1


def test_tables_at_any_position_match_formula() -> None:
    enc = RoPE(d_model=16, n_heads=2, n_layers=1)
    cos, sin = enc.tables(torch.tensor([[0, 5000]]))
    theta = rope_frequencies(8)
    torch.testing.assert_close(cos[0, 0, 1], torch.cos(5000 * theta.double()).float())
    torch.testing.assert_close(sin[0, 0, 1], torch.sin(5000 * theta.double()).float())


def test_partial_rotation_leaves_the_rest_alone() -> None:
    enc = RoPE(d_model=32, n_heads=2, n_layers=1, fraction=0.5)  # head_dim 16, rotate 8
    assert enc.rot_dim == 8
    x = torch.randn(1, 2, 3, 16)
    pos = torch.tensor([[1, 2, 3]])
    q, _ = enc.for_attention(layer=0, kind=AttnKind.CAUSAL).transform_qk(
        x, x, enc.context(pos, pos, AttnKind.CAUSAL)
    )
    torch.testing.assert_close(q[..., 8:], x[..., 8:])
    # The rotated part uses theta_i = base^(-2i/8): the rotated dimension, not head_dim.
    torch.testing.assert_close(q[0, 0, :, :8], rotate(x[0, 0, :, :8], pos[0]))


def test_module_cast_keeps_float32_angles() -> None:
    pos = torch.arange(3000, 3004)[None]
    ref = RoPE(d_model=16, n_heads=2, n_layers=1).tables(pos)
    enc = RoPE(d_model=16, n_heads=2, n_layers=1).to(torch.bfloat16)
    got = enc.tables(pos)
    assert got[0].dtype == torch.float32
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(d_model=12, n_heads=4), "must be an even integer"),  # head_dim 3
        (dict(d_model=16, n_heads=2, fraction=0.3), "must be an even integer"),
        (dict(d_model=16, n_heads=2, fraction=0.0), "fraction must be in"),
        (dict(d_model=16, n_heads=2, layout="neox"), "allowed: interleaved, half"),
    ],
)
def test_bad_settings_are_clear_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RoPE(n_layers=1, **kwargs)


def test_cross_attention_is_untouched() -> None:
    enc = RoPE(d_model=16, n_heads=2, n_layers=1)
    hook = enc.for_attention(layer=0, kind=AttnKind.CROSS)
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    ctx = enc.context(torch.arange(3)[None], torch.arange(5)[None], AttnKind.CROSS)
    q2, k2 = hook.transform_qk(q, k, ctx)
    assert q2 is q and k2 is k


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_layer_hook_equals_the_textbook_form(layout: str) -> None:
    """The hook attention calls, with the factors the module builds once per forward
    pass, on the whole context and on a block of queries cut from it."""
    rope = RoPE(d_model=2 * D, n_heads=2, n_layers=1, layout=layout)
    pos = torch.arange(3, 13)[None]
    ctx = rope.context(pos, pos, AttnKind.CAUSAL)
    hook = rope.for_attention(layer=0, kind=AttnKind.CAUSAL)
    q, k = torch.randn(2, 2, 10, D), torch.randn(2, 2, 10, D)
    for sub, rows in ((ctx, slice(0, 10)), (ctx.slice_queries(4, 7), slice(4, 7))):
        rq, rk = hook.transform_qk(q[:, :, rows], k, sub)
        for b in range(2):
            for h in range(2):
                want_q = elementwise_reference(q[b, h, rows], pos[0, rows], layout)
                want_k = elementwise_reference(k[b, h], pos[0], layout)
                torch.testing.assert_close(rq[b, h].double(), want_q, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(rk[b, h].double(), want_k, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("rot_dim", [D, D // 2])
def test_gradients_equal_the_textbook_forms(layout: str, rot_dim: int) -> None:
    """Backward through apply_rope (its in-place half-layout products included), with
    and without precomputed factors, and with a partial rotation."""
    x = torch.randn(2, 3, 6, D, requires_grad=True)
    w = torch.randn(2, 3, 6, D)
    ang = torch.arange(6).double()[:, None] * rope_frequencies(rot_dim).double()
    cos, sin = ang.cos().float()[None, None], ang.sin().float()[None, None]

    def textbook(t: torch.Tensor) -> torch.Tensor:
        rotated = [
            torch.stack(
                [
                    elementwise_reference(t[b, h, :, :rot_dim], torch.arange(6), layout)
                    for h in range(3)
                ]
            )
            for b in range(2)
        ]
        return torch.cat((torch.stack(rotated).float(), t[..., rot_dim:]), -1)

    (want,) = torch.autograd.grad((textbook(x) * w).sum(), x)
    for factors in (None, rope_factors(cos, sin, layout)):
        out = apply_rope(x, cos, sin, layout, factors=factors)
        (got,) = torch.autograd.grad((out * w).sum(), x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
