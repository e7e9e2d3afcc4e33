"""posenc's defaults against Hugging Face transformers' ports of the authors' code (#24).

Needs the optional ``interop`` extra (``pip install -e ".[interop]"``); skipped without
transformers, which CI does not install. Written against transformers 4.57 and 5.x.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from posenc.encoders.base import AttnKind
from posenc.encoders.deberta import DebertaRelative
from posenc.encoders.rope import RoPE, scaled_frequencies
from tests.conftest import identity_attention

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.deberta_v2 import modeling_deberta_v2  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

MAJOR = int(transformers.__version__.split(".")[0])


def llama_yarn_config(*, head_dim: int, base: float, factor: float, original: int, fraction: float):
    """A LlamaConfig with YaRN scaling over ``fraction`` of each head's dims."""
    rope = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    return llama_config(head_dim, base, rope, int(factor * original), fraction=fraction)


@pytest.mark.parametrize(
    ("head_dim", "fraction", "original", "base"),
    [(8, 1.0, 64, 1e4), (32, 1.0, 128, 1e4), (64, 0.5, 256, 5e5), (16, 0.5, 16, 1e4)],
)
def test_yarn_defaults_match_transformers(
    head_dim: int, fraction: float, original: int, base: float
) -> None:
    """The code ramp's frequencies and the rotated dims' temperature: q and k after the
    rotation equal Llama's rotate_half YaRN on the rotated dims, pass-through elsewhere
    (GPT-NeoX's partial rotation; Llama's own attention rotates all dims)."""
    factor = 4.0
    config = llama_yarn_config(
        head_dim=head_dim, base=base, factor=factor, original=original, fraction=fraction
    )
    rot = int(head_dim * fraction)
    hf = modeling_llama.LlamaRotaryEmbedding(config)
    enc = RoPE(
        d_model=2 * head_dim,
        n_heads=2,
        n_layers=1,
        base=base,
        layout="half",
        fraction=fraction,
        scaling="yarn",
        scaling_factor=factor,
        original_length=original,
    )
    freq, mscale = enc.frequencies(4 * original)
    torch.testing.assert_close(freq, hf.inv_freq.float(), rtol=1e-6, atol=0)
    paper = scaled_frequencies(rot, base, replace(enc.scaling, yarn_ramp="paper"))[0]
    assert (paper - hf.inv_freq).abs().max() > 1e-3  # the paper's ramp is another function
    assert mscale == pytest.approx(hf.attention_scaling)
    pos = torch.arange(4 * original)[None]
    q, k = torch.randn(1, 2, pos.shape[1], head_dim), torch.randn(1, 2, pos.shape[1], head_dim)
    cos, sin = hf(q, pos)
    hq, hk = modeling_llama.apply_rotary_pos_emb(q[..., :rot], k[..., :rot], cos, sin)
    hq, hk = torch.cat((hq, q[..., rot:]), -1), torch.cat((hk, k[..., rot:]), -1)
    ctx = enc.context(pos, pos, AttnKind.CAUSAL)
    pq, pk = enc.for_attention(layer=0, kind=AttnKind.CAUSAL).transform_qk(q, k, ctx)
    # float32 angles up to position 1023 (their ulp is 6e-5; Llama multiplies in float32)
    torch.testing.assert_close(pq, hq, atol=5e-4, rtol=0)
    torch.testing.assert_close(pk, hk, atol=5e-4, rtol=0)


@pytest.mark.parametrize(
    ("bucket_size", "max_distance", "t"),
    # t <= max_distance: no far keys; then far keys on both sides (t - 1 >= max_distance),
    # an odd bucket size whose far negative rows start at 32, not at max_distance
    [(0, 6, 12), (8, 16, 12), (32, 128, 12), (8, 16, 40), (9, 20, 48), (32, 24, 40)],
)
@pytest.mark.parametrize("kind", [AttnKind.BIDIRECTIONAL, AttnKind.CAUSAL])
def test_deberta_defaults_match_transformers(
    bucket_size: int, max_distance: int, t: int, kind: AttnKind
) -> None:
    """DeBERTa-v2's DisentangledSelfAttention (c2p + p2c, no shared keys) against posenc's
    attention with the same table and projections, in bidirectional attention and under
    a causal mask, with keys past max_distance on both sides where t allows (the
    reference's far negative distances read table row 0)."""
    c, h = 16, 2
    config = modeling_deberta_v2.DebertaV2Config(
        hidden_size=c,
        num_attention_heads=h,
        relative_attention=True,
        pos_att_type=["c2p", "p2c"],
        position_buckets=bucket_size or -1,
        max_relative_positions=max_distance,
        share_att_key=False,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    hf = modeling_deberta_v2.DisentangledSelfAttention(config).eval()
    enc = DebertaRelative(
        d_model=c, n_heads=h, n_layers=1, max_distance=max_distance, bucket_size=bucket_size
    )
    attn = identity_attention(enc, kind)
    with torch.no_grad():
        enc.table.normal_()
        for proj in (hf.query_proj, hf.key_proj, hf.value_proj):
            proj.weight.copy_(torch.eye(c))
            proj.bias.zero_()
        hf.pos_key_proj.weight.copy_(attn.pos.w_kr.weight)
        hf.pos_query_proj.weight.copy_(attn.pos.w_qr.weight)
        hf.pos_key_proj.bias.zero_()
        hf.pos_query_proj.bias.zero_()
    x = torch.randn(2, t, c)
    pos = torch.arange(t)[None]
    mask = torch.ones(2, 1, t, t, dtype=torch.bool)
    if kind is AttnKind.CAUSAL:
        mask = mask.tril()
    far = t - 1 >= max_distance and bucket_size > 0
    with torch.no_grad():
        want = hf(x, mask, rel_embeddings=enc.table)[0]
        got = attn(x, enc.context(pos, pos, kind))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # The paper's p2c row is another function here; posenc's far-key variant is
        # too, wherever a far key sits on the negative side of a row the model reads:
        # c2p's future keys (bidirectional) or p2c's past ones (paper's row).
        variants = [
            ("paper", "code", True),
            ("code", "last_bucket", far and kind is AttnKind.BIDIRECTIONAL),
        ]
        for p2c_row, far_keys, differs in variants:
            other_enc = DebertaRelative(
                d_model=c,
                n_heads=h,
                n_layers=1,
                max_distance=max_distance,
                bucket_size=bucket_size,
                p2c_row=p2c_row,
                far_keys=far_keys,
            )
            other_enc.load_state_dict(enc.state_dict())
            other = attn(x, other_enc.context(pos, pos, kind))
            gap = (other - want).abs().max()
            assert gap > 1e-3 if differs else gap < 1e-5, (p2c_row, far_keys, float(gap))


def llama_config(
    head_dim: int, base: float, rope: dict, max_positions: int, *, fraction: float = 1.0
):
    """A LlamaConfig with the scaling ``rope`` (Hugging Face's names) over ``fraction`` of each
    head's dims, in the installed version's spelling (``rope_parameters`` from 5.0,
    ``rope_scaling`` and top-level keys before)."""
    sizes = dict(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
    )
    if MAJOR >= 5:
        rope = {**rope, "rope_theta": base, "partial_rotary_factor": fraction}
        return modeling_llama.LlamaConfig(**sizes, rope_parameters=rope)
    return modeling_llama.LlamaConfig(
        **sizes, rope_theta=base, rope_scaling=rope, partial_rotary_factor=fraction
    )


@pytest.mark.parametrize(("head_dim", "original", "base"), [(16, 64, 1e4), (64, 256, 5e5)])
def test_llama3_matches_transformers(head_dim: int, original: int, base: float) -> None:
    """Llama 3.1's frequency scaling (factor 8, 1 and 4) against ROPE_INIT_FUNCTIONS."""
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    }
    want, scale = ROPE_INIT_FUNCTIONS["llama3"](llama_config(head_dim, base, rope, 8 * original))
    enc = RoPE(
        d_model=2 * head_dim,
        n_heads=2,
        n_layers=1,
        base=base,
        layout="half",
        scaling="llama3",
        scaling_factor=8.0,
        original_length=original,
    )
    freq, mscale = enc.frequencies(8 * original)
    torch.testing.assert_close(freq, want.float(), rtol=1e-6, atol=0)
    assert mscale == scale == 1.0


@pytest.mark.parametrize("length", [100, 300])
def test_longrope_matches_transformers(length: int) -> None:
    """Phi-3-style LongRoPE: the short factors up to the original length, the long ones
    past it (transformers picks them by seq_len), and the default attention factor."""
    head_dim, original = 16, 128
    short = [1.0, 1.1, 1.2, 1.4, 1.7, 2.0, 2.4, 3.0]
    long = [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 16.0]
    rope = {
        "rope_type": "longrope",
        "factor": 4.0,
        "short_factor": short,
        "long_factor": long,
        "original_max_position_embeddings": original,
    }
    config = llama_config(head_dim, 1e4, rope, 4 * original)
    want, scale = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=length)
    enc = RoPE(
        d_model=2 * head_dim,
        n_heads=2,
        n_layers=1,
        layout="half",
        scaling="longrope",
        scaling_factor=4.0,
        original_length=original,
        short_factor=short,
        long_factor=long,
    )
    freq, mscale = enc.frequencies(length)
    torch.testing.assert_close(freq, want.float(), rtol=1e-6, atol=0)
    assert mscale == pytest.approx(scale, rel=1e-12)


@pytest.mark.skipif(
    "proportional" not in ROPE_INIT_FUNCTIONS, reason="proportional RoPE: transformers 5"
)
@pytest.mark.parametrize(("head_dim", "p"), [(16, 0.5), (64, 0.25), (32, 0.75)])
def test_p_rope_matches_transformers_proportional(head_dim: int, p: float) -> None:
    """p-RoPE against Gemma's proportional RoPE: the same kept pairs, zeros after them."""
    config = llama_config(head_dim, 1e4, {"rope_type": "proportional"}, 512, fraction=p)
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](config)
    enc = RoPE(d_model=2 * head_dim, n_heads=2, n_layers=1, layout="half", p=p)
    torch.testing.assert_close(enc.frequencies(512)[0], want.float(), rtol=1e-6, atol=0)
