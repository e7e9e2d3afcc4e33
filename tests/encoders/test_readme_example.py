"""The README's "Adding an encoder" example runs as written, with no edit to attention,
and its recipe (one file, one YAML, nothing else) passes the conformance tests."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

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


def readme_recipe() -> dict[str, str]:
    """The files the README's "Adding an encoder" section says to add: path -> text,
    with the paths read from its prose and the texts from its code blocks."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Adding an encoder\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "README lost its 'Adding an encoder' section"
    body = section.group(1)
    module = re.search(r"Put it in `(posenc/encoders/\w+\.py)`", body)
    config = re.search(r"add `(conf/encoder/\w+\.yaml)`", body)
    yaml = re.search(r"```yaml\n(.*?)```", body, re.S)
    assert module and config and yaml, "the section no longer names a file, a YAML and its text"
    return {module.group(1): readme_example(), config.group(1): yaml.group(1)}


#: The test files whose encoder cases run for the README's encoder (those parametrized
#: over conf/encoder/*.yaml that run in seconds), plus the registry check.
RECIPE_TESTS = ("tests/encoders/test_conformance.py", "tests/model/test_scored.py")


def test_readme_recipe_passes_the_conformance_tests(tmp_path: Path) -> None:
    """Follow the recipe in a copy of the tree, then run the tests it promises to pass.
    Fails if the README's code or paths break, or if a test needs more than the recipe
    (a list to extend, an edit in attention.py)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("posenc", "conf", "tests"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    recipe = readme_recipe()
    for rel, text in recipe.items():
        assert not (tmp_path / rel).exists(), f"{rel} is already in the tree"
        (tmp_path / rel).write_text(text)
    name = Path(next(r for r in recipe if r.endswith(".yaml"))).stem
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}  # the copy, not the installed posenc
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-v",
            "-p",
            "no:cacheprovider",
            *RECIPE_TESTS,
            "-k",
            f"{name} or registry",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    passed = [line for line in out.splitlines() if f"{name}]" in line and "PASSED" in line]
    assert len(passed) >= 10, f"too few cases ran for {name}:\n{out[-4000:]}"
    assert re.search(r"test_registry_lists_exactly_the_yaml_encoders PASSED", out), out[-4000:]


def test_readme_encoder_plugs_in_unchanged() -> None:
    namespace: dict = {}
    # A contributor who followed the recipe has the example registered already.
    kept = registry._REGISTRY.pop("my_kerple", None)
    exec(compile(readme_example(), "README.md", "exec"), namespace)
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
            assert math.isclose(bias[0, 0, 4, 1].item(), -ln2 * math.log(1 + 3 * ln2), rel_tol=1e-6)
            r1, r2 = math.log1p(math.e), math.log1p(math.exp(-1.0))  # softplus(1), softplus(-1)
            assert math.isclose(bias[0, 2, 1, 4].item(), -r1 * math.log(1 + 3 * r2), rel_tol=1e-6)
            assert bias[0, :, 3, 3].abs().max() == 0  # no penalty at distance 0
        lm = DecoderLM(vocab_size=30, encoder="my_kerple", n_layers=2, d_model=16, n_heads=4)
        mt = EncoderDecoder(
            src_vocab_size=30,
            tgt_vocab_size=30,
            encoder="my_kerple",
            n_layers=1,
            d_model=16,
            n_heads=4,
        )
        ids = torch.randint(0, 30, (2, 9))
        (lm(ids).sum() + mt(ids, ids).sum()).backward()
        grads = [p.grad for n, p in lm.named_parameters() if n.endswith(".raw")]
        assert len(grads) == 2 and all(g is not None and g.abs().sum() > 0 for g in grads)
    finally:
        registry._REGISTRY.pop("my_kerple", None)
        if kept is not None:
            registry._REGISTRY["my_kerple"] = kept
