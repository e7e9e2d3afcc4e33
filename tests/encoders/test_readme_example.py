"""The README's "Adding an encoder" example runs as written, with no edit to attention."""

from __future__ import annotations

import re

import torch

from posenc.encoders import registry
from posenc.encoders.base import AttnKind
from posenc.model import DecoderLM, EncoderDecoder
from tests.conftest import ROOT


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- example: adding-an-encoder -->\s*```python\n(.*?)```", text, re.S)
    assert block, "README lost its adding-an-encoder example"
    return block.group(1)


def test_readme_encoder_plugs_in_unchanged() -> None:
    namespace: dict = {}
    exec(compile(readme_example(), "README.md", "exec"), namespace)  # noqa: S102
    try:
        assert "my_alibi" in registry.available()
        enc = registry.build("my_alibi", d_model=16, n_heads=4, n_layers=1)
        # ALiBi's bias for head h is -slope_h * (i - j), slopes 2^(-8h/H): check by hand.
        pos = torch.arange(5)[None]
        ctx = enc.context(pos, pos, AttnKind.CAUSAL)
        hook = enc.for_attention(layer=0, kind=AttnKind.CAUSAL)
        bias = hook.score_bias(torch.zeros(1, 4, 5, 4), torch.zeros(1, 4, 5, 4), ctx)
        for h in range(4):
            slope = 2 ** (-8 * (h + 1) / 4)
            assert torch.allclose(bias[0, h, 4, 1], torch.tensor(-slope * 3.0))
        lm = DecoderLM(vocab_size=30, encoder="my_alibi", n_layers=2, d_model=16, n_heads=4)
        mt = EncoderDecoder(src_vocab_size=30, tgt_vocab_size=30, encoder="my_alibi",
                            n_layers=1, d_model=16, n_heads=4)
        ids = torch.randint(0, 30, (2, 9))
        (lm(ids).sum() + mt(ids, ids).sum()).backward()
    finally:
        registry._REGISTRY.pop("my_alibi", None)
