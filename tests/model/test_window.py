"""Sliding-window attention (``model.window``, ``model.window_layers``): the mask worked
out by hand on six tokens, every backend against it, the layer pattern, no window where
it reaches past every key, and the refusals."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from posenc.encoders import build
from posenc.encoders.base import AttnKind
from posenc.model import DecoderLM, EncoderDecoder, backends
from posenc.model.attention import Attention
from posenc.model.backends import attend
from posenc.model.modifiers import LogitModifiers, Modifiers
from posenc.model.window import layer_window

#: Each backend, as a CPU can be made to run it: the explicit softmax with its written-out
#: backward and through autograd, SDPA with the additive mask (a GPU's path for score
#: terms), FlexAttention's eager kernel.
BACKENDS = ("explicit", "plain", "sdpa", "flex")
W = 3  # the window of the six-token example


@pytest.fixture(autouse=True)
def _quiet_eager_flex() -> None:
    warnings.filterwarnings("ignore", message=".*flex_attention.*")


def _use(backend: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Set up ``backend`` for :func:`attend` (or a model's attentions); the name it takes."""
    monkeypatch.setattr(backends, "HAND_WRITTEN_BACKWARD", backend != "plain")
    monkeypatch.setattr(backends, "fused_bias_kernel", lambda q: backend == "sdpa")
    return {"plain": "explicit", "sdpa": "auto"}.get(backend, backend)


def _probs(backend: str, mods: LogitModifiers | None, q, k, monkeypatch) -> torch.Tensor:
    """The window's attention probabilities ``(B, H, T, T)`` on ``backend``: the output
    for values that are the identity (value j is the j-th unit vector)."""
    b, h, t, d = q.shape
    enc = build("none", d_model=h * d, n_heads=h, n_layers=1)
    pos = torch.arange(t)[None]
    ctx = enc.context(pos, pos, AttnKind.CAUSAL, starts=(0, 0), bound=t)
    v = torch.eye(t, dtype=q.dtype).expand(b, h, t, t)
    name = _use(backend, monkeypatch)
    hooks = enc.for_attention(layer=0, kind=AttnKind.CAUSAL)
    return attend(
        hooks, q, k, v, ctx, key_valid=None, shift=0, p_drop=0.0, backend=name, mods=mods, window=W
    )


def _hand_built(q, k, *, scale_s: torch.Tensor | None = None, sink: torch.Tensor | None = None):
    """The window's probabilities from its definition: query i sees keys
    ``i - W < j <= i``; with SSMax's ``s``, logits times ``s log(n_i)``, ``n_i`` the keys
    in the window; with a sink, one more logit in each softmax."""
    t = q.shape[-2]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    seen = (j <= i) & (j > i - W)
    z = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if scale_s is not None:
        n = seen.sum(-1).to(z.dtype)  # (T,): 1, 2, 3, 3, 3, 3
        assert n.tolist() == [1, 2, 3, 3, 3, 3]
        z = z * (scale_s[:, None, None] * n.log()[:, None])
    e = z.exp().masked_fill(~seen, 0.0)
    total = e.sum(-1, keepdim=True)
    if sink is not None:
        total = total + sink.exp()[:, None, None]
    return e / total, seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_is_the_hand_built_mask(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Six tokens, a window of 3: each backend's probabilities are those of the mask
    built by hand, with keys outside the window at exactly 0; with SSMax (n counted in
    the window) and a sink (which stays in every query's view) as well."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 6, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    got = _probs(backend, None, q, k, monkeypatch)
    want, seen = _hand_built(q, k)
    assert (got[..., ~seen] == 0).all()
    assert (got[..., seen] > 0).all()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    mods = LogitModifiers(2, logit_scale="ssmax", sinks=True).double()
    assert mods.s is not None and mods.sink is not None
    with torch.no_grad():
        mods.s.copy_(torch.tensor([0.7, 1.3]))
        mods.sink.copy_(torch.tensor([0.5, -1.0]))
    got = _probs(backend, mods, q, k, monkeypatch)
    want, _ = _hand_built(q, k, scale_s=mods.s.detach(), sink=mods.sink.detach())
    assert (got[..., ~seen] == 0).all()
    assert (got.sum(-1) < 1 - 1e-3).all()  # the sink took its share
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_window_gradients_of_both_explicit_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Training's explicit path (its written-out backward) and autograd's give the same
    gradients with a window; keys outside every query's window get none."""
    grads = []
    for backend in ("explicit", "plain"):
        gen = torch.Generator().manual_seed(0)
        q, k = (torch.randn(1, 2, 6, 4, generator=gen, dtype=torch.float64) for _ in range(2))
        q.requires_grad_(True)
        k.requires_grad_(True)
        out = _probs(backend, None, q, k, monkeypatch)
        (out[..., 5, :] * torch.arange(6.0, dtype=out.dtype)).sum().backward()  # last query
        grads.append((q.grad, k.grad))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert (grads[0][1][..., :3, :] == 0).all()  # the last query's window: keys 3, 4, 5


H, D = 4, 8
OPTIONS = {"qk_norm": True, "logit_scale": "ssmax", "sinks": True}


@pytest.mark.parametrize("options", [{}, OPTIONS], ids=["plain", "modifiers"])
@pytest.mark.parametrize("name", ["none", "rope", "alibi", "t5", "shaw", "fire"])
def test_backends_agree_on_a_windowed_model(
    name: str, options: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local layer and a global one over 150 tokens (past the CPU's query blocks):
    every backend gives the model's outputs, and the window changes them."""
    lm = DecoderLM(
        vocab_size=11, encoder=name, d_model=H * D, n_heads=H, n_layers=2, window=5,
        window_layers=["local", "global"], **options,
    ).eval()  # fmt: skip
    if options:
        with torch.no_grad():  # sinks and s away from their initial values
            for layer in lm.stack.layers:
                layer.self_attn.logits.sink.normal_()
                layer.self_attn.logits.s.uniform_(0.2, 1.0)
    ids = torch.randint(0, 11, (2, 150))
    outs = {}
    for backend in ("auto", *BACKENDS):
        name_ = _use(backend, monkeypatch)
        for m in lm.modules():
            if isinstance(m, Attention):
                m.backend = name_
        with torch.no_grad():
            outs[backend] = lm(ids)
        monkeypatch.undo()
    for backend in BACKENDS:
        torch.testing.assert_close(outs[backend], outs["auto"], atol=2e-5, rtol=2e-5)
    lm.stack.layers[0].self_attn.window = None
    with torch.no_grad():
        assert (lm(ids) - outs["auto"]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["rope", "alibi"])
def test_a_window_past_every_key_is_no_window(name: str) -> None:
    """A window of at least the sequence's length masks nothing: outputs bit for bit
    those of no window; one shorter changes them."""
    sizes = {"vocab_size": 11, "encoder": name, "d_model": 16, "n_heads": 2, "n_layers": 2}
    ids = torch.randint(0, 11, (2, 9))
    torch.manual_seed(0)
    ref = DecoderLM(**sizes).eval()
    with torch.no_grad():
        want = ref(ids)
        for window in (9, 20):
            torch.manual_seed(0)
            assert torch.equal(DecoderLM(**sizes, window=window).eval()(ids), want)
        torch.manual_seed(0)
        assert not torch.allclose(DecoderLM(**sizes, window=8).eval()(ids), want)


def test_window_layers_pattern_is_cycled_over_the_layers() -> None:
    """``[local, local, global]`` over seven layers: local, local, global, local, local,
    global, local; null: every layer local."""
    sizes = {"vocab_size": 11, "encoder": "rope", "d_model": 16, "n_heads": 2, "n_layers": 7}
    lm = DecoderLM(**sizes, window=4, window_layers=["local", "local", "global"])
    assert [b.self_attn.window for b in lm.stack.layers] == [4, 4, None, 4, 4, None, 4]
    lm = DecoderLM(**sizes, window=4)
    assert [b.self_attn.window for b in lm.stack.layers] == [4] * 7
    assert [layer_window(2, ("global", "local"), i) for i in range(4)] == [None, 2, None, 2]


def test_model_refusals() -> None:
    """Out-of-range options, a window in a translator and in a scheme that owns its
    attention: a ValueError that names the value."""
    for bad, match in (
        ({"window": 0}, "model.window=0: must be a positive integer"),
        ({"window": 3, "window_layers": ["local", "globl"]}, "must be a non-empty list"),
        ({"window_layers": ["local"]}, "there is no window to place"),
        ({"window": 3, "window_layers": ["global"]}, "names no local layer"),
    ):
        with pytest.raises(ValueError, match=match):
            Modifiers(**bad)
    with pytest.raises(ValueError, match="model.window=4: sliding-window attention is for"):
        EncoderDecoder(src_vocab_size=11, tgt_vocab_size=11, encoder="rope", window=4)
    with pytest.raises(ValueError, match="window=4: the StickBreaking encoder"):
        DecoderLM(vocab_size=11, encoder="stickbreak", window=4)


def test_config_refusals(tmp_path) -> None:
    """One line each, before training (``task.seq_len=16`` in the tiny config)."""
    from posenc.config import ConfigError, validate
    from tests.conftest import compose_config, compose_run

    cases = {
        ("model.window=0",): "model.window=0: must be a positive integer (tokens) or null (off)",
        ("model.window=16",): (
            "model.window=16: not smaller than task.seq_len=16, so every query would see every "
            "key (no window); give model.window < 16, or model.window=null"
        ),
        ("model.window_layers=[local,global]",): (
            "model.window_layers=['local', 'global']: there is no window to place (model.window "
            "is null); set model.window=<tokens> or drop model.window_layers"
        ),
        ("model.window=4", "model.window_layers=[lokal]"): (
            "model.window_layers=['lokal']: must be a non-empty list of local and global "
            "(cycled over the layers), e.g. [local,local,local,local,local,global], or null "
            "(every layer local)"
        ),
        ("model.window=4", "encoder=stickbreak"): (
            "model.window=4: the StickBreaking encoder computes its own attention weights, not "
            "the softmax and mask these options change; drop the option or choose another encoder"
        ),
        ("mt", "model.window=4"): (
            "model.window=4: sliding-window attention is for causal decoders (task=lm, task=algo "
            "task.shape=decoder); an encoder-decoder's encoder attends both ways; set "
            "model.window=null"
        ),
    }
    cases[("algo", "model.window=19")] = (
        "model.window=19: not smaller than the longest training sequence (19 positions at the "
        "largest of task.train_lengths), so every query would see every key (no window); give "
        "model.window < 19, or model.window=null"
    )
    cases[("algo", "task.shape=encdec", "model.window=4")] = cases[("mt", "model.window=4")]
    for overrides, line in cases.items():
        task = overrides[0] if overrides[0] in ("mt", "algo") else None
        cfg = (
            compose_config(tmp_path, f"task={task}", *overrides[1:])
            if task
            else compose_run(tmp_path, *overrides)
        )
        with pytest.raises(ConfigError) as err:
            validate(cfg)
        assert str(err.value).splitlines()[1:] == [f"  {line}"], overrides
    validate(compose_run(tmp_path, "model.window=15", "model.window_layers=[local,global]"))
    validate(compose_config(tmp_path, "task=algo", "model.window=18"))
