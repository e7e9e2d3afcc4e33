"""RoPE context extension against the papers' formulas, computed by hand in the tests.

linear: Chen et al. 2023 (position interpolation); ntk: bloc97 2023 / Peng et al. 2023
(YaRN) section 3.1; dynamic_ntk: emozilla 2023 / YaRN section 3.3; yarn: YaRN section 3.4.
"""

from __future__ import annotations

import math

import pytest
import torch

from posenc.encoders.base import AttnKind
from posenc.encoders.rope import (
    SCALINGS,
    RoPE,
    Scaling,
    dynamic_ntk_factor,
    ntk_base,
    rope_frequencies,
    scaled_frequencies,
    yarn_mscale,
    yarn_pair_ramp,
)

METHODS = SCALINGS[1:]
L = 16  # original (training) length in these tests


def rope(d_model: int = 16, n_heads: int = 2, **kwargs) -> RoPE:
    return RoPE(d_model=d_model, n_heads=n_heads, n_layers=1, **kwargs)


def qk(
    enc: RoPE, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k ``(1, H, T, D)`` after the encoder's causal self-attention hook at ``pos (1, T)``."""
    ctx = enc.context(pos, pos, AttnKind.CAUSAL)
    return enc.for_attention(layer=0, kind=AttnKind.CAUSAL).transform_qk(q, k, ctx)


def textbook(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs of ``x (T, R)`` rotated by ``angles (T, R/2)``, float64."""
    x, a = x.double(), angles.double()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * a.cos() - x2 * a.sin(), x1 * a.sin() + x2 * a.cos()), -1).flatten(-2)


# ----------------------------------------------------------------------- s = 1 is plain RoPE
@pytest.mark.parametrize("method", ["linear", "ntk", "yarn"])
def test_factor_one_is_exactly_plain_rope(method: str) -> None:
    plain = rope()
    enc = rope(scaling=method, scaling_factor=1.0, original_length=L)
    pos = torch.arange(4 * L)[None]  # also past L: s = 1 is plain RoPE at every length
    x = torch.randn(1, 2, 4 * L, 8)
    for a, b in zip(plain.tables(pos), enc.tables(pos), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(qk(plain, x, x, pos), qk(enc, x, x, pos), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("method", ["ntk", "dynamic_ntk"])
@pytest.mark.parametrize("length", [1, L // 2, L])
def test_ntk_at_or_below_the_original_length(method: str, length: int) -> None:
    """dynamic_ntk is plain RoPE for every pass with keys up to L, whatever its alpha;
    ntk with factor 1 is plain RoPE at any length."""
    for factor in (1.0, 4.0) if method == "dynamic_ntk" else (1.0,):
        enc = rope(scaling=method, scaling_factor=factor, original_length=L)
        pos = torch.arange(length)[None]
        x = torch.randn(1, 2, length, 8)
        for a, b in zip(rope().tables(pos), enc.tables(pos), strict=True):
            assert torch.equal(a, b)
        for a, b in zip(qk(rope(), x, x, pos), qk(enc, x, x, pos), strict=True):
            assert torch.equal(a, b)


def test_yarn_factor_one_with_partial_rotation_adds_no_temperature() -> None:
    enc = rope(d_model=32, fraction=0.5, scaling="yarn", original_length=L)
    pos = torch.arange(8)[None]
    assert "pass_scale" not in enc.context(pos, pos, AttnKind.CAUSAL).extra
    x = torch.randn(1, 2, 8, 16)
    for a, b in zip(qk(rope(d_model=32, fraction=0.5), x, x, pos), qk(enc, x, x, pos), strict=True):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------- pinned formulas
@pytest.mark.parametrize("s", [2.0, 4.0, 2.5])
def test_linear_rotates_by_m_over_s_times_theta(s: float) -> None:
    enc = rope(d_model=16, n_heads=2, scaling="linear", scaling_factor=s)  # R = 8
    m = torch.tensor([0, 1, 3, 17, 250, 1999])
    theta = torch.tensor([10000.0 ** (-2 * i / 8) for i in range(4)], dtype=torch.float64)
    angles = (m.double() / s)[:, None] * theta  # (m/s) * theta_i, as in the paper
    x = torch.randn(1, 1, len(m), 8)
    q, _ = qk(rope(d_model=8, n_heads=1, scaling="linear", scaling_factor=s), x, x, m[None])
    # float32 angles of up to ~1000 rad: a few 1e-5 of absolute error.
    torch.testing.assert_close(q[0, 0].double(), textbook(x[0, 0], angles), atol=1e-4, rtol=1e-5)
    # And m/s need not be an integer: position 3 at s = 2 sits half way between 1 and 2.
    cos, _ = enc.tables(torch.tensor([[3]]))
    torch.testing.assert_close(cos[0, 0, 0].double(), (3 / s * theta).cos(), atol=1e-6, rtol=1e-6)


def test_ntk_base_by_hand() -> None:
    # R = 4, s = 4: base' = 10000 * 4^(4/2) = 160000, so theta = (1, 160000^-1/2 = 1/400).
    assert ntk_base(10000.0, 4.0, 4) == pytest.approx(160000.0)
    theta, mscale = scaled_frequencies(4, 10000.0, Scaling("ntk", 4.0))
    torch.testing.assert_close(theta, torch.tensor([1.0, 1 / 400]))
    assert mscale == 1.0
    # R = 8, s = 2: base' = 10000 * 2^(8/6); the fastest pair stays at 1, the slowest
    # (i = 3, exponent -6/8) is interpolated by exactly s: 10000^(-3/4) / 2.
    base = 10000.0 * 2.0 ** (8 / 6)
    theta, _ = scaled_frequencies(8, 10000.0, Scaling("ntk", 2.0))
    want = torch.tensor([base ** (-2 * i / 8) for i in range(4)])
    torch.testing.assert_close(theta, want)
    assert theta[0] == 1.0
    assert float(theta[3]) == pytest.approx(10000.0 ** (-0.75) / 2, rel=1e-6)
    # R = 2: the only frequency is base^0 = 1 for any base; NTK leaves it alone.
    assert ntk_base(10000.0, 4.0, 2) == 10000.0


def test_yarn_frequencies_and_temperature_by_hand() -> None:
    # R = 8, base 10^4: theta = (1, 0.1, 0.01, 0.001). With L = 256, r_i = L theta_i / 2pi
    # = (40.7, 4.07, 0.407, 0.0407): pair 0 is past beta = 32 (kept), pair 1 is on the ramp,
    # pairs 2 and 3 are below alpha = 1 (interpolated by s).
    s, length = 4.0, 256
    theta = [10000.0 ** (-2 * i / 8) for i in range(4)]
    r = [length / (2 * math.pi / t) for t in theta]
    assert r[0] > 32 and 1 < r[1] < 32 and r[2] < 1 and r[3] < 1  # all three regions

    def ramp(x: float) -> float:
        return 0.0 if x < 1 else 1.0 if x > 32 else (x - 1) / 31

    want = [(1 - ramp(x)) * t / s + ramp(x) * t for x, t in zip(r, theta, strict=True)]
    assert want[0] == theta[0] and want[2] == theta[2] / s
    assert theta[1] / s < want[1] < theta[1]
    got, mscale = scaled_frequencies(8, 10000.0, Scaling("yarn", s, length, yarn_ramp="paper"))
    torch.testing.assert_close(
        got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0
    )
    assert mscale == pytest.approx(0.1 * math.log(4) + 1) == yarn_mscale(4.0)
    assert mscale == pytest.approx(1.138629, abs=1e-6)
    # The tables carry the temperature: cos, sin of m * theta'_i, times mscale.
    enc = rope(
        d_model=8,
        n_heads=1,
        scaling="yarn",
        scaling_factor=s,
        original_length=length,
        yarn_ramp="paper",
    )
    cos, sin = enc.tables(torch.tensor([[100]]))
    angle = 100 * torch.tensor(want, dtype=torch.float64)
    torch.testing.assert_close(cos[0, 0, 0].double(), mscale * angle.cos(), atol=2e-5, rtol=0)
    torch.testing.assert_close(sin[0, 0, 0].double(), mscale * angle.sin(), atol=2e-5, rtol=0)


# R = 8, base 1e4, s = 4, L = 64 (issue #24): theta = (1, 0.1, 0.01, 0.001), so
# r_i = 64 theta_i / 2pi = (10.19, 1.019, 0.102, 0.0102).
def test_yarn_code_ramp_by_hand() -> None:
    # The pair where r = w: i(w) = 8 ln(64 / (2 pi w)) / (2 ln 1e4).
    # i(32) = 8 ln(0.3183) / 18.42 = -0.497 -> floor -1 -> clamped to low = 0;
    # i(1) = 8 ln(10.19) / 18.42 = 1.008 -> ceil 2 = high. The ramp (i - 0) / (2 - 0) =
    # (0, 0.5, 1, 1), gamma = 1 - ramp = (1, 0.5, 0, 0):
    # theta' = (1, 0.5 * 0.1 / 4 + 0.5 * 0.1, 0.01 / 4, 0.001 / 4) = (1, 0.0625, 0.0025, 0.00025).
    got, mscale = scaled_frequencies(8, 10000.0, Scaling("yarn", 4.0, 64))
    assert Scaling("yarn", 4.0, 64).yarn_ramp == "code"  # the default
    torch.testing.assert_close(got, torch.tensor([1.0, 0.0625, 0.0025, 0.00025]), rtol=1e-6, atol=0)
    assert mscale == pytest.approx(0.1 * math.log(4) + 1)


def test_yarn_paper_ramp_by_hand() -> None:
    # gamma(r) = (r - 1) / 31 on (1, 32): pair 0: (10.186 - 1) / 31 = 0.29633, theta' =
    # 0.70367 / 4 + 0.29633 = 0.47224; pair 1: (1.0186 - 1) / 31 = 0.000600, theta' =
    # 0.9994 * 0.025 + 0.0006 * 0.1 = 0.025045; pairs 2, 3 below alpha: theta / 4.
    got, _ = scaled_frequencies(8, 10000.0, Scaling("yarn", 4.0, 64, yarn_ramp="paper"))
    torch.testing.assert_close(
        got, torch.tensor([0.47224, 0.025045, 0.0025, 0.00025]), rtol=2e-5, atol=0
    )


def test_yarn_code_ramp_edges() -> None:
    """R = 8, base 1e4, i(w) = 8 ln(L / (2 pi w)) / (2 ln 1e4) the pair where r = w."""
    # A ramp one pair wide: alpha 2, beta 2.1, L = 256: i(2.1) = 1.288 -> low 1,
    # i(2) = 1.309 -> high 2; (i - 1) / 1 clamped = (0, 0, 1, 1).
    got = yarn_pair_ramp(8, 10000.0, 256, 2.0, 2.1)
    assert got.tolist() == [1.0, 1.0, 0.0, 0.0]
    # high == low: L = 4, i(1) = 8 ln(0.637) / 18.42 = -0.196 -> ceil 0, i(32) < 0 -> 0;
    # high becomes 0.001: a step after pair 0, (0, 1, 1, 1) -> gamma (1, 0, 0, 0).
    got = yarn_pair_ramp(8, 10000.0, 4, 1.0, 32.0)
    assert got.tolist() == [1.0, 0.0, 0.0, 0.0]
    # The upper bound is clamped to R - 1 as in the code, not to R/2 - 1: at L = 3e6,
    # i(32) = 4.17 -> low 4 and i(1) = 5.68 -> high 6, so every pair is below low and kept
    # (each has more than 32 wavelengths in L: r_3 = 3e6 * 0.001 / 2 pi = 477). Clamping
    # high to R/2 - 1 = 3 would give (i - 4) / (3 - 4) >= 1: every pair interpolated.
    got = yarn_pair_ramp(8, 10000.0, 3 * 10**6, 1.0, 32.0)
    assert got.tolist() == [1.0, 1.0, 1.0, 1.0]


def test_yarn_ramp_bounds_are_settable() -> None:
    # alpha = 0.5, beta = 2 puts pair 1 (r = 4.07) past beta: now kept unchanged; pair 2
    # (r = 0.41) is below alpha: interpolated by s.
    theta, _ = scaled_frequencies(8, 10000.0, Scaling("yarn", 4.0, 256, 0.5, 2.0))
    assert float(theta[1]) == pytest.approx(0.1)
    assert float(theta[2]) == pytest.approx(0.01 / 4)


@pytest.mark.parametrize(("alpha", "want"), [(1.0, (1.0, 2.0, 4.0)), (2.0, (1.0, 3.0, 7.0))])
def test_dynamic_ntk_factor_by_hand(alpha: float, want: tuple[float, ...]) -> None:
    # s' = max(1, alpha * l / L - (alpha - 1)) for l > L, plain RoPE (s' = 1) at l = L.
    for mult, s in zip((1, 2, 4), want, strict=True):
        assert dynamic_ntk_factor(alpha, mult * L, L) == s
    # The tables of a pass with keys up to 2L are NTK tables with s' (alpha = 2: s' = 3).
    if alpha == 2.0:
        enc = rope(scaling="dynamic_ntk", scaling_factor=alpha, original_length=L)
        pos = torch.arange(2 * L)[None]
        ntk = rope(scaling="ntk", scaling_factor=3.0)
        for a, b in zip(enc.tables(pos), ntk.tables(pos), strict=True):
            assert torch.equal(a, b)


# ----------------------------------------------------------------------- properties
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_scores_stay_relative(method: str, fraction: float) -> None:
    """<R_m q, R_n k> depends only on n - m: with one q and one k at every position, the
    score matrix is constant along each diagonal (one pass, so one dynamic s')."""
    enc = rope(d_model=32, fraction=fraction, scaling=method, scaling_factor=4.0, original_length=L)
    n = 4 * L
    q = torch.randn(1, 2, 1, 16).expand(1, 2, n, 16)
    k = torch.randn(1, 2, 1, 16).expand(1, 2, n, 16)
    rq, rk = qk(enc, q, k, torch.arange(n)[None])
    scores = (rq.double() @ rk.double().transpose(-1, -2))[0]  # (H, T, T)
    for d in (0, 1, 5, 40):
        diag = scores.diagonal(offset=d, dim1=-2, dim2=-1)
        torch.testing.assert_close(diag, diag[:, :1].expand_as(diag), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("temper", ["rotated", "score"])
def test_yarn_temperature_with_partial_rotation(temper: str) -> None:
    """``rotated`` (default, the code): the unrotated dims' score is untouched and the
    rotated dims' score gets mscale^2; ``score`` (the paper): both get mscale^2."""
    kwargs = {} if temper == "rotated" else {"yarn_temper": "score"}
    enc = rope(
        d_model=32, fraction=0.5, scaling="yarn", scaling_factor=4.0, original_length=L, **kwargs
    )
    plain = rope(d_model=32, fraction=0.5)
    m2 = yarn_mscale(4.0) ** 2
    pos = torch.arange(3)[None]
    q, k = torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16)
    q[..., 8:], k[..., 8:] = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)  # unrotated dims
    rq, rk = qk(enc, q, k, pos)
    tail = m2 if temper == "score" else 1.0
    torch.testing.assert_close(rq @ rk.transpose(-1, -2), tail * (q @ k.transpose(-1, -2)))
    # rotated dims only: mscale^2 times the score with YaRN's frequencies but no temperature
    q, k = torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16)
    q[..., :8], k[..., :8] = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    rq, rk = qk(enc, q, k, pos)
    freq, _ = enc.frequencies(3)
    angles = pos[0, :, None].double() * freq.double()  # (T, R/2)
    tq, tk = textbook(q[0, :, :, :8], angles), textbook(k[0, :, :, :8], angles)
    torch.testing.assert_close(
        (rq @ rk.transpose(-1, -2))[0].double(),
        m2 * tq @ tk.transpose(-1, -2),
        atol=1e-5,
        rtol=1e-5,
    )
    assert not torch.equal(qk(plain, q, k, pos)[0], rq)


# ----------------------------------------------------------------------- switching settings
def test_switching_never_serves_stale_tables() -> None:
    enc = rope()
    pos = torch.arange(4 * L)[None]
    plain = [t.clone() for t in enc.tables(pos)]
    previous = enc.set_scaling("yarn", 4.0, L)
    assert previous == Scaling()
    yarn = enc.tables(pos)
    assert not torch.equal(yarn[0], plain[0])
    torch.testing.assert_close(
        yarn[0], rope(scaling="yarn", scaling_factor=4.0, original_length=L).tables(pos)[0]
    )
    assert enc.set_scaling(previous).method == "yarn"
    for a, b in zip(enc.tables(pos), plain, strict=True):
        assert torch.equal(a, b)
    # Another factor of the same method is another table.
    with enc.scaled("linear", 2.0):
        two = enc.tables(pos)[0].clone()
    with enc.scaled("linear", 4.0):
        assert not torch.equal(enc.tables(pos)[0], two)
    # dynamic_ntk: a pass with keys up to 2L and one up to 4L use different s'.
    with enc.scaled("dynamic_ntk", 1.0, L):
        short = enc.tables(torch.arange(2 * L)[None])[0][0, 0, 5].clone()
        long = enc.tables(torch.arange(4 * L)[None])[0][0, 0, 5]
        assert not torch.equal(short, long)
    assert enc.scaling == Scaling()
    assert torch.equal(enc.tables(pos)[0], plain[0])


def test_scaled_restores_after_an_error() -> None:
    enc = rope(scaling="linear", scaling_factor=2.0)
    with pytest.raises(RuntimeError), enc.scaled("yarn", 4.0, L):
        raise RuntimeError("boom")
    assert enc.scaling == Scaling("linear", 2.0)


def test_yarn_ramp_settings_survive_a_switch_and_a_cast() -> None:
    enc = rope(yarn_alpha=2.0, yarn_beta=16.0, yarn_ramp="paper", yarn_temper="score")
    with enc.scaled("yarn", 4.0, L):
        s = enc.scaling
        assert (s.yarn_alpha, s.yarn_beta, s.yarn_ramp, s.yarn_temper) == (
            2.0,
            16.0,
            "paper",
            "score",
        )
    enc = rope(scaling="yarn", scaling_factor=4.0, original_length=L)
    pos = torch.arange(40)[None]
    before = enc.tables(pos)[0].clone()
    enc = enc.to(torch.bfloat16)
    assert enc.tables(pos)[0].dtype == torch.float32
    assert torch.equal(enc.tables(pos)[0], before)


def test_only_rope_declares_scaling_methods() -> None:
    from posenc.encoders.registry import get

    assert set(RoPE.scaling_methods) == {"linear", "ntk", "dynamic_ntk", "yarn", "llama3"}
    assert getattr(get("sinusoidal"), "scaling_methods", ()) == ()


LONGROPE = dict(
    scaling="longrope",
    scaling_factor=4.0,
    original_length=L,
    short_factor=[1.0, 1.25, 1.5, 2.0],
    long_factor=[1.0, 2.0, 4.0, 8.0],
)


# ----------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(scaling="rope2"),
            "unknown scaling 'rope2'; did you mean 'longrope'? allowed: none, linear, ntk, "
            "dynamic_ntk, yarn, llama3, longrope",
        ),
        (dict(scaling="llama3", scaling_factor=8.0), "scaling=llama3 needs original_length"),
        (
            dict(low_freq_factor=4.0, high_freq_factor=1.0),
            "need 0 < low_freq_factor < high_freq_factor, got 4.0, 1.0",
        ),
        (
            dict(LONGROPE, long_factor=None),
            "scaling=longrope needs long_factor, one factor per rotated pair",
        ),
        (
            dict(
                scaling="longrope", original_length=L, long_factor=[1.0] * 4, short_factor=[1.0] * 3
            ),
            "short_factor has 3 numbers; it needs one per rotated pair, 4",
        ),
        (
            dict(
                scaling="longrope",
                original_length=L,
                long_factor=[1.0, 0.0, 1.0, 1.0],
                short_factor=[1.0] * 4,
            ),
            "long_factor must be a list of positive numbers",
        ),
        (dict(attention_factor=-1.0), "attention_factor must be a positive number or null"),
        (dict(p=0.0), "p must be in \\(0, 1\\]"),
        (dict(p=1.5), "p must be in \\(0, 1\\]"),
        (dict(p=0.2), "p=0.2 keeps no frequency of 4 pairs; raise p to at least 0.25"),
        (dict(scaling="linear", scaling_factor=0.5), "scaling_factor must be a number >= 1"),
        (dict(scaling="yarn", scaling_factor=2.0), "scaling=yarn needs original_length"),
        (dict(scaling="dynamic_ntk"), "scaling=dynamic_ntk needs original_length"),
        (dict(scaling="yarn", original_length=0), "original_length must be a positive"),
        (dict(yarn_alpha=4.0, yarn_beta=2.0), "need 0 < yarn_alpha < yarn_beta"),
        (dict(yarn_ramp="foo"), "unknown yarn_ramp 'foo'; allowed: code, paper"),
        (dict(yarn_temper="all"), "unknown yarn_temper 'all'; allowed: rotated, score"),
    ],
)
def test_bad_scaling_settings_are_clear_errors(kwargs: dict, message: str) -> None:
    pattern = message if "\\(" in message else message.replace("(", "\\(").replace("?", "\\?")
    with pytest.raises(ValueError, match=pattern):
        rope(**kwargs)


def test_a_bad_switch_keeps_the_current_setting() -> None:
    enc = rope()
    with pytest.raises(ValueError, match="needs original_length"):
        enc.set_scaling("yarn", 4.0)
    assert enc.scaling == Scaling()


def test_rope_frequencies_unchanged() -> None:
    # xpos.py builds on these two: their behaviour is pinned by test_rope.py, and the plain
    # setting of scaled_frequencies is exactly rope_frequencies.
    theta, mscale = scaled_frequencies(8, 500.0, Scaling())
    assert torch.equal(theta, rope_frequencies(8, 500.0)) and mscale == 1.0


# ----------------------------------------------------------------------- llama3, longrope, p
def test_llama3_frequencies_by_hand() -> None:
    """Llama 3.1's three regimes, computed here from the formula: with L = 64, factors 1
    and 4 and base 10000 over 16 rotated dims, the wavelengths 2 pi / theta_i are 6.3, 19.9,
    62.8, 199, ...: pair 0 (< L/4) is kept, pairs 1 and 2 (between L/4 and L) are blended,
    pairs 3.. (> L) are divided by s."""
    s, base, R, length = 8.0, 10000.0, 16, 64
    theta = [base ** (-2 * i / R) for i in range(R // 2)]
    want = []
    for t in theta:
        wave = 2 * math.pi / t
        if wave < length / 4:
            want.append(t)
        elif wave > length / 1:
            want.append(t / s)
        else:
            g = (length / wave - 1) / (4 - 1)
            want.append((1 - g) * t / s + g * t)
    enc = rope(d_model=32, base=base, scaling="llama3", scaling_factor=s, original_length=length)
    freq, mscale = enc.frequencies(4 * length)
    assert mscale == 1.0
    torch.testing.assert_close(freq, torch.tensor(want, dtype=torch.float32), rtol=1e-7, atol=0)
    ratio = freq.double() / torch.tensor(theta, dtype=torch.float64)
    assert ratio[0] == 1.0 and (ratio[3:] - 1 / s).abs().max() < 1e-7
    assert all(1 / s < r < 1 for r in ratio[1:3])  # the blend lies strictly between


@pytest.mark.parametrize("length", [L, L + 1, 4 * L])
def test_longrope_factors_follow_the_pass(length: int) -> None:
    """Short factors while the keys stay within L, long ones past it; the cos/sin tables
    carry sqrt(1 + ln s / ln L) (attention_factor overrides it)."""
    enc = rope(**LONGROPE)
    factors = LONGROPE["long_factor" if length > L else "short_factor"]
    theta = rope_frequencies(8, 10000.0).double()
    freq, mscale = enc.frequencies(length)
    torch.testing.assert_close(
        freq, (theta / torch.tensor(factors).double()).float(), rtol=0, atol=0
    )
    assert mscale == pytest.approx(math.sqrt(1 + math.log(4.0) / math.log(L)), rel=1e-15)
    assert rope(**LONGROPE, attention_factor=1.25).frequencies(length)[1] == 1.25
    cos, _ = enc.tables(torch.arange(length)[None])
    assert cos[0, 0, 0, 0] == pytest.approx(mscale)  # position 0: cos = 1 times the factor


def test_p_rope_keeps_the_highest_frequencies() -> None:
    """p = 0.5 over 8 pairs keeps theta_0..theta_3 of the full rotation (base^(-2i/16)), the
    others are 0: their dims pass through unrotated at every position, and the scores stay
    relative. fraction = 0.5 (GPT-NeoX) is another map: its 4 pairs span base^(-2i/8)."""
    enc = rope(d_model=32, p=0.5)  # head_dim 16: 8 pairs
    freq, _ = enc.frequencies(8)
    full = rope_frequencies(16, 10000.0)
    assert torch.equal(freq[:4], full[:4]) and torch.equal(freq[4:], torch.zeros(4))
    assert not torch.allclose(freq[:4], rope(d_model=32, fraction=0.5).frequencies(8)[0])
    n = 3 * L
    x = torch.randn(1, 2, n, 16)
    rq, rk = qk(enc, x, x, torch.arange(n)[None])
    kept = [d for i in range(4) for d in (2 * i, 2 * i + 1)]  # interleaved pairs 0..3
    assert torch.equal(rq[..., 8:], x[..., 8:]) and not torch.allclose(rq[..., kept], x[..., kept])
    q = torch.randn(1, 2, 1, 16).expand(1, 2, n, 16)
    rq, rk = qk(enc, q, q, torch.arange(n)[None])
    scores = (rq.double() @ rk.double().transpose(-1, -2))[0]
    for d in (0, 3, 20):
        diag = scores.diagonal(offset=d, dim1=-2, dim2=-1)
        torch.testing.assert_close(diag, diag[:, :1].expand_as(diag), atol=1e-4, rtol=1e-4)


def test_p_one_is_exactly_plain_rope() -> None:
    pos = torch.arange(2 * L)[None]
    for a, b in zip(rope().tables(pos), rope(p=1.0).tables(pos), strict=True):
        assert torch.equal(a, b)
