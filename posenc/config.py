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
        _reject_mt_options(cfg, problems)
    elif cfg.task.name == "mt":
        _validate_mt(cfg, problems)
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


#: Options that only the translation task reads (task.* and model.*).
MT_TASK_KEYS = (
    "max_tokens",
    "max_len",
    "max_train_src_len",
    "length_buckets",
    "label_smoothing",
    "share_embeddings",
    "val_bleu_sentences",
    "eval_split",
    "eval_max_sentences",
    "samples",
    "decode",
)
MT_MODEL_KEYS = ("n_enc_layers", "n_dec_layers")


def _reject_mt_options(cfg: DictConfig, problems: list[str]) -> None:
    """An MT option under task=lm would be silently ignored: say so instead."""
    found = [f"task.{k}" for k in MT_TASK_KEYS if k in cfg.task]
    found += [f"model.{k}" for k in MT_MODEL_KEYS if k in cfg.model]
    for key in found:
        problems.append(
            f"{key}={OmegaConf.select(cfg, key)!r}: a translation option, but task.name=lm; "
            "remove it or run task=mt"
        )


def _optional_positive_int(problems: list[str], key: str, value: Any) -> None:
    if value is not None:
        _positive_int(problems, key, value)


def _non_negative(problems: list[str], key: str, value: Any, *, integer: bool) -> None:
    kinds = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kinds) or value < 0:
        what = "an integer" if integer else "a number"
        problems.append(f"{key}={value!r}: must be {what} >= 0")


def _validate_mt(cfg: DictConfig, problems: list[str]) -> None:
    from posenc.data.mt import check_edges
    from posenc.data.tokenizers import TOKENIZER_KINDS
    from posenc.tasks.optim import SCHEDULES

    t, m = cfg.task, cfg.model
    for key in ("max_tokens", "max_len"):
        _positive_int(problems, f"task.{key}", t[key])
    _positive_int(problems, "model.d_ff", m.d_ff)
    for key in MT_MODEL_KEYS:
        _optional_positive_int(problems, f"model.{key}", m.get(key))
    for key in ("max_train_src_len", "eval_max_sentences"):
        _optional_positive_int(problems, f"task.{key}", t[key])
    for key in ("val_bleu_sentences", "samples"):
        _non_negative(problems, f"task.{key}", t[key], integer=True)
    if isinstance(t.max_tokens, int) and isinstance(t.max_len, int) and t.max_tokens < t.max_len:
        problems.append(
            f"task.max_tokens={t.max_tokens}: smaller than task.max_len={t.max_len}, so the "
            "longest training pair would not fit in a batch"
        )
    ls = t.label_smoothing
    if isinstance(ls, bool) or not isinstance(ls, int | float) or not 0.0 <= ls < 1.0:
        problems.append(f"task.label_smoothing={ls!r}: must be in [0, 1)")
    if not isinstance(t.share_embeddings, bool):
        problems.append(f"task.share_embeddings={t.share_embeddings!r}: must be true or false")
    try:
        check_edges(list(t.length_buckets))
    except (ValueError, TypeError) as err:
        problems.append(f"task.length_buckets={list(t.length_buckets)}: {err}")
    if t.eval_split not in ("test", "val"):
        problems.append(f"task.eval_split={t.eval_split!r}: allowed test, val")
    d = t.decode
    _positive_int(problems, "task.decode.beam_size", d.beam_size)
    _non_negative(problems, "task.decode.length_penalty", d.length_penalty, integer=False)
    _non_negative(problems, "task.decode.max_len_a", d.max_len_a, integer=False)
    _non_negative(problems, "task.decode.max_len_b", d.max_len_b, integer=True)
    if t.optim.get("schedule", "cosine") not in SCHEDULES:
        problems.append(f"task.optim.schedule={t.optim.schedule!r}: allowed {', '.join(SCHEDULES)}")
    if cfg.tokenizer.kind not in TOKENIZER_KINDS:
        kinds = ", ".join(TOKENIZER_KINDS)
        problems.append(f"tokenizer.kind={cfg.tokenizer.kind!r}: allowed {kinds}")
    max_len = cfg.encoder.get("max_len")
    if max_len is not None and isinstance(t.max_len, int) and t.max_len > max_len:
        problems.append(
            f"task.max_len={t.max_len}: longer than encoder.max_len={max_len}; raise "
            f"encoder.max_len or lower task.max_len"
        )


def _try_encoder(cfg: DictConfig, problems: list[str]) -> None:
    """Build the encoder once with the model sizes: its own checks run here."""
    m = cfg.model
    try:
        instantiate(cfg.encoder)(d_model=m.d_model, n_heads=m.n_heads, n_layers=m.n_layers)
    except (ValueError, TypeError) as err:
        problems.append(f"encoder: {err}")
