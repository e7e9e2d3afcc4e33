"""FIRE, Functional Interpolation for Relative positional Encoding (Li et al. 2024,
"Functional Interpolation for Relative Positions Improves Long Context Transformers",
ICLR 2024).

Notation: B batch, H heads, T queries, S keys, W width of the MLP; i a query
position, j a key position.

Each head gets an additive attention bias (the paper's FIRE bias with progressive
interpolation)

    b(i, j) = f_theta( psi(i - j) / psi(max(L, i)) ),    psi(x) = log(c x + 1),

for causal attention (keys j <= i). ``f_theta`` is an MLP ``1 -> W -> H`` with a
ReLU; ``c > 0`` and the threshold ``L > 0`` are learned. For ``i < L`` the
normaliser ``psi(L)`` is a constant, so the bias depends on ``i - j`` only; past
``L`` the inputs are squashed into ``[0, 1]`` however long the sequence, so the MLP
sees inputs from the range it was trained on. Because of that the scheme is not
shift invariant beyond L (``relative = False``).

Parametrisation (posenc's choice): ``c = exp(log_c)`` and ``L = exp(log_threshold)``.
Any real raw value is valid (no clamping, and no re-initialisation can make c or L
non-positive), and Adam's steps on the logarithm change c and L by a
relative amount, which suits a threshold initialised at hundreds as well as c at 1.
The MLP weights are plain parameters rather than ``nn.Linear`` modules so that the
model's GPT-2 initialisation (N(0, 0.02) weights, zero biases) does not reach them:
with zero biases and inputs >= 0 the MLP would start out linear in its input and
every ReLU unit with a negative weight would be dead for good. They start from
``nn.Linear``'s default uniform init instead.

Bidirectional attention (posenc's extension; the paper defines FIRE for causal
attention only): the MLP input is the signed value

    sign(i - j) * psi(|i - j|) / psi(max(L, i, j)),

so keys before and after a query are told apart, and a pair is normalised by its
later position, as a causal pair is by its query.

Cross-attention: nothing (positions of two different sequences are not comparable).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TypedDict

import torch
from torch import Tensor, nn

from posenc.encoders.base import (
    AttentionContext,
    AttentionPositional,
    AttnKind,
    PositionalEncoder,
    ScoreMod,
    Slot,
)
from posenc.encoders.offsets import index_positions, toeplitz
from posenc.encoders.registry import register

# What prepare leaves for the hooks: the function every layer shares (one per stack).
SHARED: Slot[FireFunction] = Slot("fire")


class _FireArgs(TypedDict):
    """The keyword arguments of :class:`FireFunction`."""

    n_heads: int
    width: int
    threshold: float
    init_c: float


class FireFunction(nn.Module):
    """The learned parts of one FIRE bias: ``f_theta``, ``c`` and ``L``.

    Args:
        n_heads: H, the MLP's outputs.
        width: W, the MLP's hidden width.
        threshold: Initial L.
        init_c: Initial c.
    """

    def __init__(self, *, n_heads: int, width: int, threshold: float, init_c: float) -> None:
        super().__init__()
        self.log_c = nn.Parameter(torch.tensor(math.log(init_c)))
        self.log_threshold = nn.Parameter(torch.tensor(math.log(threshold)))
        # nn.Linear's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases.
        self.w1 = nn.Parameter(torch.empty(width, 1).uniform_(-1.0, 1.0))  # fan_in 1
        self.b1 = nn.Parameter(torch.empty(width).uniform_(-1.0, 1.0))
        bound = width**-0.5
        self.w2 = nn.Parameter(torch.empty(n_heads, width).uniform_(-bound, bound))
        self.b2 = nn.Parameter(torch.empty(n_heads).uniform_(-bound, bound))

    @property
    def c(self) -> Tensor:
        return self.log_c.exp()

    @property
    def threshold(self) -> Tensor:
        return self.log_threshold.exp()

    def psi(self, x: Tensor) -> Tensor:
        """``log(c x + 1)`` for distances ``x >= 0``."""
        return torch.log1p(self.c * x)

    def mlp(self, u: Tensor) -> Tensor:
        """``f_theta`` on inputs ``u (B|1, T, S)``; returns ``(B|1, H, T, S)``."""
        b, t, s = u.shape
        # Hidden units first, so the second layer is one matmul whose output is already
        # (B, H, T*S): no permute and no copy of the (B, H, T, S) result.
        w1, b1 = self.w1.view(-1, 1, 1), self.b1.view(-1, 1, 1)  # (W, 1, 1)
        hidden = torch.relu(w1 * u[:, None] + b1)  # (B|1, W, T, S)
        out = torch.matmul(self.w2, hidden.flatten(2)) + self.b2[:, None]  # (B|1, H, T*S)
        return out.view(b, -1, t, s)

    def inputs(self, ctx: AttentionContext) -> Tensor:
        """The MLP inputs of every (query, key) pair of ``ctx``, ``(B|1, T, S)`` float32."""
        rel = ctx.rel().float()  # (B|1, T, S), i - j
        qp = ctx.q_pos.float()[:, :, None]  # (B|1, T, 1)
        if ctx.kind is AttnKind.CAUSAL:
            # Keys after the query are masked anyway; clamp them to distance 0 so psi
            # stays finite (a NaN bias would survive the -inf mask).
            return self.psi(rel.clamp_(min=0)) / self.psi(torch.maximum(qp, self.threshold))
        later = torch.maximum(qp, ctx.k_pos.float()[:, None, :])  # (B|1, T, S)
        norm = self.psi(torch.maximum(later, self.threshold))
        return rel.sign() * self.psi(rel.abs()) / norm

    def score_mod(self, ctx: AttentionContext) -> ScoreMod:
        """The bias of one pair from its positions, MLP included (W scalar terms), for
        FlexAttention: exact on both sides of L, with no table and no branch."""
        q_at, k_at = index_positions(ctx)
        causal = ctx.kind is AttnKind.CAUSAL
        c, limit = self.c, self.threshold
        w1, b1, w2, b2 = self.w1[:, 0], self.b1, self.w2, self.b2

        def mod(score: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            qp, kp = q_at(b, i).float(), k_at(b, j).float()
            d = qp - kp
            if causal:  # later keys are masked; distance 0 keeps psi finite there
                u = torch.log1p(c * d.clamp(min=0)) / torch.log1p(c * torch.maximum(qp, limit))
            else:
                norm = torch.log1p(c * torch.maximum(torch.maximum(qp, kp), limit))
                u = d.sign() * torch.log1p(c * d.abs()) / norm
            out = score + b2[h]
            for w in range(w1.shape[0]):
                out = out + w2[h, w] * torch.relu(w1[w] * u + b1[w])
            return out

        return mod

    def forward(self, ctx: AttentionContext) -> Tensor:
        """The bias ``b(i, j)`` of every pair of ``ctx``, ``(B|1, H, T, S)``.

        Which rows may take the per-distance table depends on the learned L. Under
        ``torch.compile`` the choice between the table and the per-pair MLP is one
        ``torch.cond`` (one graph, no host read). Eager code reads L instead, since an
        eager ``torch.cond`` costs about 0.3 s a call in torch 2.13 (a 2-layer step at
        T = 16 went from 3 ms to 310 ms), and then also splits causal rows at L."""
        if torch.compiler.is_compiling():
            return self._by_cond(ctx)
        if self._below_threshold(ctx):
            return self._by_distance(ctx)
        split = self._rows_below_threshold(ctx)
        if split:  # causal, consecutive: the first rows still share one normaliser
            t = ctx.q_pos.shape[-1]
            low = self._by_distance(ctx.slice_queries(0, split))
            high = self.mlp(self.inputs(ctx.slice_queries(split, t)))
            return torch.cat((low, high), dim=-2)  # (1, H, T, S)
        return self.mlp(self.inputs(ctx))

    def _by_cond(self, ctx: AttentionContext) -> Tensor:
        """:meth:`forward` as one ``torch.cond`` on "every normaliser is psi(L)"."""

        def branch(by_distance: bool):
            def run(q_pos: Tensor, k_pos: Tensor) -> Tensor:
                sub = replace(ctx, q_pos=q_pos, k_pos=k_pos)
                bias = self._by_distance(sub) if by_distance else self.mlp(self.inputs(sub))
                # Both branches must give one memory layout, to the stride of a dim of size
                # 1, which contiguous() leaves as it is (a per-pair gather's (1, H, T, S)
                # has T*S there): re-viewing the flat data gives the standard strides.
                return bias.contiguous().view(-1).view(bias.shape)

            return run

        # cond refuses operands that share memory (a block's q_pos and k_pos are slices
        # of one tensor): the positions are small, so copy them.
        operands = (ctx.q_pos.clone(), ctx.k_pos.clone())
        return torch.cond(self._top(ctx) <= self.threshold, branch(True), branch(False), operands)

    def _top(self, ctx: AttentionContext) -> Tensor:
        """The largest position whose normaliser counts: queries (causal), or queries and
        keys (bidirectional), as a 0-d float tensor."""
        top = ctx.q_pos.amax() if ctx.q_pos.numel() else ctx.q_pos.new_zeros(())
        if ctx.kind is not AttnKind.CAUSAL and ctx.k_pos.numel():
            top = torch.maximum(top, ctx.k_pos.amax())
        return top.float()

    def _rows_below_threshold(self, ctx: AttentionContext) -> int:
        """Causal attention over consecutive positions: how many leading query rows have
        the normaliser ``psi(L)`` (positions ``<= L``), so only the rest need the per-pair
        MLP (a learned L just under the training length would otherwise send a whole
        block of queries to it); 0 when no rows or all rows qualify, or otherwise.
        Eager only (reads L)."""
        if ctx.kind is not AttnKind.CAUSAL or ctx.starts is None:
            return 0
        q0, t = ctx.starts[0], ctx.q_pos.shape[-1]
        below = int(torch.floor(self.threshold.detach())) - q0 + 1  # rows with q0 + r <= L
        return below if 0 < below < t else 0

    def _below_threshold(self, ctx: AttentionContext) -> bool:
        """True when every normaliser of ``ctx`` is ``psi(L)``: no query (causal) or no
        position at all (bidirectional) lies past L. Eager only (reads L)."""
        return bool(self._top(ctx) <= self.threshold)

    def _table(self, lo: int, hi: int, causal: bool) -> Tensor:
        """``(H, hi - lo + 1)``: the bias of each distance ``lo .. hi`` below L. Causal:
        negative distances (masked keys) get distance 0's value, so psi stays finite."""
        dist = torch.arange(lo, hi + 1, device=self.log_c.device, dtype=torch.float32)
        norm = self.psi(self.threshold)
        if causal:
            u = self.psi(dist.clamp(min=0)) / norm
        else:
            u = dist.sign() * self.psi(dist.abs()) / norm
        return self.mlp(u[None, None])[0, :, 0]

    def _by_distance(self, ctx: AttentionContext) -> Tensor:
        """The same bias when the normaliser is the constant ``psi(L)``: the input is a
        function of ``i - j`` alone, so the MLP runs on the ``T + S - 1`` distances present
        (not on every pair) and each pair picks its distance's row. This is the training
        case (positions below L), where the per-pair MLP would cost ``W`` times the score
        matrix in time and memory."""
        causal = ctx.kind is AttnKind.CAUSAL
        if ctx.starts is not None:  # consecutive positions: a Toeplitz view, no gather
            n_lo, n_hi = ctx.toeplitz_range()  # distances -n_hi .. -n_lo
            bias = toeplitz(self._table(-n_hi, -n_lo, causal).flip(-1), ctx)  # (H, T, S)
            if bias is not None:
                return bias[None]
        lo, hi = ctx.distance_range()
        if causal:  # later keys are masked; they read the row of distance 0
            lo, hi = max(lo, 0), max(hi, 0)
        table = self._table(lo, hi, causal)  # (H, R) for the R distances lo..hi
        rel = ctx.rel()
        if causal:
            rel = rel.clamp_(min=0)
        idx = rel.sub_(lo)  # (B|1, T, S) rows of the table
        return table[:, idx].movedim(0, 1)  # (B|1, H, T, S)


class _FireAttention(AttentionPositional):
    """Per-layer hook: the layer's own FIRE function, or the stack's shared one."""

    score_term = True

    def __init__(self, fire: FireFunction | None) -> None:
        super().__init__()
        self.fire = fire

    def _fire(self, ctx: AttentionContext) -> FireFunction:
        return self.fire if self.fire is not None else ctx[SHARED]

    def score_bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        return self._fire(ctx)(ctx)

    def score_mod(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreMod:
        return self._fire(ctx).score_mod(ctx)


@register("fire")
class Fire(PositionalEncoder):
    """FIRE learned additive attention bias (Li et al. 2024).

    Args:
        mlp_width: Hidden width W of ``f_theta``.
        threshold: Initial progressive-interpolation threshold L, best the training
            length (the YAML defaults it to ``task.seq_len``).
        init_c: Initial c of ``psi(x) = log(c x + 1)``.
        per_layer: One ``f_theta, c, L`` per layer (True) or one shared by the stack.

    Raises:
        ValueError: ``mlp_width < 1``, ``threshold <= 0`` or ``init_c <= 0``.
    """

    relative = False
    relative_below = "log_threshold"  # the bias depends on i - j only below L

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_layers: int,
        mlp_width: int = 32,
        threshold: float = 512.0,
        init_c: float = 1.0,
        per_layer: bool = False,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if mlp_width < 1:
            raise ValueError(f"fire: mlp_width must be >= 1, got {mlp_width}; the default is 32")
        if not threshold > 0:
            raise ValueError(
                f"fire: threshold (the initial L) must be > 0, got {threshold}; "
                f"use the training length, e.g. encoder.threshold=512"
            )
        if not init_c > 0:
            raise ValueError(
                f"fire: init_c must be > 0 (psi(x) = log(c x + 1) needs c > 0), got {init_c}; "
                f"try encoder.init_c=1.0"
            )
        self.mlp_width = int(mlp_width)
        self.per_layer = per_layer
        self._fire_args = _FireArgs(
            n_heads=n_heads, width=self.mlp_width, threshold=float(threshold), init_c=init_c
        )
        self.fire = None if per_layer else FireFunction(**self._fire_args)

    def prepare(self, ctx: AttentionContext) -> None:
        if ctx.kind is not AttnKind.CROSS and self.fire is not None:
            ctx.put(SHARED, self.fire)

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        if kind is AttnKind.CROSS:
            return AttentionPositional()
        return _FireAttention(FireFunction(**self._fire_args) if self.per_layer else None)
