"""The native tiled copy/add (posenc/native/tiles.c) against PyTorch's ops, the
gradient of a key-major offset view that uses it, and DeBERTa's model step with and
without it."""

from __future__ import annotations

import functools

import pytest
import torch

from posenc import native
from posenc.encoders.base import offset_view
from posenc.encoders.deberta import DebertaRelative
from posenc.model.transformer import DecoderLM
from tests.conftest import require_native, set_native


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The native library built, and a record of each kernel call's ``accumulate``."""
    set_native(monkeypatch, True)
    require_native()
    record: list[bool] = []
    for dtype, fn in list(native._TILED.items()):
        monkeypatch.setitem(native._TILED, dtype, lambda *a, fn=fn: record.append(a[-2]) or fn(*a))
    return record


def sources(shape: tuple[int, int, int, int], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Sources of ``shape`` whose fast axis is not the last one."""
    b, h, i, j = shape
    width = i + j  # a Toeplitz view reads rows of width - 1 apart, without overlap
    return {
        "transposed": torch.randn(b, h, j, i, dtype=dtype).transpose(-1, -2),
        # key-major offset table read as (query, key), as DeBERTa's p2c part
        "key-major Toeplitz": torch.randn(b, h, j, width, dtype=dtype)
        .as_strided((b, h, j, i), (h * j * width, j * width, width - 1, 1), 3)
        .transpose(-1, -2),
        "broadcast over heads": torch.randn(b, 1, j, i, dtype=dtype)
        .transpose(-1, -2)
        .expand(b, h, i, j),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1, 5, 7), (2, 3, 70, 45), (2, 4, 130, 257)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_tiled_copy_and_add_equal_torch(
    dtype: torch.dtype, shape: tuple[int, int, int, int], accumulate: bool, calls: list[bool]
) -> None:
    """Every source form, sizes that are not multiples of the 32-wide tile, and one
    large enough for the threaded path (the transposed source of (2, 3, 70, 45) takes
    the kernel's I-inner loop, the others its J-inner one), into a column slice of a
    wider buffer (as the score buffer's parts are): each output is the one copy or add
    PyTorch's op makes, so the results are identical."""
    for name, src in sources(shape, dtype).items():
        base = torch.randn(*shape[:-1], shape[-1] + 9, dtype=dtype)
        want = base.clone()
        cols = want[..., 4 : 4 + shape[-1]]
        cols.add_(src) if accumulate else cols.copy_(src)
        calls.clear()
        native.copy_tiled(base[..., 4 : 4 + shape[-1]], src, accumulate=accumulate)
        assert calls == [accumulate], name
        assert torch.equal(base, want), name


def test_inputs_the_kernel_does_not_take_use_torch(calls: list[bool], monkeypatch) -> None:  # noqa: ANN001
    """Half precision, a contiguous or broadcast-along-J source, a source to broadcast,
    and POSENC_NATIVE=0: PyTorch's op, same result, no kernel call."""
    t = torch.randn(2, 2, 6, 5)
    t_across = t.transpose(-1, -2).contiguous().transpose(-1, -2)  # fast axis: I
    cases = [
        (torch.zeros(2, 2, 6, 5, dtype=torch.bfloat16), t_across.bfloat16()),
        (torch.zeros(2, 2, 6, 5), t),  # unit stride along J already
        (torch.zeros(2, 2, 6, 5), t[..., :1].expand(2, 2, 6, 5)),  # stride 0 along J
        (torch.zeros(2, 2, 6, 5), torch.randn(1, 2, 5, 6).transpose(-1, -2)),  # broadcast
    ]  # fmt: skip
    for dst, src in cases:
        want = dst.clone().add_(src)
        native.copy_tiled(dst, src, accumulate=True)
        torch.testing.assert_close(dst, want, atol=0, rtol=0)
    assert calls == []
    set_native(monkeypatch, False)
    dst = torch.zeros(2, 2, 6, 5)
    native.copy_tiled(dst, t_across)
    assert torch.equal(dst, t) and calls == []


def test_tiled_grad_offset_view_matches_autograd(calls: list[bool]) -> None:
    """A key-major offset table read through ``offset_view(tiled_grad=True)`` and
    transposed (DeBERTa's p2c): same values as the plain view, the same table gradient
    as autograd's ``as_strided`` backward, written by the kernel; entries no pair reads
    get zero."""
    table = torch.randn(2, 3, 40, 79, requires_grad=True)
    kwargs = {"row0": 7, "col0": 0, "lo": -46, "cols": 40}
    plain = offset_view(table, **kwargs)
    tiled = offset_view(table, tiled_grad=True, **kwargs)
    assert plain is not None and tiled is not None
    assert torch.equal(plain, tiled)
    upstream = torch.randn(2, 3, 40, 40)  # the (query, key) gradient, query-major
    (want,) = torch.autograd.grad((plain.transpose(-1, -2) * upstream).sum(), table)
    calls.clear()
    (got,) = torch.autograd.grad((tiled.transpose(-1, -2) * upstream).sum(), table)
    assert calls == [False]
    assert torch.equal(got, want)
    # pair (r, c) reads entry c - r + 39: row 0 reads entries 39..78 only
    assert got[..., 0, :39].abs().sum() == 0 and got[..., 0, 39:].abs().min() > 0


def test_tiled_grad_offset_view_differentiates_twice() -> None:
    """The view and its gradient are each other's adjoint, so gradcheck and
    gradgradcheck hold (float64, on whichever path is available)."""
    table = torch.randn(1, 2, 5, 11, dtype=torch.float64, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        view = offset_view(x, row0=0, col0=2, lo=-4, cols=5, tiled_grad=True)
        return view.transpose(-1, -2) ** 2

    assert torch.autograd.gradcheck(f, (table,))
    assert torch.autograd.gradgradcheck(f, (table,))


def test_deberta_step_is_the_same_with_and_without_the_kernel(
    calls: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decoder step whose keys outnumber DeBERTa's table rows four times over, so p2c
    is read off key-major tables in key chunks: the kernel adds them to the scores and
    writes their gradients, and the loss and every gradient equal PyTorch's path."""

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(0)
        encoder = functools.partial(DebertaRelative, max_distance=8, bucket_size=4)
        model = DecoderLM(vocab_size=11, d_model=32, n_heads=2, n_layers=2, encoder=encoder)
        tokens = torch.randint(0, 11, (2, 70))
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    loss, grads = step()
    assert calls.count(True) >= 2 and calls.count(False) >= 2  # adds forward, copies backward
    set_native(monkeypatch, False)
    calls.clear()
    loss_ref, grads_ref = step()
    assert calls == []
    torch.testing.assert_close(loss, loss_ref, atol=0, rtol=0)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, atol=0, rtol=0)
