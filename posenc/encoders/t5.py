"""T5 relative position bias (Raffel et al. 2020, "Exploring the Limits of Transfer
Learning with a Unified Text-to-Text Transformer", JMLR, section 2.1).

Notation: B batch, H heads, T queries, S keys, R = num_buckets, M = max_distance;
i query and j key position, ``n = j - i`` the relative position (key minus query).

Each head adds a learned scalar, looked up by the bucket of n, to its logits:

    score_h(i, j) = q_i . k_j / sqrt(D)  +  b[bucket(j - i), h]

``b`` is an ``(R, H)`` table, shared by all layers of a stack as in T5
(``per_layer=True`` gives each layer its own). Buckets (:func:`t5_bucket`):

* bidirectional (encoder self-attention): R/2 buckets for ``n <= 0`` (key at or
  before the query) in ``[0, R/2)`` and R/2 for ``n > 0`` in ``[R/2, R)``; bucket R/2
  (distance 0 of the ``n > 0`` half) is never used, as in T5;
* causal (decoder self-attention): all R buckets for the distance ``-n``; keys after
  the query (``n > 0``, masked anyway) share bucket 0.

Within a direction of ``Bd`` buckets and distance ``d >= 0``: ``d < Bd/2`` gets
bucket d; from ``Bd/2`` on, ``Bd/2 + floor((Bd - Bd/2) log(d / (Bd/2)) / log(M /
(Bd/2)))``, capped at ``Bd - 1``, so everything from M on shares the last bucket.

T5 itself drops the ``1/sqrt(D)`` of the content score (folding it into the
initialisation); here the content score keeps the scaling every scheme shares and
the bias is added unscaled.

Cross-attention: nothing (positions of two different sequences are not comparable).
"""

from __future__ import annotations

import math

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
from posenc.encoders.offsets import pair_distance, toeplitz
from posenc.encoders.registry import register

# What prepare leaves for the hooks: bucket of each distance, its bound, the shared table.
BUCKETS: Slot[Tensor] = Slot("buckets")
MAX_DISTANCE: Slot[int] = Slot("max_distance")
TABLE: Slot[Tensor] = Slot("table")


def _log_bucket_starts(exact: int, n_log: int, max_distance: int) -> list[int]:
    """Smallest distance of log buckets ``1 .. n_log-1`` (bucket 0 starts at ``exact``).

    Distance d reaches log bucket k when ``n_log * log(d/exact) / log(M/exact) >= k``,
    i.e. ``(d/exact)^n_log >= (M/exact)^k``. Comparing ``d^n_log * exact^k`` with
    ``M^k * exact^n_log`` in Python integers is exact, where the floating-point log
    formula can land just below an integer at a bucket boundary and be off by one.
    """

    def reaches(d: int, k: int) -> bool:
        return d**n_log * exact**k >= max_distance**k * exact**n_log

    starts = []
    for k in range(1, n_log):
        d = math.ceil(exact * (max_distance / exact) ** (k / n_log))  # within 1 of the answer
        while reaches(d - 1, k):
            d -= 1
        while not reaches(d, k):
            d += 1
        starts.append(d)
    return starts


def _check_buckets(num_buckets: int, max_distance: int, bidirectional: bool) -> None:
    kind = "bidirectional" if bidirectional else "causal"
    per_dir = num_buckets // 2 if bidirectional else num_buckets
    if (bidirectional and num_buckets % 2) or per_dir < 2:
        need = "even and >= 4" if bidirectional else ">= 2"
        raise ValueError(
            f"t5: num_buckets={num_buckets} must be {need} for {kind} attention (each "
            f"direction needs at least one exact and one log bucket); use e.g. num_buckets=32"
        )
    if max_distance <= per_dir // 2:
        raise ValueError(
            f"t5: max_distance={max_distance} must exceed {per_dir // 2}: in {kind} attention "
            f"each distance below that has its own bucket and the log buckets span the rest "
            f"up to max_distance; raise max_distance or lower num_buckets"
        )


def t5_bucket(rel: Tensor, *, bidirectional: bool, num_buckets: int, max_distance: int) -> Tensor:
    """Bucket of each relative position ``n = j - i`` (key minus query).

    Args:
        rel: Integer relative positions n, any shape.
        bidirectional: Half the buckets per sign (``n <= 0`` low, ``n > 0`` high);
            otherwise all buckets for the distance ``-n`` and ``n > 0`` in bucket 0.
        num_buckets: Number of buckets R.
        max_distance: Distance M from which on the last bucket of a direction is used.

    Returns:
        Int64 tensor of the shape of ``rel``, values in ``[0, R)``.

    Raises:
        ValueError: Too few buckets (or an odd number when bidirectional), or
            ``max_distance`` not beyond the exact buckets.
    """
    _check_buckets(num_buckets, max_distance, bidirectional)
    rel = rel.long()
    if bidirectional:
        per_dir = num_buckets // 2
        offset = torch.where(rel > 0, per_dir, 0)
        dist = rel.abs()
    else:
        per_dir = num_buckets
        offset = torch.zeros_like(rel)
        dist = (-rel).clamp(min=0)
    exact = per_dir // 2
    starts = torch.tensor(
        _log_bucket_starts(exact, per_dir - exact, max_distance),
        dtype=torch.long,
        device=rel.device,
    )
    # right=True counts the log-bucket starts <= d; capped at per_dir - 1 by construction.
    far = exact + torch.bucketize(dist, starts, right=True)
    return offset + torch.where(dist < exact, dist, far)


def _bias_table(num_buckets: int, n_heads: int) -> nn.Embedding:
    table = nn.Embedding(num_buckets, n_heads)
    nn.init.normal_(table.weight, std=0.02)
    return table


class _T5Attention(AttentionPositional):
    """Per-layer hook; the table is the layer's own or the stack's shared one."""

    score_term = True

    def __init__(self, *, num_buckets: int, n_heads: int, own_table: bool) -> None:
        super().__init__()
        self.bias_table = _bias_table(num_buckets, n_heads) if own_table else None

    def table(self, ctx: AttentionContext) -> Tensor:
        """The ``(R, H)`` bias table this layer reads."""
        return ctx[TABLE] if self.bias_table is None else self.bias_table.weight

    def score_bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        m = ctx[MAX_DISTANCE]
        # Row of the bucket lookup: n = j - i = -rel, clipped to [-M, M] (every |n| >= M
        # is in the last bucket of its direction anyway), shifted to [0, 2M].
        per_row = self.table(ctx).to(q.dtype).T[:, ctx[BUCKETS]]  # (H, 2M+1)
        if ctx.starts is not None:  # consecutive positions: one row per offset, a view
            n_lo, n_hi = ctx.toeplitz_range()
            n = torch.arange(n_lo, n_hi + 1, device=q.device).clamp_(-m, m).add_(m)
            bias = toeplitz(per_row[:, n], ctx)  # (H, T, S)
            if bias is not None:
                return bias[None]
        row = ctx.rel().neg_().clamp_(-m, m).add_(m)  # (B|1, T, S)
        return per_row[:, row].transpose(0, 1)  # (B|1, H, T, S)

    def score_mod(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreMod:
        m, dist = ctx[MAX_DISTANCE], pair_distance(ctx)
        per_row = self.table(ctx).to(q.dtype).T[:, ctx[BUCKETS]]  # (H, 2M+1)
        return lambda score, b, h, i, j: score + per_row[h, (-dist(b, i, j)).clamp(-m, m) + m]


@register("t5")
class T5Bias(PositionalEncoder):
    """T5 relative position bias: a learned scalar per head and distance bucket.

    Args:
        num_buckets: Buckets R; even and >= 4 (bidirectional attention halves them).
        max_distance: Distance M from which on a direction's last bucket is used; must
            exceed ``num_buckets / 2`` (the exact buckets of causal attention).
        per_layer: One table per layer (True) or one shared by the stack (T5).

    Raises:
        ValueError: Bad ``num_buckets`` or ``max_distance``.
    """

    #: Bucket of every n in [-M, M] for each kind of self-attention (buffers).
    buckets_bidirectional: Tensor
    buckets_causal: Tensor

    relative = True

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_layers: int,
        num_buckets: int = 32,
        max_distance: int = 128,
        per_layer: bool = False,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        for bidirectional in (True, False):  # a stack may run either kind
            _check_buckets(num_buckets, max_distance, bidirectional)
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.per_layer = per_layer
        self.bias_table = None if per_layer else _bias_table(num_buckets, n_heads)
        # Bucket of every n in [-M, M] for each kind of self-attention: (2M+1,) int64.
        n = torch.arange(-max_distance, max_distance + 1)
        for name, bidirectional in (("buckets_bidirectional", True), ("buckets_causal", False)):
            buckets = t5_bucket(
                n, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
            )
            self.register_buffer(name, buckets, persistent=False)

    def prepare(self, ctx: AttentionContext) -> None:
        if ctx.kind is AttnKind.CROSS:
            return
        causal = ctx.kind is AttnKind.CAUSAL
        ctx.put(BUCKETS, self.buckets_causal if causal else self.buckets_bidirectional)
        ctx.put(MAX_DISTANCE, self.max_distance)
        if self.bias_table is not None:
            ctx.put(TABLE, self.bias_table.weight)

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        if kind is AttnKind.CROSS:
            return AttentionPositional()
        return _T5Attention(
            num_buckets=self.num_buckets, n_heads=self.n_heads, own_table=self.per_layer
        )
