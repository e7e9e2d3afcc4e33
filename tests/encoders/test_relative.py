"""Shaw, Transformer-XL and DeBERTa against per-pair O(T*S) references written
directly from each paper's equations (no gather, no shift, no bucketing tensors)."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from posenc.encoders.base import AttnKind
from posenc.encoders.deberta import DebertaRelative, log_bucket
from posenc.encoders.shaw import ShawRelative
from posenc.encoders.xl import TransformerXL
from tests.conftest import heads, identity_attention, merge, softmax_attend

C, H = 16, 2
Dh = C // H
KINDS = [AttnKind.CAUSAL, AttnKind.BIDIRECTIONAL]


def positions(t: int, offset: int = 0) -> torch.Tensor:
    return torch.arange(offset, offset + t)[None]


# --------------------------------------------------------------------------- Shaw


def shaw_reference(enc: ShawRelative, layer, x, qp, kp, causal: bool) -> torch.Tensor:
    """Shaw et al. eq. (3)-(5) per pair: a_ij = w[clip(j - i, -k, k)]."""
    q = k = v = heads(x, H)[0]  # identity projections: (H, T, D)
    wk = layer.key_table if layer.key_table is not None else enc.key_table
    wv = layer.value_table if layer.key_table is not None else enc.value_table
    t, s = qp.shape[-1], kp.shape[-1]
    kk = enc.max_distance
    scores = torch.empty(H, t, s)
    for h in range(H):
        for i in range(t):
            for j in range(s):
                a = int(min(max(kp[0, j] - qp[0, i], -kk), kk)) + kk
                scores[h, i, j] = q[h, i] @ (k[h, j] + wk[a]) / math.sqrt(Dh)
    if causal:
        scores = scores.masked_fill(torch.ones(t, s, dtype=torch.bool).triu(1), float("-inf"))
    alpha = scores.softmax(-1)
    out = torch.zeros(H, t, Dh)
    for h in range(H):
        for i in range(t):
            for j in range(s):
                a = int(min(max(kp[0, j] - qp[0, i], -kk), kk)) + kk
                vv = v[h, j] + (wv[a] if wv is not None else 0)
                out[h, i] += alpha[h, i, j] * vv
    return merge(out[None])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("per_layer", [True, False])
@pytest.mark.parametrize("value", [True, False])
def test_shaw_matches_the_paper(kind: AttnKind, per_layer: bool, value: bool) -> None:
    enc = ShawRelative(
        d_model=C, n_heads=H, n_layers=1, max_distance=2, per_layer=per_layer, value=value
    )
    attn = identity_attention(enc, kind)
    with torch.no_grad():  # make the tables matter as much as the content
        for p in list(enc.parameters()) + list(attn.pos.parameters()):
            p.normal_()
    x = torch.randn(1, 6, C)
    qp = positions(6, offset=3)
    out = attn(x, enc.context(qp, qp, kind))
    ref = shaw_reference(enc, attn.pos, x, qp, qp, kind is AttnKind.CAUSAL)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert attn.pos.needs_probs is value


# --------------------------------------------------------------------------- XL


def sinusoid_by_hand(dist: int, dim: int) -> torch.Tensor:
    return torch.tensor(
        [
            math.sin(dist / 10000 ** (2 * (c // 2) / dim))
            if c % 2 == 0
            else math.cos(dist / 10000 ** (2 * (c // 2) / dim))
            for c in range(dim)
        ]
    )


def xl_scores(enc: TransformerXL, layer, q, k, qp, kp) -> torch.Tensor:
    """Dai et al. eq. in 3.3: (a)+(c) = (q_i + u) k_j, (b)+(d) = (q_i + v) W_r R_{i-j}."""
    t, s = q.shape[1], k.shape[1]
    scores = torch.empty(H, t, s)
    for i in range(t):
        for j in range(s):
            r = layer.w_r(sinusoid_by_hand(int(qp[0, i] - kp[0, j]), C)).view(H, Dh)
            for h in range(H):
                scores[h, i, j] = (
                    (q[h, i] + enc.u[h]) @ k[h, j] + (q[h, i] + enc.v[h]) @ r[h]
                ) / math.sqrt(Dh)
    return scores


@pytest.mark.parametrize("kind", KINDS)
def test_xl_matches_the_paper(kind: AttnKind) -> None:
    enc = TransformerXL(d_model=C, n_heads=H, n_layers=1)
    attn = identity_attention(enc, kind)
    with torch.no_grad():
        enc.u.normal_()
        enc.v.normal_()
    x = torch.randn(1, 7, C)
    qp = positions(7, offset=11)
    with torch.no_grad():
        out = attn(x, enc.context(qp, qp, kind))
        q = heads(x, H)[0]
        ref = softmax_attend(
            xl_scores(enc, attn.pos, q, q, qp, qp)[None], heads(x, H), kind is AttnKind.CAUSAL
        )
    torch.testing.assert_close(out, merge(ref), atol=1e-5, rtol=1e-5)


def test_xl_bias_is_exact_in_the_upper_triangle() -> None:
    # The rel-shift trick is wrong above the diagonal; the bidirectional bias must
    # be right for every pair, with query and key lengths that differ.
    enc = TransformerXL(d_model=C, n_heads=H, n_layers=1)
    hook = enc.for_attention(layer=0, kind=AttnKind.BIDIRECTIONAL)
    q, k = torch.randn(1, H, 3, Dh), torch.randn(1, H, 5, Dh)
    qp, kp = torch.tensor([[4, 5, 6]]), torch.tensor([[2, 3, 4, 5, 6]])
    ctx = enc.context(qp, kp, AttnKind.BIDIRECTIONAL)
    with torch.no_grad():
        got = hook.score_bias(q, k, ctx) + (
            hook.transform_qk(q, k, ctx)[0] @ k.transpose(-1, -2)
        ) / math.sqrt(Dh)
        ref = xl_scores(enc, hook, q[0], k[0], qp, kp)
    torch.testing.assert_close(got[0], ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- DeBERTa


def delta_by_hand(r: int, span: int, bucket: int, max_distance: int, far_keys: str = "code") -> int:
    """DeBERTa's delta: log bucket (v2; unclamped as in the authors' code, or clamped to
    +-(bucket - 1) for ``far_keys="last_bucket"``) then shift and clip into [0, 2 span)."""
    if bucket:
        mid = bucket // 2
        if abs(r) > mid:
            mag = mid + math.ceil(
                math.log(abs(r) / mid) / math.log((max_distance - 1) / mid) * (mid - 1)
            )
            if far_keys == "last_bucket":
                mag = min(mag, bucket - 1)
            r = mag if r > 0 else -mag
    return min(max(r + span, 0), 2 * span - 1)


def test_log_bucket_values() -> None:
    # bucket_size 8 (mid 4), max_distance 64: exact within 4, log-spaced beyond.
    rel = torch.tensor([0, 1, -4, 4, 5, -5, 10, 63, 100, -1000])
    got = log_bucket(rel, 8, 64).tolist()
    # 5 -> 4 + ceil(3 ln(5/4) / ln(63/4)) = 4 + ceil(0.243) = 5;
    # 10 -> 4 + ceil(3 ln 2.5 / ln 15.75) = 4 + ceil(0.997) = 5; 63 -> 4 + 3 = 7.
    assert got[:8] == [0, 1, -4, 4, 5, -5, 5, 7]
    # 100 -> 4 + ceil(3 ln 25 / ln 15.75) = 8 by the formula, clamped to the last bucket 7
    assert got[8:] == [7, -7]
    # Rows (16 of them, span 8): the authors' code clips buckets +-8 (and beyond) to rows
    # 15 and 0; posenc's variant keeps +-7, rows 15 and 1. Inside max_distance both agree.
    for far_keys, rows in (("code", [15, 0, 15, 0, 1]), ("last_bucket", [15, 1, 15, 1, 1])):
        enc = DebertaRelative(
            d_model=C, n_heads=H, n_layers=1, bucket_size=8, max_distance=64, far_keys=far_keys
        )
        assert enc.row(torch.tensor([100, -1000, 64, -64, -63])).tolist() == rows


def deberta_scores(enc: DebertaRelative, layer, q, k, qp, kp) -> torch.Tensor:
    """He et al. eq. (4): (Q_c K_c^T + Q_c K_r^T[delta(i,j)] + K_c Q_r^T[delta(j,i)]) / sqrt(3d),
    or with p2c at delta(i,j) as the authors' code reads it (``enc.p2c_row == "code"``)."""
    kr = layer.w_kr(enc.table).view(-1, H, Dh)
    qr = layer.w_qr(enc.table).view(-1, H, Dh)
    t, s = q.shape[1], k.shape[1]
    scores = torch.empty(H, t, s)
    for i in range(t):
        for j in range(s):
            rel = int(qp[0, i] - kp[0, j])
            c2p = delta_by_hand(rel, enc.span, enc.bucket_size, enc.max_distance, enc.far_keys)
            p2c_rel = rel if enc.p2c_row == "code" else -rel
            p2c = delta_by_hand(p2c_rel, enc.span, enc.bucket_size, enc.max_distance, enc.far_keys)
            for h in range(H):
                scores[h, i, j] = (
                    q[h, i] @ k[h, j] + q[h, i] @ kr[c2p, h] + k[h, j] @ qr[p2c, h]
                ) / math.sqrt(3 * Dh)
    return scores


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bucket", [0, 4])
@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("p2c_row", ["code", "paper"])
@pytest.mark.parametrize("far_keys", ["code", "last_bucket"])
def test_deberta_matches_the_paper(
    kind: AttnKind, bucket: int, view: bool, p2c_row: str, far_keys: str
) -> None:
    """Attention outputs against eq. (4) (p2c at either row, either far-key row);
    ``view``: the strided-view path, with the far keys' values moved out of the score
    terms, in causal blocks of 4 queries."""
    enc = DebertaRelative(
        d_model=C,
        n_heads=H,
        n_layers=1,
        max_distance=6,
        bucket_size=bucket,
        p2c_row=p2c_row,
        far_keys=far_keys,
    )
    attn = identity_attention(enc, kind)
    if view:
        attn.pos.view_keys_per_row = 0.0
        attn.causal_block = 4
    with torch.no_grad():
        enc.table.normal_()
    x = torch.randn(1, 12, C)  # distances up to 11 exercise clipping and log buckets
    qp = positions(12, offset=5)
    with torch.no_grad():
        out = attn(x, enc.context(qp, qp, kind))
        q = heads(x, H)[0]
        ref = softmax_attend(
            deberta_scores(enc, attn.pos, q, q, qp, qp)[None], heads(x, H), kind is AttnKind.CAUSAL
        )
    torch.testing.assert_close(out, merge(ref), atol=1e-5, rtol=1e-5)


def test_deberta_causal_lookup_is_flat_over_masked_keys() -> None:
    """Causal: distances < 0 (keys after the query, masked) take distance 0's rows, so
    no product is spent on them; allowed distances keep the paper's rows, and
    bidirectional attention keeps every distance's own."""
    enc = DebertaRelative(
        d_model=C, n_heads=H, n_layers=1, max_distance=6, bucket_size=4, p2c_row="paper"
    )
    pos = positions(10)
    causal = enc.context(pos, pos, AttnKind.CAUSAL).extra
    both = enc.context(pos, pos, AttnKind.BIDIRECTIONAL).extra
    dist = torch.arange(causal["lo"], causal["lo"] + causal["rows"].shape[0])
    allowed = dist >= 0
    for key, sign in (("rows", 1), ("p2c_rows", -1)):
        want = enc.row(sign * dist)
        assert torch.equal(causal[key][allowed], want[allowed])
        assert torch.equal(both[key], want)
        assert (causal[key][~allowed] == enc.row(torch.tensor(0))).all()
    assert causal["flat"][0] == int((~allowed).sum())  # the masked run is one flat end


def test_deberta_far_keys_get_no_score_part() -> None:
    """Past the last bucket c2p is one value per query row (dropped: the softmax does
    not see it) and p2c one value per key (moved into q by transform_qk), so the parts
    leave the far keys' columns to the content score."""
    enc = DebertaRelative(d_model=C, n_heads=H, n_layers=1, max_distance=6, bucket_size=4)
    hook = enc.for_attention(layer=0, kind=AttnKind.CAUSAL)
    hook.view_keys_per_row = 0.0
    hook.view_min_queries = 0
    pos = positions(40)
    ctx = enc.context(pos, pos, AttnKind.CAUSAL, starts=(0, 0)).slice_queries(32, 40)
    q, k = torch.randn(1, H, 8, Dh), torch.randn(1, H, 40, Dh)
    parts = hook.score_parts(q, k, ctx)
    assert min(c0 for _, c0 in parts) >= 40 - 8 - 6  # keys 6+ before the block's first query
    tq, tk = hook.transform_qk(q, k, ctx)
    assert tk is k and not torch.equal(tq, q)


@pytest.mark.parametrize("p2c_row", ["code", "paper"])
def test_deberta_unequal_query_and_key_lengths(p2c_row: str) -> None:
    enc = DebertaRelative(
        d_model=C, n_heads=H, n_layers=1, max_distance=8, bucket_size=4, p2c_row=p2c_row
    )
    hook = enc.for_attention(layer=0, kind=AttnKind.BIDIRECTIONAL)
    with torch.no_grad():
        enc.table.normal_()
    q, k = torch.randn(1, H, 3, Dh), torch.randn(1, H, 9, Dh)
    qp, kp = torch.tensor([[6, 7, 8]]), torch.arange(9)[None]
    ctx = enc.context(qp, kp, AttnKind.BIDIRECTIONAL)
    with torch.no_grad():
        # the score term goes with the content score of the hook's q and k
        tq, tk = hook.transform_qk(q, k, ctx)
        got = hook.score_bias(q, k, ctx) + tq @ tk.transpose(-1, -2) * hook.scale(Dh)
        ref = deberta_scores(enc, hook, q[0], k[0], qp, kp)
    # Equal up to one constant per query row (c2p's far-key value is dropped from the
    # row), which the softmax does not see.
    torch.testing.assert_close(got[0] - got[0, ..., :1], ref - ref[..., :1], atol=1e-5, rtol=1e-5)


def test_deberta_scale_is_one_over_sqrt_3d() -> None:
    hook = DebertaRelative(d_model=C, n_heads=H, n_layers=1).for_attention(
        layer=0, kind=AttnKind.CAUSAL
    )
    assert hook.scale(Dh) == pytest.approx(1 / math.sqrt(3 * Dh))
    only_c2p = DebertaRelative(d_model=C, n_heads=H, n_layers=1, p2c=False).for_attention(
        layer=0, kind=AttnKind.CAUSAL
    )
    assert only_c2p.scale(Dh) == pytest.approx(1 / math.sqrt(2 * Dh))


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (ShawRelative, dict(max_distance=0), "max_distance must be >= 1"),
        (DebertaRelative, dict(max_distance=1), "max_distance must be >= 2"),
        (DebertaRelative, dict(bucket_size=2), "bucket_size=2 must be 0"),
        (DebertaRelative, dict(p2c_row="foo"), "unknown p2c_row 'foo'; allowed: code, paper"),
        (
            DebertaRelative,
            dict(far_keys="row0"),
            "unknown far_keys 'row0'; allowed: code, last_bucket",
        ),
        (TransformerXL, dict(d_model=18, n_heads=2), None),  # even: fine
    ],
)
def test_bad_settings(cls, kwargs: dict, message: str | None) -> None:
    args = dict(d_model=C, n_heads=H, n_layers=1) | kwargs
    if message is None:
        cls(**args)
        return
    with pytest.raises(ValueError, match=message):
        cls(**args)


def xl_scores_float64(enc: TransformerXL, layer, q, k, qp, kp) -> torch.Tensor:
    """The same equation in float64 throughout (the sinusoid too), for the folded form,
    whose only rounding is float64's: ``(B, H, T, S)`` from ``q (B, H, T, D)``,
    ``k (B, H, S, D)`` and positions ``(B|1, T)``, ``(B|1, S)``."""
    freq = 10000.0 ** (-torch.arange(0, C, 2, dtype=torch.float64) / C)
    freq = freq.float().double()  # the sinusoid's frequencies are rounded to float32 once
    dist = (qp[:, :, None] - kp[:, None, :]).double()[..., None] * freq  # (B|1, T, S, C/2)
    r = torch.stack((dist.sin(), dist.cos()), dim=-1).flatten(-2)  # (B|1, T, S, C)
    wr = layer.w_r.weight.double().unflatten(0, (H, Dh))  # (H, D, C)
    pos = torch.einsum("bhtd,hdc,btsc->bhts", q + enc.v.double()[:, None], wr, r)
    content = (q + enc.u.double()[:, None]) @ k.transpose(-1, -2)
    return (content + pos) / math.sqrt(Dh)


@pytest.mark.parametrize("kind", KINDS)
def test_xl_folded_score_is_the_paper_equation_in_float64(kind: AttnKind) -> None:
    # One dot product [q + u, q~] . [k, k~] equals (q + u) k + (q + v) W_r R_{i-j} to
    # float64 rounding: per-row positions, an offset, query and key lengths that differ.
    torch.manual_seed(0)
    enc = TransformerXL(d_model=C, n_heads=H, n_layers=1, fold=True).double()
    hook = enc.for_attention(layer=0, kind=kind).double()
    with torch.no_grad():
        for p in [enc.u, enc.v, hook.w_r.weight]:
            p.normal_()
    q, k = torch.randn(2, H, 3, Dh, dtype=torch.float64), torch.randn(2, H, 5, Dh).double()
    qp = torch.tensor([[40, 41, 42], [7, 8, 9]])
    kp = torch.tensor([[38, 39, 40, 41, 42], [5, 6, 7, 8, 9]]) + torch.tensor([[0], [3]])
    ctx = enc.context(qp, kp, kind)
    q_t, k_t = hook.transform_qk(q, k, ctx)
    assert q_t.shape[-1] == k_t.shape[-1] == Dh + C and hook.score_bias(q, k, ctx) is None
    got = q_t @ k_t.transpose(-1, -2) / math.sqrt(Dh)
    ref = xl_scores_float64(enc, hook, q, k, qp, kp)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)


def test_xl_folded_model_equals_the_table_model_values_and_gradients() -> None:
    # The same weights in either form: a whole LM's logits and every gradient agree to
    # the float32 rounding of the table's sinusoid (the fold's angles are float64 here).
    from posenc.model import DecoderLM

    torch.manual_seed(0)
    models = [
        DecoderLM(
            vocab_size=11,
            encoder=functools.partial(TransformerXL, fold=fold),
            d_model=C,
            n_heads=H,
            n_layers=2,
            d_ff=32,
            dropout=0.0,
        ).double()
        for fold in (False, True)
    ]
    models[1].load_state_dict(models[0].state_dict())  # one checkpoint serves both
    ids = torch.randint(11, (2, 9))
    outs = []
    for m in models:
        logits = m(ids)
        logits.square().sum().backward()
        outs.append((logits, {n: p.grad for n, p in m.named_parameters()}))
    (table, g_table), (folded, g_folded) = outs
    torch.testing.assert_close(folded, table, atol=1e-6, rtol=1e-6)
    for name, grad in g_table.items():
        torch.testing.assert_close(g_folded[name], grad, atol=1e-5, rtol=1e-5, msg=name)
    assert (folded - table).abs().max() > 0  # the two paths differ: the test compares two


def test_xl_fold_is_refused_in_a_head_split_in_one_line() -> None:
    from posenc.encoders.mix import Mix

    enc = Mix(d_model=C, n_heads=H, n_layers=1, heads=[{"name": "xl", "fold": True}, "none"])
    with pytest.raises(ValueError, match=r"^encoder.heads: .*fold=true.*encoder.layers$"):
        enc.for_attention(layer=0, kind=AttnKind.CAUSAL)
