"""Which kernel trains a learned relative bias fastest on a GPU: one causal attention
layer's forward and backward with T5's bias (a learned value per head and clipped
offset), each way against SDPA without a bias, measured in the same rounds.

    python experiments/probe_flex_bias.py                  # 4x4096, bf16, 4 heads of 64
    python experiments/probe_flex_bias.py --batch 1 --length 256 --rounds 2   # a CPU try

Ways (every bias gradient checked against the explicit way's):
  sdpa           SDPA without a bias (the baseline)
  flex           FlexAttention without a bias (its own kernel's cost)
  flex_<tiles>   the same with other forward tiles (TILES, as kernel_options)
  explicit       SDPA with the bias as an additive (1, H, T, S) mask: posenc's GPU path
  flex_table     FlexAttention reading the (H, 2M+1) table per pair: its backward adds
                 every pair's gradient into a few entries (atomics)
  flex_dense     FlexAttention reading a (H, T, S) bias built once per pass from the
                 table (a Toeplitz view): the batch shares it, so few atomics collide

Prints median milliseconds per forward+backward, the ratio of speed against ``sdpa``
and peak memory against ``sdpa``'s. On a CPU FlexAttention has no backward (torch
2.13): only the SDPA ways run there.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc.encoders.offsets import offset_view

#: FlexAttention's tile sizes tried beside its defaults (forward: BLOCK_M queries by
#: BLOCK_N keys; the backward keeps its own defaults).
TILES = {
    "m128n64": {"BLOCK_M": 128, "BLOCK_N": 64},
    "m128n128w8": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8},
    "m64n128": {"BLOCK_M": 64, "BLOCK_N": 128},
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--max-distance", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    b, h, t, d, m = args.batch, args.heads, args.length, args.dim, args.max_distance
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=gen).to(device, dtype) for _ in range(3))
    for x in (q, k, v):
        x.requires_grad_(True)
    table = (torch.randn(h, 2 * m + 1, generator=gen) * 0.5).to(device).requires_grad_(True)
    grad_out = torch.randn(b, h, t, d, generator=gen).to(device, dtype)
    n = torch.arange(-(t - 1), 2, device=device).clamp(-m, m) + m  # offsets j - i
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()

    def dense() -> Tensor:  # (H, T, S): table row per offset, read as a Toeplitz view
        rows = table.to(dtype)[:, n].unsqueeze(1).expand(h, t, n.numel()).contiguous()
        view = offset_view(rows, row0=0, col0=0, lo=-(t - 1), cols=t)
        assert view is not None
        return view

    ways: dict[str, Callable[[], Tensor]] = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "explicit": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=dense().masked_fill(~causal, float("-inf"))[None]
        ),
    }
    if cuda:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention)
        mask = create_block_mask(lambda b_, h_, i, j: i >= j, None, None, t, t, device=device)

        def per_pair(score: Tensor, b_: Tensor, h_: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return score + table[h_, (j - i).clamp(-m, m) + m].to(score.dtype)

        def with_dense() -> Tensor:
            bias = dense()
            return flex(
                q, k, v, score_mod=lambda s, b_, h_, i, j: s + bias[h_, i, j], block_mask=mask
            )

        ways["flex"] = lambda: flex(q, k, v, block_mask=mask)
        for name, options in TILES.items():
            ways[f"flex_{name}"] = lambda o=options: flex(
                q, k, v, block_mask=mask, kernel_options=o
            )
        ways |= {
            "flex_table": lambda: flex(q, k, v, score_mod=per_pair, block_mask=mask),
            "flex_dense": with_dense,
        }

    def step(fn: Callable[[], Tensor]) -> tuple[Tensor, Tensor | None]:
        for x in (q, k, v, table):
            x.grad = None
        out = fn()
        out.backward(grad_out)
        return out.detach(), None if table.grad is None else table.grad.detach().clone()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    ref_out, ref_grad = step(ways["explicit"])
    usable: dict[str, Callable[[], Tensor]] = {}
    for name, fn in ways.items():
        try:
            out, grad = step(fn)  # compiles
            step(fn)
            sync()
        except Exception as e:  # a way that fails is reported; the others run
            print(f"{name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue
        if grad is not None:
            err = (grad - ref_grad).abs().max().item() / ref_grad.abs().max().item()
            print(f"{name}: table gradient vs explicit, max relative error {err:.2e}")
        usable[name] = fn
    times: dict[str, list[float]] = {name: [] for name in usable}
    peaks: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, fn in usable.items():
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            step(fn)
            sync()
            times[name].append(time.perf_counter() - start)
            if cuda:
                peaks[name] = torch.cuda.max_memory_allocated() / 2**20
    base = statistics.median(times["sdpa"])
    print(f"\n{b}x{t}, {h} heads of {d}, {dtype}, {device}; forward+backward of one layer")
    print("| way | median ms | speed vs sdpa | peak MiB | memory vs sdpa |\n|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        peak = peaks.get(name, float("nan"))
        ratio = peak / peaks["sdpa"] if peaks else float("nan")
        print(f"| {name} | {med * 1e3:.2f} | {base / med:.2f} | {peak:,.0f} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
