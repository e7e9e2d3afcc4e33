"""FoX, the Forgetting Transformer's forget gate (Lin et al. 2025): the gate term from
the paper's formula by hand, ALiBi as its fixed gate, and what the gates may read."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from posenc.encoders import build, get
from posenc.encoders.base import AttnKind
from posenc.model import DecoderLM
from tests.conftest import identity_attention

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


# ------------------------------------------------------------ bias_init=spread, pro=true


def test_spread_bias_is_the_authors_decay_times_over_heads() -> None:
    """Four heads from 2 to 128 tokens: decay times 2, 8, 32, 128 (log-spaced), the
    authors' ``b_h = -log(expm1(1 / T_h))`` to 1e-12, so each gate starts at
    ``exp(-1 / T_h)``; the gate term of a pair i - j tokens apart is then
    ``-(i - j) / T_h`` for zero gate weights."""
    enc = build("fox", d_model=8, n_heads=4, n_layers=1, bias_init="spread")
    hooks = enc.for_attention(layer=0, kind=AttnKind.CAUSAL).double()
    hooks.init_weights()
    want = [-math.log(math.expm1(1.0 / t)) for t in (2.0, 8.0, 32.0, 128.0)]
    got = hooks.proj.bias.detach().tolist()
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < 1e-12
    nn.init.zeros_(hooks.proj.weight)
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    pos = torch.arange(6)[None]
    ctx = hooks.with_input(x, enc.context(pos, pos, AttnKind.CAUSAL), key_valid=None, cache=None)
    with torch.no_grad():
        bias = hooks.score_bias(torch.zeros(1, 4, 6, 2).double(), None, ctx)
    dist = (pos[0][:, None] - pos[0][None, :]).double()
    for h, t in enumerate((2.0, 8.0, 32.0, 128.0)):
        torch.testing.assert_close(bias[0, h].tril(), (-dist / t).tril(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("gate", ["full", "bias_only"])
def test_spread_survives_the_models_initialisation(gate: str) -> None:
    """The stack's initialisation (N(0, 0.02) weights, zero biases) leaves the spread
    biases of every layer in place; zero is the default and gives sigmoid(0) gates."""
    want = -torch.log(torch.expm1(1.0 / torch.tensor([2.0, 128.0], dtype=torch.float64)))
    for bias_init, start in (("spread", want), ("zero", torch.zeros(2, dtype=torch.float64))):
        model = DecoderLM(
            vocab_size=11, encoder=functools.partial(get("fox"), gate=gate, bias_init=bias_init),
            d_model=C, n_heads=H, n_layers=2,
        )  # fmt: skip
        for layer in model.stack.layers:
            hooks = layer.self_attn.pos
            b = hooks.proj.bias if gate == "full" else hooks.bias
            torch.testing.assert_close(b.detach().double(), start, rtol=1e-6, atol=1e-6)


def authors_fox_pro(x: torch.Tensor, p: dict[str, torch.Tensor], n_heads: int) -> torch.Tensor:
    """``(T, C)``: the authors' ``ForgettingAttentionLayer`` with the Pro config (key and
    value shift, QK-norm, output norm and gate; full forget gate) and identity q, k, v, o
    projections, one head and one token at a time in float64 (zhixuan-lin/
    forgetting-transformer, ``modeling_forgetting_transformer.py``: ``ShiftLinear``
    mixes ``alpha * prev + (1 - alpha) * cur``; ``GroupNorm(is_rms_norm)`` eps 1e-5 on
    q and k; ``FusedGroupNormGated`` eps 1e-6 with ``sigmoid(ogate_proj(x))``)."""
    t, c = x.shape
    d = c // n_heads

    def sig(a: float) -> float:
        return 1.0 / (1.0 + math.exp(-a))

    def rms(vec: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return vec / math.sqrt(float((vec**2).mean()) + eps) * w

    out = torch.zeros(t, c, dtype=torch.float64)
    for h in range(n_heads):
        cols = slice(h * d, (h + 1) * d)
        k, v, q = [], [], []
        for i in range(t):
            a_k, a_v = sig(float(p["k_shift"][h] @ x[i])), sig(float(p["v_shift"][h] @ x[i]))
            prev = x[i - 1, cols] if i > 0 else torch.zeros(d, dtype=torch.float64)
            k.append(rms((1 - a_k) * x[i, cols] + a_k * prev, p["k_norm"][h], 1e-5))
            v.append((1 - a_v) * x[i, cols] + a_v * prev)
            q.append(rms(x[i, cols], p["q_norm"][h], 1e-5))
        log_f = [math.log(sig(float(p["gate_w"][h] @ x[s] + p["gate_b"][h]))) for s in range(t)]
        for i in range(t):
            scores = [
                float(q[i] @ k[j]) / math.sqrt(d) + sum(log_f[j + 1 : i + 1]) for j in range(i + 1)
            ]
            top = max(scores)
            e = [math.exp(s - top) for s in scores]
            o = sum(e[j] / sum(e) * v[j] for j in range(i + 1))
            gate = [sig(float(p["out_gate"][h * d + m] @ x[i])) for m in range(d)]
            out[i, cols] = rms(o, p["out_norm"][h], 1e-6) * torch.tensor(gate, dtype=torch.float64)
    return out


def test_pro_equals_the_authors_layer() -> None:
    """FoX Pro, float64, T = 5, two heads of 3, every Pro parameter away from its start:
    the layer (identity projections) equals the authors' layer written out, to 1e-12.
    Without pro the layer differs."""
    torch.manual_seed(6)
    enc = build("fox", d_model=6, n_heads=2, n_layers=1, pro=True)
    attn = identity_attention(enc, AttnKind.CAUSAL).double()
    hooks = attn.pos
    with torch.no_grad():
        for param in hooks.parameters():
            param.copy_(torch.randn_like(param) * 0.7)
    x = torch.randn(1, 5, 6, dtype=torch.float64)
    pos = torch.arange(5)[None]
    with torch.no_grad():
        got = attn(x, enc.context(pos, pos, AttnKind.CAUSAL))
    pro = hooks.pro
    params = {
        "k_shift": pro.k_shift.weight, "v_shift": pro.v_shift.weight, "q_norm": pro.q_norm,
        "k_norm": pro.k_norm, "out_gate": pro.out_gate.weight, "out_norm": pro.out_norm,
        "gate_w": hooks.proj.weight, "gate_b": hooks.proj.bias,
    }  # fmt: skip
    want = authors_fox_pro(x[0], {k: v.detach() for k, v in params.items()}, 2)
    torch.testing.assert_close(got[0], want, rtol=1e-12, atol=1e-12)
    plain = identity_attention(build("fox", d_model=6, n_heads=2, n_layers=1), AttnKind.CAUSAL)
    plain = plain.double()
    plain.pos.load_state_dict({"proj.weight": hooks.proj.weight, "proj.bias": hooks.proj.bias})
    with torch.no_grad():
        assert not torch.allclose(plain(x, enc.context(pos, pos, AttnKind.CAUSAL)), got, atol=1e-3)


def test_pro_starts_as_the_authors() -> None:
    """Norm scales 1, shift and output-gate weights N(0, 0.02)."""
    torch.manual_seed(7)
    model = DecoderLM(
        vocab_size=11, encoder=functools.partial(get("fox"), pro=True), d_model=64, n_heads=4,
        n_layers=1,
    )  # fmt: skip
    pro = model.stack.layers[0].self_attn.pos.pro
    for scale in (pro.q_norm, pro.k_norm, pro.out_norm):
        assert torch.equal(scale, torch.ones_like(scale))
    for lin in (pro.k_shift, pro.v_shift, pro.out_gate):
        assert abs(float(lin.weight.detach().std()) - 0.02) < 0.004 and lin.bias is None


@pytest.mark.parametrize(
    "settings", [{"bias_init": "spread"}, {"pro": True}, {"pro": True, "gate": "bias_only"}]
)
def test_cached_decoding_equals_the_full_pass(settings: dict) -> None:
    from tests.model.test_cache import TOL, L, N, _cached_and_full, lm

    model = lm("fox", settings)
    ids = torch.randint(0, 17, (2, N))
    with torch.no_grad():  # a prefill, single steps and uneven chunks
        got, want = _cached_and_full(model, ids, [L, 1, 1, 3, L + 2, N - 2 * L - 7])
    assert (got - want).abs().max() <= TOL


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "encoder.bias_init=foo",
            "encoder: fox: unknown bias_init 'foo'; allowed: zero, spread (zero is the authors' "
            "full-gate start, spread their decay times over heads)",
        ),
        ("encoder.pro=maybe", "encoder.pro='maybe': must be true or false"),
        (
            "encoder.gate=fixed encoder.bias_init=spread",
            "encoder: fox: bias_init=spread sets a learned gate's bias, and gate=fixed has none "
            "(its gates are ALiBi's slopes); use gate=full or gate=bias_only with "
            "bias_init=spread",
        ),
        (
            "encoder.decay_time_min=0",
            "encoder: fox: decay_time_min=0, decay_time_max=128: need finite numbers with 0 < "
            "decay_time_min <= decay_time_max (tokens), e.g. 2 and 128",
        ),
    ],
)
def test_bad_values_are_refused_in_one_line(tmp_path, override: str, line: str) -> None:
    from posenc.config import ConfigError
    from posenc.train import train
    from tests.conftest import compose_run

    with pytest.raises(ConfigError) as err:
        train(compose_run(tmp_path, "encoder=fox", *override.split()))
    assert str(err.value).splitlines()[1:] == [f"  {line}"]
    assert not (tmp_path / "run").exists()
