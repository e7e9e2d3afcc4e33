"""DeBERTa's log buckets and table rows against a float64 reference written from the
formula with Python's ``math`` (issue #27, point 12), and its p2c row under both
conventions, by hand (issue #24)."""

from __future__ import annotations

import math

import pytest
import torch

from posenc.encoders.base import AttnKind
from posenc.encoders.deberta import DebertaRelative, log_bucket

C, H = 16, 2


def reference_bucket(r: int, bucket_size: int, max_distance: int) -> int:
    """DeBERTa-v2's ``make_log_bucket_position`` for one distance, in float64:
    ``sign(r) * (mid + ceil(log(|r|/mid) / log((max_distance-1)/mid) * (mid-1)))`` for
    ``|r| > mid``, else ``r``; unclamped, as the reference."""
    mid = bucket_size // 2
    if abs(r) <= mid:
        return r
    ratio = math.log(abs(r) / mid) / math.log((max_distance - 1) / mid)
    mag = mid + math.ceil(ratio * (mid - 1))
    return mag if r > 0 else -mag


def test_log_bucket_equals_the_float64_formula_everywhere() -> None:
    """Every bucket size x max distance the encoder accepts up to 64 x 160, at every
    distance within 1.5 max_distance: equal to the reference wherever the reference is
    within |bucket| <= bucket_size - 1, clamped to it elsewhere."""
    settings = clamped = 0
    for bucket_size in range(4, 65):
        for max_distance in range(bucket_size // 2 + 2, 161):
            settings += 1
            top = max_distance + max_distance // 2
            dist = torch.arange(-top, top + 1)
            got = log_bucket(dist, bucket_size, max_distance).tolist()
            want = [reference_bucket(r, bucket_size, max_distance) for r in dist.tolist()]
            for r, g, w in zip(dist.tolist(), got, want, strict=True):
                assert abs(g) <= bucket_size - 1, (bucket_size, max_distance, r, g)
                if abs(w) <= bucket_size - 1:
                    assert g == w, (bucket_size, max_distance, r, g, w)
                else:
                    clamped += 1
                    assert g == math.copysign(bucket_size - 1, w), (bucket_size, max_distance, r)
    assert settings == 8677 and clamped > 0  # the sweep ran, and reached past the range


def test_log_bucket_issue_case() -> None:
    # bucket_size 26, max_distance 70: +-69 is the last bucket, 25, not 26 (a torch log
    # against a math log made the ratio 1 + ulp there); row(-69) = -25 + 26 = 1.
    assert log_bucket(torch.tensor([69, -69, 70, -500]), 26, 70).tolist() == [25, -25, 25, -25]
    enc = DebertaRelative(d_model=C, n_heads=H, n_layers=1, bucket_size=26, max_distance=70)
    assert enc.row(torch.tensor([-69, 69])).tolist() == [1, 51]


def test_log_bucket_odd_bucket_size_reaches_the_last_bucket_past_max_distance() -> None:
    # bucket_size 9 (mid 4), max_distance 20: the formula gives 2 mid - 1 = 7 at 19 and
    # 2 mid = 8 = bucket_size - 1 from 20 on.
    got = log_bucket(torch.tensor([19, 20, 21, 1000, -20]), 9, 20).tolist()
    assert got == [7, 8, 8, 8, -8]


def reference_row(r: int, bucket_size: int, max_distance: int) -> int:
    """The authors' table row of distance ``r``: the unclamped bucket, then their row
    clip ``clamp(bucket + span, 0, 2 span - 1)`` (DeBERTa-v2's
    ``disentangled_attention_bias``, span = bucket_size)."""
    bucket = reference_bucket(r, bucket_size, max_distance)
    return min(max(bucket + bucket_size, 0), 2 * bucket_size - 1)


def test_default_rows_equal_the_reference_row_clip_with_far_keys() -> None:
    """The default (``far_keys=code``) reads the authors' row at every distance, far keys
    on both sides included: past max_distance the negative side is on row 0, a row no
    distance inside it reads. ``last_bucket`` keeps that side on row 1 instead."""
    settings = far_rows = 0
    for bucket_size in range(4, 13):
        for max_distance in range(bucket_size // 2 + 2, 25):
            settings += 1
            enc = DebertaRelative(
                d_model=C, n_heads=H, n_layers=1, bucket_size=bucket_size, max_distance=max_distance
            )
            # odd bucket sizes reach row 0 only at about max_distance^2 / bucket_size
            top = max_distance**2 + 4
            dist = torch.arange(-top, top + 1)
            want = [reference_row(r, bucket_size, max_distance) for r in dist.tolist()]
            assert enc.row(dist).tolist() == want, (bucket_size, max_distance)
            inside = enc.row(torch.arange(-(max_distance - 1), max_distance))
            assert inside.min() >= 1  # row 0 is the far keys' alone
            assert want[0] == 0
            far_rows += want.count(0)
            posenc = DebertaRelative(
                d_model=C,
                n_heads=H,
                n_layers=1,
                bucket_size=bucket_size,
                max_distance=max_distance,
                far_keys="last_bucket",
            )
            alt = posenc.row(dist)
            assert alt.min() == 1 and alt[0] == 1
            assert alt.tolist() == [max(w, 1) for w in want]
    assert settings == 173 and far_rows > 0


def test_far_keys_odd_bucket_size_by_hand() -> None:
    # bucket_size 9 (mid 4), max_distance 20: the formula's bucket is
    # 4 + ceil(3 ln(r/4) / ln(19/4)): at 31, 4 + ceil(3.943) = 8 (row 1 on the negative
    # side), at 32, 4 + ceil(4.004) = 9 = span (row 0); positive side: row 17 throughout.
    rows = {"code": [1, 1, 0, 0, 17, 17], "last_bucket": [1, 1, 1, 1, 17, 17]}
    for far_keys, want in rows.items():
        enc = DebertaRelative(
            d_model=C, n_heads=H, n_layers=1, bucket_size=9, max_distance=20, far_keys=far_keys
        )
        assert enc.row(torch.tensor([-20, -31, -32, -500, 32, 500])).tolist() == want
        assert enc.saturation == (32 if far_keys == "code" else 20)


@pytest.mark.parametrize("far_keys", ["code", "last_bucket"])
def test_rows_are_constant_from_saturation_on_and_not_before(far_keys: str) -> None:
    """``saturation`` (what flat_ends relies on) is the smallest D with one row for all
    d >= D and one for all d <= -D, for log buckets and for plain clipping."""
    for bucket_size, max_distance in [
        (0, 6),
        (0, 128),
        (4, 6),
        (8, 64),
        (9, 20),
        (26, 70),
        (32, 128),
        (60, 32),
        (256, 512),
    ]:
        enc = DebertaRelative(
            d_model=C,
            n_heads=H,
            n_layers=1,
            bucket_size=bucket_size,
            max_distance=max_distance,
            far_keys=far_keys,
        )
        sat = enc.saturation
        far = torch.arange(sat, 4 * max(max_distance, sat))
        for sign in (1, -1):
            rows = enc.row(sign * far)
            assert (rows == rows[0]).all(), (bucket_size, max_distance, sign)
        before = enc.row(torch.tensor([sat - 1, -(sat - 1)]))
        assert (before != enc.row(torch.tensor([sat, -sat]))).any()
        # odd bucket sizes: the code's negative side moves to row 0 past max_distance
        assert sat <= max_distance or (far_keys == "code" and bucket_size % 2)
        rows = enc.row(torch.arange(-4 * max_distance, 4 * max_distance))
        assert rows.min() >= 0 and rows.max() <= 2 * enc.span - 1


# ----------------------------------------------------------------- p2c row (issue #24)
# 5 tokens at positions 0..4, d_model = head dim = 1, no log buckets, max_distance 2:
# row(d) = clip(d + 2, 0, 3), and the table rows through W_qr = 1 are Q^r = (1, 2, 3, 4).
# code: Q^r[row(i - j)] (the row c2p reads); paper: Q^r[row(j - i)] (eq. 4), its transpose.
QR_CODE = [[3, 2, 1, 1, 1], [4, 3, 2, 1, 1], [4, 4, 3, 2, 1], [4, 4, 4, 3, 2], [4, 4, 4, 4, 3]]
QR_PAPER = [[3, 4, 4, 4, 4], [2, 3, 4, 4, 4], [1, 2, 3, 4, 4], [1, 1, 2, 3, 4], [1, 1, 1, 2, 3]]


@pytest.mark.parametrize(("p2c_row", "qr"), [("code", QR_CODE), ("paper", QR_PAPER)])
@pytest.mark.parametrize("view", [False, True])
def test_p2c_by_hand_for_five_tokens(p2c_row: str, qr: list, view: bool) -> None:
    """With q = 0 the score is p2c alone: k_j * Q^r[row] / sqrt(2 D) (c2p off: two terms)."""
    enc = DebertaRelative(
        d_model=1, n_heads=1, n_layers=1, max_distance=2, bucket_size=0, c2p=False, p2c_row=p2c_row
    )
    hook = enc.for_attention(layer=0, kind=AttnKind.BIDIRECTIONAL)
    with torch.no_grad():
        enc.table.copy_(torch.tensor([[1.0], [2.0], [3.0], [4.0]]))
        hook.w_qr.weight.fill_(1.0)
    if view:  # the strided-view path (consecutive positions), not the per-pair gather
        hook.view_keys_per_row = 0.0
        hook.view_min_queries = 0
    pos = torch.arange(5)[None]
    ctx = enc.context(pos, pos, AttnKind.BIDIRECTIONAL, starts=(0, 0) if view else None)
    q = torch.zeros(1, 1, 5, 1)
    k = torch.tensor([1.0, 10.0, 100.0, 1000.0, 10000.0]).view(1, 1, 5, 1)
    with torch.no_grad():
        tq, tk = hook.transform_qk(q, k, ctx)
        got = hook.score_bias(q, k, ctx) + tq @ tk.transpose(-1, -2) * hook.scale(1)
    want = torch.tensor(qr, dtype=torch.float32) * k.view(1, 5) / math.sqrt(2)
    torch.testing.assert_close(got[0, 0], want)
