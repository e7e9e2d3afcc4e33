"""FoX, the Forgetting Transformer's forget gate (Lin et al. 2025): the gate term from
the paper's formula by hand, ALiBi as its fixed gate, and what the gates may read."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from posenc.encoders import build
from posenc.encoders.base import AttnKind
from posenc.model import DecoderLM

C, H = 8, 2


def _hooks(gate: str = "full"):
    enc = build("fox", d_model=C, n_heads=H, n_layers=1, gate=gate).double()
    return enc, enc.for_attention(layer=0, kind=AttnKind.CAUSAL).double()


@torch.no_grad()
def _bias(enc, hooks, x: torch.Tensor, key_valid: torch.Tensor | None = None) -> torch.Tensor:
    t = x.shape[1]
    pos = torch.arange(t)[None]
    ctx = enc.context(pos, pos, AttnKind.CAUSAL, starts=(0, 0))
    ctx = hooks.with_input(x, ctx, key_valid=key_valid, cache=None)
    q = torch.zeros(x.shape[0], H, t, C // H, dtype=x.dtype)
    return hooks.score_bias(q, q, ctx)  # (B, H, T, T)


def test_gate_term_is_the_sum_of_log_gates_between_key_and_query() -> None:
    """score_h(i, j) - q.k/sqrt(D) = sum_{j < t <= i} log sigmoid(w_h . x_t + b_h), from
    the formula term by term (float64)."""
    torch.manual_seed(0)
    enc, hooks = _hooks()
    nn.init.normal_(hooks.proj.weight)
    nn.init.normal_(hooks.proj.bias)
    x = torch.randn(1, 5, C, dtype=torch.float64)
    got = _bias(enc, hooks, x)
    w, b = hooks.proj.weight.detach(), hooks.proj.bias.detach()
    for h in range(H):
        for i in range(5):
            for j in range(i + 1):
                want = sum(
                    math.log(1.0 / (1.0 + math.exp(-float(w[h] @ x[0, t] + b[h]))))
                    for t in range(j + 1, i + 1)
                )
                assert abs(float(got[0, h, i, j]) - want) < 1e-12, (h, i, j)


def test_a_pair_reads_only_the_tokens_between_its_key_and_query() -> None:
    """Changing token t moves the term of exactly the pairs j < t <= i."""
    torch.manual_seed(1)
    enc, hooks = _hooks()
    nn.init.normal_(hooks.proj.weight)
    x = torch.randn(1, 6, C, dtype=torch.float64)
    y = x.clone()
    y[0, 3] += 1.0
    moved = (_bias(enc, hooks, x) - _bias(enc, hooks, y)).abs()[0, 0] > 1e-12  # (T, T)
    i, j = torch.meshgrid(torch.arange(6), torch.arange(6), indexing="ij")
    seen = j <= i  # the pairs attention uses (the rest are masked)
    assert torch.equal(moved & seen, (j < 3) & (i >= 3))


def test_padding_adds_no_gate() -> None:
    """A left-padded row has the same gate terms among its real tokens as alone."""
    torch.manual_seed(2)
    enc, hooks = _hooks()
    nn.init.normal_(hooks.proj.weight)
    x = torch.randn(1, 6, C, dtype=torch.float64)
    padded = torch.cat([torch.randn(1, 2, C, dtype=torch.float64), x], 1)
    valid = torch.tensor([[False, False] + [True] * 6])
    got = _bias(enc, hooks, padded, key_valid=valid)[..., 2:, 2:]
    torch.testing.assert_close(got, _bias(enc, hooks, x), rtol=0, atol=1e-12)


def test_fixed_gate_is_alibi_bit_for_bit() -> None:
    """gate=fixed sets log f_h = -m_h: the same logits as ALiBi, exactly."""
    torch.manual_seed(3)
    sizes = dict(vocab_size=23, d_model=32, n_heads=4, n_layers=2)
    fox = DecoderLM(encoder=build_fixed, **sizes).eval()
    alibi = DecoderLM(encoder="alibi", **sizes).eval()
    alibi.load_state_dict(fox.state_dict())
    ids = torch.randint(0, 23, (2, 12))
    with torch.no_grad():
        assert torch.equal(fox(ids), alibi(ids))


def build_fixed(**sizes):
    return build("fox", gate="fixed", **sizes)


def test_constant_gates_are_relative_and_the_full_gate_reads_no_position() -> None:
    assert not build("fox", d_model=C, n_heads=H, n_layers=1).uses_positions
    for gate in ("bias_only", "fixed"):
        enc = build("fox", d_model=C, n_heads=H, n_layers=1, gate=gate)
        assert enc.relative and enc.uses_positions
    assert build("fox", d_model=C, n_heads=H, n_layers=1, rope=True).relative


def test_bad_gate_names_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown gate 'forget'; allowed: full, bias_only, fixed"):
        build("fox", d_model=C, n_heads=H, n_layers=1, gate="forget")


@pytest.mark.parametrize("gate", ["full", "bias_only", "fixed"])
@pytest.mark.parametrize("per_row", [False, True])
def test_score_mod_is_the_score_term(gate: str, per_row: bool) -> None:
    """FlexAttention's score_mod, read at every (b, h, q_idx, kv_idx), adds what
    score_bias adds on the pairs a causal query sees."""
    from tests.model.test_backends import dense_score_mod

    torch.manual_seed(4)
    enc, hooks = _hooks(gate)
    for p in hooks.parameters():
        nn.init.normal_(p)
    x = torch.randn(2, 7, C, dtype=torch.float64)
    pos = torch.stack([torch.arange(7) * 2, torch.arange(7) * 3 + 1]) if per_row else None
    if pos is None:
        ctx = enc.context(
            torch.arange(7)[None], torch.arange(7)[None], AttnKind.CAUSAL, starts=(0, 0)
        )
    else:
        ctx = enc.context(pos, pos, AttnKind.CAUSAL, bound=64)
    ctx = hooks.with_input(x, ctx, key_valid=None, cache=None)
    q = torch.randn(2, H, 7, C // H, dtype=torch.float64)
    with torch.no_grad():
        ref = hooks.score_bias(q, q, ctx).expand(2, H, 7, 7)
        got = dense_score_mod(hooks.score_mod(q, q, ctx), ref.shape)
    keep = torch.ones(7, 7, dtype=torch.bool).tril().expand_as(ref)
    torch.testing.assert_close(got[keep].to(ref.dtype), ref[keep], rtol=0, atol=1e-6)
