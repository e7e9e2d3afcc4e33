"""Native CPU kernels, built on first use with the system's C compiler.

PyTorch's eager elementwise ops each make a pass over memory: a RoPE written with them
takes one pass for the interleaved layout (a complex product) and several for the
split-half one. ``rope.c`` rotates q or k in one pass for either layout, reading each
row of the tables once for several rows of q or k, and its backward (the transpose:
the same rotation with the sine negated) is the same kernel. It walks q or k in their
memory order and writes the result in the same order: the attention layer's q and k
are ``(B, H, T, D)`` views of a ``(B, T, H, D)`` projection, so their results are too
(see :func:`rope`). For the interleaved
layout it reads one table of (cos, sin) pairs laid out as the pairs of x
(:func:`rope`). ``tiles.c`` copies or adds a tensor whose fast axis is not the
destination's in cache-sized square tiles (DeBERTa's position-to-content term, a
key-major table added to query-major scores, and its gradient).

The library is compiled once per set of sources and compiler into ``$POSENC_NATIVE_CACHE``
(default ``~/.cache/posenc/native``) and loaded with :mod:`ctypes`; a build is
written under a temporary name and renamed, so parallel jobs sharing the cache do not
see half-written files. Without a C compiler, or with ``POSENC_NATIVE=0``, or on any
other device than the CPU, posenc uses its PyTorch forms (same values, slower): a
failed build warns once with the compiler's message and never stops a run.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

_SOURCES = [Path(__file__).with_name(name) for name in ("rope.c", "tiles.c")]
# Portable flags: no -march=native, since a cache in a shared home directory can be
# read by cluster nodes with other CPUs; rope.c asks GCC for an AVX2 clone of its loop,
# chosen at load time where the CPU has it.
_FLAGS = ["-O3", "-shared", "-fPIC", "-std=c11"]
_LOCK = threading.Lock()
# "on": POSENC_NATIVE's switch once read; "lib": CDLL | None once tried; "error": str
_STATE: dict[str, object] = {}
_FUNCS: dict[torch.dtype, ctypes._CFuncPtr] = {}  # dtype -> its RoPE kernel
_TILED: dict[torch.dtype, ctypes._CFuncPtr] = {}  # dtype -> its tiled copy/add
_KERNELS = {
    torch.float32: ("posenc_rope_f32", "posenc_tiled_f32", ctypes.c_float),
    torch.float64: ("posenc_rope_f64", "posenc_tiled_f64", ctypes.c_double),
}


def enabled() -> bool:
    """False when ``POSENC_NATIVE`` is ``0``/``false``/``no``/``off``.

    Read once per process, at the first kernel call, since reading the environment
    costs more than a small kernel call; :func:`refresh` reads it again."""
    on = _STATE.get("on")
    if on is None:
        value = os.environ.get("POSENC_NATIVE", "1").strip().lower()
        on = _STATE["on"] = value not in ("0", "false", "no", "off")
    return on  # type: ignore[return-value]


def refresh() -> None:
    """Read ``POSENC_NATIVE`` again at the next kernel call (after changing it at run time)."""
    _STATE.pop("on", None)


def cache_dir() -> Path:
    """Where built libraries go: ``$POSENC_NATIVE_CACHE`` or ``~/.cache/posenc/native``."""
    env = os.environ.get("POSENC_NATIVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "posenc" / "native"


def compiler() -> str | None:
    """The C compiler a build would use: $CC, else cc, gcc or clang on the PATH."""
    found = (c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c))
    return next(found, None)


def _build() -> ctypes.CDLL:
    """Compile the sources into one library (with OpenMP when the compiler has it)
    unless a build of the same sources, flags and compiler is cached; load it."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (tried $CC, cc, gcc, clang)")
    source = b"".join(path.read_bytes() for path in _SOURCES)
    attempts = [[*_FLAGS, "-fopenmp"], _FLAGS]  # clang on macOS has no -fopenmp
    errors = []
    for flags in attempts:
        key = hashlib.sha256(
            source + " ".join([shutil.which(cc) or cc, *flags, platform.machine()]).encode()
        ).hexdigest()[:16]
        target = cache_dir() / f"posenc_native_{key}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            proc = subprocess.run(
                [cc, *flags, *map(str, _SOURCES), "-o", tmp], capture_output=True, text=True
            )
            if proc.returncode != 0:
                os.unlink(tmp)
                errors.append(f"{cc} {' '.join(flags)}: {proc.stderr.strip()[-2000:]}")
                continue
            os.replace(tmp, target)
        lib = ctypes.CDLL(str(target))
        for dtype, (rope_name, tiled_name, ctype) in _KERNELS.items():
            fn = getattr(lib, rope_name)
            fn.restype = None
            pointers_and_sizes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 13
            fn.argtypes = [*pointers_and_sizes, ctypes.c_bool, ctype, ctypes.c_int]
            _FUNCS[dtype] = fn
            fn = getattr(lib, tiled_name)
            fn.restype = None
            sizes_and_strides = [ctypes.c_int64] * 11
            fn.argtypes = [ctypes.c_void_p] * 2 + sizes_and_strides + [ctypes.c_bool, ctypes.c_int]
            _TILED[dtype] = fn
        return lib
    names = " and ".join(f"posenc/native/{path.name}" for path in _SOURCES)
    raise RuntimeError(f"building {names} failed:\n" + "\n".join(errors))


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None when disabled or unbuildable (warns once why)."""
    if not enabled():
        return None
    if "lib" in _STATE:  # tried already: no lock on the per-call path
        return _STATE["lib"]  # type: ignore[return-value]
    with _LOCK:
        if "lib" not in _STATE:
            try:
                _STATE["lib"] = _build()
            except (OSError, RuntimeError) as err:
                _STATE["lib"], _STATE["error"] = None, str(err)
                warnings.warn(
                    f"posenc: native kernels unavailable, using the PyTorch forms "
                    f"(same values, slower). Set POSENC_NATIVE=0 to silence. Reason: {err}",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return _STATE["lib"]  # type: ignore[return-value]


def build_error() -> str | None:
    """Why the last build attempt failed (the compiler's message), or None."""
    return _STATE.get("error")  # type: ignore[return-value]


def rope_supported(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether :func:`rope` takes these inputs: CPU, float32/float64 ``x``, constant
    tables (no gradient), and the kernels available. :func:`try_rope` makes the same
    checks inline, without this call, on its per-call path."""
    return (
        x.is_cpu
        and x.dtype in _KERNELS
        and x.dim() == 4
        and not (cos.requires_grad or sin.requires_grad)
        and library() is not None
    )


# The complex dtype whose (real, imaginary) pairs are the kernel's (cos, sin) pairs.
_PAIRED = {torch.float32: torch.complex64, torch.float64: torch.complex128}


def _launch(
    x: Tensor, tab: Tensor, tab2: Tensor, strides: tuple[int, int, int], layout: str, sign: float
) -> Tensor:
    """One kernel call on ``x (B, H, T, D)`` with tables and ``(R, cs0, cs1)`` from
    :func:`rope` (strides in elements of ``x``'s dtype). The result is laid out in the
    memory order the kernel walks (``rope.c``): a view of a ``(B, T, H, D)`` tensor when
    x's heads are adjacent, as the attention layer's q and k, else contiguous."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    nb, nh, nt, d = x.shape
    xs = x.stride()
    if xs[1] < xs[2]:
        y = torch.empty((nb, nt, nh, d), dtype=x.dtype).transpose(1, 2)
    else:
        y = torch.empty((nb, nh, nt, d), dtype=x.dtype)
    ys = y.stride()
    rot, cs0, cs1 = strides
    _FUNCS[x.dtype](
        x.data_ptr(), y.data_ptr(), tab.data_ptr(), tab2.data_ptr(),
        nb, nh, nt, d, rot, xs[0], xs[1], xs[2], ys[0], ys[1], ys[2], cs0, cs1,
        layout == "half", sign, torch.get_num_threads(),
    )  # fmt: skip
    return y


class _Rope(torch.autograd.Function):
    """``[[c, -s], [s, c]]`` on every pair (``s`` times ``sign``). The gradient is the
    transpose, the same map with ``-sign``, so it differentiates to any order. Tables
    need not be unit norm (YaRN folds its temperature into them)."""

    @staticmethod
    def forward(ctx, x, tab, tab2, strides, layout, sign):  # noqa: ANN001, ANN205
        ctx.save_for_backward(tab, tab2)
        ctx.strides, ctx.layout, ctx.sign = strides, layout, sign
        return _launch(x, tab, tab2, strides, layout, sign)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        tab, tab2 = ctx.saved_tensors
        out = _Rope.apply(grad, tab, tab2, ctx.strides, ctx.layout, -ctx.sign)
        return out, None, None, None, None, None


def rope(
    x: Tensor, cos: Tensor, sin: Tensor, layout: str, *, factors: Tensor | None = None
) -> Tensor:
    """Rotate the first ``R = 2 * cos.shape[-1]`` dims of ``x (B, H, T, D)`` (the rest
    pass through), as :func:`posenc.encoders.rope.apply_rope`.

    The ``half`` layout reads ``cos`` and ``sin``. The ``interleaved`` one reads one
    table of ``(cos_i, sin_i)`` pairs laid out as the pairs of ``x``, so that one vector
    load brings the factors of four pairs: the complex ``factors`` are that table
    already (their real and imaginary parts alternate in memory); without them it is
    stacked here, one pass over the tables.

    Args:
        x: ``(B, H, T, D)`` float32 or float64, any strides with a unit last one.
        cos: ``(B|1, 1, T, R/2)`` cosines of the angles; sin: their sines.
        layout: ``interleaved`` or ``half``.
        factors: Optional :func:`posenc.encoders.rope.rope_factors` of the tables.

    Returns:
        A new ``(B, H, T, D)`` tensor of ``x.dtype``: a view of a ``(B, T, H, D)`` one
        when the heads of ``x`` are adjacent in memory (stride 1 < stride 2, as the
        attention layer's q and k), else contiguous.

    Raises:
        ValueError: The tables do not fit ``x``, or :func:`rope_supported` is false.
    """
    out = try_rope(x, cos, sin, layout, factors)
    if out is None:
        why = build_error() or ("POSENC_NATIVE is off" if not enabled() else None)
        raise ValueError(
            f"rope: the native kernel takes a 4-d float32/float64 CPU x and tables without "
            f"gradient; got a {x.dim()}-d {x.dtype} x on {x.device}, tables requiring grad: "
            f"{cos.requires_grad or sin.requires_grad}{f' ({why})' if why else ''}. "
            f"Check rope_supported() first, or call posenc.encoders.rope.apply_rope, "
            f"which falls back to the PyTorch forms"
        )
    return out


def try_rope(
    x: Tensor, cos: Tensor, sin: Tensor, layout: str, factors: Tensor | None = None
) -> Tensor | None:
    """:func:`rope` where :func:`rope_supported`, else None: the check and the call in
    one step, since apply_rope runs this for q and k in every layer."""
    if not x.is_cpu or x.dim() != 4 or cos.requires_grad or sin.requires_grad:
        return None
    dtype = x.dtype
    # Switched on and built: no call. Otherwise library() reads the switch, builds once.
    if not (_STATE.get("on") and dtype in _FUNCS) and (library() is None or dtype not in _FUNCS):
        return None
    cshape, xshape = cos.shape, x.shape
    if cshape[-2] != xshape[-2] or cshape[0] not in (1, xshape[0]) or 2 * cshape[-1] > xshape[-1]:
        raise ValueError(
            f"rope: tables {tuple(cshape)} do not fit x {tuple(xshape)}: need "
            f"(B|1, 1, T, R/2) with T={xshape[-2]} and R <= {xshape[-1]}"
        )
    scale = 1
    if layout == "half":
        if cos.dtype != dtype:
            cos, sin = cos.to(dtype), sin.to(dtype)
        if cos.stride(-1) != 1 or sin.stride() != cos.stride():
            cos, sin = cos.contiguous(), sin.contiguous()
        tab, tab2 = cos, sin
    else:
        if (
            factors is not None
            and factors.dtype == _PAIRED[dtype]
            and factors.shape == cshape
            and factors.stride(-1) == 1
        ):
            tab, scale = factors, 2  # strides in complex elements: two reals each
        else:
            tab = torch.stack((cos, sin), -1).flatten(-2).to(dtype).contiguous()
        tab2 = tab  # not read for this layout
    cs0 = scale * tab.stride(0) if cshape[0] > 1 else 0
    strides = (2 * cshape[-1], cs0, scale * tab.stride(-2))
    if x.requires_grad and torch.is_grad_enabled():
        return _Rope.apply(x, tab, tab2, strides, layout, 1.0)
    return _launch(x, tab, tab2, strides, layout, 1.0)  # no graph to record: skip autograd


def copy_tiled(dst: Tensor, src: Tensor, *, accumulate: bool = False) -> None:
    """``dst.copy_(src)``, or ``dst.add_(src)`` with ``accumulate``, in square tiles.

    For a ``src`` whose fast axis is not ``dst``'s (a transposed or key-major view):
    row-order element loops, as PyTorch's, read such a source one cache line per
    element; ``tiles.c`` reads and writes a cache-sized block at a time. Other inputs,
    or without the native library, take PyTorch's op (same values: each output element
    is one add or copy either way).

    Args:
        dst: ``(B, H, I, J)`` CPU tensor with a unit stride along J, written in place.
        src: Same shape and dtype (float32 or float64 for the kernel), any strides.
    """
    if (
        dst.device.type == "cpu"
        and src.device == dst.device
        and dst.dtype == src.dtype
        and dst.dtype in _KERNELS
        and dst.dim() == 4
        and src.shape == dst.shape
        and dst.stride(-1) == 1
        and src.stride(-1) > 1  # not contiguous or broadcast along J
        and library() is not None
    ):
        ds, ss = dst.stride(), src.stride()
        _TILED[dst.dtype](
            dst.data_ptr(), src.data_ptr(), *dst.shape, ds[0], ds[1], ds[2], *ss,
            accumulate, torch.get_num_threads(),
        )  # fmt: skip
    elif accumulate:
        dst.add_(src)
    else:
        dst.copy_(src)
