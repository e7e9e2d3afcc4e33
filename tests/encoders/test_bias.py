"""ALiBi and the T5 bias against the papers' numbers and per-pair O(T*S) references
written directly from the formulas (loops, math.log and math.floor; no lookup tables,
no bucketize)."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from posenc.encoders.alibi import ALiBi, alibi_slopes
from posenc.encoders.base import AttnKind, PositionalEncoder
from posenc.encoders.t5 import T5Bias, t5_bucket
from posenc.model import DecoderLM
from tests.conftest import heads, identity_attention, merge, softmax_attend

C, H = 16, 4
Dh = C // H
KINDS = [AttnKind.CAUSAL, AttnKind.BIDIRECTIONAL]


def per_row_positions(t: int) -> torch.Tensor:
    """``(2, T)``: row 0 at offset 5, row 1 increasing with gaps (as random_positions)."""
    gaps = torch.randperm(40)[:t].sort().values
    return torch.stack([torch.arange(5, 5 + t), gaps])


POSITIONS = {
    "from_0": lambda t: torch.arange(t)[None],
    "offset": lambda t: torch.arange(23, 23 + t)[None],
    "per_row": per_row_positions,
}


def reference(x, qp, kind: AttnKind, bias) -> torch.Tensor:
    """Identity-projection attention with ``bias(h, i_pos, j_pos)`` added per pair.

    Args:
        x: ``(B, T, C)``; its heads are q, k and v.
        qp: ``(B|1, T)`` positions (also the keys').
        bias: Scalar bias of head h for query position i and key position j.
    """
    q = heads(x, H)  # (B, H, T, D)
    b, _, t, _ = q.shape
    scores = torch.empty(b, H, t, t)
    for r in range(b):
        pos = qp[min(r, qp.shape[0] - 1)].tolist()
        for h in range(H):
            for i in range(t):
                for j in range(t):
                    content = float(q[r, h, i] @ q[r, h, j]) / math.sqrt(Dh)
                    scores[r, h, i, j] = content + bias(h, pos[i], pos[j])
    return merge(softmax_attend(scores, q, kind is AttnKind.CAUSAL))


def attention(enc: PositionalEncoder, kind: AttnKind, x, *, blocked: bool, layer: int = 0):
    """Identity-projection attention; ``blocked``: three queries per block (not dividing T)."""
    attn = identity_attention(enc, kind, layer)
    b, t = x.shape[:2]
    if blocked:
        attn.max_score_bytes = 3 * b * H * t * x.element_size()
        assert attn.query_block(b, H, t, t, x.element_size()) == 3
    return attn


# --------------------------------------------------------------------------- ALiBi


# fmt: off
PAPER_SLOPES = {
    # Press et al. 2022, section 3: 8 heads -> 1/2^1 .. 1/2^8.
    8: [2**-1, 2**-2, 2**-3, 2**-4, 2**-5, 2**-6, 2**-7, 2**-8],
    # 16 heads: the 8 slopes interpolated by geometric means of neighbours.
    16: [2**-0.5, 2**-1, 2**-1.5, 2**-2, 2**-2.5, 2**-3, 2**-3.5, 2**-4,
         2**-4.5, 2**-5, 2**-5.5, 2**-6, 2**-6.5, 2**-7, 2**-7.5, 2**-8],
    # Not a power of two: the 8-head slopes, then slopes 0, 2, 4, 6 of the 16-head ones.
    12: [2**-1, 2**-2, 2**-3, 2**-4, 2**-5, 2**-6, 2**-7, 2**-8,
         2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5],
    # 6 heads: the 4-head slopes 2^-2, 2^-4, 2^-6, 2^-8, then slopes 0 and 2 of the 8-head.
    6: [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3],
    1: [2**-8],
}
# fmt: on


@pytest.mark.parametrize(("n_heads", "expected"), PAPER_SLOPES.items())
def test_alibi_slopes_are_the_papers(n_heads: int, expected: list[float]) -> None:
    got = alibi_slopes(n_heads)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(expected), rtol=0, atol=0)


def alibi_by_hand(h: int, i: int, j: int) -> float:
    return -(2.0 ** (-8 * (h + 1) / H)) * abs(i - j)  # H = 4: slopes 2^-2 .. 2^-8


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("where", sorted(POSITIONS))
def test_alibi_matches_the_formula(kind: AttnKind, blocked: bool, where: str) -> None:
    enc = ALiBi(d_model=C, n_heads=H, n_layers=1)
    x = torch.randn(2, 10, C)
    qp = POSITIONS[where](10)
    attn = attention(enc, kind, x, blocked=blocked)
    with torch.no_grad():
        out = attn(x, enc.context(qp, qp, kind))
    ref = reference(x, qp, kind, alibi_by_hand)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    unbiased = reference(x, qp, kind, lambda h, i, j: 0.0)
    assert not torch.allclose(out, unbiased, atol=1e-3)  # the bias did something


def test_alibi_bias_with_fewer_queries_than_keys() -> None:
    # A cache: three new queries against all keys so far, different per batch row.
    enc = ALiBi(d_model=C, n_heads=H, n_layers=1)
    hook = enc.for_attention(layer=0, kind=AttnKind.CAUSAL)
    qp, kp = torch.tensor([[6, 7, 8], [10, 12, 13]]), torch.tensor([[0, 2, 4, 6, 7, 8]] * 2)
    q, k = torch.randn(2, H, 3, Dh), torch.randn(2, H, 6, Dh)
    got = hook.score_bias(q, k, enc.context(qp, kp, AttnKind.CAUSAL))
    ref = torch.tensor(
        [
            [
                [[alibi_by_hand(h, i, j) for j in kp[b].tolist()] for i in qp[b].tolist()]
                for h in range(H)
            ]
            for b in range(2)
        ]
    )
    torch.testing.assert_close(got, ref)


def test_alibi_slopes_stay_float32_under_a_module_cast() -> None:
    enc = ALiBi(d_model=24, n_heads=12, n_layers=1).to(torch.bfloat16)
    assert enc.slopes.dtype == torch.float32
    torch.testing.assert_close(enc.slopes, alibi_slopes(12), rtol=0, atol=0)
    assert "slopes" not in enc.state_dict()  # nothing to save: the slopes are fixed
    hook = enc.for_attention(layer=0, kind=AttnKind.BIDIRECTIONAL)
    q = torch.randn(1, 12, 5, 2, dtype=torch.bfloat16)
    pos = torch.arange(300, 305)[None]
    bias = hook.score_bias(q, q, enc.context(pos, pos, AttnKind.BIDIRECTIONAL))
    assert bias.dtype == torch.bfloat16 and bias.shape == (1, 12, 5, 5)


# --------------------------------------------------------------------------- T5


def bucket_by_hand(n: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """Raffel et al. 2020, 2.1, for n = j - i (key minus query)."""
    if bidirectional:
        per_dir, base, d = num_buckets // 2, (num_buckets // 2 if n > 0 else 0), abs(n)
    else:
        per_dir, base, d = num_buckets, 0, max(-n, 0)
    exact = per_dir // 2
    if d < exact:
        return base + d
    log_part = math.log(d / exact) / math.log(max_distance / exact) * (per_dir - exact)
    return base + min(per_dir - 1, exact + math.floor(log_part))


# fmt: off
# n = j - i -> bucket for num_buckets=32, max_distance=128, derived by hand:
# bidirectional: 16 per sign, 8 exact, then 8 + floor(8 log(d/8) / log 16) = 8 + floor(2 log2(d/8)).
BIDIRECTIONAL_32_128 = {
    0: 0, -1: 1, -7: 7, -8: 8, -11: 8, -12: 9, -15: 9, -16: 10, -31: 11, -32: 12,
    -63: 13, -64: 14, -127: 15, -128: 15, -1000: 15,
    1: 17, 7: 23, 8: 24, 11: 24, 12: 25, 15: 25, 16: 26, 31: 27, 32: 28,
    63: 29, 64: 30, 127: 31, 128: 31, 1000: 31,
}
# causal: 32 buckets for the distance -n, 16 exact, then 16 + floor(16 log(d/16) / log 8);
# keys after the query (n > 0) share bucket 0.
CAUSAL_32_128 = {
    0: 0, -1: 1, -7: 7, -8: 8, -15: 15, -16: 16, -18: 16, -19: 17, -31: 21, -32: 21,
    -63: 26, -64: 26, -127: 31, -128: 31, -1000: 31, 1: 0, 8: 0, 1000: 0,
}
# fmt: on


@pytest.mark.parametrize(
    ("bidirectional", "table"), [(True, BIDIRECTIONAL_32_128), (False, CAUSAL_32_128)]
)
def test_t5_bucket_pinned_values(bidirectional: bool, table: dict[int, int]) -> None:
    rel = torch.tensor(list(table))
    got = t5_bucket(rel, bidirectional=bidirectional, num_buckets=32, max_distance=128)
    assert dict(zip(table, got.tolist(), strict=True)) == table
    assert table == {n: bucket_by_hand(n, bidirectional, 32, 128) for n in table}


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (8, 20), (64, 1000)])
def test_t5_bucket_matches_the_formula_everywhere(
    bidirectional: bool, num_buckets: int, max_distance: int
) -> None:
    rel = torch.arange(-3 * max_distance, 3 * max_distance + 1)
    got = t5_bucket(
        rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    ).tolist()
    ref = [bucket_by_hand(n, bidirectional, num_buckets, max_distance) for n in rel.tolist()]
    assert got == ref
    # Every bucket is reached, except R/2 when bidirectional: it would hold n > 0 at
    # distance 0, but n = 0 belongs to the n <= 0 half (as in T5).
    unused = {num_buckets // 2} if bidirectional else set()
    assert set(got) == set(range(num_buckets)) - unused


def t5_by_hand(table: torch.Tensor, enc: T5Bias, kind: AttnKind):
    bidirectional = kind is AttnKind.BIDIRECTIONAL

    def bias(h: int, i: int, j: int) -> float:
        bucket = bucket_by_hand(j - i, bidirectional, enc.num_buckets, enc.max_distance)
        return float(table.detach()[bucket, h])

    return bias


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("where", sorted(POSITIONS))
def test_t5_matches_the_formula(kind: AttnKind, per_layer: bool, blocked: bool, where: str) -> None:
    # 8 buckets up to distance 12: distances up to ~40 reach exact, log and clipped buckets.
    enc = T5Bias(
        d_model=C, n_heads=H, n_layers=2, num_buckets=8, max_distance=12, per_layer=per_layer
    )
    x = torch.randn(2, 10, C)
    qp = POSITIONS[where](10)
    attn = attention(enc, kind, x, blocked=blocked, layer=1)
    with torch.no_grad():  # make the table matter as much as the content
        for p in list(enc.parameters()) + list(attn.pos.parameters()):
            p.normal_()
    if per_layer:
        assert not list(enc.parameters())
        table = attn.pos.bias_table.weight
    else:
        assert not list(attn.pos.parameters())
        table = enc.bias_table.weight
    with torch.no_grad():
        out = attn(x, enc.context(qp, qp, kind))
        ref = reference(x, qp, kind, t5_by_hand(table, enc, kind))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_t5_bias_with_fewer_queries_than_keys() -> None:
    enc = T5Bias(d_model=C, n_heads=H, n_layers=1, num_buckets=8, max_distance=12)
    hook = enc.for_attention(layer=0, kind=AttnKind.BIDIRECTIONAL)
    qp, kp = torch.tensor([[6, 7, 8], [20, 30, 31]]), torch.tensor([[0, 2, 4, 6, 7, 8, 9]] * 2)
    q, k = torch.randn(2, H, 3, Dh), torch.randn(2, H, 7, Dh)
    with torch.no_grad():
        got = hook.score_bias(q, k, enc.context(qp, kp, AttnKind.BIDIRECTIONAL))
        bias = t5_by_hand(enc.bias_table.weight, enc, AttnKind.BIDIRECTIONAL)
    ref = torch.tensor(
        [
            [[[bias(h, i, j) for j in kp[b].tolist()] for i in qp[b].tolist()] for h in range(H)]
            for b in range(2)
        ]
    )
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("per_layer", [False, True])
def test_t5_table_shared_across_layers_unless_per_layer(per_layer: bool) -> None:
    enc = T5Bias(d_model=C, n_heads=H, n_layers=3, per_layer=per_layer)
    hooks = [enc.for_attention(layer=i, kind=AttnKind.CAUSAL) for i in range(3)]
    ctx = enc.context(torch.arange(5)[None], torch.arange(5)[None], AttnKind.CAUSAL)
    tables = [hook.table(ctx) for hook in hooks]
    if per_layer:
        assert len({id(t) for t in tables}) == 3 and enc.bias_table is None
        assert all(t is hook.bias_table.weight for t, hook in zip(tables, hooks, strict=True))
    else:  # T5: one table, the very same Parameter in every layer, owned by the stack
        assert all(t is enc.bias_table.weight for t in tables)
        assert not any(list(hook.parameters()) for hook in hooks)
    assert all(t.shape == (32, H) for t in tables)

    model = DecoderLM(
        vocab_size=40,
        encoder=functools.partial(T5Bias, per_layer=per_layer),
        d_model=C,
        n_heads=H,
        n_layers=3,
    )
    found = [n for n, _ in model.named_parameters() if "bias_table" in n]
    assert len(found) == (3 if per_layer else 1), found
    model(torch.randint(0, 40, (2, 6))).sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "bias_table" in n)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_buckets=7), r"num_buckets=7 must be even and >= 4 .*use e\.g\. num_buckets=32"),
        (dict(num_buckets=2, max_distance=8), "num_buckets=2 must be even and >= 4"),
        (dict(max_distance=8), r"max_distance=8 must exceed 8: in bidirectional .*raise"),
        (dict(max_distance=16), r"max_distance=16 must exceed 16: in causal .*raise"),
        (dict(num_buckets=4, max_distance=3), None),  # smallest valid: 1 exact + 1 log bucket
    ],
)
def test_t5_bad_settings(kwargs: dict, message: str | None) -> None:
    args = dict(d_model=C, n_heads=H, n_layers=1) | kwargs
    if message is None:
        T5Bias(**args)
        return
    with pytest.raises(ValueError, match=message):
        T5Bias(**args)


def test_t5_bucket_bad_settings() -> None:
    rel = torch.arange(-3, 4)
    with pytest.raises(ValueError, match="num_buckets=5 must be even and >= 4 for bidirectional"):
        t5_bucket(rel, bidirectional=True, num_buckets=5, max_distance=10)
    with pytest.raises(ValueError, match="num_buckets=1 must be >= 2 for causal"):
        t5_bucket(rel, bidirectional=False, num_buckets=1, max_distance=10)
    # causal attention may use an odd number of buckets: 1 exact, 2 log
    got = t5_bucket(rel, bidirectional=False, num_buckets=3, max_distance=4)
    assert got.tolist() == [2, 2, 1, 0, 0, 0, 0]


def test_alibi_bad_heads() -> None:
    with pytest.raises(ValueError, match="n_heads must be >= 1, got 0"):
        alibi_slopes(0)
