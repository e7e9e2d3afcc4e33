"""The strided (Toeplitz) fast path of the relative schemes against their gather path.

With consecutive positions, Shaw, Transformer-XL, DeBERTa, T5 and FIRE compute their
terms per key-minus-query offset and read the pairs off that table as a strided view
(``offset_view``, ``toeplitz``); with any other positions they gather. Both must give the same
scores, value terms and gradients wherever attention is allowed.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from posenc.encoders import base as base_mod
from posenc.encoders import get
from posenc.encoders import offsets as offsets_mod
from posenc.encoders.base import AttentionContext, AttnKind, ScoreParts
from posenc.encoders.deberta import by_rows, flat_ends
from posenc.encoders.offsets import offset_view
from posenc.encoders.shaw import offsets_to_slots, slots_to_offsets
from posenc.model.attention import Attention

H, D = 2, 8


@pytest.mark.parametrize(
    ("rows", "width", "cols", "row0", "col0", "lo"),
    [(4, 7, 4, 0, 0, -3), (3, 8, 6, 5, 3, -4), (5, 6, 5, 2, 0, -6), (1, 3, 3, 0, 0, 0)],
)
def test_offset_view_is_the_offset_lookup(
    rows: int, width: int, cols: int, row0: int, col0: int, lo: int
) -> None:
    """out[r, c] = table[r, (col0 + c) - (row0 + r) - lo] for every in-table pair, and the
    view is a view (it shares the table's storage)."""
    table = torch.randn(2, rows, width)
    out = offset_view(table, row0=row0, col0=col0, lo=lo, cols=cols)
    assert out is not None and out.shape == (2, rows, cols)
    assert out.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
    checked = 0
    for r, c in itertools.product(range(rows), range(cols)):
        m = (col0 + c) - (row0 + r) - lo
        if 0 <= m < width:
            torch.testing.assert_close(out[:, r, c], table[:, r, m])
            checked += 1
    assert checked >= rows  # the cases are not vacuous


def test_offset_view_refuses_overlap_and_out_of_bounds() -> None:
    table = torch.randn(3, 5)
    # width <= cols: row r's last column and row r+1's first would share an entry
    assert offset_view(table, row0=0, col0=0, lo=-2, cols=5) is None
    # (0, 0) before the table's start
    assert offset_view(table, row0=0, col0=0, lo=1, cols=2) is None
    # last pair past the table's end
    assert offset_view(table, row0=0, col0=4, lo=0, cols=3) is not None  # just fits
    assert offset_view(table, row0=0, col0=5, lo=0, cols=3) is None


def test_shaw_slot_maps_are_the_clip_lookup_and_adjoint() -> None:
    k = 3
    for n_lo, n_hi in [(-9, 1), (-2, 2), (-9, -5), (4, 8), (-4, 6), (0, 0)]:
        per_slot = torch.randn(2, 5, 2 * k + 1)
        n = torch.arange(n_lo, n_hi + 1)
        ref = per_slot[..., n.clamp(-k, k) + k]
        got = slots_to_offsets(per_slot, n_lo, n_hi, k)
        torch.testing.assert_close(got, ref)
        # adjoint: <S a, b> = <a, S^T b>, and S^T sums what shares a row
        b = torch.randn_like(ref)
        back = offsets_to_slots(b, n_lo, k)
        torch.testing.assert_close((got * b).sum(), (per_slot * back).sum())
        ref_back = torch.zeros_like(per_slot).index_add_(-1, n.clamp(-k, k) + k, b)
        torch.testing.assert_close(back, ref_back)


def test_deberta_takes_the_view_for_long_keys_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeBERTa gathers while keys are few per table row (cheaper there) and takes the
    view beyond; both give the same bias."""
    enc = _build("deberta")  # P = 8 table rows
    hooks = enc.for_attention(layer=0, kind=AttnKind.BIDIRECTIONAL)
    used: list[str] = []
    for path in ("_by_view", "_by_gather"):
        inner = getattr(hooks, path)
        monkeypatch.setattr(hooks, path, lambda *a, _f=inner, _p=path: used.append(_p) or _f(*a))
    for s in (32, 33):
        pos = torch.arange(s)[None]
        q, k = torch.randn(1, H, s, D), torch.randn(1, H, s, D)
        hooks.score_bias(q, k, enc.context(pos, pos, AttnKind.BIDIRECTIONAL, starts=(0, 0)))
    assert used == ["_by_gather", "_by_view"]  # 32 = 4 x 8 keys: gather; 33: view


def test_deberta_row_runs() -> None:
    """flat_ends, found from Python ints alone, only claims runs the lookup really has,
    and by_rows over any range of such a lookup equals the plain per-entry product."""
    enc = get("deberta")(d_model=H * D, n_heads=H, n_layers=1, max_distance=10, bucket_size=6)
    for lo, hi, causal in itertools.product((-60, -12, -3, 0, 4), (5, 9, 25, 60), (False, True)):
        dist = torch.arange(lo, hi + 1)
        for rows in (
            enc.row(dist.clamp(min=0) if causal else dist),
            enc.row(-(dist.clamp(min=0) if causal else dist)),
        ):
            a, b = flat_ends(lo, hi, enc.saturation, causal)
            assert 0 <= a <= b <= hi - lo
            assert (rows[: a + 1] == rows[a]).all() and (rows[b:] == rows[b]).all()
    rows = torch.tensor([0, 0, 0, 1, 2, 2, 3, 5, 5, 5])
    proj = torch.randn(H, 6, D)
    x = torch.randn(2, H, 3, D)
    for first, last, reverse in itertools.product(range(10), range(10), (False, True)):
        if last < first:
            continue
        idx = rows[first : last + 1]
        ref = x @ proj[:, idx.flip(0) if reverse else idx].transpose(-1, -2)
        for flat in ((2, 7), (1, 8), (0, 9)):  # exact runs, and shorter ones
            got = by_rows(x, proj, rows, first, last, flat, reverse=reverse)
            torch.testing.assert_close(got, ref)


ENCODERS = {
    "shaw": {"max_distance": 3},
    "xl": {},
    "deberta": {"max_distance": 8, "bucket_size": 4},  # rows saturate within the test
    "deberta_c2p": {"max_distance": 6, "bucket_size": 0, "p2c": False},
    "deberta_paper": {"max_distance": 8, "bucket_size": 4, "p2c_row": "paper"},
    "t5": {"num_buckets": 8, "max_distance": 6},
    "fire": {},  # positions stay below its threshold L: the per-distance path
}
#: Schemes with a per-head table per offset (offsets.toeplitz): they take the view for
#: every block of consecutive positions, causal keys past the last query included.
PER_HEAD_TABLE = {"t5", "fire"}  # and sandwich (parameter-free: tests/encoders/test_sandwich.py)


def _build(name: str) -> torch.nn.Module:
    return get(name.split("_")[0])(d_model=H * D, n_heads=H, n_layers=1, **ENCODERS[name])


# (T, S, q0, k0): self-attention, offset positions, a cache (T < S), a block of queries
# against the keys up to it (what causal attention's query blocks pass); the last two
# are long enough for Shaw's and DeBERTa's constant ends to cover whole key columns
# (the parts of base.offset_window on both sides).
SHAPES = [(7, 7, 0, 0), (6, 6, 5, 5), (3, 9, 11, 5), (4, 9, 5, 0), (5, 24, 19, 0), (4, 20, 2, 0)]


@pytest.mark.parametrize("name", list(ENCODERS))
@pytest.mark.parametrize("kind", [AttnKind.CAUSAL, AttnKind.BIDIRECTIONAL])
@pytest.mark.parametrize("shape", SHAPES)
def test_view_path_equals_gather_path(
    name: str, kind: AttnKind, shape: tuple[int, int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    t, s, q0, k0 = shape
    enc = _build(name)
    hooks = enc.for_attention(layer=0, kind=kind)
    if hasattr(hooks, "view_keys_per_row"):
        hooks.view_keys_per_row = 0.0  # DeBERTa: the view even for these few keys
        hooks.view_min_queries = 0
    q = torch.randn(2, H, t, D, requires_grad=True)
    k = torch.randn(2, H, s, D, requires_grad=True)
    fast = enc.context(
        torch.arange(q0, q0 + t)[None], torch.arange(k0, k0 + s)[None], kind, starts=(q0, k0)
    )
    assert fast.starts == (q0, k0)
    # its own memo: a context serves one forward pass, and each path runs its own
    slow = dataclasses.replace(fast, starts=None, bound=max(q0 + t, k0 + s), memo={})
    # allowed pairs; causal attention masks keys after the query
    allowed = torch.ones(t, s, dtype=torch.bool)
    if kind is AttnKind.CAUSAL:
        allowed = fast.rel()[0] >= 0
    weights = torch.randn(2, H, t, s) * allowed
    probs = torch.rand(2, H, t, s, requires_grad=True)
    params = [p for p in hooks.parameters()] + [p for p in enc.parameters()]

    def run(ctx: AttentionContext) -> tuple[torch.Tensor, ...]:
        bias = hooks.score_bias(q, k, ctx)
        value = hooks.value_term(probs * allowed, ctx)
        loss = (bias * weights).sum() + (0.0 if value is None else value.square().sum())
        grads = torch.autograd.grad(loss, [q, k, probs, *params], allow_unused=True)
        return bias.detach() * allowed, value, *grads

    def no_pairs(*args: object, **kwargs: object) -> None:
        raise AssertionError("the fast path built per-pair distances to gather with")

    # The view path must not fall back to gathering, except for causal keys past the
    # last query (attention trims those from a causal block before the hooks run; a
    # per-head table widens its offsets to take the view there too, since FIRE's rows
    # below its threshold are such a block and a gather's backward is slow on a GPU).
    trimmed = kind is AttnKind.BIDIRECTIONAL or k0 + s <= q0 + t or name in PER_HEAD_TABLE
    with monkeypatch.context() as m:
        if trimmed:
            m.setattr(AttentionContext, "rel", no_pairs)
            m.setattr(offsets_mod, "gather_rel", no_pairs)
        got = run(fast)
    ref = run(slow)
    for a, b in zip(got, ref, strict=True):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", [AttnKind.CAUSAL, AttnKind.BIDIRECTIONAL])
@pytest.mark.parametrize("shape", SHAPES)
def test_deberta_p2c_chunk_sizes_agree(kind: AttnKind, shape: tuple[int, int, int, int]) -> None:
    """The view path's position-to-content window in key chunks of T, 2T (the default)
    or 3T: the same score and the same gradients, and more chunks for smaller sizes."""
    t, s, q0, k0 = shape
    enc = _build("deberta")
    hooks = enc.for_attention(layer=0, kind=kind)
    hooks.view_keys_per_row = 0.0
    hooks.view_min_queries = 0
    q = torch.randn(2, H, t, D, requires_grad=True)
    k = torch.randn(2, H, s, D, requires_grad=True)
    weights = torch.randn(2, H, t, s)
    params = [q, k, *enc.parameters(), *hooks.parameters()]

    def run(chunk: int) -> tuple[int, list[torch.Tensor]]:
        hooks.p2c_chunk = chunk
        q_pos, k_pos = torch.arange(q0, q0 + t)[None], torch.arange(k0, k0 + s)[None]
        ctx = enc.context(q_pos, k_pos, kind, starts=(q0, k0))
        parts = hooks.score_parts(q, k, ctx)
        assert parts is not None
        dense = base_mod.dense_parts(parts, s)
        grads = torch.autograd.grad((dense * weights).sum(), params)
        return len(parts), [dense.detach(), *grads]

    n_ref, ref = run(1)
    for chunk in (2, 3):
        n, got = run(chunk)
        assert n <= n_ref
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_deberta_causal_queries_after_their_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Causal, with every key before the queries (lo > 0: no masked distance), and the
    nearest distances sharing a log bucket: the view path's lookup starts with a flat
    run of real values, which it must expand, not pad with zeros as it may when that
    run is masked distances."""
    enc = get("deberta")(d_model=H * D, n_heads=H, n_layers=1, max_distance=128, bucket_size=32)
    hooks = enc.for_attention(layer=0, kind=AttnKind.CAUSAL)
    hooks.view_keys_per_row = 0.0
    hooks.view_min_queries = 0
    t, s, q0, k0 = 4, 12, 60, 30  # distances 19 .. 33
    q_pos, k_pos = torch.arange(q0, q0 + t)[None], torch.arange(k0, k0 + s)[None]
    fast = enc.context(q_pos, k_pos, AttnKind.CAUSAL, starts=(q0, k0))
    assert fast.extra["lo"] == 19
    assert fast.extra["rows"][0] == fast.extra["rows"][1]  # 19 and 20: one bucket
    assert fast.extra["p2c_rows"][0] == fast.extra["p2c_rows"][1]
    slow = dataclasses.replace(fast, starts=None, bound=max(q0 + t, k0 + s), memo={})
    q = torch.randn(2, H, t, D, requires_grad=True)
    k = torch.randn(2, H, s, D, requires_grad=True)
    weights = torch.randn(2, H, t, s)
    params = [q, k, *enc.parameters(), *hooks.parameters()]

    def run(ctx: AttentionContext) -> list[torch.Tensor]:
        bias = hooks.score_bias(q, k, ctx)
        return [bias.detach(), *torch.autograd.grad((bias * weights).sum(), params)]

    with monkeypatch.context() as m:
        m.setattr(AttentionContext, "rel", None)  # the view path, or this test fails
        got = run(fast)
    for a, b in zip(got, run(slow), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["shaw", "xl", "deberta", "alibi", "t5"])
def test_causal_blocks_skip_masked_keys(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Causal attention in query blocks leaves out the keys masked for a whole block:
    every block's hooks see keys only up to its last query, and the output and input
    gradients equal one block over all keys."""
    enc = get(name)(d_model=H * D, n_heads=H, n_layers=1)
    attn = Attention(
        d_model=H * D, n_heads=H, dropout=0.0, pos=enc.for_attention(layer=0, kind=AttnKind.CAUSAL)
    ).eval()
    x = torch.randn(2, 12, H * D, requires_grad=True)
    pos = torch.arange(12)[None]
    ref = attn(x, enc.context(pos, pos, AttnKind.CAUSAL, starts=(0, 0)))
    (g_ref,) = torch.autograd.grad(ref.square().sum(), x)
    seen: list[tuple[int, int]] = []
    inner = attn.pos.score_parts

    def spy(q: torch.Tensor, k: torch.Tensor, ctx: AttentionContext) -> ScoreParts | None:
        seen.append((int(ctx.q_pos[0, -1]), k.shape[-2]))
        return inner(q, k, ctx)

    monkeypatch.setattr(attn.pos, "score_parts", spy)
    attn.causal_block = 5
    out = attn(x, enc.context(pos, pos, AttnKind.CAUSAL, starts=(0, 0)))
    (g_out,) = torch.autograd.grad(out.square().sum(), x)
    assert seen == [(4, 5), (9, 10), (11, 12)]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_out, g_ref, atol=1e-5, rtol=1e-5)


def test_slicing_keys_slices_per_key_tables() -> None:
    """A context cut to its first keys equals the context built for those keys (RoPE;
    xPos centres its tables on the keys, so only its scores, not its tables, agree)."""
    enc = get("rope")(d_model=H * D, n_heads=H, n_layers=1)
    q_pos, k_pos = torch.arange(3, 9)[None], torch.arange(9)[None]
    cut = enc.context(q_pos, k_pos, AttnKind.CAUSAL, starts=(3, 0)).slice_keys(5)
    ref = enc.context(q_pos, k_pos[:, :5], AttnKind.CAUSAL, starts=(3, 0))
    assert cut.starts == ref.starts == (3, 0)
    for key in ("k_cos", "k_sin", "q_cos", "q_sin"):
        torch.testing.assert_close(cut.extra[key], ref.extra[key])
