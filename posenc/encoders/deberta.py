"""DeBERTa disentangled attention (He et al. 2020/2021, section 3.1).

Notation: B batch, H heads, T queries, S keys, D head dim, C d_model, P = 2 * span.

The score of query i on key j sums three terms, scaled by ``1/sqrt(3D)``:

    content-to-content  q_i . k_j
    content-to-position q_i . K^r_{delta(i, j)}
    position-to-content k_j . Q^r_{delta(i, j)}   (p2c_row=code, default)
                        k_j . Q^r_{delta(j, i)}   (p2c_row=paper)

The paper (eq. 4) reads p2c at the row of ``j - i``. The authors' code (and its Hugging
Face port, ``DisentangledSelfAttention``) indexes the key-major p2c product with
``-r + span`` where ``r = delta`` of query minus key, then transposes, which reads the
row of ``i - j``, c2p's row; the released checkpoints were trained so. ``p2c_row``
chooses; the default follows the code.

``K^r = P W_{k,r}`` and ``Q^r = P W_{q,r}`` project one relative-position table P
(shared by all layers of the stack) with per-layer matrices. ``delta`` maps the
distance ``i - j`` to a row of P: clipped to ``[-span, span)``, and, with
``bucket_size > 0``, log-bucketed beyond ``bucket_size / 2`` up to ``max_distance``
(DeBERTa-v2). Past ``max_distance`` the authors' log buckets keep growing and their row
clip ``clamp(bucket + span, 0, 2 span - 1)`` ends them: far keys on the positive side
take the last row, those on the negative side row 0, a row no distance inside
``max_distance`` reads (``far_keys=code``, default). ``far_keys=last_bucket``, posenc's
variant, keeps both sides in their last log bucket (row 1 on the negative side).

With consecutive positions both terms are computed per key-minus-query offset,
``(B, H, T, T+S-1)`` at most, and read as strided (Toeplitz) views; otherwise per
distinct row, ``(B, H, T, P)``, gathered with explicit query and key positions. Either
way T != S is handled (the original gather assumes equal query and key lengths).

Far keys cost no score pass. Beyond the last bucket both terms are constant: c2p adds
one value per query row (``q_i . K^r[end]``), p2c one value per key column
(``k_j . Q^r[end]``). The row value is dropped: c2p is scored with ``K^r - K^r[end]``,
which subtracts it from every key of the row, and a softmax does not change when a row
is shifted. The column value is a product with ``k_j`` and the fixed
vector ``Q^r[end]``, so it moves into the content score: ``q_i . k_j + k_j . Q^r[end] =
(q_i + Q^r[end]) . k_j`` (``transform_qk``), and p2c is scored with ``Q^r - Q^r[end]``.
Same attention and gradients (the scores differ by one constant per row); the far
keys' columns then hold the content score alone, with no score pass of their own.

Cross-attention: nothing (no relative distance between two sequences).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor, nn

from posenc.encoders.base import (
    AttentionContext,
    AttentionPositional,
    AttnKind,
    PositionalEncoder,
    ScoreMod,
    ScoreParts,
    Slot,
    dense_parts,
    normal_linears,
)
from posenc.encoders.offsets import (
    gather_rel,
    offset_view,
    offset_window,
    pair_distance,
    window_parts,
)
from posenc.encoders.registry import register
from posenc.errors import unknown_value

# What prepare leaves for the hooks: the shared table, the rows of the distances lo..
# (c2p's, p2c's), their flat ends and the far keys' rows.
TABLE: Slot[Tensor] = Slot("table")
LO: Slot[int] = Slot("lo")
ROWS: Slot[Tensor] = Slot("rows")
ROWS_P2C: Slot[Tensor] = Slot("p2c_rows")
FLAT: Slot[tuple[int, int]] = Slot("flat")
P2C_FLAT: Slot[tuple[int, int]] = Slot("p2c_flat")
C2P_END: Slot[Tensor] = Slot("c2p_end")
P2C_END: Slot[Tensor] = Slot("p2c_end")

#: p2c's table row: the authors' code (row of i - j) or the paper's eq. 4 (row of j - i).
P2C_ROWS = ("code", "paper")
#: Rows of the distances past the last log bucket: the authors' code (the negative side
#: on row 0) or posenc's variant (both sides on their last bucket's row).
FAR_KEYS = ("code", "last_bucket")


@functools.lru_cache(maxsize=32)
def _bucket_magnitudes(bucket_size: int, max_distance: int) -> tuple[int, ...]:
    """``|bucket|`` of the distances ``0 .. max_distance``, from the formula in float64
    (Python's ``math``, one ``log`` for both terms of the ratio), clamped to
    ``bucket_size - 1``. Every larger distance has the last value: past
    ``max_distance - 1`` the ratio exceeds 1, so the formula gives at least
    ``2 * mid >= bucket_size - 1``."""
    mid, top = bucket_size // 2, bucket_size - 1
    denom = math.log((max_distance - 1) / mid)
    # the reference's order of operations: ceil(log(|r| / m) / log(...) * (m - 1))
    far = (
        mid + math.ceil(math.log(r / mid) / denom * (mid - 1))
        for r in range(mid + 1, max_distance + 1)
    )
    return (*range(mid + 1), *(min(b, top) for b in far))


def _far_distance(bucket_size: int, max_distance: int) -> int:
    """Smallest ``|r|`` whose unclamped log bucket (:func:`log_bucket`'s formula, in the
    same float64 order of operations) reaches ``bucket_size``: from there on the
    reference's row clip sends negative distances to row 0. It is ``max_distance`` for
    an even ``bucket_size``; an odd one stops at ``bucket_size - 1`` for a while first.
    The buckets never decrease with ``|r|``, so a short walk up from just below the
    real-valued root finds it."""
    mid = bucket_size // 2
    denom = math.log((max_distance - 1) / mid)

    def magnitude(r: int) -> int:
        return mid + math.ceil(math.log(r / mid) / denom * (mid - 1))

    # magnitude(r) >= bucket_size  <=>  log(r / mid) / denom * (mid - 1) > bucket_size - mid - 1
    root = mid * math.exp(denom * (bucket_size - mid - 1) / (mid - 1))
    r = max(mid + 1, math.floor(root) - 2)
    while magnitude(r) < bucket_size:
        r += 1
    return r


def log_bucket(rel: Tensor, bucket_size: int, max_distance: int) -> Tensor:
    """Log-bucket signed distances: exact up to ``bucket_size/2``, log-spaced beyond.

    A distance ``r`` with ``|r| > m`` (``m = bucket_size // 2``) becomes
    ``sign(r) * min(bucket_size - 1, m + ceil(log(|r| / m) / log((max_distance - 1) / m)
    * (m - 1)))``: DeBERTa-v2's ``make_log_bucket_position`` (numpy, float64), whose
    buckets reach ``bucket_size - 1`` at ``|r| = max_distance - 1`` and would grow past
    it farther out, clamped to ``|bucket| <= bucket_size - 1``. Which table row such a
    far distance reads is the encoder's ``far_keys`` (:meth:`DebertaRelative.row`):
    the reference's row clip sends the far negative ones to row 0.

    The buckets of ``0 .. max_distance`` are computed once in Python floats and looked up,
    the same on every device: a tensor ``log`` may round differently from ``math.log`` by
    an ulp, and where the ratio times ``m - 1`` is an integer (at ``|r| = max_distance -
    1`` it is exactly ``m - 1``) ``ceil`` turns that ulp into another bucket (issue #27,
    point 12).

    Args:
        rel: Integer distances, any shape.
        bucket_size: Number of buckets on each side.
        max_distance: Distance mapped to the last log bucket.

    Returns:
        Integer tensor of the same shape and dtype.
    """
    return lookup_buckets(rel, _bucket_magnitudes(bucket_size, max_distance))


def lookup_buckets(rel: Tensor, magnitudes: tuple[int, ...]) -> Tensor:
    """:func:`log_bucket` with its ``|bucket|`` table (distances ``0 .. len - 1``; larger
    ones take the last entry) already made, so a traced forward pass sees constants."""
    mags = torch.tensor(magnitudes, device=rel.device)
    return torch.sign(rel) * mags[rel.abs().clamp(max=len(magnitudes) - 1)].to(rel.dtype)


def flat_ends(lo: int, hi: int, saturation: int, causal: bool) -> tuple[int, int]:
    """``(a, b)``: entries ``0 .. a`` of a lookup over distances ``lo .. hi`` share one
    table row, and so do entries ``b ..`` (the constant runs at both ends), ``a <= b``.

    Found from Python ints alone, never from the lookup's values (no host read): every
    distance with ``|d| >= saturation`` has its side's end row, and in causal attention
    every ``d <= 0`` has distance 0's row (masked keys, see ``prepare``). The runs may
    be longer than this says; only their entries must share a row.
    """
    last = hi - lo
    a = min(max((0 if causal else -saturation) - lo, 0), last)
    b = min(max(saturation - lo, a), last)
    return a, b


def by_rows(
    x: Tensor,
    proj: Tensor,
    rows: Tensor,
    first: int,
    last: int,
    flat: tuple[int, int],
    *,
    reverse: bool = False,
    zero_ends: bool = False,
) -> Tensor:
    """``x @ proj[:, rows[e]]`` for entries ``e = first .. last`` (or ``last .. first``
    with ``reverse``), computing each repeated end value once and expanding it.

    Args:
        x: ``(B, H, N, D)``.
        proj: ``(H, P, D)`` projected table rows.
        rows: 1-D table row of each entry.
        first: First entry. last: Last entry.
        flat: :func:`flat_ends` of ``rows``.
        reverse: Output entries in descending order.
        zero_ends: The repeated ends may be zeros instead: each is either zero already
            (the far keys' row, shifted to 0) or unused (causal attention's masked
            distances). Zeros pad the ends, and the backward is a slice, where expanded
            ends would be summed back into their column.

    Returns:
        ``(B, H, N, last - first + 1)``.
    """
    a = min(max(flat[0], first), last)  # entries first..a share entry a's row
    b = max(min(flat[1], last), first)  # entries b..last share entry b's row
    idx = rows[a : b + 1]
    mid = x @ proj.index_select(1, idx.flip(0) if reverse else idx).transpose(-1, -2)
    before, after = (last - b, a - first) if reverse else (a - first, last - b)
    if not before and not after:
        return mid
    if zero_ends:
        return nn.functional.pad(mid, (before, after))
    lead = mid.shape[:-1]
    parts = [mid[..., :1].expand(*lead, before)] if before else []
    parts.append(mid)
    if after:
        parts.append(mid[..., -1:].expand(*lead, after))
    return torch.cat(parts, dim=-1)


class _DebertaAttention(AttentionPositional):
    """Per-layer hooks: the disentangled position terms of one attention module."""

    score_term = True

    def init_weights(self) -> None:
        """The relative projections ~ N(0, 0.02), as the authors' code
        (``initializer_range`` 0.02)."""
        normal_linears(self)

    def __init__(self, *, d_model: int, n_heads: int, c2p: bool, p2c: bool) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_terms = 1 + int(c2p) + int(p2c)
        self.w_kr = nn.Linear(d_model, d_model, bias=False) if c2p else None
        self.w_qr = nn.Linear(d_model, d_model, bias=False) if p2c else None

    #: The strided-view path scores every distinct offset up to ``max_distance`` on both
    #: sides; the gather path only the P table rows but pays a per-pair gather. The view
    #: is used once there are more keys than this many per table row (measured on a
    #: 2-core CPU: gather faster at S <= 256, the view from S = 512, with P = 64).
    view_keys_per_row: float = 4.0
    #: The view path's position-to-content window goes in chunks of c = this many times
    #: T keys (T: the queries of a block), each scored against the (c + 1)T - 1 distances
    #: its keys meet, so a key gets (c + 1)/c times the T products it needs; larger c
    #: means fewer, larger ops and a larger (B, H, cT, (c + 1)T) intermediate. Measured
    #: on a 2-core CPU, 2x1024 fwd+bwd, against c = 1 (paired runs): 0.99-1.08x the
    #: speed with 2 threads, 1.00-1.05x with 1; c = 4 no faster than 2.
    p2c_chunk: int = 2
    #: ... and only for at least this many queries: a few queries (cached decoding steps)
    #: gather, since the view's p2c chunks of 2T keys would be S / 2T tiny products (a
    #: 4-layer decoding step at S = 640 went from 9.1 to 3.6 ms; scratch timing).
    view_min_queries: int = 32

    def scale(self, head_dim: int) -> float:
        return (self.n_terms * head_dim) ** -0.5  # 1/sqrt(3D) with both terms

    def _project(self, w: nn.Linear, ctx: AttentionContext, dtype: torch.dtype) -> Tensor:
        """``(H, P, D)``: the shared table through ``w``, once per layer and forward."""
        table = ctx[TABLE]
        return ctx.once(
            w,
            str(dtype),
            lambda: w(table.to(dtype)).unflatten(-1, (self.n_heads, -1)).transpose(0, 1),
        )

    def _shifted(
        self, w: nn.Linear, ctx: AttentionContext, dtype: torch.dtype, end: Slot[Tensor]
    ) -> Tensor:
        """``(H, P, D)``: :meth:`_project` minus its row ``ctx[end]`` (the far
        keys' row), once per layer and forward."""
        row = ctx[end]

        def make() -> Tensor:
            proj = self._project(w, ctx, dtype)
            return proj - proj.index_select(1, row)

        return ctx.once(w, f"{dtype} - {end.name}", make)

    def transform_qk(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        if self.w_qr is None:
            return q, k
        # (q_i + Q^r[end]) . k_j: the content score plus p2c's far-key value (the
        # score's scale multiplies both, as it does p2c in score_parts).
        end = self._project(self.w_qr, ctx, q.dtype).index_select(1, ctx[P2C_END])
        return q + end, k  # end: (H, 1, D)

    def score_bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor | None:
        parts = self.score_parts(q, k, ctx)
        return None if parts is None else dense_parts(parts, k.shape[-2])

    def score_parts(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreParts | None:
        # Both terms are products with q or k: scale those, not the (B, H, T, S) sum.
        scale = self.scale(q.shape[-1])
        q, k = q * scale, k * scale
        many_keys = k.shape[-2] > self.view_keys_per_row * ctx[TABLE].shape[0]
        many_queries = q.shape[-2] >= self.view_min_queries
        if ctx.starts is not None and many_keys and many_queries:
            parts = self._by_view(q, k, ctx)
            if parts is not None:
                return parts
        bias = self._by_gather(q, k, ctx)
        return None if bias is None else [(bias, 0)]

    def score_mod(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreMod:
        """c2p read from ``(B, H, T, P)`` query-by-row scores, p2c from ``(B, H, S, P)``
        key-by-row scores, both shifted as in :meth:`score_parts`."""
        scale = self.scale(q.shape[-1])
        rows, p2c_rows, lo, dist = ctx[ROWS], ctx[ROWS_P2C], ctx[LO], pair_distance(ctx)
        c2p = p2c = None
        if self.w_kr is not None:
            kr = self._shifted(self.w_kr, ctx, q.dtype, C2P_END)
            c2p = (q * scale) @ kr.transpose(-1, -2)  # (B, H, T, P)
        if self.w_qr is not None:
            qr = self._shifted(self.w_qr, ctx, k.dtype, P2C_END)
            p2c = (k * scale) @ qr.transpose(-1, -2)  # (B, H, S, P)
        if ctx.kind is AttnKind.CAUSAL and lo < 0:
            # Distances below 0 (masked keys) have distance 0's rows (prepare): index the
            # rows from distance 0 and clamp there, so that no int the kernel captures
            # changes with the length (each value would compile a kernel of its own).
            rows, p2c_rows, lo = rows[-lo:], p2c_rows[-lo:], 0

        def mod(score: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            # lookup entry of the distance; the rows hold every distance present
            e = (dist(b, i, j) - lo).clamp(min=0)
            if c2p is not None:
                score = score + c2p[b, h, i, rows[e]]
            if p2c is not None:
                score = score + p2c[b, h, j, p2c_rows[e]]
            return score

        return mod

    def _by_view(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreParts | None:
        """Consecutive positions: per-offset scores read as strided views (no gather);
        None when a view does not fit (the caller gathers). Beyond the last bucket a
        term is constant along a row (c2p) or a column (p2c): those key columns get one
        value per query or per key, expanded, and only the window between them is
        scored per offset. The p2c window comes in key chunks, each added onto its own
        columns."""
        rows, lo = ctx[ROWS], ctx[LO]
        if self.w_kr is None:
            return None
        # c2p: q_i . K^r[rows[d - lo]] for distance d = i - j = -n. Lookup entries up to
        # flat[0] share a row (d small: n large), so do those from flat[1] (n small).
        assert ctx.starts is not None  # score_parts calls this for consecutive positions only
        (a, b), (q0, k0), t = ctx[FLAT], ctx.starts, q.shape[-2]
        # Causal with keys up to the queries (lo <= 0): a lookup's flat run at one end is
        # the masked distances (< 0; distance 0 has a row of its own), at the other the
        # far keys' row, which the shift below makes 0, so by_rows pads both with 0.
        # (With lo > 0 the first distances may share a log bucket: real values.)
        causal = ctx.kind is AttnKind.CAUSAL and lo <= 0
        w = offset_window(ctx, -(lo + b), -(lo + a))
        first, last = -w.n_hi - lo, -w.n_lo - lo  # lookup entries of distances -n_hi..-n_lo
        if first < 0 or last >= rows.shape[0]:
            return None
        # K^r - K^r[rows[b]]: the far keys' row value is 0 (the row is shifted by it).
        kr = self._shifted(self.w_kr, ctx, q.dtype, C2P_END)  # (H, P, D)
        parts = window_parts(
            ctx,
            w,
            left=None,
            table=by_rows(q, kr, rows, first, last, ctx[FLAT], reverse=True, zero_ends=causal),
            right=q @ kr.index_select(1, rows[a : a + 1]).transpose(-1, -2),  # (B, H, T, 1)
        )
        if parts is None or self.w_qr is None:
            return parts
        # p2c: k_j . Q^r[p2c_rows[d - lo]], d = i - j again; constant (per key) where the
        # lookup is flat, so the same split with p2c_rows's ends.
        (a, b) = ctx[P2C_FLAT]
        w = offset_window(ctx, -(lo + b), -(lo + a))
        # Q^r - Q^r[end]: the far keys (columns before w.left) get 0; transform_qk has
        # put k_j . Q^r[end] into the content score of every column.
        qr = self._shifted(self.w_qr, ctx, k.dtype, P2C_END)  # (H, P, D)

        def per_key(keys: Tensor, row: Tensor) -> Tensor:  # (B, H, T, n): one value per key
            col = keys @ qr.index_select(1, row).transpose(-1, -2)  # (B, H, n, 1)
            return col.transpose(-1, -2).expand(*col.shape[:-2], t, col.shape[-2])

        if w.right < k.shape[-2]:
            parts.append((per_key(k[..., w.right :, :], ctx[ROWS_P2C][a : a + 1]), w.right))
        # In the window, rows are keys and columns queries, offset i - j = d. A key meets
        # only T distances, so keys go in chunks of cT, each against its own (c + 1)T - 1
        # distances (all of them for every key would cost S x (T + S)).
        step = t * self.p2c_chunk
        for c0 in range(w.left, w.right, step):
            c1 = min(w.right, c0 + step)
            # the chunk's distances that the lookup covers (masked ones included)
            d_lo = max(q0 - (k0 + c1 - 1), lo)
            d_hi = min(q0 + t - 1 - (k0 + c0), lo + rows.shape[0] - 1)
            if d_hi < d_lo:
                return None
            kc = k[..., c0:c1, :]
            per_d = by_rows(
                kc, qr, ctx[ROWS_P2C], d_lo - lo, d_hi - lo, ctx[P2C_FLAT], zero_ends=causal
            )
            part = offset_view(per_d, row0=k0 + c0, col0=q0, lo=d_lo, cols=t)
            if part is None:
                return None
            parts.append((part.transpose(-1, -2), c0))  # (B, H, T, c1 - c0)
        return parts

    def _by_gather(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor | None:
        rows, lo = ctx[ROWS], ctx[LO]
        rel = ctx.rel() - lo  # (B|1, T, S): i - j, offset into the rows lookup
        bias = None
        if self.w_kr is not None:  # content-to-position: q_i . K^r[delta(i, j)]
            # shifted as in the view path, so both paths give the same term
            kr = self._shifted(self.w_kr, ctx, q.dtype, C2P_END)
            per_row = q @ kr.transpose(-1, -2)  # (B, H, T, P)
            bias = gather_rel(per_row, rows[rel])
        if self.w_qr is not None:  # position-to-content: k_j . Q^r[delta(i, j) or (j, i)]
            # shifted by the row transform_qk moved into the content score
            qr = self._shifted(self.w_qr, ctx, k.dtype, P2C_END)
            per_row = k @ qr.transpose(-1, -2)  # (B, H, S, P)
            # p2c_rows holds the row of each distance i - j (code) or of j - i (paper),
            # read key-major: index (B|1, S, T).
            p2c_rows = ctx[ROWS_P2C][rel.transpose(-1, -2)]
            p2c = gather_rel(per_row, p2c_rows).transpose(-1, -2)  # (B, H, T, S)
            bias = p2c if bias is None else bias + p2c
        return bias


@register("deberta")
class DebertaRelative(PositionalEncoder):
    """DeBERTa disentangled attention with a shared relative-position table.

    Args:
        max_distance: Largest distance told apart (DeBERTa's max_relative_positions).
        bucket_size: Log buckets on each side (DeBERTa-v2's position_buckets);
            0 disables log bucketing and clips at ``max_distance`` instead.
        c2p: Use the content-to-position term.
        p2c: Use the position-to-content term.
        p2c_row: Table row of p2c: ``code`` (default, the authors' code and released
            checkpoints: the row of ``i - j``, as c2p) or ``paper`` (eq. 4: ``j - i``).
        far_keys: Rows of the distances whose log bucket would pass ``bucket_size - 1``
            (``|d| >= max_distance`` for an even ``bucket_size``): ``code`` (default, the
            authors' code: the last row on the positive side, row 0 on the negative) or
            ``last_bucket`` (posenc's variant: each side's last log bucket). Both are
            the same map without log buckets (``bucket_size=0``: the row clip alone).
    """

    relative = True

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_layers: int,
        max_distance: int = 128,
        bucket_size: int = 32,
        c2p: bool = True,
        p2c: bool = True,
        p2c_row: str = "code",
        far_keys: str = "code",
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if max_distance < 2:
            raise ValueError(f"deberta: max_distance must be >= 2, got {max_distance}")
        if bucket_size and not 4 <= bucket_size < 2 * (max_distance - 1):
            raise ValueError(
                f"deberta: bucket_size={bucket_size} must be 0 (no log buckets) or in "
                f"[4, 2 * (max_distance - 1)) = [4, {2 * (max_distance - 1)})"
            )
        if p2c_row not in P2C_ROWS:
            raise ValueError(f"deberta: {unknown_value('p2c_row', p2c_row, P2C_ROWS)}")
        if far_keys not in FAR_KEYS:
            raise ValueError(f"deberta: {unknown_value('far_keys', far_keys, FAR_KEYS)}")
        self.p2c_row = p2c_row
        self.far_keys = far_keys
        self.max_distance = max_distance
        self.bucket_size = bucket_size
        self.c2p, self.p2c = c2p, p2c
        self.span = bucket_size if bucket_size else max_distance
        # log_bucket's table, made here: the forward pass only looks it up
        self._magnitudes = _bucket_magnitudes(bucket_size, max_distance) if bucket_size else ()
        # from this |distance| on, far_keys=code reads row 0 on the negative side (None: never)
        self._far = (
            _far_distance(bucket_size, max_distance) if bucket_size and far_keys == "code" else None
        )
        self.table = nn.Parameter(torch.randn(2 * self.span, d_model) * 0.02)
        self.saturation = self._saturation()

    def _saturation(self) -> int:
        """Smallest D with one table row for all distances ``d >= D`` and one for all
        ``d <= -D`` (found once, here, so forward passes need no host read). Log buckets
        are constant from ``max_distance`` on (:func:`log_bucket`), clipped distances
        from ``span``, the code's far negative rows from ``_far``, so a search up to
        there finds it."""
        d = torch.arange(max(self.max_distance, self.span, self._far or 0) + 2)
        rows, rows_neg = self.row(d), self.row(-d)
        moved = (rows != rows[-1]) | (rows_neg != rows_neg[-1])
        return int(moved.nonzero().max()) + 1

    def row(self, rel: Tensor) -> Tensor:
        """Row of the table for signed distances ``rel`` (delta in the paper)."""
        if self.bucket_size:
            bucket = lookup_buckets(rel, self._magnitudes)
            if self._far is not None:
                # The reference's bucket is >= span here: the clip below then gives the
                # last row on the positive side and row 0 on the negative.
                bucket = torch.where(rel.abs() >= self._far, rel.sign() * self.span, bucket)
            rel = bucket
        return (rel + self.span).clamp(0, 2 * self.span - 1)

    def prepare(self, ctx: AttentionContext) -> None:
        if ctx.kind is AttnKind.CROSS:
            return
        # delta for each distance present (or that the positions' bound allows), from
        # Python ints: O(T + S) lookups that the layers index per pair (rows[d - lo] for
        # d = i - j; p2c_rows: the same (code) or for -d (paper)).
        lo, hi = ctx.distance_range()
        dist = torch.arange(lo, hi + 1, device=ctx.q_pos.device)
        causal = ctx.kind is AttnKind.CAUSAL
        if causal:
            # Keys after the query (distance < 0) are masked: give them distance 0's
            # rows, so the lookup is flat there and their columns need no products.
            dist = dist.clamp(min=0)
        rows = self.row(dist)
        p2c_rows = rows if self.p2c_row == "code" else self.row(-dist)
        # Beyond the largest distance told apart, rows repeat: score those ends once.
        flat = flat_ends(lo, hi, self.saturation, causal)
        ctx.put(TABLE, self.table)
        ctx.put(LO, lo)
        ctx.put(ROWS, rows)
        ctx.put(ROWS_P2C, p2c_rows)
        ctx.put(FLAT, flat)
        ctx.put(P2C_FLAT, flat)  # flat_ends is symmetric in the sign of d: both p2c lookups
        # The far keys' rows (a query's farthest keys), as tensors: their c2p value
        # is dropped from each query row and their p2c value moved into q (module
        # docstring).
        ctx.put(C2P_END, rows[flat[1] : flat[1] + 1])  # (1,): a row index for index_select
        ctx.put(P2C_END, p2c_rows[flat[1] : flat[1] + 1])

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        if kind is AttnKind.CROSS:
            return AttentionPositional()
        return _DebertaAttention(
            d_model=self.d_model, n_heads=self.n_heads, c2p=self.c2p, p2c=self.p2c
        )
