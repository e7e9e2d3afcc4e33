"""#37 item 3: the stack initialises its own layers; a scheme's weights are the scheme's."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from posenc.encoders.base import AttentionPositional, AttnKind, PositionalEncoder
from posenc.model import DecoderLM, EncoderDecoder


class _Hooks(AttentionPositional):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.own = nn.Linear(d_model, d_model)
        self.calls = 0

    def init_weights(self) -> None:
        self.calls += 1
        nn.init.constant_(self.own.weight, 0.5)
        nn.init.constant_(self.own.bias, -0.5)


class _Scheme(PositionalEncoder):
    """A scheme with a Linear of its own (set when built) and one per layer."""

    def __init__(self, *, d_model: int, n_heads: int, n_layers: int) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        self.table = nn.Linear(d_model, d_model)
        nn.init.constant_(self.table.weight, 0.25)

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        return _Hooks(self.d_model) if kind is not AttnKind.CROSS else AttentionPositional()


@pytest.mark.parametrize("seq2seq", [False, True])
def test_the_stack_leaves_a_schemes_weights_to_the_scheme(seq2seq: bool) -> None:
    torch.manual_seed(0)
    sizes = dict(n_layers=3, d_model=64, n_heads=4)
    if seq2seq:
        model = EncoderDecoder(src_vocab_size=7, tgt_vocab_size=7, encoder=_Scheme, **sizes)
        stacks = [model.encoder_stack, model.decoder_stack]
    else:
        model = DecoderLM(vocab_size=7, encoder=_Scheme, **sizes)
        stacks = [model.stack]
    for stack in stacks:
        assert torch.all(stack.encoder.table.weight == 0.25)  # untouched
        hooks = [m for m in stack.modules() if isinstance(m, _Hooks)]
        assert len(hooks) == 3
        for h in hooks:
            assert h.calls == 1
            assert torch.all(h.own.weight == 0.5) and torch.all(h.own.bias == -0.5)
        # the stack's own layers: GPT-2's N(0, 0.02), residual projections / sqrt(2L)
        for name, m in stack.named_modules():
            if isinstance(m, nn.Linear) and ".pos." not in name and name != "encoder.table":
                residual = name.endswith(("out_proj", "ff.2"))
                want = 0.02 / math.sqrt(2 * 3) if residual else 0.02
                assert m.weight.std().item() == pytest.approx(want, rel=0.15), name
                assert m.bias is None or torch.all(m.bias == 0)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("xl", ["w_r"]),
        ("deberta", ["w_kr", "w_qr"]),
        ("fox", ["proj"]),
        ("path", ["w_proj.0", "w_proj.1", "beta_proj"]),
    ],
)
def test_schemes_with_linears_start_them_as_their_authors_code(
    name: str, params: list[str]
) -> None:
    """N(0, 0.02) weights, zero biases, in every layer (residual scaling is the
    stack's, never theirs)."""
    torch.manual_seed(0)
    model = DecoderLM(vocab_size=7, encoder=name, n_layers=2, d_model=64, n_heads=4)
    for layer in model.stack.layers:
        pos = layer.self_attn.pos
        for p in params:
            lin = pos.get_submodule(p)
            assert lin.weight.std().item() == pytest.approx(0.02, rel=0.15), (name, p)
            assert lin.bias is None or torch.all(lin.bias == 0)
