"""The attention module: fused and explicit paths agree, masks are right."""

from __future__ import annotations

import pytest
import torch

from posenc.encoders import build
from posenc.encoders.base import AttentionPositional, AttnKind
from posenc.model.attention import Attention, key_prefixes
from posenc.model.backends import attention_mask
from tests.conftest import heads, merge, softmax_attend


class _ForceProbs(AttentionPositional):
    """Wraps a scheme's hooks but demands the explicit-softmax path."""

    needs_probs = True
    score_term = True

    def __init__(self, inner: AttentionPositional) -> None:
        super().__init__()
        self.inner = inner

    def scale(self, head_dim: int) -> float:
        return self.inner.scale(head_dim)

    def score_bias(self, q, k, ctx):
        return self.inner.score_bias(q, k, ctx)

    def transform_qk(self, q, k, ctx):
        return self.inner.transform_qk(q, k, ctx)


@pytest.mark.parametrize("name", ["none", "rope", "xl", "deberta"])
@pytest.mark.parametrize("kind", [AttnKind.CAUSAL, AttnKind.BIDIRECTIONAL])
def test_fused_and_explicit_paths_agree(name: str, kind: AttnKind) -> None:
    enc = build(name, d_model=16, n_heads=2, n_layers=1)
    fused = Attention(
        d_model=16, n_heads=2, dropout=0.0, pos=enc.for_attention(layer=0, kind=kind)
    ).eval()
    explicit = Attention(d_model=16, n_heads=2, dropout=0.0, pos=_ForceProbs(fused.pos)).eval()
    explicit.load_state_dict(fused.state_dict(), strict=False)
    x = torch.randn(2, 7, 16)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, 5:] = False
    pos = torch.arange(7)[None]
    ctx = enc.context(pos, pos, kind)
    with torch.no_grad():
        torch.testing.assert_close(
            fused(x, ctx, key_valid=valid), explicit(x, ctx, key_valid=valid), atol=1e-5, rtol=1e-5
        )


def test_causal_mask_with_a_key_cache() -> None:
    # 2 new queries over 5 keys: query i sees keys j <= i + 3.
    mask = attention_mask(
        bias=None,
        causal=True,
        key_valid=None,
        t=2,
        s=5,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    assert torch.isinf(mask).tolist() == [[False] * 4 + [True], [False] * 5]


def test_nothing_leaks_past_the_causal_mask() -> None:
    attn = Attention(d_model=8, n_heads=2, dropout=0.0, pos=AttentionPositional()).eval()
    for p in attn.parameters():
        torch.nn.init.normal_(p)
    with torch.no_grad():
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj):
            proj.weight.copy_(torch.eye(8))
            proj.bias.zero_()
    x = torch.randn(1, 6, 8)
    pos = torch.arange(6)[None]
    ctx = build("none", d_model=8, n_heads=2, n_layers=1).context(pos, pos, AttnKind.CAUSAL)
    with torch.no_grad():
        out = attn(x, ctx)
    q = heads(x, 2)
    ref = softmax_attend(q @ q.transpose(-1, -2) / 2.0, q, causal=True)  # D=4: scale 1/2
    torch.testing.assert_close(out, merge(ref))
    # and the first position attends to itself only
    torch.testing.assert_close(out[:, 0], x[:, 0])


@pytest.mark.parametrize("name", ["shaw", "xl", "deberta", "rope", "none"])
@pytest.mark.parametrize("kind", [AttnKind.CAUSAL, AttnKind.BIDIRECTIONAL])
def test_query_blocks_give_the_same_result(name: str, kind: AttnKind) -> None:
    """A long input is processed a block of queries at a time: same numbers, forward
    and backward, with padding and offset positions."""
    enc = build(name, d_model=16, n_heads=2, n_layers=1)
    whole = Attention(
        d_model=16, n_heads=2, dropout=0.0, pos=enc.for_attention(layer=0, kind=kind)
    ).eval()
    x = torch.randn(2, 11, 16, requires_grad=True)
    valid = torch.ones(2, 11, dtype=torch.bool)
    valid[1, 8:] = False
    pos = torch.arange(5, 16)[None]
    ctx = enc.context(pos, pos, kind)
    ref = whole(x, ctx, key_valid=valid)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), x)
    whole.max_score_bytes = 2 * 2 * 11 * 4 * 3  # three queries per block: 4 blocks
    if whole.pos.adds_scores:
        assert whole.query_block(2, 2, 11, 11, 4) == 3
    out = whole(x, enc.context(pos, pos, kind), key_valid=valid)
    (g_out,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_out, g_ref, atol=1e-5, rtol=1e-5)


def test_key_prefixes_equal_slices_in_values_and_gradients() -> None:
    """key_prefixes' views are x[:, :, :stop]; its backward, which adds every block's
    gradient into one buffer, gives what slicing's zero-padded sum gives, also when
    some prefixes get no gradient."""
    stops = [3, 6, 9, 9]
    x = torch.randn(2, 3, 9, 4, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(2, 3, s, 4, dtype=torch.float64) for s in stops]
    for used in ([0, 1, 2, 3], [0, 2], [1]):
        got = key_prefixes(x, stops)
        for p, s in zip(got, stops, strict=True):
            assert torch.equal(p, x[:, :, :s])
        (g_got,) = torch.autograd.grad(sum((got[i] * weights[i]).sum() for i in used), x)
        (g_ref,) = torch.autograd.grad(
            sum((x[:, :, : stops[i]] * weights[i]).sum() for i in used), x
        )
        torch.testing.assert_close(g_got, g_ref)
    assert torch.autograd.gradcheck(lambda t: key_prefixes(t, [2, 5, 9]), (x,))
    plain = x.detach()
    assert [p.shape[-2] for p in key_prefixes(plain, stops)] == stops


@pytest.mark.parametrize("name", ["shaw", "xl", "deberta", "t5", "alibi", "fire"])
def test_query_blocks_give_the_same_parameter_gradients(name: str) -> None:
    """Blocks of causal queries share per-layer work (a table projected once per
    forward, keys and values cut by key_prefixes): every parameter's gradient, the
    attention's and the scheme's, equals that of one block."""
    enc = build(name, d_model=16, n_heads=2, n_layers=1)
    att = Attention(
        d_model=16, n_heads=2, dropout=0.0, pos=enc.for_attention(layer=0, kind=AttnKind.CAUSAL)
    ).eval()
    params = [p for p in [*att.parameters(), *enc.parameters()] if p.requires_grad]
    x = torch.randn(2, 13, 16)
    pos = torch.arange(2, 15)[None]

    def grads() -> list[torch.Tensor]:
        out = att(x, enc.context(pos, pos, AttnKind.CAUSAL))
        return torch.autograd.grad(out.square().sum(), params, allow_unused=True)

    ref = grads()
    att.causal_block = 4  # blocks of 4, 4, 4, 1 queries
    calls = []
    linears = [m for m in att.pos.modules() if isinstance(m, torch.nn.Linear)]
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in linears]
    got = grads()
    for h in hooks:
        h.remove()
    assert len(calls) == len(linears)  # xl's W_k,R, deberta's two: once, not once per block
    for p, g, r in zip(params, got, ref, strict=True):
        if r is None:
            assert g is None
        else:
            torch.testing.assert_close(
                g, r, atol=1e-5, rtol=1e-5, msg=lambda m, p=p: f"{tuple(p.shape)}: {m}"
            )


def test_context_memo_is_shared_by_slices_not_by_forwards() -> None:
    enc = build("xl", d_model=16, n_heads=2, n_layers=1)
    pos = torch.arange(6)[None]
    ctx = enc.context(pos, pos, AttnKind.CAUSAL)
    made = []
    value = ctx.once(enc, "t", lambda: made.append(1) or len(made))
    assert ctx.slice_queries(2, 4).slice_keys(4).once(enc, "t", lambda: 99) == value == 1
    assert enc.context(pos, pos, AttnKind.CAUSAL).once(enc, "t", lambda: 7) == 7
    assert made == [1]


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_qkv_bias_sets_the_projections_biases(tmp_path, qkv_bias: bool) -> None:
    """``model.qkv_bias`` (default true) from the composed config to every attention of
    both model shapes: false leaves q, k and v without biases (as the FoX and PaTH
    authors' layers), the output projection keeps its own."""
    from omegaconf import OmegaConf

    from posenc.config import validate
    from posenc.model import DecoderLM, EncoderDecoder
    from tests.conftest import compose_run

    overrides = [] if qkv_bias else ["model.qkv_bias=false"]
    cfg = compose_run(tmp_path, *overrides)
    validate(cfg)
    sizes = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "compile"}
    assert sizes["qkv_bias"] is qkv_bias
    lm = DecoderLM(vocab_size=11, encoder="fox", **sizes)
    mt = EncoderDecoder(src_vocab_size=11, tgt_vocab_size=11, encoder="rope", **sizes)
    for model in (lm, mt):
        attns = [m for m in model.modules() if isinstance(m, Attention)]
        assert attns
        for attn in attns:
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                assert (proj.bias is not None) is qkv_bias
            assert attn.out_proj.bias is not None
    assert sum(p.numel() for p in lm.parameters()) == sum(
        p.numel()
        for p in DecoderLM(vocab_size=11, encoder="fox", **{**sizes, "qkv_bias": True}).parameters()
    ) - (0 if qkv_bias else 3 * sizes["d_model"] * sizes["n_layers"])


def test_qkv_bias_must_be_a_bool(tmp_path) -> None:
    from posenc.config import ConfigError
    from posenc.train import train
    from tests.conftest import compose_run

    with pytest.raises(ConfigError) as err:
        train(compose_run(tmp_path, "model.qkv_bias=maybe"))
    assert str(err.value).splitlines()[1:] == ["  model.qkv_bias='maybe': must be true or false"]
