"""KERPLE (Chi et al. 2022) against its kernels written out here from the paper's
formulas and the authors' GPT-NeoX code (log: -p log(1 + a d); power: -a d^p, d = i - j
under a causal mask), its initialisation and its projection onto r >= 0.01."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posenc.encoders.base import AttnKind
from posenc.encoders.kerple import EPS, Kerple
from posenc.train import train
from tests.conftest import compose_run


def oracle(form: str, r1: torch.Tensor, r2: torch.Tensor, t: int) -> torch.Tensor:
    """The authors' causal bias ``(H, T, T)`` in float64: their ``diff`` is
    ``tril(i - j)`` (0 above the diagonal, where the mask hides the keys)."""
    i = torch.arange(t, dtype=torch.float64)
    diff = (i[:, None] - i[None, :]).tril()
    p, a = r1.double()[:, None, None], r2.double()[:, None, None]
    if form == "log":
        return -p * torch.log(1 + a * diff)
    return -p * diff.pow(a)


@pytest.mark.parametrize("form", ["log", "power"])
@pytest.mark.parametrize("per_layer", [False, True])
def test_bias_is_the_authors_kernel(form: str, per_layer: bool) -> None:
    enc = Kerple(d_model=16, n_heads=4, n_layers=2, form=form, per_layer=per_layer).double()
    hook = enc.for_attention(layer=0, kind=AttnKind.CAUSAL).double()
    params = hook.own if per_layer else enc.kernel
    t = 12
    pos = torch.arange(t)[None]
    ctx = enc.context(pos, pos, AttnKind.CAUSAL)
    q = torch.zeros(1, 4, t, 4, dtype=torch.float64)
    got = hook.score_bias(q, q, ctx)[0]  # (H, T, T)
    want = oracle(form, params.r1.flatten(), params.r2.flatten(), t)
    seen = torch.ones(t, t, dtype=torch.bool).tril()
    # float32 kernel (as bf16/fp32 training computes it), rounded once
    torch.testing.assert_close(got[:, seen], want[:, seen], rtol=1e-6, atol=1e-6)
    assert (got[:, seen] <= 0).all() and (got.diagonal(dim1=-2, dim2=-1) == 0).all()
    # bidirectional attention: the same kernel of |i - j|, symmetric
    bi = enc.for_attention(layer=0, kind=AttnKind.BIDIRECTIONAL).double()
    if per_layer:
        bi.load_state_dict(hook.state_dict())
    sym = bi.score_bias(q, q, enc.context(pos, pos, AttnKind.BIDIRECTIONAL))[0]
    torch.testing.assert_close(sym, sym.transpose(-1, -2))
    torch.testing.assert_close(sym[:, seen], got[:, seen])


def test_initialisation_follows_the_authors() -> None:
    """log: multiplier ~ U(0, 2), scale ~ U(0, 1); power: multiplier ~ U(0, 1), exponent
    ~ U(0, 2); everything at least 0.01. 4096 heads put each range's ends in view."""
    torch.manual_seed(0)
    for form, (hi1, hi2) in {"log": (2.0, 1.0), "power": (1.0, 2.0)}.items():
        k = Kerple(d_model=4096, n_heads=4096, n_layers=1, form=form).kernel
        for r, hi in ((k.r1, hi1), (k.r2, hi2)):
            assert r.shape == (4096, 1, 1)
            assert r.min() == EPS and hi - 0.01 < r.max() <= hi
            assert abs(r.mean().item() - hi / 2) < 0.05 * hi


def test_projection_keeps_the_domain() -> None:
    k = Kerple(d_model=8, n_heads=2, n_layers=1, form="power").kernel
    with torch.no_grad():
        k.r1.copy_(torch.tensor([-1.0, 3.0]).view(2, 1, 1))
        k.r2.copy_(torch.tensor([5.0, 0.001]).view(2, 1, 1))
    k.project_()
    eps = torch.tensor(EPS).item()  # 0.01 in float32
    assert k.r1.flatten().tolist() == [eps, 3.0]
    assert k.r2.flatten().tolist() == [2.0, eps]


def test_training_projects_after_every_step(tmp_path: Path) -> None:
    """A large rate drives some r below 0.01 during training; after each optimizer step
    (so in the saved checkpoint too) every value is back in the domain, and the run's
    loss stays finite."""
    train(
        compose_run(
            tmp_path, "encoder=kerple", "encoder.form=power", "task.optim.lr=3.0",
            "task.optim.warmup_steps=0", "task.eval.multipliers=[1]",
        )
    )  # fmt: skip
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    r = {k: v for k, v in state["state_dict"].items() if "kernel.r" in k}
    assert set(r) == {"model.stack.encoder.kernel.r1", "model.stack.encoder.kernel.r2"}
    assert all(v.min() >= EPS for v in r.values())
    assert r["model.stack.encoder.kernel.r2"].max() <= 2.0


def test_unknown_form_is_refused() -> None:
    with pytest.raises(ValueError, match="kerple: unknown form 'exp'; allowed: log, power"):
        Kerple(d_model=8, n_heads=2, n_layers=1, form="exp")
