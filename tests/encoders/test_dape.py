"""DAPE (Zheng et al. 2024) against its logits written out per pair from the paper's
formula, ``A = QK^T/sqrt(D) + B + f([QK^T/sqrt(D); B])`` with ``f`` the authors' MLP
(``2H -> W -> H``, LeakyReLU), by loops in float64; with ``f``'s output zeroed it is its
base scheme exactly."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch

from posenc.encoders import build
from posenc.encoders.alibi import alibi_slopes
from posenc.encoders.base import AttnKind
from posenc.encoders.dape import BASES, Dape
from posenc.model import DecoderLM
from tests.conftest import compose_run, heads, identity_attention, merge, run_py, run_self

C, H = 16, 4
KINDS = [AttnKind.CAUSAL, AttnKind.BIDIRECTIONAL]


def _zeroed(hooks) -> None:
    """``f``'s output layer to zero in one layer's hooks (each layer has its own)."""
    with torch.no_grad():
        hooks.mlp.out.weight.zero_()
        hooks.mlp.out.bias.zero_()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("base", BASES)
def test_zeroed_mlp_is_the_base_exactly(base: str, kind: AttnKind) -> None:
    """With f's output layer zeroed, DAPE's attention equals its base scheme's, built
    alone with the same parameters, bit for bit; the MLP's first layer is left random."""
    options = {"per_layer": False} if base != "alibi" else {}
    dape = Dape(d_model=C, n_heads=H, n_layers=1, base=base, per_layer=False)
    alone = build(base, d_model=C, n_heads=H, n_layers=1, **options)
    alone.load_state_dict(dape.base.state_dict())
    attn = identity_attention(dape, kind)
    _zeroed(attn.pos)
    x = torch.randn(2, 9, C)
    pos = torch.arange(3, 12)[None]
    with torch.no_grad():
        got = run_self(attn, dape, x, pos, kind)
        want = run_self(identity_attention(alone, kind), alone, x, pos, kind)
        assert torch.equal(got, want)
        attn.pos.mlp.out.weight.normal_()  # and the MLP changes the attention
        assert not torch.allclose(run_self(attn, dape, x, pos, kind), want, atol=1e-4)


def by_hand(x: torch.Tensor, hooks, kind: AttnKind) -> torch.Tensor:
    """Identity-projection attention over the heads of ``x (1, T, C)`` with DAPE-ALiBi's
    logits computed pair by pair: content, ALiBi's bias, and f written out unit by unit."""
    q = heads(x, H)[0].double().detach()  # (H, T, D)
    t, d = q.shape[1], q.shape[2]
    mlp = hooks.mlp.double().requires_grad_(False)
    w1, b1 = mlp.hidden.weight, mlp.hidden.bias  # (W, 2H), (W,)
    w2, b2 = mlp.out.weight, mlp.out.bias  # (H, W), (H,)
    slopes = alibi_slopes(H).double()
    scores = torch.empty(H, t, t, dtype=torch.float64)
    signs = set()
    for i in range(t):
        for j in range(t):
            content = [float(q[h, i] @ q[h, j]) / math.sqrt(d) for h in range(H)]
            bias = [-float(slopes[h]) * abs(i - j) for h in range(H)]
            u = content + bias  # the authors' order: content scores, then bias
            hidden = []
            for w in range(w1.shape[0]):
                pre = sum(float(w1[w, c]) * u[c] for c in range(2 * H)) + float(b1[w])
                signs.add(pre > 0)
                hidden.append(pre if pre > 0 else 0.01 * pre)
            for h in range(H):
                f = sum(float(w2[h, w]) * hidden[w] for w in range(len(hidden))) + float(b2[h])
                scores[h, i, j] = content[h] + bias[h] + f
    assert signs == {True, False}  # both sides of the LeakyReLU were used
    if kind is AttnKind.CAUSAL:
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return merge((scores.softmax(-1) @ q)[None])


@pytest.mark.parametrize("kind", KINDS)
def test_logits_are_the_papers_formula(kind: AttnKind) -> None:
    """DAPE-ALiBi with a 5-unit MLP, float64: the attention output equals the softmax of
    the logits computed pair by pair (the MLP's weights drawn at unit scale)."""
    dape = Dape(d_model=C, n_heads=H, n_layers=1, base="alibi", mlp_width=5).double()
    attn = identity_attention(dape, kind).double()
    with torch.no_grad():
        for p in attn.pos.mlp.parameters():
            p.normal_()
    x = torch.randn(1, 7, C, dtype=torch.float64)
    with torch.no_grad():
        got = run_self(attn, dape, x, torch.arange(7)[None], kind)
    torch.testing.assert_close(got, by_hand(x, attn.pos, kind), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("base", BASES)
def test_nothing_leaks_past_the_causal_mask(base: str) -> None:
    """Changing tokens from position 7 on leaves every output before 7 as it was, for
    each base, though the MLP reads the scores of the masked pairs too."""
    model = DecoderLM(
        vocab_size=40, encoder=functools.partial(Dape, base=base), d_model=32, n_heads=4,
        n_layers=2,
    ).eval()  # fmt: skip
    ids = torch.randint(0, 40, (2, 12))
    changed = ids.clone()
    changed[:, 7:] = torch.randint(0, 40, (2, 5))
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("base", BASES)
def test_gradient_reaches_every_layers_mlp(base: str) -> None:
    """Each layer has its own MLP (and, per_layer, its own base parameters), and a
    training step's gradient reaches all of them."""
    model = DecoderLM(
        vocab_size=40, encoder=functools.partial(Dape, base=base), d_model=32, n_heads=4,
        n_layers=2,
    )  # fmt: skip
    model(torch.randint(0, 40, (2, 10))).square().mean().backward()
    named = dict(model.named_parameters())
    mlp = {n: p for n, p in named.items() if ".mlp." in n and "attn" in n}
    assert len(mlp) == 2 * 4, sorted(named)  # two layers: two weights and two biases each
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mlp.values())
    hooks = [layer.self_attn.pos for layer in model.stack.layers]
    assert hooks[0].mlp is not hooks[1].mlp
    if base != "alibi":  # the authors' code builds the base in every layer
        own = [n for n in named if "attn.pos.base." in n]
        assert own and all(named[n].grad is not None for n in own)


@pytest.mark.parametrize("base", ["kerple", "fire"])
def test_per_layer_false_shares_the_base(base: str) -> None:
    enc = Dape(d_model=C, n_heads=H, n_layers=2, base=base, per_layer=False)
    hooks = [enc.for_attention(layer=i, kind=AttnKind.CAUSAL) for i in range(2)]
    assert not list(hooks[0].base.parameters()) and list(enc.base.parameters())
    assert hooks[0].mlp is not hooks[1].mlp  # the MLP stays per layer


def test_declares_its_base_kind() -> None:
    """Relative on ALiBi and KERPLE, relative below FIRE's threshold, content-dependent."""
    kinds = {b: Dape(d_model=C, n_heads=H, n_layers=1, base=b) for b in BASES}
    assert kinds["alibi"].relative and kinds["kerple"].relative
    assert not kinds["fire"].relative and kinds["fire"].relative_below == "log_threshold"
    assert all(e.data_dependent for e in kinds.values())
    assert (
        not Dape(d_model=C, n_heads=H, n_layers=1)
        .for_attention(layer=0, kind=AttnKind.CROSS)
        .score_term
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base": "rope"}, "dape: unknown base 'rope'; allowed: alibi, kerple, fire"),
        ({"mlp_width": 0}, "dape: mlp_width must be an integer >= 1, got 0"),
        (
            {"base_options": {"flavour": 1}},
            "dape: encoder.base_options.flavour: kerple has no option 'flavour' here; "
            "allowed: form",
        ),
        ({"base": "alibi", "base_options": {"form": "log"}}, "alibi has no option 'form'"),
        ({"base_options": {"per_layer": False}}, "set encoder.per_layer instead"),
        ({"base_options": {"form": "exp"}}, "kerple: unknown form 'exp'"),
        ({"base_options": "power"}, "dape: encoder.base_options='power': must be a mapping"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Dape(d_model=C, n_heads=H, n_layers=1, **kwargs)


def test_run_py_refuses_an_unknown_base_before_training(tmp_path: Path) -> None:
    proc = run_py(tmp_path, "encoder=dape", "encoder.base=rope")
    assert proc.returncode == 2
    assert proc.stderr == (
        "error: invalid config:\n  encoder: dape: unknown base 'rope'; allowed: alibi, kerple, "
        "fire (the score-bias scheme the MLP adapts), e.g. encoder.base=kerple\n"
    )


@pytest.mark.parametrize("given", [None, {"threshold": 100.0}])
def test_dapes_fire_starts_at_the_training_length_as_the_fire_arm(
    tmp_path: Path, given: dict | None
) -> None:
    # Composed as a run composes it: DAPE's FIRE takes the threshold L that encoder=fire
    # takes (task.seq_len), unless base_options sets its own.
    import hydra.utils

    overrides = ["task=lm", "task.seq_len=64", "model.n_heads=2", "model.d_model=16"]
    options = [] if given is None else ["encoder.base_options={threshold:100.0}"]
    runs = {
        name: compose_run(tmp_path / name, f"encoder={name}", *extra, *overrides)
        for name, extra in (("fire", []), ("dape", ["encoder.base=fire", *options]))
    }
    built = {
        name: hydra.utils.instantiate(cfg.encoder)(d_model=16, n_heads=2, n_layers=1)
        for name, cfg in runs.items()
    }
    fire = built["dape"].base
    expected = 64.0 if given is None else 100.0
    shared = fire.fire if fire.fire is not None else None
    hooks = fire.for_attention(layer=0, kind=AttnKind.CAUSAL)
    function = shared if shared is not None else hooks.fire
    assert float(function.threshold.detach()) == pytest.approx(expected)
    plain = built["fire"].fire if built["fire"].fire is not None else None
    assert plain is not None and float(plain.threshold.detach()) == pytest.approx(64.0)
