"""Generate text from a trained LM checkpoint.

    python -m posenc.generate outputs/lm/rope/<run>/checkpoints/best.ckpt \\
        --prompt "ROMEO:" --tokens 200 --temperature 0.8 --top-k 40 --seed 0

The run's own config (``<run>/.hydra/config.yaml``, next to ``checkpoints/``) gives the
data and tokenizer, so the prompt is encoded as in training. Decoding uses the
key/value cache (``--no-cache``: re-run the whole sequence each step; same tokens).
Generation may run past the training length, as far as the encoder allows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import cast

import torch
from omegaconf import DictConfig, OmegaConf

from posenc.tasks.generate import generate


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m posenc.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", type=Path, help="an LM checkpoint (.ckpt) of a posenc run")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--tokens", type=int, default=200, help="new tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy decoding")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k best tokens")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--no-cache", action="store_true", help="decode without the KV cache")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Print the prompt and its continuation; a clear message and exit 1 on bad input."""
    args = _parse(argv)
    try:
        text = run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"posenc.generate: {err}", file=sys.stderr)
        return 1
    print(text)
    return 0


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


def run(args: argparse.Namespace) -> str:
    """The generated text for the parsed arguments."""
    from posenc.runner import load_for_eval
    from posenc.tasks.lm import LMTask
    from posenc.tasks.lm_job import lm_datamodule

    if not args.ckpt.is_file():
        raise FileNotFoundError(f"no checkpoint at {args.ckpt}")
    config = args.ckpt.resolve().parent.parent / ".hydra" / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(
            f"{config} not found: give a checkpoint inside a posenc run directory "
            f"(<run>/checkpoints/*.ckpt), whose config says how its tokenizer was built"
        )
    cfg = run_config(config)
    if cfg.task.name != "lm":
        raise ValueError(f"{args.ckpt} is a task={cfg.task.name} checkpoint; generation needs "
                         f"a language model (task=lm)")
    dm = lm_datamodule(cfg)
    dm.setup()
    cfg.ckpt_path = str(args.ckpt)
    model = load_for_eval(LMTask, cfg, dm.vocab_size).model.eval()
    ids = dm.tokenizer.encode(args.prompt)
    if not ids:
        raise ValueError(f"the prompt {args.prompt!r} encodes to no tokens; give some text")
    out = generate(
        model,
        torch.tensor([ids]),
        args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        use_cache=not args.no_cache,
    )
    return dm.tokenizer.decode(out[0].tolist())


if __name__ == "__main__":
    sys.exit(main())
