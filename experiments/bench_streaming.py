"""StreamingLLM's evaluation at 16x the training length: each block of queries scoring
only the keys it can see (the sinks and a slice around its window), against every block
scoring all keys (the computation before keys were cut), in the same interleaved rounds.

    python experiments/bench_streaming.py [--encoder rope] [--batch 8] [--rounds 5]

What is timed is what ``task.eval.context_extension=[streaming]`` runs per test batch:
the default LM model (4 layers, d_model 128, 4 heads) trained at ``--seq-len`` 128,
a no-grad forward pass and its token NLL over ``--batch`` rows of 16x that length, with
the default cache (4 sinks, a window of the training length minus the sinks). It prints
the median seconds of each, the median per-round speed-up and the largest difference
between the two paths' NLLs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_common import fmt_seconds, interleaved, per_call_seconds

from posenc.encoders import available
from posenc.model import DecoderLM, streaming
from posenc.model.streaming import Streaming, refusal

VOCAB = 65  # TinyShakespeare's characters
SINKS = 4  # the paper's


def nll_pass(model: DecoderLM, ids: torch.Tensor, setting: Streaming) -> Callable[[], torch.Tensor]:
    """One evaluation batch under the streaming cache: per-token NLL ``(B, T-1)``."""

    def run() -> torch.Tensor:
        with torch.no_grad(), model.streaming(setting):
            logits = model(ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")

    return run


def with_cut(cut: bool, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``fn`` with keys cut to the visible ones (``cut``) or every key scored."""

    def run() -> torch.Tensor:
        before, streaming.SLICE_KEYS = streaming.SLICE_KEYS, cut
        try:
            return fn()
        finally:
            streaming.SLICE_KEYS = before

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--encoder", default="rope")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--multiplier", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.encoder not in available():
        allowed = ", ".join(available())
        parser.error(f"encoder {args.encoder!r} is not registered; allowed: {allowed}")
    if args.seq_len <= SINKS:
        parser.error(f"--seq-len {args.seq_len}: must be more than the {SINKS} sinks")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = DecoderLM(vocab_size=VOCAB, encoder=args.encoder, n_layers=4, d_model=128, n_heads=4)
    model.eval()
    if (why := refusal(model)) is not None:
        parser.error(f"encoder {args.encoder!r}: streaming does not apply: {why}")
    length = args.seq_len * args.multiplier
    ids = torch.randint(0, VOCAB, (args.batch, length + 1))
    setting = Streaming(SINKS, args.seq_len - SINKS)
    run = nll_pass(model, ids, setting)
    cut, every = with_cut(True, run), with_cut(False, run)
    diff = (cut() - every()).abs().max().item()
    device = torch.device("cpu")
    result = interleaved(
        {
            "every key": lambda: per_call_seconds(every, 1, device),
            "cut keys": lambda: per_call_seconds(cut, 1, device),
        },
        baseline="every key",
        rounds=args.rounds,
    )
    print(
        f"{args.encoder}, streaming {setting.sinks}+{setting.window} at {length} "
        f"({args.multiplier}x {args.seq_len}), batch {args.batch}, {args.threads} thread(s)"
    )
    for name, r in result.items():
        print(
            f"| {name} | {fmt_seconds(r['median_s'])} | {r['ratio']:.2f}x "
            f"[{r['ratio_min']:.2f}, {r['ratio_max']:.2f}] |"
        )
    print(f"largest NLL difference between the two: {diff:.2e}")


if __name__ == "__main__":
    main()
