"""Checks of a composed config, run before any data is loaded.

Each problem is one line: the key, the value, what is allowed. All problems are
reported together so a sweep with a typo fails in a second, not after a download.
"""

from __future__ import annotations

from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf


class ConfigError(ValueError):
    """A config value is wrong; the message lists every problem found."""


def _positive_int(problems: list[str], key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        problems.append(f"{key}={value!r}: must be a positive integer")


def eval_lengths(cfg: DictConfig) -> list[int]:
    """Absolute LM evaluation lengths: ``multiplier * seq_len``."""
    return [int(m * cfg.task.seq_len) for m in cfg.task.eval.multipliers]


def validate(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` listing every problem found in ``cfg``.

    Args:
        cfg: The composed run config.
    """
    problems: list[str] = []
    missing = OmegaConf.missing_keys(cfg)
    problems += [f"{k}: required but not set (add {k}=... to the command)" for k in sorted(missing)]
    m = cfg.model
    for key in ("n_layers", "d_model", "n_heads"):
        _positive_int(problems, f"model.{key}", m[key])
    if not problems and m.d_model % m.n_heads:
        problems.append(f"model.n_heads={m.n_heads}: must divide model.d_model={m.d_model}")
    if not 0.0 <= float(m.dropout) < 1.0:
        problems.append(f"model.dropout={m.dropout}: must be in [0, 1)")
    if cfg.task.name == "lm":
        _validate_lm(cfg, problems)
    if not problems:
        _try_encoder(cfg, problems)
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def _validate_lm(cfg: DictConfig, problems: list[str]) -> None:
    t = cfg.task
    for key in ("seq_len", "batch_size", "eval_batch_size"):
        _positive_int(problems, f"task.{key}", t[key])
    for mult in t.eval.multipliers:
        if not isinstance(mult, int | float) or mult <= 0:
            problems.append(f"task.eval.multipliers contains {mult!r}: must be positive numbers")
    allowed = ("nonoverlap", "sliding")
    for p in t.eval.protocols:
        if p not in allowed:
            problems.append(f"task.eval.protocols contains {p!r}: allowed {', '.join(allowed)}")
    if t.eval.sliding_stride is not None:
        _positive_int(problems, "task.eval.sliding_stride", t.eval.sliding_stride)
    if t.eval.max_tokens is not None:
        _positive_int(problems, "task.eval.max_tokens", t.eval.max_tokens)
    if cfg.tokenizer.kind not in ("char", "bpe", "unigram"):
        problems.append(f"tokenizer.kind={cfg.tokenizer.kind!r}: allowed char, bpe, unigram")
    max_len = cfg.encoder.get("max_len")
    if max_len is not None and isinstance(t.seq_len, int) and t.seq_len > max_len:
        problems.append(
            f"task.seq_len={t.seq_len}: longer than encoder.max_len={max_len}; raise "
            f"encoder.max_len or shorten task.seq_len"
        )


def _try_encoder(cfg: DictConfig, problems: list[str]) -> None:
    """Build the encoder once with the model sizes: its own checks run here."""
    m = cfg.model
    try:
        instantiate(cfg.encoder)(d_model=m.d_model, n_heads=m.n_heads, n_layers=m.n_layers)
    except (ValueError, TypeError) as err:
        problems.append(f"encoder: {err}")
