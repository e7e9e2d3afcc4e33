"""What a training step keeps for its backward pass, per encoder, against ``none``: the
bytes of every tensor autograd saves during the forward pass (the memory that grows
with T x S for a score term), and the step's speed, measured in the same rounds.

    python experiments/bench_saved.py cope --length 1024     # CPU: about a minute

On a GPU the peak of a whole step is what ``bench.py --sections steps`` reports; this
counts the saved tensors alone, which a CPU can measure exactly.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import make_model, random_batch, train_step

from posenc.encoders import available

MODEL = {"n_layers": 2, "d_model": 64, "n_heads": 4, "d_ff": 256, "dropout": 0.0}


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of one forward."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids)
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("encoders", nargs="+", help=f"any of {', '.join(available())}")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3, help="timed steps per encoder")
    args = p.parse_args(argv)
    bad = [e for e in args.encoders if e not in available()]
    if bad:
        p.error(f"not registered: {', '.join(bad)}; allowed: {', '.join(available())}")
    torch.set_num_threads(1)
    device = torch.device("cpu")
    names = ["none", *[e for e in args.encoders if e != "none"]]
    ids, tgt = random_batch(1, args.length, 256, device, seed=0)
    models, saved = {}, {}
    for name in names:
        torch.manual_seed(0)
        models[name] = make_model(name, MODEL, 256, device, args.length)
        saved[name] = saved_bytes(models[name][0], ids)
        train_step(*models[name], ids, tgt, None)  # warm-up
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.rounds):  # interleaved: the machine's load falls on every encoder
        for name in names:
            start = time.perf_counter()
            train_step(*models[name], ids, tgt, None)
            times[name].append(time.perf_counter() - start)
    base_t, base_s = statistics.median(times["none"]), saved["none"]
    print(f"1x{args.length}, {MODEL}, one thread, median of {args.rounds} interleaved steps")
    print("| encoder | saved for backward | vs none | step | speed vs none |")
    print("|---|---|---|---|---|")
    for name in names:
        med = statistics.median(times[name])
        print(
            f"| {name} | {saved[name] / 2**20:.0f} MiB | {saved[name] / base_s:.1f}x "
            f"| {med * 1e3:.0f} ms | {base_t / med:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
