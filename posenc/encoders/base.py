"""The plug-point contract between positional encoders and the shared transformer.

Notation: B batch, H heads, T query length, S key length, D head dim, C d_model.

A positional scheme is split in two objects:

* :class:`PositionalEncoder`, one per transformer stack. It owns what the whole
  stack shares (tables, global vectors), may act on the token embeddings
  (:meth:`PositionalEncoder.embed`), and once per forward pass builds an
  :class:`AttentionContext` that every layer of the stack reads (so tables and
  gather indices are computed once, not once per layer).
* :class:`AttentionPositional`, one per attention module, made by
  :meth:`PositionalEncoder.for_attention`. It owns per-layer parameters and
  implements the hooks that attention calls, always in this order:

  1. ``score_bias(q, k, ctx)`` -> additive logits ``(B|1, H|1, T, S)`` or None,
     computed from the *projected* q and k (attention calls ``score_parts``, which
     wraps it unless a scheme hands over its term in column pieces);
  2. ``transform_qk(q, k, ctx)`` -> the q and k used for the content score;
  3. the content score ``q @ k^T * scale(D)`` plus the bias, masked, softmaxed;
  4. ``value_term(probs, ctx)`` -> ``(B, H, T, D)`` added to ``probs @ v``
     (only when ``needs_probs`` is true).

Without a score term or a value term, step 3 is ``scaled_dot_product_attention``
with its fused kernels; otherwise :func:`posenc.model.scored.scored_attention`.
What counts is the softmax of step 3: a scheme may shift a query row of its bias by
one constant, or move a part of its term that is a product with k into q in step 2
(DeBERTa does both, so its bias alone is not the paper's term).

Every hook defaults to "nothing", so a scheme overrides only what it uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc import native


class AttnKind(str, Enum):
    """Which attention a context is for."""

    CAUSAL = "causal"  # decoder self-attention
    BIDIRECTIONAL = "bidirectional"  # encoder self-attention
    CROSS = "cross"  # decoder queries over encoder keys

    @property
    def is_self(self) -> bool:
        return self is not AttnKind.CROSS


@dataclass
class AttentionContext:
    """Per-forward state shared by all layers of one stack for one attention kind.

    Attributes:
        q_pos: Query positions, ``(B|1, T)`` int64.
        k_pos: Key positions, ``(B|1, S)`` int64.
        kind: Causal, bidirectional or cross attention.
        extra: Scheme-specific shared tensors (tables, gather indices).
        query_dims: For each entry of ``extra`` indexed by query, the dim that is, so
            attention can cut the context into blocks of queries (see
            :meth:`slice_queries`). A scheme that puts a per-query tensor in ``extra``
            must list it here.
        key_dims: The same for entries indexed by key (see :meth:`slice_keys`).
        starts: ``(q0, k0)`` when the positions are one shared run of consecutive
            integers, ``q_pos = q0 + arange(T)`` and ``k_pos = k0 + arange(S)`` (the
            usual case, where relative terms can be read off a per-offset table as a
            strided view, :func:`offset_view`); None otherwise (per-row or randomized
            positions). Found from the positions when not given.
        memo: Per-forward results a layer computes once and reuses for every block of
            queries (see :meth:`once`). Slices of a context share it.
    """

    q_pos: Tensor
    k_pos: Tensor
    kind: AttnKind
    extra: dict[str, Any] = field(default_factory=dict)
    query_dims: dict[str, int] = field(default_factory=dict)
    key_dims: dict[str, int] = field(default_factory=dict)
    starts: tuple[int, int] | None | str = "find"
    memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.starts == "find":
            q0, k0 = run_start(self.q_pos), run_start(self.k_pos)
            self.starts = None if q0 is None or k0 is None else (q0, k0)

    def slice_queries(self, start: int, stop: int) -> AttentionContext:
        """The context of queries ``start:stop`` only (keys unchanged)."""
        stop = min(stop, self.q_pos.shape[-1])
        extra = dict(self.extra)
        for key, dim in self.query_dims.items():
            extra[key] = extra[key].narrow(dim, start, stop - start)
        starts = None if self.starts is None else (self.starts[0] + start, self.starts[1])
        return replace(self, q_pos=self.q_pos[:, start:stop], extra=extra, starts=starts)

    def slice_keys(self, stop: int) -> AttentionContext:
        """The context of the first ``stop`` keys only (queries unchanged): what a block
        of causal queries can see."""
        stop = min(stop, self.k_pos.shape[-1])
        extra = dict(self.extra)
        for key, dim in self.key_dims.items():
            extra[key] = extra[key].narrow(dim, 0, stop)
        return replace(self, k_pos=self.k_pos[:, :stop], extra=extra, starts=self.starts)

    def once(self, owner: nn.Module, name: str, make: Any) -> Any:
        """``make()`` computed once per forward pass for ``owner``, e.g. a layer's
        projection of a shared table that every block of queries reads. The context
        lives one forward pass, so the result never outlives the weights it used."""
        key = (id(owner), name)
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def offset_range(self) -> tuple[int, int]:
        """Smallest and largest key-minus-query offset ``n = k_pos[j] - q_pos[i]`` a
        relative table must cover for :func:`offset_view` (needs ``starts``).

        Bidirectional: every pair's offset. Causal: from the smallest offset up to 1
        only, since keys past the query (n > 0) are masked; the one extra offset keeps
        the view's rows from overlapping (see :func:`offset_view`).
        """
        if self.starts is None:
            raise ValueError("offset_range needs consecutive positions (ctx.starts)")
        (q0, k0), t, s = self.starts, self.q_pos.shape[-1], self.k_pos.shape[-1]
        lo, hi = k0 - (q0 + t - 1), k0 + s - 1 - q0
        if self.kind is AttnKind.CAUSAL:
            hi = max(lo, min(hi, 1))
        return lo, hi

    def rel(self) -> Tensor:
        """Relative distance ``i - j`` (query minus key position), ``(B|1, T, S)``."""
        return self.q_pos[:, :, None] - self.k_pos[:, None, :]


ScoreParts = list[tuple[Tensor, int]]
"""A score term as parts: ``(term (B|1, H|1, T, n), c0)`` adds ``term`` onto the score
columns ``c0 .. c0 + n - 1``. One ``(term, 0)`` of width S is a plain ``(T, S)`` term;
several parts let a scheme add, e.g., per-block terms without first summing them into
a ``(T, S)`` tensor of their own."""


def dense_parts(parts: ScoreParts, s: int) -> Tensor:
    """The ``(B|1, H|1, T, S)`` sum of score parts (for consumers of one tensor)."""
    out = None
    for term, c0 in parts:
        full = F.pad(term, (c0, s - c0 - term.shape[-1]))
        out = full if out is None else out + full
    if out is None:
        raise ValueError("dense_parts: no score parts")
    return out


class AttentionPositional(nn.Module):
    """Per-attention-module hooks; the base class does nothing at every hook."""

    #: True when the scheme needs the attention probabilities (a value term);
    #: attention then takes its explicit-softmax path instead of the fused kernel.
    needs_probs: bool = False

    @property
    def adds_scores(self) -> bool:
        """Whether the scheme materialises ``(B, H, T, S)`` terms (a score bias or the
        probabilities); attention then works through the queries in blocks when that
        matrix would be large."""
        cls = type(self)
        return (
            self.needs_probs
            or cls.score_bias is not AttentionPositional.score_bias
            or cls.score_parts is not AttentionPositional.score_parts
        )

    def scale(self, head_dim: int) -> float:
        """Multiplier of the content score ``q @ k^T`` (and of nothing else)."""
        return head_dim**-0.5

    def score_bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor | None:
        """Additive attention logits, already in the units of the scaled score.

        Args:
            q: Projected queries ``(B, H, T, D)``.
            k: Projected keys ``(B, H, S, D)``.
            ctx: The stack's shared context.

        Returns:
            ``(B|1, H|1, T, S)`` or None.
        """
        return None

    def score_parts(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreParts | None:
        """The score term as :data:`ScoreParts`, what attention calls. By default the one
        part ``(score_bias(q, k, ctx), 0)``; a scheme whose term is naturally a sum of
        pieces on column ranges overrides it (and makes ``score_bias`` their sum)."""
        bias = self.score_bias(q, k, ctx)
        return None if bias is None else [(bias, 0)]

    def transform_qk(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        """Return the queries and keys that enter the content score."""
        return q, k

    def value_term(self, probs: Tensor, ctx: AttentionContext) -> Tensor | None:
        """Extra output ``(B, H, T, D)`` from the probabilities ``(B, H, T, S)``."""
        return None


class PositionalEncoder(nn.Module):
    """One per stack. Subclasses take keyword arguments ``d_model``, ``n_heads``,
    ``n_layers`` (filled in by the model builder) plus their own settings."""

    #: True for schemes whose attention scores depend only on relative positions.
    relative: bool = False
    #: Longest sequence the scheme can encode, or None for no limit.
    max_length: int | None = None
    #: Context-extension methods the scheme can apply to a trained model at evaluation
    #: time (RoPE: linear, ntk, dynamic_ntk, yarn). A scheme that lists any must provide
    #: ``scaled(method, factor, original_length)``, a context manager that applies the
    #: method inside the ``with`` block and restores the previous setting after it.
    scaling_methods: tuple[str, ...] = ()

    def __init__(self, *, d_model: int, n_heads: int, n_layers: int) -> None:
        super().__init__()
        if d_model <= 0 or n_heads <= 0 or n_layers <= 0:
            raise ValueError(
                f"d_model, n_heads and n_layers must be positive, got {d_model}, {n_heads}, "
                f"{n_layers}"
            )
        if d_model % n_heads:
            raise ValueError(
                f"n_heads={n_heads} must divide d_model={d_model}; pick a divisor of {d_model}"
            )
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_layers = n_layers
        self.head_dim = d_model // n_heads

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        """Hook (a): act on token embeddings ``x (B, T, C)`` at ``positions (B|1, T)``."""
        return x

    def context(self, q_pos: Tensor, k_pos: Tensor, kind: AttnKind) -> AttentionContext:
        """Build the shared per-forward state for one attention kind of the stack."""
        return AttentionContext(q_pos=q_pos, k_pos=k_pos, kind=kind)

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        """Make the per-layer hooks for attention module ``layer`` of ``kind``."""
        return AttentionPositional()


def gather_rel(table: Tensor, index: Tensor) -> Tensor:
    """Pick per-pair scores from per-distance scores.

    Args:
        table: ``(B, H, T, R)`` scores of each query against each of R distance slots.
        index: ``(B|1, T, S)`` slot of each (query, key) pair, values in ``[0, R)``.

    Returns:
        ``(B, H, T, S)`` with ``out[b, h, i, j] = table[b, h, i, index[b, i, j]]``.
    """
    b, h, t, _ = table.shape
    idx = index[:, None].expand(b, h, t, index.shape[-1])  # (B, H, T, S), no copy
    return torch.gather(table, -1, idx)


def run_start(pos: Tensor) -> int | None:
    """``p0`` if ``pos`` is ``(1, N)`` and equal to ``p0 + arange(N)``, else None (one
    host sync)."""
    if pos.dim() != 2 or pos.shape[0] != 1 or pos.is_floating_point():
        return None
    n = pos.shape[-1]
    if n == 0:
        return None
    p0 = int(pos[0, 0])
    if n > 1 and not bool((pos[0, 1:] - pos[0, :-1] == 1).all()):
        return None
    return p0


def offset_view(
    per_offset: Tensor, *, row0: int, col0: int, lo: int, cols: int, tiled_grad: bool = False
) -> Tensor | None:
    """Read a per-offset table as a per-pair matrix, as a strided view (no gather).

    ``out[..., r, c] = per_offset[..., r, (col0 + c) - (row0 + r) - lo]``: row r (a query
    at position ``row0 + r``) picks, for each column c (a key at ``col0 + c``), the entry
    of their offset. With the offset axis contiguous, moving one row down and one
    column right keeps the offset, so the matrix is ``as_strided`` with strides
    ``(L - 1, 1)``: a Toeplitz view (the "skew" of Huang et al. 2018, Music Transformer,
    without its padding copy). Pairs whose offset falls outside ``[lo, lo + L)`` read
    an entry of a neighbouring row, which is only allowed for masked pairs.

    Args:
        per_offset: ``(..., R, L)`` scores per row and offset ``lo .. lo + L - 1``.
        row0: Position of row 0. col0: Position of column 0.
        lo: Offset of table entry 0.
        cols: Number of columns S.
        tiled_grad: Write the table's gradient with :func:`posenc.native.copy_tiled`,
            for a view that is used transposed (a key-major table added to query-major
            scores): its gradient then arrives in the other memory order, which
            autograd's own ``as_strided`` backward copies one cache line per element.

    Returns:
        ``(..., R, S)`` view, or None when the view would leave the table's storage
        or its rows would overlap (``L <= S``, which would make gradients of aliased
        entries collide); the caller then gathers.
    """
    per_offset = per_offset.contiguous()
    rows, width = per_offset.shape[-2], per_offset.shape[-1]
    c = col0 - row0 - lo  # table index of (row 0, column 0)
    last = (rows - 1) * (width - 1) + cols - 1 + c  # flat index of the last pair
    if c < 0 or last > rows * width - 1 or (rows > 1 and width <= cols):
        return None
    lead = per_offset.shape[:-2]
    size, stride = (*lead, rows, cols), (*per_offset.stride()[:-2], width - 1, 1)
    if tiled_grad and per_offset.dim() == 4:
        return _TiledView.apply(per_offset, (per_offset.shape, size, stride, c))
    return per_offset.as_strided(size, stride, per_offset.storage_offset() + c)


class _TiledView(torch.autograd.Function):
    """``table.as_strided(size, stride, offset)`` for a contiguous 4-D table (``offset``
    counted from the table's first element) with non-overlapping elements; the
    gradient is a zero table with the view's gradient written in by
    :func:`posenc.native.copy_tiled`. The two maps are each other's adjoint, so each
    one's backward is the other and gradients go to any order."""

    @staticmethod
    def forward(ctx, table: Tensor, geometry: tuple) -> Tensor:  # noqa: ANN001
        ctx.geometry = geometry
        _, size, stride, offset = geometry
        return table.as_strided(size, stride, table.storage_offset() + offset)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        return _TiledScatter.apply(grad, ctx.geometry), None


class _TiledScatter(torch.autograd.Function):
    """The adjoint of :class:`_TiledView`: a zero table holding ``view`` at the view's
    place."""

    @staticmethod
    def forward(ctx, view: Tensor, geometry: tuple) -> Tensor:  # noqa: ANN001
        ctx.geometry = geometry
        shape, size, stride, offset = geometry
        table = view.new_zeros(shape)
        native.copy_tiled(table.as_strided(size, stride, offset), view)
        return table

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        return _TiledView.apply(grad.contiguous(), ctx.geometry), None


@dataclass(frozen=True)
class OffsetWindow:
    """The key columns of a context with consecutive positions, split for a term that
    is constant in each row beyond two offsets (Shaw's clipped distances, DeBERTa's
    last buckets): columns ``[0, left)`` have offset ``<= n_left`` for every query, columns
    ``[right, S)`` offset ``>= n_right``, and the window ``[left, right)`` between them needs
    the offsets ``n_lo .. n_hi`` of a per-offset table (see :func:`offset_window`)."""

    left: int
    right: int
    n_lo: int
    n_hi: int


def offset_window(ctx: AttentionContext, n_left: int | None, n_right: int | None) -> OffsetWindow:
    """Split ``ctx``'s keys (needs ``ctx.starts``) by offset ``n = k_pos - q_pos``: the
    columns where every query's offset is ``<= n_left``, those where it is ``>= n_right``
    (not in causal attention, where they are masked), and the window between.

    A constant end then costs one value per row, expanded over its columns, instead of
    a strided view of a table as wide as all keys; only the window needs the table, with
    the causal cap of :meth:`AttentionContext.offset_range`.
    """
    if ctx.starts is None:
        raise ValueError("offset_window needs consecutive positions (ctx.starts)")
    (q0, k0), t, s = ctx.starts, ctx.q_pos.shape[-1], ctx.k_pos.shape[-1]
    # Column c holds offsets k0 + c - q0 - (T - 1) .. k0 + c - q0 over the queries.
    left = 0 if n_left is None else min(max(n_left + q0 - k0 + 1, 0), s)
    right = s
    if n_right is not None and ctx.kind is not AttnKind.CAUSAL:
        right = min(max(n_right + q0 + t - 1 - k0, left), s)
    n_lo, n_hi = k0 + left - (q0 + t - 1), k0 + right - 1 - q0
    if ctx.kind is AttnKind.CAUSAL:
        n_hi = max(n_lo, min(n_hi, 1))
    return OffsetWindow(left=left, right=right, n_lo=n_lo, n_hi=n_hi)


def window_parts(
    ctx: AttentionContext,
    w: OffsetWindow,
    *,
    left: Tensor | None,
    table: Tensor | None,
    right: Tensor | None,
) -> ScoreParts | None:
    """Score parts of a query-major offset term split by :func:`offset_window`.

    Args:
        ctx: The context (consecutive positions).
        w: Its window.
        left: ``(..., T, 1)`` each row's value on the columns ``[0, w.left)``, or None
            for none (zero: no part).
        table: ``(..., T, w.n_hi - w.n_lo + 1)`` the values per offset of the window.
        right: ``(..., T, 1)`` each row's value on ``[w.right, S)``.

    Returns:
        The parts, or None when the window's view does not fit (the caller gathers).
    """
    (q0, k0), s = ctx.starts, ctx.k_pos.shape[-1]
    parts: ScoreParts = []
    if w.left and left is not None:
        parts.append((left.expand(*left.shape[:-1], w.left), 0))
    if w.right > w.left:
        view = offset_view(table, row0=q0, col0=k0 + w.left, lo=w.n_lo, cols=w.right - w.left)
        if view is None:
            return None
        parts.append((view, w.left))
    if w.right < s:
        parts.append((right.expand(*right.shape[:-1], s - w.right), w.right))
    return parts


def toeplitz(per_offset: Tensor, ctx: AttentionContext) -> Tensor | None:
    """A score term that depends on the offset alone, ``(..., L)`` for the offsets of
    ``ctx.offset_range()``, as the ``(..., T, S)`` matrix of ``ctx``'s pairs (needs
    ``ctx.starts``): the table repeated per query row, then :func:`offset_view`. Its
    gradient is a sum over rows, where a per-pair gather's is a scatter. None when the
    view does not fit (the caller gathers)."""
    if ctx.starts is None:
        return None
    (q0, k0), t, s = ctx.starts, ctx.q_pos.shape[-1], ctx.k_pos.shape[-1]
    n_lo, _ = ctx.offset_range()
    rows = per_offset.unsqueeze(-2).expand(*per_offset.shape[:-1], t, per_offset.shape[-1])
    return offset_view(rows.contiguous(), row0=q0, col0=k0, lo=n_lo, cols=s)


def positions_like(x: Tensor, offset: int = 0) -> Tensor:
    """Default positions ``offset .. offset+T-1`` for ``x (B, T, ...)``, shape ``(1, T)``."""
    return torch.arange(offset, offset + x.shape[1], device=x.device)[None]
