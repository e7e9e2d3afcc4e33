"""Relative terms as per-offset tables, read per (query, key) pair.

Notation: B batch, H heads, T queries, S keys, L offsets; a pair's offset is
``n = k_pos[j] - q_pos[i]`` (key minus query).

A relative scheme scores a query against each distance once (``(B, H, T, L)``, L about
T + S) instead of against each key. Two ways to spread that over the ``(T, S)`` pairs,
both exact:

* consecutive positions (``ctx.starts``): moving one query down and one key right keeps
  the offset, so the pair matrix is a strided (Toeplitz) view of the per-offset table,
  no copy (:func:`offset_view`, :func:`toeplitz`, and :func:`offset_window` for terms
  that are constant beyond a clipping distance);
* any positions: a per-pair gather (:func:`gather_rel`).

Everything here works on Python ints known before the forward pass, so it traces as
one graph under ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc.encoders.base import AttentionContext, AttnKind, ScoreParts


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


def offset_view(per_offset: Tensor, *, row0: int, col0: int, lo: int, cols: int) -> Tensor | None:
    """Read a per-offset table as a per-pair matrix, as a strided view (no gather).

    ``out[..., r, c] = per_offset[..., r, (col0 + c) - (row0 + r) - lo]``: row r (a query
    at position ``row0 + r``) picks, for each column c (a key at ``col0 + c``), the entry
    of their offset. With the offset axis contiguous, moving one row down and one
    column right keeps the offset, so the matrix has strides ``(L - 1, 1)``: a Toeplitz
    view (the "skew" of Huang et al. 2018, Music Transformer, usually without its padding
    copy). Pairs whose offset falls outside ``[lo, lo + L)`` read an entry of a
    neighbouring row, which is only allowed for masked pairs.

    Args:
        per_offset: ``(..., R, L)`` scores per row and offset ``lo .. lo + L - 1``.
        row0: Position of row 0. col0: Position of column 0.
        lo: Offset of table entry 0.
        cols: Number of columns S.

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
    # Row r starts at flat index c + r (L - 1): the rows, flattened from entry c, cut into
    # rows of L - 1 entries, hold it (plain views, which every compiler backend follows;
    # an as_strided on an intermediate gave wrong values under inductor).
    flat = per_offset.flatten(-2)
    if rows == 1:
        return flat.narrow(-1, c, cols).unsqueeze(-2)
    need = c + rows * (width - 1)
    if need > rows * width:  # the last row's cut runs past the table: pad, never read
        flat = F.pad(flat, (0, need - rows * width))
    return flat.narrow(-1, c, rows * (width - 1)).unflatten(-1, (rows, width - 1))[..., :cols]


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
    table: Tensor,
    right: Tensor,
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
    assert ctx.starts is not None  # w came from offset_window, which needs them
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
    ``ctx.toeplitz_range()``, as the ``(..., T, S)`` matrix of ``ctx``'s pairs (needs
    ``ctx.starts``): the table repeated per query row, then :func:`offset_view`. Its
    gradient is a sum over rows, where a per-pair gather's is a scatter. None when the
    view does not fit (the caller gathers)."""
    if ctx.starts is None:
        return None
    (q0, k0), t, s = ctx.starts, ctx.q_pos.shape[-1], ctx.k_pos.shape[-1]
    n_lo, _ = ctx.offset_range()
    rows = per_offset.unsqueeze(-2).expand(*per_offset.shape[:-1], t, per_offset.shape[-1])
    return offset_view(rows.contiguous(), row0=q0, col0=k0, lo=n_lo, cols=s)


IndexFn = Callable[[Tensor, Tensor], Tensor]


def index_positions(ctx: AttentionContext) -> tuple[IndexFn, IndexFn]:
    """``(q_position(b, q_idx), k_position(b, kv_idx))``: the positions a
    FlexAttention ``score_mod`` sees for its indices (``q0 + q_idx`` for a run, else a
    lookup in the position tensors, per row or shared)."""
    if ctx.starts is not None:
        q0, k0 = ctx.starts
        return (lambda b, i: i + q0), (lambda b, j: j + k0)
    qp, kp = ctx.q_pos, ctx.k_pos
    per_row_q, per_row_k = qp.shape[0] > 1, kp.shape[0] > 1
    return (
        lambda b, i: qp[b if per_row_q else 0, i],
        lambda b, j: kp[b if per_row_k else 0, j],
    )


def pair_distance(ctx: AttentionContext) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """``distance(b, q_idx, kv_idx) = i - j`` (query minus key position), for a
    FlexAttention ``score_mod``."""
    if ctx.starts is not None:
        d0 = ctx.starts[0] - ctx.starts[1]
        return lambda b, i, j: i - j + d0
    q_at, k_at = index_positions(ctx)
    return lambda b, i, j: q_at(b, i) - k_at(b, j)
