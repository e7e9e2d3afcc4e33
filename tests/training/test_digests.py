"""The digests a checkpoint carries of its tensors (posenc/training/digests.py); the load
paths that check them are in tests/training/test_checkpoints.py."""

from __future__ import annotations

import pytest
import torch

from posenc.errors import CheckpointError
from posenc.training import digests


def _checkpoint() -> dict:
    return {
        "state_dict": {"w": torch.randn(3, 4), "h": torch.randn(2).bfloat16()},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "m": torch.ones(3, 4)}}}],
        "global_step": 3,
    }


def test_every_tensor_has_a_digest_named_by_its_path() -> None:
    sealed = digests.seal(_checkpoint())
    assert sealed[digests.KEY]["algorithm"] == digests.ALGORITHM
    assert sorted(sealed[digests.KEY]["tensors"]) == [
        "optimizer_states.0.state.0.m",
        "optimizer_states.0.state.0.step",
        "state_dict.h",
        "state_dict.w",
    ]
    assert digests.mismatches(sealed) == ""


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda c: c["state_dict"]["h"].add_(1), "state_dict.h"),  # bfloat16
        (
            lambda c: c["optimizer_states"][0]["state"][0]["step"].add_(1),
            "optimizer_states.0.state.0.step",
        ),
        # the same bytes read as another dtype or shape are other numbers
        (
            lambda c: c["state_dict"].update(w=c["state_dict"]["w"].view(torch.int32)),
            "state_dict.w",
        ),
        (lambda c: c["state_dict"].update(w=c["state_dict"]["w"].reshape(4, 3)), "state_dict.w"),
    ],
)
def test_a_changed_value_dtype_or_shape_is_named(edit, named: str) -> None:  # type: ignore[no-untyped-def]
    sealed = digests.seal(_checkpoint())
    edit(sealed)
    assert (
        digests.mismatches(sealed) == f"tensor {named} does not match the digest stored in the file"
    )
    with pytest.raises(CheckpointError, match=f"checkpoint x.ckpt is damaged: tensor {named} "):
        digests.check("x.ckpt", sealed)


def test_missing_and_added_tensors_are_named() -> None:
    sealed = digests.seal(_checkpoint())
    sealed["state_dict"]["extra"] = sealed["state_dict"].pop("w")
    assert digests.mismatches(sealed) == (
        "tensor state_dict.w is missing; tensor state_dict.extra has no digest"
    )


def test_many_mismatches_name_three_and_count_the_rest() -> None:
    ckpt = {"state_dict": {f"t{i}": torch.zeros(2) for i in range(5)}}
    sealed = digests.seal(ckpt)
    for t in sealed["state_dict"].values():
        t.add_(1)
    assert digests.mismatches(sealed).startswith(
        "tensor state_dict.t0, state_dict.t1, state_dict.t2 and 2 more "
    )


def test_a_checkpoint_without_digests_has_none() -> None:
    assert digests.mismatches(_checkpoint()) is None


def test_a_file_is_hashed_once_until_it_changes(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A run loads one checkpoint several times (config check, model, restore): its
    tensors are hashed once; a file written again is hashed again, and its damage found."""
    path = tmp_path / "a.ckpt"
    sealed = digests.seal(_checkpoint())
    torch.save(sealed, path)
    calls = []
    real = digests.digests
    monkeypatch.setattr(digests, "digests", lambda c: calls.append(1) or real(c))
    for _ in range(3):
        digests.check(path, torch.load(path, weights_only=True))
    assert len(calls) == 1
    sealed["state_dict"]["w"].add_(1)
    torch.save(sealed, path)
    import os

    os.utime(path, ns=(1, 1))  # another mtime even where the clock is coarse
    with pytest.raises(CheckpointError, match="state_dict.w does not match"):
        digests.check(path, torch.load(path, weights_only=True))
