"""The README's "Adding an encoder" example runs as written, with no edit to attention."""

from __future__ import annotations

import math
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
        assert "my_kerple" in registry.available()
        enc = registry.build("my_kerple", d_model=16, n_heads=4, n_layers=1)
        # KERPLE-log's bias is -r1 * log(1 + r2 * |i - j|); at init r1 = r2 = softplus(0)
        # = ln 2, so query 4 on key 1 (distance 3) gets -ln2 * ln(1 + 3 ln2) in every head.
        pos = torch.arange(5)[None]
        hook = enc.for_attention(layer=0, kind=AttnKind.CAUSAL)
        with torch.no_grad():
            hook.raw[:, 2] = torch.tensor([[[1.0]], [[-1.0]]])  # head 2: other r1, r2
        for kind in (AttnKind.CAUSAL, AttnKind.BIDIRECTIONAL):
            ctx = enc.context(pos, pos, kind)
            bias = hook.score_bias(torch.zeros(1, 4, 5, 4), torch.zeros(1, 4, 5, 4), ctx)
            ln2 = math.log(2.0)
            assert math.isclose(bias[0, 0, 4, 1].item(), -ln2 * math.log(1 + 3 * ln2),
                                rel_tol=1e-6)
            r1, r2 = math.log1p(math.e), math.log1p(math.exp(-1.0))  # softplus(1), softplus(-1)
            assert math.isclose(bias[0, 2, 1, 4].item(), -r1 * math.log(1 + 3 * r2),
                                rel_tol=1e-6)
            assert bias[0, :, 3, 3].abs().max() == 0  # no penalty at distance 0
        lm = DecoderLM(vocab_size=30, encoder="my_kerple", n_layers=2, d_model=16, n_heads=4)
        mt = EncoderDecoder(src_vocab_size=30, tgt_vocab_size=30, encoder="my_kerple",
                            n_layers=1, d_model=16, n_heads=4)
        ids = torch.randint(0, 30, (2, 9))
        (lm(ids).sum() + mt(ids, ids).sum()).backward()
        grads = [p.grad for n, p in lm.named_parameters() if n.endswith(".raw")]
        assert len(grads) == 2 and all(g is not None and g.abs().sum() > 0 for g in grads)
    finally:
        registry._REGISTRY.pop("my_kerple", None)
