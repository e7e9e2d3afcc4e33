"""Section ``tiles`` of ``experiments/bench.py``: DeBERTa's key-major p2c part, added to
the scores and its gradient copied back, with ``posenc.native.copy_tiled`` against
PyTorch's ``add_`` and ``copy_`` (what posenc ran before it).

Notation: B batch, H heads, T queries of a causal block, W = cT keys of a p2c chunk (c:
``_DebertaAttention.p2c_chunk``), N = W + T - 1 distances per key, S keys of the block.

The position-to-content term is a key-major table ``(B, H, W, N)`` of per-key,
per-distance scores, read as a ``(T, W)`` block of the query-major score buffer (a
transposed Toeplitz view). The forward adds it into the buffer; the backward writes the
buffer's gradient slice back into a zero table through the same view. Both walk one
tensor across its memory order. The shapes are those of the training section's 2x1024
step (blocks of 128 queries, the last block's 1024 keys, its chunk on the diagonal).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from bench_common import Row, interleaved
from torch import Tensor
from torch.utils.benchmark import Timer

from posenc import native
from posenc.encoders.deberta import _DebertaAttention

BASELINE = "PyTorch"  # each group's baseline row starts with it
FORWARD, BACKWARD = "PyTorch add_ (forward)", "PyTorch copy_ (backward)"


def chunk_keys(t: int, s: int) -> int:
    """W: the keys of one p2c chunk, as DeBERTa's view path cuts them."""
    return min(s, t * _DebertaAttention.p2c_chunk)


def make_inputs(b: int, h: int, t: int, s: int, gen: torch.Generator) -> dict[str, Tensor]:
    """A score buffer and its gradient ``(B, H, T, S)``, a key-major table and a zero one
    for its gradient ``(B, H, W, N)``, with the chunk's views into them."""
    w = chunk_keys(t, s)
    n, c0 = w + t - 1, s - w  # the chunk of keys on the block's diagonal
    # key r, query i (the block's last T of S): distance entry w - 1 + i - r of row r
    geometry = ((b, h, w, t), (h * w * n, w * n, n - 1, 1), w - 1)
    scores, grad = (torch.randn(b, h, t, s, generator=gen) for _ in range(2))
    table, table_grad = torch.randn(b, h, w, n, generator=gen), torch.zeros(b, h, w, n)
    return {
        "dst": scores[..., c0 : c0 + w],
        "part": table.as_strided(*geometry).transpose(-1, -2),  # (B, H, T, W)
        "grad": grad[..., c0 : c0 + w].transpose(-1, -2),  # (B, H, W, T)
        "grad_dst": table_grad.as_strided(*geometry),
        "contiguous": torch.randn(b, h, t, w, generator=gen),
    }


def ops(x: dict[str, Tensor]) -> dict[str, dict[str, Callable[[], object]]]:
    """Baseline name -> {name: op}; each group is timed against its own baseline."""
    return {
        FORWARD: {
            FORWARD: lambda: x["dst"].add_(x["part"]),
            "posenc copy_tiled, add (forward)": lambda: native.copy_tiled(
                x["dst"], x["part"], accumulate=True
            ),
            "floor: add_ of a contiguous (T, W) block (forward)": lambda: x["dst"].add_(
                x["contiguous"]
            ),
        },
        BACKWARD: {
            BACKWARD: lambda: x["grad_dst"].copy_(x["grad"]),
            "posenc copy_tiled (backward)": lambda: native.copy_tiled(x["grad_dst"], x["grad"]),
        },
    }


def check_agreement(x: dict[str, Tensor]) -> dict[str, Any]:
    """The tiled add and copy give PyTorch's results, bit for bit."""
    want = x["dst"].clone().add_(x["part"])
    got = x["dst"].clone()
    native.copy_tiled(got, x["part"], accumulate=True)
    want_g, got_g = torch.zeros_like(x["grad_dst"]), torch.zeros_like(x["grad_dst"])
    want_g.copy_(x["grad"])
    native.copy_tiled(got_g, x["grad"])
    out = {}
    for name, (a, b) in {"add": (got, want), "copy": (got_g, want_g)}.items():
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"copy_tiled {name}")
        out[name] = {"max_abs_err": (a - b).abs().max().item(), "ok": True}
    return out


def run(
    *, shape: tuple[int, int, int, int], rounds: int, number: int, device: torch.device
) -> dict[str, Any]:
    """Check, then time each group in interleaved rounds with fresh inputs each round.

    Args:
        shape: ``(B, H, T, S)``.

    Returns:
        ``{"config", "baseline", "checks", "rows"}`` with rows as :class:`Row`.
    """
    if device.type != "cpu":
        return {"config": {"device": str(device)}, "baseline": "-", "rows": [
            Row(what="tiles", median=None, ratio=None, note="CPU only: CUDA uses PyTorch's ops")
        ]}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    x = make_inputs(*shape, gen)
    checks = check_agreement(x)

    def fresh_inputs() -> None:
        x.update(make_inputs(*shape, gen))

    def measurer(fn: Callable[[], object]) -> Callable[[], float]:
        timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
        return lambda: timer.timeit(number).mean

    rows = []
    for baseline, group in ops(x).items():
        # the closures read x[...] at call time, so fresh inputs reach them
        stats = interleaved(
            {name: measurer(fn) for name, fn in group.items()},
            baseline=baseline,
            rounds=rounds,
            before_round=fresh_inputs,
        )
        rows += [
            Row(what=name, median=s["median_s"], ratio=s["ratio"], raw=s)
            for name, s in stats.items()
        ]
    b, h, t, s = shape
    return {
        "config": {
            "shape_BHTS": list(shape),
            "table_BHWN": [b, h, chunk_keys(t, s), chunk_keys(t, s) + t - 1],
            "dtype": "float32",
            "number": number,
            "copy_tiled": "native"
            if native.library() is not None
            else f"pytorch ({native.build_error() or 'POSENC_NATIVE off'})",
        },
        "baseline": BASELINE,
        "unit": "seconds per call",
        "checks": checks,
        "checks_passed": all(c["ok"] for c in checks.values()),
        "rows": rows,
    }
