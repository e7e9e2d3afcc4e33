"""KERPLE, kernelized relative positional embedding (Chi, Fan, Ramadge and Rudnicky 2022,
"KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation", NeurIPS,
section 4), as its authors' code (chijames/KERPLE, ``ParallelKerpleLog`` and
``ParallelKerplePower`` of their GPT-NeoX fork) runs it.

Notation: B batch, H heads, T queries, S keys; i query and j key position.

Each head adds a learned conditionally positive definite kernel of the distance to its
scaled logits ``q_i . k_j / sqrt(D)``:

    log:    -r1_h * log(1 + r2_h * |i - j|)
    power:  -r1_h * |i - j| ^ r2_h            (0 < r2_h <= 2)

with r1, r2 > 0. As in the authors' code: r1 (their ``bias_p`` for log, ``bias_a`` for
power) and r2 are drawn uniformly, the log form's multiplier from U(0, 2) and its
inner scale from U(0, 1), the power form's multiplier from U(0, 1) and exponent from
U(0, 2); every parameter is kept at >= eps = 0.01 (the exponent also <= 2) by
clamping its value before each use, which posenc does once at construction and after
each optimizer step (:meth:`KerpleParameters.project_`), so every forward pass reads the same
values. One pair per head is shared by the whole stack (the authors pass one module to
every layer); ``per_layer=true`` gives each layer its own. The parameters have the
authors' shape ``(H, 1, 1)``, so AdamW decays them as the authors' optimizer does.

Under a causal mask only ``j <= i`` is seen (the authors' ``i - j``); bidirectional
self-attention takes ``|i - j|``, as posenc's ALiBi does. Cross-attention: nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posenc.encoders.base import (
    AttentionContext,
    AttentionPositional,
    AttnKind,
    Constrained,
    PositionalEncoder,
    ScoreMod,
    Slot,
)
from posenc.encoders.offsets import pair_distance
from posenc.encoders.registry import register
from posenc.errors import unknown_value

FORMS = ("log", "power")
#: The authors' floor for every parameter (``self.eps``).
EPS = 1e-2
#: The power form's largest exponent (a kernel -|d|^p is conditionally positive definite
#: for 0 < p <= 2).
MAX_POWER = 2.0


class KerpleParameters(Constrained):
    """r1 and r2 of every head, ``(H, 1, 1)`` each, drawn as the authors draw them."""

    def __init__(self, n_heads: int, form: str) -> None:
        super().__init__()
        scale1, scale2 = (2.0, 1.0) if form == "log" else (1.0, 2.0)
        self.r1 = nn.Parameter(torch.rand(n_heads, 1, 1) * scale1)
        self.r2 = nn.Parameter(torch.rand(n_heads, 1, 1) * scale2)
        self.form = form
        self.project_()

    @torch.no_grad()
    def project_(self) -> None:
        """Clamp to the kernel's domain, as the authors' forward does before each use."""
        self.r1.clamp_(min=EPS)
        self.r2.clamp_(min=EPS, max=MAX_POWER if self.form == "power" else None)

    def values(self) -> tuple[Tensor, Tensor]:
        """r1 and r2 in float32, clamped as :meth:`project_` does: after a step they are
        already inside (and the clamp passes their gradient); a value set by hand outside
        the domain reads as the nearest one inside."""
        hi = MAX_POWER if self.form == "power" else None
        return self.r1.float().clamp(min=EPS), self.r2.float().clamp(min=EPS, max=hi)

    def kernel(self, dist: Tensor) -> Tensor:
        """The bias at distances ``dist (..., T, S)`` >= 0 (float32): ``(..., H, T, S)``."""
        r1, r2 = self.values()
        d = dist.unsqueeze(-3)
        if self.form == "log":
            return -r1 * torch.log1p(r2 * d)
        return -r1 * d.pow(r2)


#: What prepare leaves for the hooks: the stack's shared kernel.
KERNEL: Slot[KerpleParameters] = Slot("kerple")


class _KerpleAttention(AttentionPositional):
    """Per-layer hook: the stack's kernel, or this layer's own."""

    score_term = True

    def __init__(self, own: KerpleParameters | None) -> None:
        super().__init__()
        self.own = own

    def params(self, ctx: AttentionContext) -> KerpleParameters:
        return ctx[KERNEL] if self.own is None else self.own

    def score_bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        # float32 distances (exact to 2^24) and kernel, rounded once to q's dtype
        dist = ctx.rel().abs().to(torch.float32)  # (B|1, T, S)
        return self.params(ctx).kernel(dist).to(q.dtype)  # (B|1, H, T, S)

    def score_mod(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreMod:
        p, dist = self.params(ctx), pair_distance(ctx)
        r1, r2 = (v.flatten() for v in p.values())
        if p.form == "log":
            return lambda s, b, h, i, j: s - r1[h] * torch.log1p(r2[h] * dist(b, i, j).abs())
        return lambda s, b, h, i, j: s - r1[h] * dist(b, i, j).abs().float().pow(r2[h])


@register("kerple")
class Kerple(PositionalEncoder):
    """KERPLE: a learned log or power kernel of the distance per head, in self-attention.

    Args:
        form: ``log`` (-r1 log(1 + r2 |i-j|)) or ``power`` (-r1 |i-j|^r2).
        per_layer: One pair (r1, r2) per head for each layer, instead of one for the
            stack (the authors' code).

    Raises:
        ValueError: An unknown form.
    """

    relative = True

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_layers: int,
        form: str = "log",
        per_layer: bool = False,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if form not in FORMS:
            raise ValueError(f"kerple: {unknown_value('form', form, FORMS)}")
        self.form = form
        self.per_layer = per_layer
        self.kernel = None if per_layer else KerpleParameters(n_heads, form)

    def prepare(self, ctx: AttentionContext) -> None:
        if ctx.kind is not AttnKind.CROSS and self.kernel is not None:
            ctx.put(KERNEL, self.kernel)

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        if kind is AttnKind.CROSS:
            return AttentionPositional()
        own = KerpleParameters(self.n_heads, self.form) if self.per_layer else None
        return _KerpleAttention(own)
