"""Where one encoder's training step spends its time: the top operators of one step
under ``torch.profiler``, after the steps a benchmark round would have taken.

    python experiments/profile_step.py fire                 # the GPU check's size on a GPU
    python experiments/profile_step.py fire --batch 1 --length 256 --before 5 --top 8

The model and step are ``bench.py --sizes gpu``'s (4 layers, d_model 256, bf16 autocast
on a GPU; forward, loss, backward, clip, AdamW), so a ratio the GPU check reports can be
taken apart here. ``--before`` steps run first: learned parameters move as they would
in the benchmark's rounds (FIRE's threshold L, for one, which decides how much of the
bias goes through the per-pair MLP). Prints the table sorted by device time on a GPU,
by CPU time otherwise, and the step's wall time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import GPU, resolve_device
from bench_common import sync
from bench_train import make_model, random_batch, train_step

from posenc.encoders import available


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("encoder", help=f"one of {', '.join(available())}")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--before", type=int, default=12, help="steps run before the profiled one")
    p.add_argument("--top", type=int, default=15, help="rows of the table")
    p.add_argument("--compile", action="store_true", help="model.compile() first")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    args = p.parse_args(argv)
    if args.encoder not in available():
        p.error(f"encoder {args.encoder!r} is not registered; allowed: {', '.join(available())}")
    device = resolve_device(args.device)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    model, opt = make_model(args.encoder, GPU["model"], GPU["vocab"], device, args.length)
    if args.compile:
        model.compile()
    ids, tgt = random_batch(args.batch, args.length, GPU["vocab"], device, seed=args.length)
    for _ in range(args.before):
        train_step(model, opt, ids, tgt, autocast)
    sync(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        train_step(model, opt, ids, tgt, autocast)
        sync(device)
        seconds = time.perf_counter() - start
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.top))
    print(
        f"{args.encoder} @ {args.batch}x{args.length} on {device.type}"
        f"{' (compiled)' if args.compile else ''}: one step {seconds * 1e3:.1f} ms"
        f" after {args.before} steps"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
