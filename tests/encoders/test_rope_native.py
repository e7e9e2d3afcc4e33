"""The native RoPE kernel (posenc/native/rope.c) against the formulas, its gradients,
the model path that uses it, and what happens when it cannot be built."""

from __future__ import annotations

import functools
import subprocess
import warnings

import pytest
import torch

from posenc import native
from posenc.encoders.rope import RoPE, apply_rope, rope_factors
from posenc.model.transformer import DecoderLM
from tests.conftest import require_native, set_native

pytestmark = pytest.mark.usefixtures("_kernel")


@pytest.fixture
def _kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    set_native(monkeypatch, True)
    require_native()


def textbook(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """Eq. (34) of RoFormer in float64, per pair, on the given tables; dims past R kept."""
    x, c, s = x.double(), cos.double(), sin.double()
    r = 2 * c.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    if layout == "interleaved":
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2)
    else:
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        out = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), -1)
    return torch.cat((out, rest), -1)


def tables(b: int, t: int, half: int, dtype: torch.dtype = torch.float32):  # noqa: ANN201
    ang = torch.rand(b, 1, t, half, dtype=torch.float64) * 50
    return ang.cos().to(dtype), ang.sin().to(dtype)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("shape", "rot"),
    [
        ((2, 3, 5, 8), 8),
        ((2, 3, 7, 10), 6),
        ((2, 4, 512, 64), 64),
        ((1, 2, 300, 64), 32),
        ((2, 5, 9, 32), 32),
        ((1, 3, 7, 128), 128),
        ((1, 3, 7, 128), 64),
    ],
)
def test_values_equal_the_textbook_form(layout, dtype, shape, rot) -> None:  # noqa: ANN001
    """Contiguous inputs (the kernel's positions-adjacent order), (B, T, H, D)-transposed
    ones as the attention layer makes them and a slice of a fused (B, T, 3, H, D)
    projection (its heads-adjacent order), shared and per-batch tables; the
    (2, 4, 512, 64) case is large enough to run on several threads. R = D = 32, 64 and
    128 take the kernel's loops compiled for those sizes, the other cases its general
    loop. The result keeps the memory order of its order of work."""
    b, h, t, d = shape
    inputs = {
        "contiguous": torch.randn(shape, dtype=dtype),
        "transposed": torch.randn(b, t, h, d, dtype=dtype).transpose(1, 2),
        "fused slice": torch.randn(b, t, 3, h, d, dtype=dtype)[:, :, 1].transpose(1, 2),
    }
    for name, x in inputs.items():
        for tb in (1, b):
            cos, sin = tables(tb, t, rot // 2)
            got = native.rope(x, cos, sin, layout)
            in_order = got if name == "contiguous" or h == 1 else got.transpose(1, 2)
            assert got.dtype == dtype and in_order.is_contiguous()
            tol = 1e-12 if dtype == torch.float64 else 2e-6
            want = textbook(x, cos, sin, layout)
            torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
            # apply_rope takes this path and agrees with its PyTorch form
            torch.testing.assert_close(apply_rope(x, cos, sin, layout), got)
            torch.testing.assert_close(
                apply_rope(x.float(), cos, sin, layout, native=False), got.float(),
                atol=2e-6, rtol=2e-6,
            )


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_threads_split_rows_anywhere(layout: str) -> None:
    """1, 2 and 3 threads give identical results where the work (3 x 5 x 301 rows)
    splits in the middle of a head and of a batch row, with per-batch tables, in both
    of the kernel's orders (heads or positions adjacent)."""
    cos, sin = tables(3, 301, 16)
    threads = torch.get_num_threads()
    for x in (torch.randn(3, 301, 5, 48).transpose(1, 2), torch.randn(3, 5, 301, 48)):
        try:
            outs = []
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                outs.append(native.rope(x, cos, sin, layout))
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        want = textbook(x, cos, sin, layout)
        torch.testing.assert_close(outs[0].double(), want, atol=2e-6, rtol=2e-6)


def test_sliced_tables_of_a_query_block() -> None:
    """A block of queries reads a slice of the tables: a row stride and an offset."""
    cos, sin = tables(1, 20, 4)
    x = torch.randn(2, 3, 6, 8)
    got = native.rope(x, cos[:, :, 9:15], sin[:, :, 9:15], "interleaved")
    want = textbook(x, cos[:, :, 9:15], sin[:, :, 9:15], "interleaved")
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("rot", [6, 4])
def test_gradients_to_second_order(layout: str, rot: int) -> None:
    """The backward is the same kernel with the sine negated (the transpose); checked
    numerically, twice differentiated, with tables that are not unit norm (YaRN)."""
    x = torch.randn(2, 2, 3, 6, dtype=torch.float64, requires_grad=True)
    cos, sin = tables(2, 3, rot // 2, torch.float64)
    cos, sin = cos * 1.3, sin * 1.3

    def fn(t: torch.Tensor) -> torch.Tensor:
        return native.rope(t, cos, sin, layout)

    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize(("d", "rot"), [(16, 12), (64, 64)])
@pytest.mark.parametrize("with_factors", [False, True])
def test_backward_equals_the_pytorch_form(
    layout: str, d: int, rot: int, with_factors: bool
) -> None:
    """The transposed rotation, through the general loop and the one for R = D = 64,
    with the interleaved pair table stacked from cos/sin or read from the factors."""
    x = torch.randn(2, 5, 3, d).transpose(1, 2).requires_grad_()
    w = torch.randn(2, 3, 5, d)
    cos, sin = tables(2, 5, rot // 2)
    fac = rope_factors(cos, sin, layout) if with_factors else None
    (want,) = torch.autograd.grad((apply_rope(x, cos, sin, layout, native=False) * w).sum(), x)
    (got,) = torch.autograd.grad((apply_rope(x, cos, sin, layout, factors=fac) * w).sum(), x)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_interleaved_reads_the_complex_factors_in_place() -> None:
    """The complex ``cos + i sin`` factors are the kernel's (cos, sin) pair table as they
    lie in memory, also as a view of a block of queries with per-batch tables: the
    result equals the table stacked from cos and sin, and the textbook form. Factors of
    other angles change the result, so the kernel does read them; float64 inputs, which
    complex64 factors do not fit, stack their table instead."""
    x = torch.randn(2, 3, 20, 16)
    cos, sin = tables(2, 30, 8)
    fac = rope_factors(cos, sin, "interleaved")
    blk = slice(7, 27)
    c, s, f = cos[:, :, blk], sin[:, :, blk], fac[:, :, blk]
    got = native.rope(x, c, s, "interleaved", factors=f)
    torch.testing.assert_close(got, native.rope(x, c, s, "interleaved"), atol=0, rtol=0)
    want = textbook(x, c, s, "interleaved")
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)
    other_c, other_s = tables(2, 20, 8)
    got = native.rope(x, c, s, "interleaved", factors=rope_factors(other_c, other_s, "interleaved"))
    torch.testing.assert_close(got, native.rope(x, other_c, other_s, "interleaved"))
    x64 = x.double()
    got = native.rope(x64, c, s, "interleaved", factors=f)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_tables_that_do_not_fit_are_an_error() -> None:
    cos, sin = tables(1, 4, 4)
    with pytest.raises(ValueError, match=r"tables \(1, 1, 4, 4\) do not fit x \(2, 2, 5, 8\)"):
        native.rope(torch.randn(2, 2, 5, 8), cos, sin, "half")
    with pytest.raises(ValueError, match="unknown layout 'pairs'"):
        apply_rope(torch.randn(2, 2, 4, 8), cos, sin, "pairs")


def test_what_the_kernel_does_not_take_goes_to_pytorch() -> None:
    cos, sin = tables(1, 4, 4)
    x = torch.randn(1, 2, 4, 8)
    assert native.rope_supported(x, cos, sin)
    assert not native.rope_supported(x.bfloat16(), cos, sin)
    assert not native.rope_supported(x, cos.requires_grad_(), sin)
    with pytest.raises(ValueError, match=r"takes a 4-d float32/float64 CPU x.*got a 4-d "
                       r"torch.bfloat16 x on cpu.*rope_supported\(\) first"):
        native.rope(x.bfloat16(), cos.detach(), sin, "half")
    xb = x.bfloat16()  # apply_rope rotates it in float32 with its PyTorch form
    torch.testing.assert_close(
        apply_rope(xb, cos.detach(), sin, "half"),
        apply_rope(xb.float(), cos.detach(), sin, "half").bfloat16(),
    )


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_a_model_step_is_the_same_on_both_paths(layout: str, monkeypatch) -> None:  # noqa: ANN001
    """One forward and backward of the decoder: the kernel runs for q and k in every
    layer (and again in the backward), and the loss and every gradient equal the
    PyTorch forms'."""
    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = DecoderLM(
            vocab_size=11, d_model=32, n_heads=2, n_layers=2,
            encoder=functools.partial(RoPE, layout=layout),
        )  # fmt: skip
        tokens = torch.randint(0, 11, (2, 24))
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    calls = []
    launch = native._launch
    monkeypatch.setattr(native, "_launch", lambda *a: calls.append(a[-1]) or launch(*a))
    loss, grads = step()
    assert calls.count(1.0) == 4 and calls.count(-1.0) == 4  # 2 layers x (q, k)
    set_native(monkeypatch, False)
    calls.clear()
    loss_ref, grads_ref = step()
    assert not calls
    torch.testing.assert_close(loss, loss_ref)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=1e-5)


def test_disabled_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    set_native(monkeypatch, False)
    assert native.library() is None
    assert not native.rope_supported(torch.randn(1, 1, 2, 4), *tables(1, 2, 2))


def test_the_switch_is_read_once_until_refreshed(monkeypatch: pytest.MonkeyPatch) -> None:
    """POSENC_NATIVE is read at the first call, not per call (it costs more than a
    small kernel call); refresh() reads it again."""
    set_native(monkeypatch, True)
    assert native.enabled()
    monkeypatch.setenv("POSENC_NATIVE", "off")
    assert native.enabled()
    native.refresh()
    assert not native.enabled() and native.library() is None


def test_a_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setattr(native, "_FUNCS", {})
    monkeypatch.setenv("POSENC_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setattr(native, "compiler", lambda: "false")
    cos, sin = tables(1, 4, 4)
    x = torch.randn(1, 2, 4, 8)
    with pytest.warns(RuntimeWarning, match="native kernels unavailable.*building posenc"):
        out = apply_rope(x, cos, sin, "half")
    torch.testing.assert_close(out.double(), textbook(x, cos, sin, "half"), atol=2e-6, rtol=2e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_rope(x, cos, sin, "half")  # no second warning
    assert native.build_error() is not None
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind


def test_a_build_is_cached(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setenv("POSENC_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setattr(native, "_FUNCS", {})
    assert native.library() is not None
    built = sorted(p.name for p in tmp_path.iterdir())
    assert len(built) == 1 and built[0].endswith(".so")

    def no_compiler(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("compiled again")

    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setattr(native, "_FUNCS", {})
    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert native.library() is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == built
