"""Rotary position embedding, RoPE (Su et al. 2021, RoFormer, section 3.4).

Notation: B batch, H heads, T sequence, D head dim, R rotated dims (R <= D, even).

Pair i of a query or key at position m is rotated by the angle ``m * theta_i`` with
``theta_i = base^(-2i/R)``. Then ``<R_m q, R_n k>`` depends on q, k and ``n - m``
only, so attention scores are relative. Two layouts of the pairs are in use:

* ``interleaved``: pair i is dims ``(2i, 2i+1)`` -- RoFormer, torchtune, fairseq2;
* ``half``: pair i is dims ``(i, i + R/2)`` -- GPT-NeoX, Hugging Face ("rotate_half").

They are the same map up to a fixed permutation of the dims, but weights trained
under one are wrong under the other, so the layout is a named option.

Cross-attention: nothing. Decoder and encoder positions index different sequences,
so their difference means nothing; queries and keys pass through unrotated.

Context extension (``scaling``), with s the scale factor and L the original (training)
length; each keeps the scores relative and, at s = 1, is exactly plain RoPE:

* ``linear``: position interpolation (Chen et al. 2023, "Extending Context Window of Large
  Language Models via Positional Interpolation"): the angle ``m * theta_i`` becomes
  ``(m / s) * theta_i``.
* ``ntk``: "NTK-aware" scaling (bloc97 2023; Peng et al. 2023, YaRN, section 3.1): the base
  becomes ``base * s^(R / (R - 2))``, which leaves the fastest pair alone and interpolates
  the slowest one by exactly s.
* ``dynamic_ntk``: dynamic NTK (emozilla 2023; YaRN section 3.3): each forward pass with
  keys up to length l uses ``ntk`` with ``s' = max(1, alpha * l / L - (alpha - 1))`` when
  ``l > L`` and plain RoPE otherwise; the configured factor is alpha.
* ``yarn``: YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large
  Language Models", section 3.4): "NTK-by-parts" frequencies (section 3.2)
  ``theta'_i = (1 - gamma_i) * theta_i / s + gamma_i * theta_i``, plus the attention
  temperature ``sqrt(1/t) = 0.1 ln(s) + 1``. With ``r_i = L * theta_i / (2 pi)`` (wavelengths
  per original context), gamma_i is 0 for pairs with fewer than alpha wavelengths in L and 1
  for those with more than beta; in between, two ramps are in use (``yarn_ramp``):

  - ``code`` (default): the authors' code (``find_correction_range`` and
    ``linear_ramp_factor`` of jquesnelle/yarn, as ported to Hugging Face transformers, which
    published YaRN checkpoints were trained with) is linear in the pair index i, between
    ``low = floor(i(beta))`` and ``high = ceil(i(alpha))`` with
    ``i(w) = R ln(L / (2 pi w)) / (2 ln base)`` the (fractional) pair with r = w, clamped
    to ``[0, R - 1]``: ``gamma_i = 1 - clamp((i - low) / (high - low), 0, 1)`` (``high``
    gets + 0.001 when equal to ``low``);
  - ``paper``: linear in r, ``gamma(r) = clamp((r - alpha) / (beta - alpha), 0, 1)``
    (eq. 17-18). As r is exponential in i, the two differ between the bounds.

  The temperature is folded into the cos/sin tables of both q and k (the score gets
  ``mscale^2 = 1/t``). With partial rotation (``fraction < 1``), ``yarn_temper`` says what
  it tempers: ``rotated`` (default, the code: only the rotated dims' cos/sin carry it) or
  ``score`` (the paper's whole-score temperature: the unrotated dims are multiplied by
  mscale too). Defaults follow the code since checkpoints and their configs assume it.
* ``llama3``: Llama 3.1's frequency scaling (Meta 2024; Hugging Face transformers'
  ``_compute_llama3_parameters``): with wavelength ``lambda_i = 2 pi / theta_i``, pairs with
  ``lambda_i > L / low_freq_factor`` are interpolated (``theta_i / s``), pairs with
  ``lambda_i < L / high_freq_factor`` are left alone, and in between
  ``theta'_i = (1 - g) theta_i / s + g theta_i`` with
  ``g = (L / lambda_i - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
  Llama 3.1 uses s = 8, factors 1 and 4, L = 8192.
* ``longrope`` (Ding et al. 2024, "LongRoPE"; Phi-3's ``su`` scaling): a searched factor per
  pair, ``theta'_i = theta_i / lambda_i``, with the ``long_factor`` list for passes whose keys
  reach beyond L and the ``short_factor`` list otherwise (so, like ``dynamic_ntk``, the
  frequencies follow the pass), and ``attention_factor`` on the cos/sin tables
  (default ``sqrt(1 + ln s / ln L)`` for s > 1, else 1). The lists come from the
  authors' search for a given model; posenc takes them as given. Training-time only: an
  evaluation-time extension (``task.eval.context_extension``) has no lists to search.

Proportional RoPE, p-RoPE (Barbero et al. 2025, "Round and Round We Go! What makes Rotary
Positional Encodings useful?", ICLR; Gemma's ``rope_proportion``): ``p < 1`` keeps the
``floor(p R / 2)`` highest frequencies ``theta_i = base^(-2i/R)`` and sets the others to 0,
so those pairs are not rotated and carry no position. Unlike ``fraction`` (GPT-NeoX's
partial rotation, whose frequencies are spread over the rotated dims only), the kept
frequencies are those of the full rotation.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from posenc.choices import SCALINGS, TRAINED_SCALINGS
from posenc.encoders.base import (
    AttentionContext,
    AttentionPositional,
    AttnKind,
    PositionalEncoder,
    Slot,
)
from posenc.encoders.registry import register
from posenc.errors import unknown_value

LAYOUTS = ("interleaved", "half")
#: Methods that need the original (training) length L.
NEEDS_LENGTH = ("dynamic_ntk", "yarn", "llama3", "longrope")
#: Methods whose frequencies follow the length of the pass.
PASS_SCALINGS = ("dynamic_ntk", "longrope")
#: YaRN's ramp between alpha and beta: the authors' code (per pair index) or the paper (in r).
YARN_RAMPS = ("code", "paper")
#: What YaRN's temperature tempers with partial rotation: the rotated dims (code) or the score.
YARN_TEMPERS = ("rotated", "score")


def rope_frequencies(rot_dim: int, base: float | Tensor = 10000.0, device=None) -> Tensor:
    """``theta_i = base^(-2i/R)`` for ``i = 0 .. R/2-1``, float32, shape ``(R/2,)``.

    Computed in float64 and rounded once. ``base`` may be a 0-d tensor (dynamic NTK's
    base depends on the pass's length), so no host read is needed."""
    if rot_dim <= 0 or rot_dim % 2:
        raise ValueError(
            f"rope: the rotated dimension must be a positive even number, got {rot_dim}; "
            f"choose head_dim and fraction so that head_dim * fraction is even"
        )
    i = torch.arange(rot_dim // 2, device=device, dtype=torch.float64)
    exponent = -2.0 * i / rot_dim
    if isinstance(base, Tensor):
        return (base.double()[..., None] ** exponent).float()  # (..., R/2) for a (...) base
    # A number stays on the host: a tensor made of it would be a copy to the device at
    # every decoding step, which a CUDA graph cannot replay.
    return torch.pow(float(base), exponent).float()


def rope_factors(cos: Tensor, sin: Tensor, layout: str) -> Tensor:
    """What :func:`apply_rope` multiplies by, built from the ``(..., T, R/2)`` tables.

    ``interleaved``: ``cos + i sin`` as complex64, ``(..., T, R/2)``. ``half``: the
    real factors of ``x * [cos, cos] + swap(x) * [-sin, sin]`` per half, stacked as
    ``(2, ..., T, 2, R/2)``. The position axis is :data:`FACTOR_T_DIM` of the layout.
    """
    if layout == "interleaved":
        return torch.complex(cos, sin)
    if layout == "half":
        return torch.stack((torch.stack((cos, cos), -2), torch.stack((-sin, sin), -2)))
    raise ValueError(f"rope: {unknown_value('layout', layout, LAYOUTS)}")


#: The position axis of :func:`rope_factors` per layout (for cutting blocks of queries).
FACTOR_T_DIM = {"interleaved": -2, "half": -3}

# What prepare leaves for the hooks: the layout, the ``(cos, sin)`` tables of the queries
# and keys with their :func:`rope_factors` (per layout: their position axis differs),
# and YaRN's multiplier of the unrotated dims when it scales the whole score.
LAYOUT: Slot[str] = Slot("layout")
Q_COS: Slot[Tensor] = Slot("q_cos", query_dim=-2)
Q_SIN: Slot[Tensor] = Slot("q_sin", query_dim=-2)
K_COS: Slot[Tensor] = Slot("k_cos", key_dim=-2)
K_SIN: Slot[Tensor] = Slot("k_sin", key_dim=-2)
Q_ROT = {layout: Slot[Tensor]("q_rot", query_dim=dim) for layout, dim in FACTOR_T_DIM.items()}
K_ROT = {layout: Slot[Tensor]("k_rot", key_dim=dim) for layout, dim in FACTOR_T_DIM.items()}
PASS_SCALE: Slot[float] = Slot("pass_scale")


def put_rotation_tables(
    ctx: AttentionContext,
    layout: str,
    q: tuple[Tensor, Tensor],
    k: tuple[Tensor, Tensor] | None = None,
) -> None:
    """Store the ``(cos, sin)`` tables of the queries and keys (None: the queries') in
    ``ctx`` for every layer's :func:`apply_rope`, with their :func:`rope_factors` built
    once, and the axes a block of queries is cut along."""
    same = k is None
    if k is None:
        k = q
    ctx.put(LAYOUT, layout)
    ctx.put(Q_COS, q[0])
    ctx.put(Q_SIN, q[1])
    ctx.put(K_COS, k[0])
    ctx.put(K_SIN, k[1])
    q_rot = rope_factors(*q, layout)
    ctx.put(Q_ROT[layout], q_rot)
    ctx.put(K_ROT[layout], q_rot if same else rope_factors(*k, layout))


def rotate_qk(q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
    """``q`` and ``k`` rotated by the tables :func:`put_rotation_tables` left in ``ctx``."""
    layout = ctx[LAYOUT]
    q = apply_rope(q, ctx[Q_COS], ctx[Q_SIN], layout, factors=ctx.get(Q_ROT[layout]))
    k = apply_rope(k, ctx[K_COS], ctx[K_SIN], layout, factors=ctx.get(K_ROT[layout]))
    return q, k


def apply_rope(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    layout: str = "interleaved",
    *,
    factors: Tensor | None = None,
) -> Tensor:
    """Rotate the first ``R = 2 * cos.shape[-1]`` dims of ``x``; pass the rest through.

    The rotation runs in float32 (float64 for a float64 ``x``, with the same float32
    angles) and casts the result back to ``x.dtype``, so bf16/fp16 inputs keep the
    precision of the angle at large positions and float64 ones are not rounded. The
    interleaved layout runs as one complex product (pairs are adjacent, so ``x`` is
    viewed as complex without a copy), where the textbook ``x1*cos - x2*sin,
    x1*sin + x2*cos`` form makes several passes over ``x``. The ``half`` layout has no
    such view: ``x`` as ``(..., 2, R/2)`` halves, swapped by one flip, then two in-place
    products with the stacked factors (``experiments/bench.py`` times both layouts).

    Args:
        x: ``(B, H, T, D)``.
        cos: ``(B|1, 1, T, R/2)`` float32 cosines of the angles.
        sin: Same shape, sines.
        layout: ``interleaved`` or ``half``.
        factors: :func:`rope_factors` of ``cos, sin, layout``, when the caller has them
            already (the RoPE module builds them once per forward pass for every layer).

    Returns:
        ``(B, H, T, D)`` in ``x.dtype``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"rope: {unknown_value('layout', layout, LAYOUTS)}")
    half = cos.shape[-1]
    rot = x[..., : 2 * half].to(torch.promote_types(x.dtype, torch.float32))
    if factors is None:
        factors = rope_factors(cos, sin, layout)
    if layout == "interleaved":
        if rot.stride(-1) != 1 or any(st % 2 for st in rot.stride()[:-1]):
            rot = rot.contiguous()  # view_as_complex needs adjacent, aligned pairs
        z = torch.view_as_complex(rot.unflatten(-1, (half, 2)))  # (B, H, T, R/2)
        out = torch.view_as_real(z * factors).flatten(-2)
    else:  # half (rope_factors has checked the name)
        halves = rot.unflatten(-1, (2, half))  # (B, H, T, 2, R/2): [x1, x2]
        # [x2, x1] * [-sin, sin] + [x1, x2] * [cos, cos]: the flip is the one new tensor
        out = halves.flip(-2).mul_(factors[1]).addcmul_(halves, factors[0]).flatten(-2)
    out = out.to(x.dtype)
    return out if 2 * half == x.shape[-1] else torch.cat((out, x[..., 2 * half :]), dim=-1)


@dataclass(frozen=True)
class Scaling:
    """One context-extension setting of RoPE; checked on construction.

    Attributes:
        method: One of :data:`SCALINGS`.
        factor: Scale factor s >= 1 (for ``dynamic_ntk`` the alpha of ``s'``).
        original_length: The length L the model was trained at; required by
            ``dynamic_ntk`` and ``yarn``, unused by ``linear`` and ``ntk``.
        yarn_alpha: Ramp start of ``yarn`` (in wavelengths per L); 1 in the paper.
        yarn_beta: Ramp end of ``yarn``; 32 in the paper.
        yarn_ramp: ``code`` or ``paper`` (:data:`YARN_RAMPS`, module docstring).
        yarn_temper: ``rotated`` or ``score`` (:data:`YARN_TEMPERS`, module docstring).
        low_freq_factor: ``llama3``: pairs with a wavelength above L / this are interpolated.
        high_freq_factor: ``llama3``: pairs with a wavelength below L / this are kept.
        long_factor: ``longrope``: one factor per pair for passes longer than L.
        short_factor: ``longrope``: one factor per pair otherwise.
        attention_factor: ``longrope``: the cos/sin multiplier; None: the paper's default.

    Raises:
        ValueError: Unknown method, factor < 1, a missing or bad original length, a
            ramp with ``not 0 < yarn_alpha < yarn_beta``, an unknown ``yarn_ramp`` or
            ``yarn_temper``, ``not 0 < low_freq_factor < high_freq_factor``, or
            ``longrope`` without both factor lists of positive numbers.
    """

    method: str = "none"
    factor: float = 1.0
    original_length: int | None = None
    yarn_alpha: float = 1.0
    yarn_beta: float = 32.0
    yarn_ramp: str = "code"
    yarn_temper: str = "rotated"
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    long_factor: tuple[float, ...] | None = None
    short_factor: tuple[float, ...] | None = None
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if self.method not in SCALINGS + TRAINED_SCALINGS:
            raise ValueError(
                f"rope: {unknown_value('scaling', self.method, SCALINGS + TRAINED_SCALINGS)}"
            )
        f = self.factor
        if isinstance(f, bool) or not isinstance(f, int | float) or not math.isfinite(f) or f < 1:
            raise ValueError(
                f"rope: scaling_factor must be a number >= 1 (target length / original "
                f"length), got {f!r}"
            )
        object.__setattr__(self, "factor", float(f))
        L = self.original_length
        if L is not None and (isinstance(L, bool) or not isinstance(L, int) or L <= 0):
            raise ValueError(f"rope: original_length must be a positive integer, got {L!r}")
        if L is None and self.method in NEEDS_LENGTH:
            raise ValueError(
                f"rope: scaling={self.method} needs original_length, the context length the "
                f"model was trained at (e.g. encoder.original_length=128)"
            )
        if not 0 < self.yarn_alpha < self.yarn_beta:
            raise ValueError(
                f"rope: need 0 < yarn_alpha < yarn_beta, got {self.yarn_alpha}, {self.yarn_beta}"
            )
        for key, value, allowed in (
            ("yarn_ramp", self.yarn_ramp, YARN_RAMPS),
            ("yarn_temper", self.yarn_temper, YARN_TEMPERS),
        ):
            if value not in allowed:
                raise ValueError(f"rope: {unknown_value(key, value, allowed)}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"rope: need 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor}, {self.high_freq_factor}"
            )
        for name in ("long_factor", "short_factor"):
            listed = getattr(self, name)
            if listed is None:
                if self.method == "longrope":
                    raise ValueError(
                        f"rope: scaling=longrope needs {name}, one factor per rotated pair "
                        f"(e.g. encoder.{name}=[1.0,1.5,...]; LongRoPE's search gives them)"
                    )
                continue
            given = tuple(listed)
            if not given or not all(finite_positive(v) for v in given):
                raise ValueError(f"rope: {name} must be a list of positive numbers, got {given}")
            object.__setattr__(self, name, tuple(float(v) for v in given))
        a = self.attention_factor
        if a is not None and not finite_positive(a):
            raise ValueError(f"rope: attention_factor must be a positive number or null, got {a!r}")


def finite_positive(value: object) -> bool:
    """A finite int or float > 0, not a bool."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def ntk_base(base: float, factor: float, rot_dim: int) -> float:
    """NTK-aware base ``base * s^(R / (R - 2))`` (YaRN section 3.1). With R = 2 the one
    frequency is ``base^0 = 1`` whatever the base, so the base is returned unchanged."""
    return base if rot_dim <= 2 else base * factor ** (rot_dim / (rot_dim - 2))


def dynamic_ntk_factor(alpha: float, length: int, original_length: int) -> float:
    """``s' = max(1, alpha * l / L - (alpha - 1))`` for ``l > L``, else 1 (YaRN section 3.3)."""
    if length <= original_length:
        return 1.0
    return max(1.0, alpha * length / original_length - (alpha - 1.0))


def dynamic_ntk_frequencies(
    rot_dim: int, base: float, alpha: float, original_length: int, length: Tensor
) -> Tensor:
    """Dynamic NTK's ``theta'`` for a pass whose keys reach ``length`` (a 0-d tensor, so
    the pass needs no host read): :func:`ntk_base` with :func:`dynamic_ntk_factor`'s
    ``s'``, in float64. At ``l <= L``, ``s' = 1`` and this is :func:`rope_frequencies`.
    A ``(B,)`` length (per-row positions: each row's own length) gives ``(B, R/2)``."""
    s = (alpha * length.double() / original_length - (alpha - 1.0)).clamp(min=1.0)
    new_base = base * s ** (rot_dim / (rot_dim - 2)) if rot_dim > 2 else base
    return rope_frequencies(rot_dim, new_base, device=length.device)


def yarn_mscale(factor: float) -> float:
    """``sqrt(1/t) = 0.1 ln(s) + 1`` (YaRN section 3.4); it multiplies both q and k."""
    return 0.1 * math.log(factor) + 1.0


def yarn_ramp(r: Tensor, alpha: float, beta: float) -> Tensor:
    """``gamma(r)``: 0 below alpha, 1 above beta, linear in r in between (YaRN paper,
    section 3.2, eq. 17-18)."""
    return ((r - alpha) / (beta - alpha)).clamp(0.0, 1.0)


def yarn_pair_ramp(
    rot_dim: int, base: float, original_length: int, alpha: float, beta: float, device=None
) -> Tensor:
    """``gamma_i``, float64 ``(R/2,)``, as the YaRN authors' code computes it: linear in the
    pair index between the pairs where ``r = beta`` (floored) and ``r = alpha`` (ceiled),
    bounds clamped to ``[0, R - 1]`` as there (module docstring)."""

    def pair(wavelengths: float) -> float:  # solves L * base^(-2i/R) / (2 pi) = wavelengths
        return (
            rot_dim * math.log(original_length / (wavelengths * 2 * math.pi)) / (2 * math.log(base))
        )

    low = max(math.floor(pair(beta)), 0)
    high = min(math.ceil(pair(alpha)), rot_dim - 1)
    span = high - low if high != low else 0.001
    i = torch.arange(rot_dim // 2, device=device, dtype=torch.float64)
    return 1.0 - ((i - low) / span).clamp(0.0, 1.0)


def llama3_frequencies(theta: Tensor, scaling: Scaling) -> Tensor:
    """Llama 3.1's ``theta'`` (module docstring) from the plain ``theta`` ``(R/2,)``, float32."""
    t, s, length = theta.double(), scaling.factor, scaling.original_length
    assert length is not None  # Scaling.__post_init__: llama3 needs it (NEEDS_LENGTH)
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    ratio = length * t / (2 * math.pi)  # L / wavelength: wavelengths per original context
    g = ((ratio - low) / (high - low)).clamp(0.0, 1.0)  # 0: long waves, 1: short waves
    return ((1.0 - g) * t / s + g * t).float()


def longrope_mscale(scaling: Scaling) -> float:
    """LongRoPE's cos/sin multiplier: ``attention_factor``, else ``sqrt(1 + ln s / ln L)``
    for s > 1 and 1 otherwise (Ding et al. 2024; as Hugging Face transformers)."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    s, length = scaling.factor, scaling.original_length
    assert length is not None  # Scaling.__post_init__: longrope needs it (NEEDS_LENGTH)
    return 1.0 if s <= 1.0 else math.sqrt(1.0 + math.log(s) / math.log(length))


def longrope_frequencies(rot_dim: int, base: float, scaling: Scaling, length: Tensor) -> Tensor:
    """LongRoPE's ``theta_i / lambda_i`` for a pass whose keys reach ``length`` (a 0-d or
    ``(B,)`` tensor, so no host read): the long factors past L, the short ones otherwise;
    ``(R/2,)`` or ``(B, R/2)`` float32."""
    assert scaling.long_factor is not None and scaling.short_factor is not None
    theta = rope_frequencies(rot_dim, base, device=length.device).double()
    factors = torch.tensor(
        (scaling.short_factor, scaling.long_factor), dtype=torch.float64, device=length.device
    )
    assert scaling.original_length is not None  # Scaling.__post_init__: NEEDS_LENGTH
    longer = (length > scaling.original_length).long()
    return (theta / factors[longer]).float()


def scaled_frequencies(
    rot_dim: int, base: float, scaling: Scaling, device=None
) -> tuple[Tensor, float]:
    """Per-pair frequencies and the cos/sin multiplier of a static setting.

    Args:
        rot_dim: Rotated dims R.
        base: RoPE base.
        scaling: A setting with a static method (``dynamic_ntk`` is
            :func:`dynamic_ntk_frequencies`).
        device: Device of the result.

    Returns:
        ``theta'`` float32 ``(R/2,)`` and ``mscale`` (1 except for ``yarn``). At s = 1 this
        is exactly :func:`rope_frequencies` and 1.
    """
    method, s = scaling.method, scaling.factor
    theta = rope_frequencies(rot_dim, base, device=device)
    if method == "none" or s == 1.0:
        return theta, 1.0
    if method == "linear":
        return (theta.double() / s).float(), 1.0
    if method == "ntk":
        return rope_frequencies(rot_dim, ntk_base(base, s, rot_dim), device=device), 1.0
    if method == "yarn":
        t = theta.double()
        length, alpha, beta = scaling.original_length, scaling.yarn_alpha, scaling.yarn_beta
        assert length is not None  # Scaling.__post_init__: yarn needs it (NEEDS_LENGTH)
        if scaling.yarn_ramp == "code":
            gamma = yarn_pair_ramp(rot_dim, base, length, alpha, beta, device=device)
        else:
            gamma = yarn_ramp(length * t / (2 * math.pi), alpha, beta)
        return ((1.0 - gamma) * t / s + gamma * t).float(), yarn_mscale(s)
    if method == "llama3":
        return llama3_frequencies(theta, scaling), 1.0
    raise ValueError(f"rope: scaling {method!r} has no static frequencies; resolve it first")


class _RotateQK(AttentionPositional):
    """Per-layer hook: rotate q and k with the stack's per-forward tables."""

    def transform_qk(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        q, k = rotate_qk(q, k, ctx)
        tail = ctx.get(PASS_SCALE)
        if tail is not None:  # YaRN's whole-score temperature (yarn_temper=score): unrotated dims
            rot = 2 * ctx[Q_COS].shape[-1]
            q = torch.cat((q[..., :rot], q[..., rot:] * tail), dim=-1)
            k = torch.cat((k[..., :rot], k[..., rot:] * tail), dim=-1)
        return q, k


@register("rope")
class RoPE(PositionalEncoder):
    """Rotary embedding of queries and keys in self-attention.

    The cos/sin tables are built per forward pass from the positions (``(T, R/2)``
    products, cheaper than one layer's projections): no cache to grow, no host read,
    and they stay float32 whatever the module is cast to.

    Args:
        base: ``theta_i = base^(-2i/R)``; 10000 in the paper.
        layout: ``interleaved`` (RoFormer) or ``half`` (GPT-NeoX / rotate_half).
        fraction: Share of each head's dims that is rotated (GPT-NeoX's
            ``rotary_pct``); the first ``head_dim * fraction`` dims rotate.
        scaling: Context extension: ``none``, ``linear``, ``ntk``, ``dynamic_ntk``,
            ``yarn``, ``llama3`` or ``longrope`` (module docstring).
        scaling_factor: s >= 1 (the alpha of ``dynamic_ntk``).
        original_length: Training length L; required by the methods of
            :data:`NEEDS_LENGTH`.
        yarn_alpha: ``yarn`` ramp start (beta_slow in the authors' code).
        yarn_beta: ``yarn`` ramp end (beta_fast there).
        yarn_ramp: ``code`` (default: the authors' code, linear in the pair index) or
            ``paper`` (linear in wavelengths per L, eq. 17-18).
        yarn_temper: With ``fraction < 1``, ``rotated`` (default, the code: the temperature
            scales the rotated dims only) or ``score`` (the paper: the whole score).
        p: p-RoPE's share of the frequencies kept, the highest; the others are 0 (module
            docstring). 1: plain RoPE.
        low_freq_factor: ``llama3``'s low-frequency factor (1 in Llama 3.1).
        high_freq_factor: ``llama3``'s high-frequency factor (4 in Llama 3.1).
        long_factor: ``longrope``'s per-pair factors past L (R/2 numbers).
        short_factor: ``longrope``'s per-pair factors up to L (R/2 numbers).
        attention_factor: ``longrope``'s cos/sin multiplier; null: ``sqrt(1 + ln s / ln L)``.

    Raises:
        ValueError: Odd rotated dimension, fraction or p outside (0, 1], p keeping no
            pair, unknown layout, or a bad scaling setting (see :class:`Scaling`).
    """

    relative = True
    #: Context-extension methods :meth:`scaled` accepts (the LM job's support test).
    scaling_methods = SCALINGS[1:]

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_layers: int,
        base: float = 10000.0,
        layout: str = "interleaved",
        fraction: float = 1.0,
        scaling: str = "none",
        scaling_factor: float = 1.0,
        original_length: int | None = None,
        yarn_alpha: float = 1.0,
        yarn_beta: float = 32.0,
        yarn_ramp: str = "code",
        yarn_temper: str = "rotated",
        p: float = 1.0,
        low_freq_factor: float = 1.0,
        high_freq_factor: float = 4.0,
        long_factor: list[float] | None = None,
        short_factor: list[float] | None = None,
        attention_factor: float | None = None,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if layout not in LAYOUTS:
            raise ValueError(f"rope: {unknown_value('layout', layout, LAYOUTS)}")
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"rope: fraction must be in (0, 1], got {fraction}")
        if base <= 1.0:
            raise ValueError(f"rope: base must be > 1, got {base}")
        rot = self.head_dim * fraction
        if rot != int(rot) or int(rot) % 2:
            raise ValueError(
                f"rope: rotated dimension head_dim * fraction = {self.head_dim} * {fraction} = "
                f"{rot:g} must be an even integer; change fraction or d_model/n_heads"
            )
        self.rot_dim = int(rot)
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 < p <= 1.0:
            raise ValueError(
                f"rope: p must be in (0, 1] (the share of frequencies kept), got {p!r}"
            )
        # Gemma's rope_proportion: int(p * R // 2) pairs keep their frequency.
        self.kept_pairs = int(p * self.rot_dim // 2)
        if self.kept_pairs < 1:
            raise ValueError(
                f"rope: p={p} keeps no frequency of {self.rot_dim // 2} pairs; raise p to at "
                f"least {2 / self.rot_dim:g} or use encoder=none"
            )
        self.p = float(p)
        self.base = float(base)
        self.layout = layout
        self.scaling = Scaling(
            scaling,
            scaling_factor,
            original_length,
            yarn_alpha,
            yarn_beta,
            yarn_ramp=yarn_ramp,
            yarn_temper=yarn_temper,
            low_freq_factor=low_freq_factor,
            high_freq_factor=high_freq_factor,
            long_factor=None if long_factor is None else tuple(long_factor),
            short_factor=None if short_factor is None else tuple(short_factor),
            attention_factor=attention_factor,
        )
        for key in ("long_factor", "short_factor"):
            factors = getattr(self.scaling, key)
            if factors is not None and len(factors) != self.rot_dim // 2:
                raise ValueError(
                    f"rope: {key} has {len(factors)} numbers; it needs one per rotated pair, "
                    f"{self.rot_dim // 2} (head_dim * fraction / 2)"
                )

    @property
    def pass_dependent(self) -> bool:
        """Dynamic NTK's base follows the length of the pass, so every hidden state past
        the first layer does too: a cached step runs the whole prefix again (exact)."""
        return self.scaling.method in PASS_SCALINGS

    def set_scaling(
        self,
        method: str | Scaling = "none",
        factor: float = 1.0,
        original_length: int | None = None,
    ) -> Scaling:
        """Switch the context-extension method of the built encoder (no retraining).

        Args:
            method: A name from :data:`SCALINGS`, or a :class:`Scaling` (e.g. one returned
                by an earlier call, to restore it).
            factor: s (the alpha of ``dynamic_ntk``); ignored when ``method`` is a Scaling.
            original_length: Training length L; ignored when ``method`` is a Scaling.

        Returns:
            The previous setting. The YaRN settings (``yarn_alpha``, ``yarn_beta``,
            ``yarn_ramp``, ``yarn_temper``) are kept.

        Raises:
            ValueError: As :class:`Scaling`.
        """
        previous = self.scaling
        if isinstance(method, Scaling):
            self.scaling = method
        else:
            self.scaling = replace(
                previous, method=method, factor=factor, original_length=original_length
            )
        return previous

    @contextmanager
    def scaled(
        self, method: str, factor: float = 1.0, original_length: int | None = None
    ) -> Iterator[None]:
        """:meth:`set_scaling` for the duration of a ``with`` block, then restore."""
        previous = self.set_scaling(method, factor, original_length)
        try:
            yield
        finally:
            self.set_scaling(previous)

    def frequencies(self, length: int | Tensor, device=None) -> tuple[Tensor, float]:
        """``theta'`` ``(R/2,)`` float32 and the cos/sin multiplier of the current scaling
        for a pass whose keys reach ``length`` (only :data:`PASS_SCALINGS` read it), with
        p-RoPE's dropped frequencies at 0."""
        sc = self.scaling
        mscale = 1.0
        if sc.method == "dynamic_ntk":
            assert sc.original_length is not None  # Scaling.__post_init__: NEEDS_LENGTH
            length = torch.as_tensor(length, device=device)
            freq = dynamic_ntk_frequencies(
                self.rot_dim, self.base, sc.factor, sc.original_length, length
            )
        elif sc.method == "longrope":
            length = torch.as_tensor(length, device=device)
            freq, mscale = (
                longrope_frequencies(self.rot_dim, self.base, sc, length),
                longrope_mscale(sc),
            )
        else:
            freq, mscale = scaled_frequencies(self.rot_dim, self.base, sc, device=device)
        if self.kept_pairs < self.rot_dim // 2:  # p-RoPE: the lowest frequencies carry no position
            dropped = torch.arange(self.rot_dim // 2, device=freq.device) >= self.kept_pairs
            freq = freq.masked_fill(dropped, 0.0)
        return freq, mscale

    def tables(
        self, positions: Tensor, length: int | Tensor | None = None, *, theta=None
    ) -> tuple[Tensor, Tensor]:
        """cos and sin at ``positions (B|1, T)``, each ``(B|1, 1, T, R/2)`` float32.

        Args:
            positions: Integer positions >= 0.
            length: The pass's key length l for ``dynamic_ntk``; default max position + 1.
            theta: ``(frequencies, multiplier)`` from :meth:`frequencies`, when known.
        """
        if theta is None:
            if length is None:
                length = positions.amax() + 1 if positions.numel() else 0
            theta = self.frequencies(length, positions.device)
        freq, mscale = theta
        if freq.dim() == 2:  # one row of frequencies per sequence (dynamic NTK, per row)
            freq = freq[:, None, :]
        angle = positions.float()[..., None] * freq  # (B|1, T, R/2), float32 under autocast
        cos, sin = angle.cos(), angle.sin()
        if mscale != 1.0:
            cos, sin = cos * mscale, sin * mscale
        return cos[:, None], sin[:, None]

    def prepare(self, ctx: AttentionContext) -> None:
        if ctx.kind is AttnKind.CROSS:
            return
        # dynamic_ntk's l, the keys' length: a static cache's written keys, known from the
        # run, else each row's own.
        length: int | Tensor
        if ctx.lengths is not None:
            length = ctx.lengths
        elif ctx.starts is not None:
            length = ctx.starts[1] + ctx.k_pos.shape[-1]
        else:
            length = ctx.k_pos.amax(-1) + 1 if ctx.k_pos.numel() else 0
        theta = self.frequencies(length, ctx.q_pos.device)
        ctx.stable_keys = self.scaling.method not in PASS_SCALINGS  # theta' follows the length
        q_tables = self.tables(ctx.q_pos, theta=theta)
        same = ctx.k_pos is ctx.q_pos
        k_tables = None if same else self.tables(ctx.k_pos, theta=theta)
        put_rotation_tables(ctx, self.layout, q_tables, k_tables)
        sc = self.scaling
        if (
            sc.method == "yarn"
            and theta[1] != 1.0
            and self.rot_dim < self.head_dim
            and sc.yarn_temper == "score"
        ):
            ctx.put(PASS_SCALE, theta[1])

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        return AttentionPositional() if kind is AttnKind.CROSS else _RotateQK()
