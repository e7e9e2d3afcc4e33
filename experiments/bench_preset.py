"""A preset's full training step per encoder, as ``python run.py`` trains it: data loader,
forward, backward, clipping, optimiser and Lightning's loop, timed from the end of one
step to the end of the next. Tokens/s in the steady state (after ``--warmup`` steps,
where ``model.compile=auto`` compiles) and peak GPU memory over those steps, each against
``none`` measured in the same run.

    python experiments/bench_preset.py [--preset lm_gpu] [--encoders none,rope,...]
        [--corpus DIR] [--quick] [--json OUT.json] [override ...]

The corpus: ``DIR/train.txt`` and ``DIR/val.txt`` (plain text), or by default a
synthetic one written to a temporary folder (random words: the speed of a step does not
depend on what the words say, and no dataset travels with the code). Each run writes
into a temporary folder that is removed afterwards (checkpoints of the full preset are
hundreds of MB); only the JSON stays. ``--quick``: tiny sizes, for a CPU. Any
``key=value`` argument is passed to the run, after the script's own.

The JSON has bench.py's shape (``meta``; ``sections.preset.rows``, one per encoder:
``what`` "step: <encoder> @ BxT", ``median`` seconds per step, ``ratio`` tokens/s against
``none``, ``raw`` the absolute figures), so experiments/gpu_check_report.py reads it.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import string
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posenc.errors import UserError  # noqa: E402
from posenc.preflight import register_resolvers  # noqa: E402  (after the path: run from anywhere)
from posenc.train import train  # noqa: E402
from posenc.training import job  # noqa: E402

BASELINE = "none"
#: Tiny sizes for a CPU (``--quick``): the same code path in seconds.
QUICK = [
    "model.n_layers=1",
    "model.d_model=32",
    "model.n_heads=2",
    "model.d_ff=64",
    "task.seq_len=32",
    "task.batch_size=4",
    "tokenizer.vocab_size=300",
    "trainer.precision=32-true",
]


def synthetic_corpus(folder: Path, train_chars: int, seed: int = 0) -> Path:
    """Write ``train.txt`` and ``val.txt`` of random lowercase words (40k distinct, 2-9
    letters, lines of about 100 characters) into ``folder``: text enough for a BPE
    vocabulary of 16k pieces and for batches of random windows, without any dataset.

    Returns:
        ``folder``.
    """
    rng = random.Random(seed)
    words = [
        "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(40000)
    ]

    def text(chars: int) -> str:
        lines, n = [], 0
        while n < chars:
            line = " ".join(rng.choices(words, k=16)) + "."
            lines.append(line)
            n += len(line) + 1
        return "\n".join(lines) + "\n"

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.txt").write_text(text(train_chars), encoding="utf-8")
    (folder / "val.txt").write_text(text(max(train_chars // 50, 20000)), encoding="utf-8")
    return folder


class StepClock(pl.Callback):
    """End-of-step times (the device synchronised) and tokens per step; peak memory is
    reset once the warm-up steps are done, so it covers the steady state only.

    Args:
        warmup: Steps before the steady state.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.ends: list[float] = []
        self.tokens = 0
        self.peak_mib: float | None = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        device = pl_module.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.ends.append(time.perf_counter())
        self.tokens = int(batch["input"].numel())
        if device.type != "cuda":
            return
        if len(self.ends) == self.warmup:
            torch.cuda.reset_peak_memory_stats(device)
        elif len(self.ends) > self.warmup:
            self.peak_mib = torch.cuda.max_memory_allocated(device) / 2**20

    def seconds_per_step(self) -> float:
        """Mean seconds of a steady-state step (end of step ``warmup`` to the last end)."""
        steady = self.ends[self.warmup - 1 :]
        return (steady[-1] - steady[0]) / (len(steady) - 1)


@contextmanager
def clocked(clock: StepClock) -> Iterator[None]:
    """posenc's trainer, with ``clock`` among its callbacks (job.fit builds it)."""
    build = job.build_trainer

    def with_clock(*args: Any, **kwargs: Any) -> pl.Trainer:
        if len(args) > 5:  # the task's callbacks, given by position
            args = (*args[:5], [*args[5], clock], *args[6:])
        else:
            kwargs["extra"] = [*kwargs.get("extra", ()), clock]
        return build(*args, **kwargs)

    job.build_trainer = with_clock  # type: ignore[assignment]
    try:
        yield
    finally:
        job.build_trainer = build  # type: ignore[assignment]


def run_overrides(args: argparse.Namespace, encoder: str, corpus: Path, run: Path) -> list[str]:
    """The command line of one measured run: the preset on the corpus, validated and
    evaluated once on one window (the step is what is measured), then the user's."""
    steps = args.warmup + args.steps
    return [
        f"experiment={args.preset}",
        f"encoder={encoder}",
        "data=text_files",
        f"data.source.train={corpus / 'train.txt'}",
        f"data.source.val={corpus / 'val.txt'}",
        "task.eval.splits=[val]",
        "task.eval.multipliers=[1]",
        "task.eval.protocols=[nonoverlap]",
        "task.eval.max_tokens=1",
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={steps}",
        "trainer.limit_val_batches=1",
        "trainer.enable_progress_bar=false",
        f"checkpoint_every_n_steps={steps}",
        f"paths.output_dir={run / encoder}",
        f"paths.cache_dir={run / 'cache'}",
        *(QUICK if args.quick else []),
        *args.overrides,
    ]


def measure(args: argparse.Namespace, encoder: str, corpus: Path, run: Path) -> dict[str, Any]:
    """One encoder's steady-state step: tokens/s, seconds per step, peak memory (CUDA
    only: None on a CPU), parameters; ``failed`` with the error's line if it raised."""
    clock = StepClock(args.warmup)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=run_overrides(args, encoder, corpus, run))
    try:
        with clocked(clock):
            metrics = train(cfg)
    except (UserError, RuntimeError) as err:  # RuntimeError: CUDA out of memory, say
        return {"failed": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
    finally:
        shutil.rmtree(run / encoder, ignore_errors=True)
    seconds = clock.seconds_per_step()
    return {
        "seconds_per_step": seconds,
        "tokens_per_step": clock.tokens,
        "tokens_per_s": clock.tokens / seconds,
        "peak_memory_mib": clock.peak_mib,
        "n_params": metrics.get("n_params"),
        "steps": args.steps,
        "warmup": args.warmup,
    }


def row(encoder: str, raw: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    """bench.py's row: ``ratio`` tokens/s against ``none``, ``raw.peak_ratio`` memory."""
    size = f"{raw.get('batch', '?')}x{raw.get('seq_len', '?')}"
    ratio = peak = None
    if base and "failed" not in raw and "failed" not in base:
        ratio = raw["tokens_per_s"] / base["tokens_per_s"]
        if raw["peak_memory_mib"] and base["peak_memory_mib"]:
            peak = raw["peak_memory_mib"] / base["peak_memory_mib"]
    raw = {**raw, "peak_ratio": peak}
    return {
        "what": f"step: {encoder} @ {size}",
        "median": raw.get("seconds_per_step"),
        "ratio": ratio,
        "raw": raw,
    }


def sizes(args: argparse.Namespace) -> tuple[int, int]:
    """(batch, seq_len) the preset trains at, with the overrides."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        extra = (QUICK if args.quick else []) + args.overrides
        cfg = compose("config", overrides=[f"experiment={args.preset}", *extra])
    return int(cfg.task.batch_size), int(cfg.task.seq_len)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="lm_gpu", help="conf/experiment/<preset>.yaml (an LM one)")
    p.add_argument(
        "--encoders", default="none,rope,alibi,t5,xl", help="comma-separated; none is added first"
    )
    p.add_argument(
        "--corpus", type=Path, help="a folder with train.txt and val.txt (default: synthetic)"
    )
    p.add_argument(
        "--corpus-chars", type=int, default=4_000_000, help="synthetic training text size"
    )
    p.add_argument(
        "--warmup", type=int, default=10, help="steps before the steady state (compilation)"
    )
    p.add_argument("--steps", type=int, default=30, help="steady-state steps timed")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a CPU")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("overrides", nargs="*", help="key=value for every run, after the script's")
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        p.error(f"--warmup and --steps must be >= 1, got {args.warmup} and {args.steps}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    register_resolvers()
    encoders = [BASELINE, *(e for e in args.encoders.split(",") if e and e != BASELINE)]
    batch, seq_len = sizes(args)
    meta = {
        "command": " ".join(["python", "experiments/bench_preset.py", *sys.argv[1:]]),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "preset": args.preset,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    report: dict[str, Any] = {"meta": meta, "sections": {"preset": {"rows": []}}}
    rows = report["sections"]["preset"]["rows"]
    with tempfile.TemporaryDirectory(prefix="posenc-bench-preset-") as tmp:
        corpus = args.corpus or synthetic_corpus(Path(tmp) / "corpus", args.corpus_chars)
        base: dict[str, Any] | None = None
        for encoder in encoders:
            raw = {
                **measure(args, encoder, corpus, Path(tmp) / "runs"),
                "batch": batch,
                "seq_len": seq_len,
            }
            base = raw if encoder == BASELINE else base
            rows.append(row(encoder, raw, base))
            print(json.dumps(rows[-1]), flush=True)
            if args.json:  # after every encoder: a time limit keeps the rows measured
                args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
