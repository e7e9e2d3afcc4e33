"""Section ``rope`` of ``experiments/bench.py``: RoPE forms against a memory-bound copy.

Notation: B batch, H heads, T positions, D head dim (all of it rotated here).

RoPE is elementwise: it reads q and k once and writes them once, so its floor is
the cost of one out-of-place elementwise pass over q and k. Each form below
rotates both q and k, as ``posenc.encoders.rope._RotateQK`` does. ``apply_rope``
runs the native kernel (``posenc/native/rope.c``) on the CPU when it is built; its
PyTorch forms, used otherwise, are timed as well.

q and k are laid out as the attention layer makes them: ``(B, H, T, D)`` views of a
``(B, T, H * D)`` projection, so the heads of a position are adjacent in memory. The
goal rows are timed on those. ``apply_rope`` on contiguous ``(B, H, T, D)`` tensors
(the kernel's other loop order) is timed too, with a copy of the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from bench_common import Goal, Row, interleaved
from torch import Tensor
from torch.utils.benchmark import Timer

from posenc import native
from posenc.encoders.base import AttnKind
from posenc.encoders.rope import RoPE, apply_rope

# The baseline. torch.add(x, 0) and x.clone() move the same bytes (allocate an
# output, read x once, write it once), but clone() goes to the copy kernel,
# while add goes through the same vectorised TensorIterator elementwise loop
# (threading grain, broadcasting machinery) that every eager RoPE form is made
# of. So add measures "one elementwise pass", which is what a perfectly fused
# RoPE would cost; clone is timed too, for information.
BASELINE = "copy: torch.add(x, 0)"
GOAL = Goal(">=", 0.9)


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim (GPT-NeoX / Hugging Face)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_rotate_half(x: Tensor, cos_full: Tensor, sin_full: Tensor) -> Tensor:
    """Naive ``half`` layout: ``x * cos + rotate_half(x) * sin`` with ``(1, 1, T, D)`` tables."""
    return x * cos_full + rotate_half(x) * sin_full


def rope_complex(x: Tensor, freqs: Tensor) -> Tensor:
    """``interleaved`` layout as a complex product; ``freqs (1, 1, T, D/2)`` complex64."""
    z = torch.view_as_complex(x.unflatten(-1, (-1, 2)))  # (B, H, T, D/2), a view
    return torch.view_as_real(z * freqs).flatten(-2)  # (B, H, T, D)


def dense_rotation(cos: Tensor, sin: Tensor) -> Tensor:
    """Block-diagonal ``R_t (T, D, D)``, interleaved layout, from ``(..., T, D/2)`` tables."""
    c, s = cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])  # (T, D/2)
    t, half = c.shape
    r = torch.zeros(t, half, 2, half, 2, dtype=c.dtype, device=c.device)
    i = torch.arange(half, device=c.device)
    r[:, i, 0, i, 0], r[:, i, 0, i, 1] = c, -s
    r[:, i, 1, i, 0], r[:, i, 1, i, 1] = s, c
    return r.reshape(t, 2 * half, 2 * half)


def rope_dense(x: Tensor, rot: Tensor) -> Tensor:
    """``x_t @ R_t^T`` for every position: ``(B, H, T, D) x (T, D, D)``."""
    return torch.einsum("bhtd,ted->bhte", x, rot)


def as_heads(flat: Tensor, heads: int) -> Tensor:
    """``(B, T, H * D) -> (B, H, T, D)`` view, as the attention layer leaves a projection."""
    return flat.unflatten(-1, (heads, flat.shape[-1] // heads)).transpose(1, 2)


def draw_qk(shape: tuple[int, int, int, int], gen: torch.Generator, device: torch.device) -> dict:
    """New q and k in both memory orders: as the attention layer makes them, and contiguous."""
    b, h, t, d = shape
    out = {}
    for which in ("q", "k"):
        out[which] = as_heads(torch.randn(b, t, h * d, generator=gen).to(device), h)
        out[which + "_contiguous"] = torch.randn(shape, generator=gen).to(device)
    return out


def make_inputs(shape: tuple[int, int, int, int], device: torch.device) -> dict[str, Tensor]:
    """q, k and every form's tables, the cos/sin ones exactly as the RoPE module caches them."""
    b, h, t, d = shape
    pos = torch.arange(t, device=device)[None]
    ctx = {  # what every layer of a forward pass reads, for each layout
        layout: RoPE(d_model=h * d, n_heads=h, n_layers=1, cache_len=t, layout=layout)
        .to(device)
        .context(pos, pos, AttnKind.CAUSAL)
        .extra
        for layout in ("interleaved", "half")
    }
    cos, sin = ctx["half"]["q_cos"], ctx["half"]["q_sin"]  # (1, 1, T, D/2)
    return {
        **draw_qk(shape, torch.Generator().manual_seed(0), device),
        "cos": cos,
        "sin": sin,
        # rope_factors of each layout, built once per forward pass by the module
        "factors_interleaved": ctx["interleaved"]["q_rot"],
        "factors_half": ctx["half"]["q_rot"],
        "cos_full": torch.cat((cos, cos), -1),  # (1, 1, T, D)
        "sin_full": torch.cat((sin, sin), -1),
        "freqs": torch.complex(cos, sin),  # (1, 1, T, D/2) complex64
        "rot": dense_rotation(cos, sin),  # (T, D, D)
    }


# Rows timed on contiguous (B, H, T, D) q and k: information, no goal.
CONTIGUOUS = "contiguous (B, H, T, D) q, k: "


def forms(x: dict[str, Tensor]) -> dict[str, tuple[str | None, Callable[[Tensor], Tensor]]]:
    """Name -> (layout it must agree with, or None for copies; the per-tensor function).
    Names starting with :data:`CONTIGUOUS` take the contiguous q and k."""
    cos, sin = x["cos"], x["sin"]

    def posenc(layout: str, native: bool = True) -> Callable[[Tensor], Tensor]:
        factors = x["factors_" + layout]
        return lambda t: apply_rope(t, cos, sin, layout, factors=factors, native=native)

    return {
        BASELINE: (None, lambda t: torch.add(t, 0)),
        "copy: x.clone()": (None, lambda t: t.clone()),
        "posenc apply_rope, interleaved": ("interleaved", posenc("interleaved")),
        "posenc apply_rope, half": ("half", posenc("half")),
        # What apply_rope runs where the native kernel is off or cannot be built.
        "posenc PyTorch form, interleaved": ("interleaved", posenc("interleaved", False)),
        "posenc PyTorch form, half": ("half", posenc("half", False)),
        "ref: dense block-diagonal R (interleaved)": (
            "interleaved",
            lambda t: rope_dense(t, x["rot"]),
        ),
        "ref: naive rotate_half, full tables (half)": (
            "half",
            lambda t: rope_rotate_half(t, x["cos_full"], x["sin_full"]),
        ),
        "ref: complex multiply (interleaved)": (
            "interleaved",
            lambda t: rope_complex(t, x["freqs"]),
        ),
        CONTIGUOUS + BASELINE: (None, lambda t: torch.add(t, 0)),
        CONTIGUOUS + "posenc apply_rope, interleaved": ("interleaved", posenc("interleaved")),
        CONTIGUOUS + "posenc apply_rope, half": ("half", posenc("half")),
    }


def inputs_of(name: str) -> tuple[str, str]:
    """The keys of the q and k a form is timed on."""
    return ("q_contiguous", "k_contiguous") if name.startswith(CONTIGUOUS) else ("q", "k")


def check_agreement(x: dict[str, Tensor], table: dict[str, Any]) -> dict[str, Any]:
    """Assert every RoPE form equals posenc's apply_rope of its layout; return the errors."""
    out = {}
    for name, (layout, fn) in table.items():
        if layout is None:
            continue
        for which in inputs_of(name):
            want = apply_rope(x[which], x["cos"], x["sin"], layout)
            got = fn(x[which])
            err = (got - want).abs().max().item()
            # float32 with |x| ~ 4: the dense form sums D products, so allow ~1e-5.
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{name} on {which}")
            out[f"{name} [{which}]"] = {"max_abs_err": err, "layout": layout, "ok": True}
    return out


def run(
    *, shape: tuple[int, int, int, int], rounds: int, number: int, device: torch.device
) -> dict[str, Any]:
    """Check the forms agree, then time each on q and k in interleaved rounds.

    Returns:
        ``{"config", "baseline", "checks", "rows"}`` with rows as :class:`Row`.
    """
    x = make_inputs(shape, device)
    table = forms(x)
    checks = check_agreement(x, table)
    gen = torch.Generator().manual_seed(1)

    def fresh_inputs() -> None:
        # New q and k each round: a copy and a rotation of 16 MB tensors straddle the
        # last-level cache, so one pair of buffers' place in memory moved whole runs'
        # ratios by 0.2-0.3 here; drawing new ones averages that out over the rounds.
        x.update(draw_qk(shape, gen, device))

    def measurer(name: str, fn: Callable[[Tensor], Tensor]) -> Callable[[], float]:
        # Timer runs the statement at the process's thread count (its default is
        # 1) and synchronises CUDA around the block.
        q, k = inputs_of(name)
        timer = Timer(
            stmt=f"fn(x['{q}']); fn(x['{k}'])",
            globals={"fn": fn, "x": x},
            num_threads=torch.get_num_threads(),
        )
        return lambda: timer.timeit(number).mean

    stats = interleaved(
        {name: measurer(name, fn) for name, (_, fn) in table.items()},
        baseline=BASELINE,
        rounds=rounds,
        before_round=fresh_inputs,
    )
    rows = [
        Row(
            what=name,
            median=s["median_s"],
            ratio=s["ratio"],
            goal=GOAL if name in ("posenc apply_rope, interleaved", "posenc apply_rope, half")
            else None,
            raw=s,
        )
        for name, s in stats.items()
    ]
    return {
        "config": {
            "shape_BHTD": list(shape),
            "q_k": "views (B, H, T, D) of (B, T, H * D) projections, as the attention "
            "layer makes them; rows marked contiguous: contiguous (B, H, T, D)",
            "dtype": "float32",
            "number": number,
            # apply_rope's path on these inputs: the native kernel or the PyTorch forms
            "apply_rope": "native" if native.rope_supported(x["q"], x["cos"], x["sin"])
            else f"pytorch ({native.build_error() or 'POSENC_NATIVE off or not the CPU'})",
        },
        "baseline": BASELINE,
        "unit": "seconds per call (q and k)",
        "checks": checks,
        "checks_passed": all(c["ok"] for c in checks.values()),
        "rows": rows,
    }
