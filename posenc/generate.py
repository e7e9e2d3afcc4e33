"""Generate text from a trained LM checkpoint.

    python -m posenc.generate outputs/lm/rope/<run>/checkpoints/best.ckpt \\
        --prompt "ROMEO:" --tokens 200 --temperature 0.8 --top-k 40 --seed 0

The checkpoint carries its run's config and tokenizer, so the prompt is encoded as in
training, without the training data (older checkpoints: the run directory's config and
data rebuild the tokenizer). Its tensors are checked against the digests stored in it: a
damaged file is refused. Decoding uses the key/value cache (``--no-cache``: re-run the
whole sequence each step; same tokens). Generation may run past the training length, as
far as the encoder allows.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from omegaconf import DictConfig, OmegaConf

from posenc.data.tokenizers import fingerprints, from_payload
from posenc.decoding.lm import generate
from posenc.errors import UserError
from posenc.progress import ticker
from posenc.schema import typed
from posenc.tasks.lm import LMTask
from posenc.tasks.lm_job import lm_datamodule
from posenc.training import checkpoints
from posenc.training.rundir import missing_checkpoint
from posenc.training.trainer import load_for_eval


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m posenc.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("ckpt", type=Path, help="an LM checkpoint (.ckpt) of a posenc run")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--tokens", type=int, default=200, help="new tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy decoding")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k best tokens")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--no-cache", action="store_true", help="decode without the KV cache")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Print the prompt and its continuation; bad input is one line and exit status 2."""
    args = _parse(argv)
    try:
        text = run(args)
    except (UserError, ValueError, FileNotFoundError) as err:
        print(f"posenc.generate: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


def _check_args(args: argparse.Namespace) -> None:
    """The numbers on the command line, before any work.

    Raises:
        ValueError: One is out of range (the message names it and what is allowed).
    """
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(
            f"--temperature {args.temperature}: must be a finite number >= 0 (0: greedy decoding)"
        )
    if args.tokens < 1:
        raise ValueError(f"--tokens {args.tokens}: must be at least 1")
    if args.top_k is not None and args.top_k < 1:
        raise ValueError(f"--top-k {args.top_k}: must be at least 1 (or left out: all tokens)")


def run_config(config: Path) -> DictConfig:
    """A run's recorded config, its ``${hydra:...}`` values (e.g. the tokenizer cache
    under the directory the run started from) read from the ``hydra.yaml`` beside it, so
    the config resolves outside a Hydra run."""
    text = config.read_text().replace("${hydra:", "${hydra.")
    cfg = OmegaConf.create(text)
    record = config.parent / "hydra.yaml"
    if record.is_file():
        cfg = OmegaConf.merge(cfg, OmegaConf.load(record))
    return cast(DictConfig, cfg)  # config.yaml is a mapping


def _config(ckpt_path: Path, saved: dict[str, Any]) -> DictConfig:
    """The run's config: the one the checkpoint carries, else its run directory's."""
    if "config" in saved:
        return OmegaConf.create(saved["config"])
    config = ckpt_path.resolve().parent.parent / ".hydra" / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(
            f"{ckpt_path} carries no config and {config} is not there: give a checkpoint "
            f"inside its posenc run directory (<run>/checkpoints/*.ckpt)"
        )
    return run_config(config)


def run(args: argparse.Namespace) -> str:
    """The generated text for the parsed arguments.

    A checkpoint carries its run's config and its tokenizer, so it generates on its own;
    one written before checkpoints carried the tokenizer (2026-11-26) rebuilds it from
    the training data that its run directory's config names.
    """
    _check_args(args)
    if not args.ckpt.is_file():
        raise FileNotFoundError(missing_checkpoint(args.ckpt))
    ckpt = checkpoints.load(args.ckpt)  # checked once: its tensors against their digests
    saved = ckpt.get("posenc") or {}
    cfg = _config(args.ckpt, saved)
    if cfg.task.name != "lm":
        raise ValueError(
            f"{args.ckpt} is a task={cfg.task.name} checkpoint; generation needs "
            f"a language model (task=lm)"
        )
    if "tokenizer_payload" in saved:
        tokenizer = from_payload(saved["tokenizer_payload"], str(args.ckpt))
    else:
        dm = lm_datamodule(typed(cfg))
        dm.setup()
        tokenizer = dm.tokenizer
    cfg.ckpt_path = str(args.ckpt)
    model = load_for_eval(LMTask, typed(cfg), tokenizer.vocab_size, fingerprints(tokenizer), ckpt)
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise ValueError(f"the prompt {args.prompt!r} encodes to no tokens; give some text")
    if tokenizer.unk_id in ids:
        unknown = sorted({c for c in args.prompt if tokenizer.encode(c) == [tokenizer.unk_id]})
        print(
            f"posenc.generate: note: the tokenizer does not know {''.join(unknown)!r} of the "
            f"prompt; the model reads it as its unknown token (printed as "
            f"{tokenizer.decode([tokenizer.unk_id])!r})",
            file=sys.stderr,
        )
    out = generate(
        model.model.eval(),
        torch.tensor([ids]),
        args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        use_cache=not args.no_cache,
        progress=_progress(args.tokens),
    )
    return tokenizer.decode(out[0].tolist())


def _progress(total: int) -> Callable[[int], None]:
    """A line on stderr every 10 s of a long generation (the text itself is printed
    whole at the end): tokens done, elapsed, ETA."""
    return ticker(
        total, "tokens", lambda line: print(f"posenc.generate: {line}", file=sys.stderr), last=False
    )


if __name__ == "__main__":
    sys.exit(main())
