"""Checks of a composed config, run before any data is loaded.

Each problem is one line: the key, the value, what is allowed. All problems are
reported together so a sweep with a typo fails in a second, not after a download.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from posenc import checks
from posenc.checks import algo_longest, algo_options
from posenc.data.algo import GRIDS, PROBLEMS, SHAPES
from posenc.data.algo_problems import check as check_problem
from posenc.data.buckets import check_edges
from posenc.data.tokenizers import TOKENIZER_KINDS
from posenc.encoders.base import AttnKind
from posenc.encoders.rope import SCALINGS
from posenc.errors import UserError
from posenc.model import DecoderLM, EncoderDecoder
from posenc.training.gate import GATE_KEYS, PASSKEY, PERCENT, metrics
from posenc.training.optim import SCHEDULES


class ConfigError(UserError, ValueError):
    """A config value is wrong; the message lists every problem found."""


def _positive_int(problems: list[str], key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        problems.append(f"{key}={value!r}: must be a positive integer")


def check_lm_batch(cfg: DictConfig, train_tokens: int, vocab_size: int) -> None:
    """Refuse a training batch the loaded data or this machine cannot hold; run once the
    data is tokenized, before the model and trainer are built (see
    :func:`posenc.checks.lm_batch`).

    Raises:
        ConfigError: One line naming ``task.batch_size``, the limit and the fix.
    """
    problem = checks.lm_batch(cfg, train_tokens, vocab_size)
    if problem:
        raise ConfigError(problem)


def eval_lengths(cfg: DictConfig) -> list[int]:
    """Absolute LM evaluation lengths: ``multiplier * seq_len``."""
    return [int(m * cfg.task.seq_len) for m in cfg.task.eval.multipliers]


def passkey_lengths(cfg: DictConfig) -> list[int]:
    """Absolute passkey lengths, ``multiplier * seq_len`` (empty: the evaluation is off)."""
    p = cfg.task.eval.get("passkey") or {}
    return [int(m * cfg.task.seq_len) for m in p.get("multipliers") or []]


def check_passkey(cfg: DictConfig, min_length: int, split_tokens: dict[str, int]) -> None:
    """Refuse passkey lengths the format or the data cannot fill; run once the data is
    tokenized (see :func:`posenc.checks.passkey_data`).

    Raises:
        ConfigError: One line per problem, naming the key, the length and the fix.
    """
    problems = checks.passkey_data(cfg, passkey_lengths(cfg), min_length, split_tokens)
    if problems:
        raise ConfigError(problem_message(problems))


def validate(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` listing every problem found in ``cfg``.

    Each group of checks runs under :func:`posenc.checks.guarded`, so a value of a type no
    check expected becomes a problem line naming its group, never a traceback.

    Args:
        cfg: The composed run config.
    """
    problems: list[str] = []
    missing = OmegaConf.missing_keys(cfg)
    problems += [f"{k}: required but not set (add {k}=... to the command)" for k in sorted(missing)]
    groups: list[tuple[str, Callable[[DictConfig, list[str]], None]]] = [
        ("config keys", _unknown_keys),
        ("seed, eval_only, resume, ckpt_path, init_from", _run_keys),
        ("model", _validate_model),
        ("model.random_positions", _random_positions),
        ("trainer", checks.trainer),
        ("task.optim", _validate_optim),
        ("paths.cache_dir", lambda c, p: checks.cache_dir(c.paths.cache_dir, p)),
        ("task.learned", _validate_gate),
    ]
    if cfg.task.name == "lm":
        groups += [
            ("tokenizer", _validate_tokenizer),
            ("task", _validate_lm),
            ("task", _reject_mt_options),
        ]
    elif cfg.task.name == "mt":
        groups += [("tokenizer", _validate_tokenizer), ("task", _validate_mt)]
    elif cfg.task.name == "algo":
        groups += [("task", _validate_algo)]
    else:
        problems.append(
            f"task.name={cfg.task.name!r}: allowed lm, mt, algo (choose with "
            f"task=lm, task=mt or task=algo)"
        )
    for section, check in groups:
        checks.guarded(problems, section, partial(check, cfg, problems))
    if not problems:
        checks.guarded(problems, "encoder", lambda: _try_encoder(cfg, problems))
    if problems:
        raise ConfigError(problem_message(problems))


def problem_message(problems: list[str]) -> str:
    """A header with the number of problems (if more than one), then a line each."""
    count = f" ({len(problems)} problems)" if len(problems) > 1 else ""
    return f"invalid config{count}:\n  " + "\n  ".join(problems)


def _validate_model(cfg: DictConfig, problems: list[str]) -> None:
    m = cfg.model
    found: list[str] = []
    for key in ("n_layers", "d_model", "n_heads"):
        _positive_int(found, f"model.{key}", m[key])
    if not found and m.d_model % m.n_heads:
        found.append(f"model.n_heads={m.n_heads}: must divide model.d_model={m.d_model}")
    problems += found
    _optional_positive_int(problems, "model.d_ff", m.get("d_ff"))
    if not isinstance(m.get("embed_scale", False), bool):
        problems.append(f"model.embed_scale={m.embed_scale!r}: must be true or false")
    if not _number(m.dropout) or not 0.0 <= float(m.dropout) < 1.0:
        problems.append(f"model.dropout={m.dropout!r}: must be a number in [0, 1)")
    if not isinstance(m.get("compile", False), bool):
        problems.append(f"model.compile={m.compile!r}: must be true or false")
    budget = m.get("score_budget_mib", 8)
    if not _number(budget) or not float(budget) >= 0:
        problems.append(
            f"model.score_budget_mib={budget!r}: must be a number >= 0 (MiB; 0: no query blocking)"
        )


def _validate_tokenizer(cfg: DictConfig, problems: list[str]) -> None:
    if "vocab_size" in cfg.tokenizer:
        _positive_int(problems, "tokenizer.vocab_size", cfg.tokenizer.vocab_size)
    if cfg.tokenizer.kind not in TOKENIZER_KINDS:
        kinds = ", ".join(TOKENIZER_KINDS)
        problems.append(f"tokenizer.kind={cfg.tokenizer.kind!r}: allowed {kinds}")


def _validate_gate(cfg: DictConfig, problems: list[str]) -> None:
    """``task.learned``: the learnability gate (:mod:`posenc.training.gate`)."""
    if cfg.task.name not in ("lm", "mt", "algo"):
        return
    gate = cfg.task.get("learned")
    if gate is None:
        return
    if not OmegaConf.is_dict(gate):
        problems.append(
            f"task.learned={gate!r}: must be null (no gate) or {{metric, threshold, stop}}, "
            f"e.g. task.learned.metric=val/seq_acc task.learned.threshold=95"
        )
        return
    for key in gate:
        if key not in GATE_KEYS:
            problems.append(f"task.learned.{key}: unknown key; allowed {', '.join(GATE_KEYS)}")
    allowed = metrics(cfg)
    metric, threshold = gate.get("metric"), gate.get("threshold")
    if metric not in allowed:
        problems.append(
            f"task.learned.metric={metric!r}: allowed for task {cfg.task.name}: "
            f"{', '.join(allowed)} (validation at the training length)"
        )
    elif allowed[metric]:
        problems.append(f"task.learned.metric={metric}: {allowed[metric]}")
    if not _number(threshold) or not math.isfinite(threshold):
        problems.append(f"task.learned.threshold={threshold!r}: must be a finite number")
    elif metric in PERCENT and not 0 <= threshold <= 100:
        problems.append(f"task.learned.threshold={threshold}: {metric} is in percent (0..100)")
    elif metric == PASSKEY and not 0 <= threshold <= 1:
        problems.append(
            f"task.learned.threshold={threshold}: {metric} is a fraction in [0, 1]; "
            f"e.g. 0.9 for 90% retrieval"
        )
    if not isinstance(gate.get("stop", False), bool):
        problems.append(f"task.learned.stop={gate.stop!r}: must be true or false")


def _validate_optim(cfg: DictConfig, problems: list[str]) -> None:
    """``task.optim``, the same keys and rules for every task."""
    _check_keys(problems, "task.optim.", list(cfg.task.optim), OPTIM_KEYS)
    checks.optim(cfg.task.optim, problems, SCHEDULES)


LM_TASK_KEYS = [
    "name",
    "seq_len",
    "batch_size",
    "eval_batch_size",
    "optim",
    "eval",
    "passkey_mix",
    "passkey_answer_weight",
    "learned",
]
LM_EVAL_KEYS = [
    "splits",
    "multipliers",
    "protocols",
    "sliding_stride",
    "max_tokens",
    "skip_unsupported",
    "context_extension",
    "extension_factor",
    "passkey",
]
PASSKEY_KEYS = ["multipliers", "depths", "samples", "key_len", "seed"]
OPTIM_KEYS = ["lr", "betas", "weight_decay", "warmup_steps", "schedule", "min_lr_ratio"]


def _validate_lm(cfg: DictConfig, problems: list[str]) -> None:
    t = cfg.task
    _check_keys(problems, "task.", [k for k in t if k not in MT_TASK_KEYS], LM_TASK_KEYS)
    _check_keys(problems, "task.eval.", list(t.eval), LM_EVAL_KEYS)
    e = t.eval
    for split in checks.as_list(problems, "task.eval.splits", e.splits, "[test]") or []:
        if split not in ("train", "val", "test"):
            problems.append(f"task.eval.splits contains {split!r}: allowed train, val, test")
    for key in ("seq_len", "batch_size", "eval_batch_size"):
        _positive_int(problems, f"task.{key}", t[key])
    for mult in checks.as_list(problems, "task.eval.multipliers", e.multipliers, "[1,2,4]") or []:
        if not _number(mult) or not math.isfinite(mult) or mult <= 0:
            problems.append(
                f"task.eval.multipliers contains {mult!r}: must be positive numbers "
                f"(evaluation length = multiplier * task.seq_len)"
            )
        elif (
            isinstance(t.seq_len, int)
            and not isinstance(t.seq_len, bool)
            and t.seq_len > 0
            and int(mult * t.seq_len) < 1
        ):
            problems.append(
                f"task.eval.multipliers contains {mult!r}: {mult} * task.seq_len="
                f"{t.seq_len} is below one token; give multipliers >= "
                f"{1 / t.seq_len:.3g}"
            )
    allowed = ("nonoverlap", "sliding")
    for p in checks.as_list(problems, "task.eval.protocols", e.protocols, "[nonoverlap]") or []:
        if p not in allowed:
            problems.append(f"task.eval.protocols contains {p!r}: allowed {', '.join(allowed)}")
    if t.eval.sliding_stride is not None:
        _positive_int(problems, "task.eval.sliding_stride", t.eval.sliding_stride)
    if t.eval.max_tokens is not None:
        _positive_int(problems, "task.eval.max_tokens", t.eval.max_tokens)
    if not isinstance(e.get("skip_unsupported", True), bool):
        problems.append(f"task.eval.skip_unsupported={e.skip_unsupported!r}: must be true or false")
    _context_extension(t.eval, problems)
    _passkey(t, problems)
    max_len = cfg.encoder.get("max_len")
    skip = t.eval.get("skip_unsupported", True)
    fits = _fits_encoder(problems, cfg, "seq_len")
    if fits and max_len is not None and not skip and not problems:
        for key, lengths in (
            ("task.eval.multipliers", eval_lengths(cfg)),
            ("task.eval.passkey.multipliers", passkey_lengths(cfg)),
        ):
            too_long = [L for L in lengths if max_len < L]
            if too_long:
                problems.append(
                    f"{key} give lengths {too_long} past encoder.max_len={max_len}; drop "
                    f"those multipliers, raise encoder.max_len, or set "
                    f"task.eval.skip_unsupported=true to record NaN for them"
                )


def _passkey(t: DictConfig, problems: list[str]) -> None:
    p = t.eval.get("passkey")
    if OmegaConf.is_dict(p):
        _check_keys(problems, "task.eval.passkey.", list(p), PASSKEY_KEYS)
    checks.passkey(t, problems, PASSKEY_KEYS)


def _context_extension(e: DictConfig, problems: list[str]) -> None:
    """``task.eval.context_extension`` (RoPE methods evaluated besides the plain run) and
    ``task.eval.extension_factor``."""
    allowed = ", ".join(SCALINGS[1:])
    methods = e.get("context_extension", [])
    if not OmegaConf.is_list(methods):
        problems.append(
            f"task.eval.context_extension={methods!r}: must be a list, e.g. "
            f"task.eval.context_extension=[{methods}]; allowed methods {allowed}"
        )
    else:
        for m in methods:
            if m not in SCALINGS[1:]:
                problems.append(f"task.eval.context_extension contains {m!r}: allowed {allowed}")
        twice = sorted({m for m in methods if list(methods).count(m) > 1})
        if twice:
            problems.append(
                f"task.eval.context_extension lists {', '.join(twice)} twice; give each method once"
            )
    f = e.get("extension_factor", "auto")
    if f != "auto" and not (_number(f) and math.isfinite(f) and f >= 1):
        problems.append(
            f"task.eval.extension_factor={f!r}: must be auto (s = max(1, eval "
            f"length / task.seq_len)) or a number >= 1"
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


ALGO_TASK_KEYS = [
    "name",
    "problem",
    "shape",
    "train_lengths",
    "test_multiple",
    "bucket_width",
    "symbols",
    "reverse_digits",
    "batch_size",
    "eval_batch_size",
    "val_per_size",
    "test_per_size",
    "optim",
    "data_tokens",
    "test_sizes",
    "lm_loss",
    "learned",
]


def _validate_algo(cfg: DictConfig, problems: list[str]) -> None:
    t = cfg.task
    _check_keys(problems, "task.", list(t), ALGO_TASK_KEYS)
    if t.problem not in PROBLEMS:
        problems.append(f"task.problem={t.problem!r}: allowed {', '.join(PROBLEMS)}")
    if t.shape not in SHAPES:
        problems.append(
            f"task.shape={t.shape!r}: allowed decoder (decoder-only: prompt, "
            f"separator, answer) or encdec (encoder-decoder: prompt -> answer)"
        )
    for key in (
        "batch_size",
        "eval_batch_size",
        "bucket_width",
        "val_per_size",
        "test_per_size",
        "data_tokens",
    ):
        _positive_int(problems, f"task.{key}", t.get(key, 1))
    if t.get("test_sizes", "auto") not in ("auto", *GRIDS):
        problems.append(
            f"task.test_sizes={t.test_sizes!r}: allowed auto (the problem's own), "
            f"{', '.join(GRIDS)}"
        )
    lengths = checks.as_list(problems, "task.train_lengths", t.train_lengths, "[1,16]")
    if lengths is not None and (
        len(lengths) != 2
        or any(isinstance(x, bool) or not isinstance(x, int) for x in lengths)
        or not 1 <= lengths[0] <= lengths[1]
    ):
        problems.append(
            f"task.train_lengths={list(lengths)}: must be [lo, hi] with integers "
            f"1 <= lo <= hi, e.g. task.train_lengths=[1,16]"
        )
        lengths = None
    m = t.test_multiple
    if not _number(m) or not math.isfinite(m) or m < 1:
        problems.append(
            f"task.test_multiple={m!r}: must be a number >= 1 (test sizes go up to "
            f"test_multiple * the largest training size)"
        )
    k = t.symbols
    if isinstance(k, bool) or not isinstance(k, int) or not 2 <= k <= 26:
        problems.append(
            f"task.symbols={k!r}: must be an integer in 2..26 (letters of the "
            f"copy, reverse, duplicate and sort problems)"
        )
    if not isinstance(t.reverse_digits, bool):
        problems.append(f"task.reverse_digits={t.reverse_digits!r}: must be true or false")
    elif t.reverse_digits and t.problem != "addition":
        problems.append(
            f"task.reverse_digits=true: only the addition problem has digits to "
            f"reverse (task.problem={t.problem}); drop it"
        )
    if problems or lengths is None:
        return
    if not isinstance(t.get("lm_loss", False), bool):
        problems.append(f"task.lm_loss={t.lm_loss!r}: must be true or false")
        return
    problems += check_problem(
        PROBLEMS[t.problem],
        t.shape,
        lengths[0],
        lengths[1],
        algo_options(cfg),
        t.get("lm_loss", False),
    )
    max_len = cfg.encoder.get("max_len")
    longest = algo_longest(cfg, int(math.floor(m * lengths[1])))
    if max_len is not None and longest is not None and longest > max_len:
        problems.append(
            f"task.test_multiple={m}: the largest test instance takes {longest} positions, "
            f"more than encoder.max_len={max_len}; raise encoder.max_len or lower "
            f"task.test_multiple"
        )
    problem = checks.algo_memory(cfg, lengths[0], lengths[1], int(math.floor(m * lengths[1])))
    if problem:
        problems.append(problem)


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
    edges = checks.as_list(problems, "task.length_buckets", t.length_buckets, "[0,10,20,1000]")
    try:
        if edges is not None:
            check_edges(edges)
    except (ValueError, TypeError) as err:
        problems.append(f"task.length_buckets={edges}: {err}")
    if t.eval_split not in ("test", "val"):
        problems.append(f"task.eval_split={t.eval_split!r}: allowed test, val")
    _validate_monitor(t, problems)
    d = t.decode
    _positive_int(problems, "task.decode.beam_size", d.beam_size)
    _non_negative(problems, "task.decode.length_penalty", d.length_penalty, integer=False)
    _non_negative(problems, "task.decode.max_len_a", d.max_len_a, integer=False)
    _non_negative(problems, "task.decode.max_len_b", d.max_len_b, integer=True)
    if not isinstance(d.get("use_cache", True), bool):
        problems.append(f"task.decode.use_cache={d.use_cache!r}: must be true or false")
    _check_keys(
        problems,
        "task.decode.",
        list(d),
        ["beam_size", "length_penalty", "max_len_a", "max_len_b", "use_cache"],
    )
    _fits_encoder(problems, cfg, "max_len")


def _validate_monitor(t: DictConfig, problems: list[str]) -> None:
    monitor, mode = t.get("monitor", "val/loss"), t.get("monitor_mode", "min")
    allowed = {"val/loss": "min", "val/nll": "min", "val/ppl": "min", "val/bleu": "max"}
    if monitor not in allowed:
        problems.append(f"task.monitor={monitor!r}: allowed {', '.join(allowed)}")
    elif mode != allowed[monitor]:
        problems.append(f"task.monitor_mode={mode!r}: {monitor} needs {allowed[monitor]}")
    if monitor == "val/bleu" and t.val_bleu_sentences == 0:
        problems.append(
            "task.monitor=val/bleu: needs task.val_bleu_sentences > 0 (it is 0); "
            "raise it or monitor val/loss"
        )


def _try_encoder(cfg: DictConfig, problems: list[str]) -> None:
    """Build the encoder once with the model sizes and make the attention hooks the task
    needs: the encoder's own checks (and refusals, e.g. causal-only schemes in a
    translation encoder) run here, before any data is loaded."""
    m = cfg.model
    kinds = [AttnKind.CAUSAL]
    if cfg.task.name == "mt" or cfg.task.get("shape") == "encdec":
        kinds += [AttnKind.BIDIRECTIONAL, AttnKind.CROSS]
    try:
        enc = instantiate(cfg.encoder)(d_model=m.d_model, n_heads=m.n_heads, n_layers=m.n_layers)
        for kind in kinds:
            enc.for_attention(layer=0, kind=kind)
    except (ValueError, TypeError) as err:
        problems.append(f"encoder: {err}")


def _random_positions(cfg: DictConfig, problems: list[str]) -> None:
    """``model.random_positions`` (Ruoss et al. 2023) must cover the longest training
    sequence and, for a ``learned`` table, fit in it."""
    n = cfg.model.get("random_positions")
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        problems.append(
            f"model.random_positions={n!r}: must be a positive integer (the range positions "
            f"are drawn from in training) or null (off)"
        )
        return
    if cfg.task.name == "algo":
        key = "train_lengths"
        hi = cfg.task.train_lengths[-1] if OmegaConf.is_list(cfg.task.train_lengths) else None
        longest = algo_longest(cfg, hi) if isinstance(hi, int) else None
    else:
        key = "seq_len" if cfg.task.name == "lm" else "max_len"
        longest = cfg.task.get(key)
    if isinstance(longest, int) and n < longest and cfg.task.name == "algo":
        problems.append(
            f"model.random_positions={n}: smaller than the longest training sequence "
            f"({longest} positions at the largest of task.train_lengths); it must be at "
            f"least that (e.g. 8-16x)"
        )
    elif isinstance(longest, int) and n < longest:
        problems.append(
            f"model.random_positions={n}: smaller than task.{key}={longest}; it must be at "
            f"least the longest training sequence (e.g. 8-16x task.{key})"
        )
    max_len = cfg.encoder.get("max_len")
    if max_len is not None and n > max_len:
        problems.append(
            f"model.random_positions={n}: larger than encoder.max_len={max_len}, so the "
            f"learned table cannot embed the drawn positions; raise encoder.max_len to {n}"
        )


_number = checks.number


def _suggest(key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def _check_keys(problems: list[str], prefix: str, given: list[str], allowed: list[str]) -> None:
    for key in given:
        if key not in allowed:
            problems.append(
                f"{prefix}{key}: unknown key; {_suggest(key, allowed)}allowed: "
                f"{', '.join(sorted(allowed))}"
            )


def _params(fn: Any, drop: tuple[str, ...] = ()) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p not in drop + ("self",)]


TOP_LEVEL = [
    "encoder",
    "task",
    "trainer",
    "data",
    "tokenizer",
    "model",
    "seed",
    "eval_only",
    "ckpt_path",
    "resume",
    "checkpoint_every_n_steps",
    "paths",
    "init_from",
    "threads",
    "tuned",
]


def _unknown_keys(cfg: DictConfig, problems: list[str]) -> None:
    """Misspelled or unknown keys would be ignored or crash late: name them now."""
    _check_keys(problems, "", [str(k) for k in cfg if k != "hydra"], TOP_LEVEL)
    fixed = ("d_model", "n_heads", "n_layers")
    try:
        cls: type[Any] = get_class(cfg.encoder._target_)
    except Exception as err:
        problems.append(f"encoder._target_={cfg.encoder.get('_target_')!r}: {err}")
    else:
        allowed = _params(cls.__init__, fixed) + ["_target_", "_partial_"]
        _check_keys(problems, "encoder.", list(cfg.encoder), allowed)
    encdec = cfg.task.name == "mt" or (
        cfg.task.name == "algo" and cfg.task.get("shape") == "encdec"
    )
    model_cls = EncoderDecoder if encdec else DecoderLM
    allowed = _params(
        model_cls.__init__, ("vocab_size", "src_vocab_size", "tgt_vocab_size", "encoder")
    )
    allowed.append("compile")  # read by the LightningModule, not the model
    if cfg.task.name == "lm":  # MT-only model keys are reported by _reject_mt_options
        allowed += list(MT_MODEL_KEYS)
    if cfg.task.name == "algo":  # the two shapes share conf/model/algo.yaml
        allowed = [k for k in allowed if k not in ("share_embeddings", *MT_MODEL_KEYS)]
    _check_keys(problems, "model.", list(cfg.model), allowed)
    _check_keys(
        problems, "trainer.", list(cfg.trainer), _params(pl.Trainer.__init__) + ["_target_"]
    )


def _run_keys(cfg: DictConfig, problems: list[str]) -> None:
    threads = cfg.get("threads")
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads <= 0
    ):
        problems.append(
            f"threads={threads!r}: must be a positive integer (CPU threads per "
            f"process) or null (torch's default: one per core)"
        )
    if not isinstance(cfg.seed, int) or isinstance(cfg.seed, bool) or cfg.seed < 0:
        problems.append(f"seed={cfg.seed!r}: must be an integer >= 0")
    for key in ("eval_only", "resume"):
        if not isinstance(cfg[key], bool):
            problems.append(f"{key}={cfg[key]!r}: must be true or false")
    _positive_int(problems, "checkpoint_every_n_steps", cfg.checkpoint_every_n_steps)
    if cfg.eval_only and not cfg.ckpt_path:
        problems.append("eval_only=true: needs ckpt_path=/path/to/checkpoint.ckpt")
    if cfg.ckpt_path and not Path(str(cfg.ckpt_path)).is_file():
        problems.append(f"ckpt_path={cfg.ckpt_path}: no such file")
    init = cfg.get("init_from")
    if init and not Path(str(init)).is_file():
        problems.append(f"init_from={init}: no such file")
    if init and (cfg.eval_only or cfg.ckpt_path):
        problems.append(
            f"init_from={init}: starts a new run from a checkpoint's weights, but "
            f"{'eval_only=true' if cfg.eval_only else 'ckpt_path'} is set too; use ckpt_path "
            f"alone to evaluate or continue a run, init_from alone to fine-tune from one"
        )


def _fits_encoder(problems: list[str], cfg: DictConfig, key: str) -> bool:
    """``task.<key>`` (the training length) must fit a ``learned`` table's ``max_len``."""
    max_len, length = cfg.encoder.get("max_len"), cfg.task[key]
    if max_len is not None and isinstance(length, int) and length > max_len:
        problems.append(
            f"task.{key}={length}: longer than encoder.max_len={max_len}; raise "
            f"encoder.max_len or lower task.{key}"
        )
        return False
    return True
