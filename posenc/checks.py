"""Value checks that :func:`posenc.config.validate` runs: for both tasks the optimiser,
the trainer's step budget, the cache folder, and the guard that turns a check tripping
over a wrongly typed value into a problem line; for the LM the batch and the passkey
evaluation.

Each check appends one line per problem, ``key=value: what is allowed``, to ``problems``.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from posenc.data.algo import PROBLEMS, Options, longest_sequence
from posenc.data.algo_problems import grid_sizes

__all__ = [
    "as_list",
    "cache_dir",
    "guarded",
    "lm_batch",
    "number",
    "optim",
    "passkey",
    "passkey_data",
    "trainer",
]

#: Lightning's time-based ``val_check_interval``, ``DD:HH:MM:SS``.
_DURATION = re.compile(r"\d+:\d{1,2}:\d{1,2}:\d{1,2}")


def number(value: Any) -> bool:
    """An int or float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    return number(value) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def algo_options(cfg: DictConfig) -> Any:
    """The instance options (:class:`posenc.data.algo.Options`) of ``cfg.task``."""
    k = cfg.task.get("data_tokens", 16)
    return Options(
        symbols=cfg.task.symbols,
        reverse_digits=bool(cfg.task.reverse_digits),
        data_tokens=k if isinstance(k, int) and not isinstance(k, bool) else 16,
    )


def algo_longest(cfg: DictConfig, size: int) -> int | None:
    """Positions an algorithmic instance of ``size`` takes (None for an unknown problem)."""
    problem = PROBLEMS.get(cfg.task.problem)
    if problem is None:
        return None
    return longest_sequence(problem, size, cfg.task.shape, algo_options(cfg))


def guarded(problems: list[str], section: str, check: Callable[[], None]) -> None:
    """Run ``check()``; if it raises on an unexpected value, report ``section`` instead.

    The checks test the types they know about, so this is the net for the ones they do
    not: validation lists problems, it never crashes with a traceback of its own.
    """
    try:
        check()
    except Exception as err:
        problems.append(
            f"{section}: a value has the wrong type ({type(err).__name__}: {err}); "
            f"compare it with conf/ and the README"
        )


def as_list(problems: list[str], key: str, value: Any, example: str) -> list[Any] | None:
    """``value`` as a list, or None after reporting that ``key`` must be a non-empty list."""
    if not OmegaConf.is_list(value) and not isinstance(value, list | tuple):
        problems.append(f"{key}={value!r}: must be a list, e.g. {key}={example}")
        return None
    if not len(value):
        problems.append(f"{key}=[]: must list at least one value, e.g. {key}={example}")
        return None
    return list(value)


def optim(o: DictConfig, problems: list[str], schedules: tuple[str, ...]) -> None:
    """``task.optim``: AdamW and the learning-rate schedule (shared by lm and mt)."""
    k = "task.optim."
    lr = o.get("lr")
    if not (_finite(lr) and lr > 0):
        problems.append(f"{k}lr={lr!r}: must be a positive number (finite; e.g. 1e-3)")
    betas = o.get("betas")
    if not (
        OmegaConf.is_list(betas)
        and len(betas) == 2
        and all(_finite(b) and 0 <= b < 1 for b in betas)
    ):
        shown = list(betas) if OmegaConf.is_list(betas) else betas
        problems.append(
            f"{k}betas={shown!r}: must be two numbers in [0, 1) (Adam's beta1, "
            f"beta2), e.g. [0.9, 0.99]"
        )
    wd = o.get("weight_decay")
    if not (_finite(wd) and wd >= 0):
        problems.append(f"{k}weight_decay={wd!r}: must be a number >= 0 (0: no decay)")
    warmup = o.get("warmup_steps")
    if not (_integer(warmup) and warmup >= 0):
        problems.append(f"{k}warmup_steps={warmup!r}: must be an integer >= 0 (0: no warmup)")
    schedule = o.get("schedule", "cosine")
    if schedule not in schedules:
        problems.append(f"{k}schedule={schedule!r}: allowed {', '.join(schedules)}")
    ratio = o.get("min_lr_ratio", 0.1)
    if not (_finite(ratio) and 0 <= ratio <= 1):
        problems.append(
            f"{k}min_lr_ratio={ratio!r}: must be a number in [0, 1] (the cosine "
            f"schedule ends at lr * min_lr_ratio)"
        )


def trainer(cfg: DictConfig, problems: list[str]) -> None:
    """``trainer.*`` values posenc relies on: a positive step budget, validation by steps,
    gradient clipping."""
    t = cfg.trainer
    steps = t.get("max_steps")
    if not _integer(steps):
        problems.append(f"trainer.max_steps={steps!r}: must be a positive integer (training steps)")
    elif steps == 0 and not cfg.get("eval_only"):
        problems.append(
            "trainer.max_steps=0: would record the metrics of an untrained model; "
            "give a positive number of steps, or evaluate a trained model with "
            "eval_only=true ckpt_path=..."
        )
    elif steps < 0 and not cfg.get("eval_only"):
        problems.append(
            f"trainer.max_steps={steps}: posenc runs are bounded by steps (with -1 "
            f"Lightning would train for 1000 epochs); give a positive max_steps"
        )
    clip = t.get("gradient_clip_val")
    if clip is not None and not (_finite(clip) and clip >= 0):
        problems.append(
            f"trainer.gradient_clip_val={clip!r}: must be a number >= 0, or null for no clipping"
        )
    # Lightning's own positive-integer knobs: 0 fails deep inside it (ZeroDivisionError).
    for key in ("accumulate_grad_batches", "log_every_n_steps", "num_nodes"):
        value = t.get(key)
        if value is not None and not (_integer(value) and value >= 1):
            problems.append(f"trainer.{key}={value!r}: must be a positive integer")
    _val_check_interval(t, problems)


def _val_check_interval(t: DictConfig, problems: list[str]) -> None:
    every = t.get("val_check_interval")
    if every is None or (_integer(every) and every > 0):
        return
    if isinstance(every, str) and _DURATION.fullmatch(every):
        return
    by_epoch = t.get("check_val_every_n_epoch") is not None
    if by_epoch and isinstance(every, float) and 0 < every <= 1:
        return
    fraction = "" if by_epoch else " with trainer.check_val_every_n_epoch set"
    problems.append(
        f"trainer.val_check_interval={every!r}: must be a positive integer (training "
        f"steps between validations), a time DD:HH:MM:SS, or a fraction in (0, 1] "
        f"of an epoch{fraction}"
    )


def cache_dir(path: Any, problems: list[str]) -> None:
    """``paths.cache_dir`` (``POSENC_CACHE_DIR``) must be a folder posenc can write to: it is
    created if missing, and a temporary file is written and removed."""
    key = "paths.cache_dir"
    if not isinstance(path, str) or not path:
        problems.append(f"{key}={path!r}: must be a folder path (or set POSENC_CACHE_DIR)")
        return
    folder = Path(path).expanduser()
    blocker = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        where = "is a file" if blocker == folder else f"is inside {blocker}, which is a file"
        problems.append(
            f"{key}={path}: {where}, not a folder; point paths.cache_dir (or "
            f"POSENC_CACHE_DIR) at a folder"
        )
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        problems.append(
            f"{key}={path}: cannot write there ({err.strerror or err}); point "
            f"paths.cache_dir (or POSENC_CACHE_DIR) at a writable folder"
        )


def lm_batch(cfg: DictConfig, train_tokens: int, vocab_size: int) -> str | None:
    """The problem with ``task.batch_size`` once the LM data is loaded, or None.

    A batch of more windows than the training split holds without overlap would repeat
    the whole text within every step and only grow memory. On CPU, a batch whose logits
    alone (``batch_size x seq_len x vocab`` floats, with their gradient) exceed the
    machine's memory is refused too. ``eval_only`` trains nothing: no problem.

    Args:
        cfg: The validated run config (task=lm).
        train_tokens: Tokens in the training split.
        vocab_size: The tokenizer's vocabulary.
    """
    if cfg.eval_only:
        return None
    batch, seq_len = cfg.task.batch_size, cfg.task.seq_len
    windows = (train_tokens - 1) // seq_len
    if batch > windows:
        return (
            f"task.batch_size={batch}: larger than the {windows} windows of task.seq_len="
            f"{seq_len} in the training split ({train_tokens} tokens), so every step would "
            f"repeat the whole text; lower task.batch_size to at most {windows}"
        )
    need = batch * seq_len * vocab_size * 4 * 2
    ram = _physical_memory()
    on_cpu = cfg.trainer.get("accelerator") == "cpu" or not torch.cuda.is_available()
    if on_cpu and ram and need > ram:
        return (
            f"task.batch_size={batch}: its logits alone ({batch} x {seq_len} x vocab "
            f"{vocab_size}, with their gradient) need {need / 2**30:.1f} GiB, more than "
            f"this machine's {ram / 2**30:.1f} GiB; lower task.batch_size"
        )
    return None


def algo_memory(cfg: DictConfig, lo: int, hi: int, test_hi: int) -> str | None:
    """The problem with an algorithmic task's sizes that would exhaust the memory, or None:
    its test set (``task.test_per_size`` instances of every size of the test grid up to
    ``test_hi``, for each test distribution, held in memory) or, on a CPU, the attention
    scores of one training batch at the largest training size (``batch x heads x T^2``
    per layer, kept for the backward pass).

    Args:
        cfg: The run config (task=algo, known problem and shape).
        lo: The smallest training size.
        hi: The largest training size.
        test_hi: The largest test size.
    """

    ram = _physical_memory()
    if not ram:
        return None
    t = cfg.task
    problem = PROBLEMS[t.problem]
    grid = t.get("test_sizes", "auto")
    grid = problem.grid if grid == "auto" else grid
    sizes = grid_sizes(problem, lo, hi, test_hi, grid, algo_options(cfg))
    # int64 token ids, input and target, of every instance of every distribution
    positions = sum(algo_longest(cfg, n) or 0 for n in sizes)
    test_bytes = t.test_per_size * len(problem.variants) * positions * 8 * 2
    if test_bytes > ram / 4:
        where = f"every size {sizes[0]}..{sizes[-1]}" if grid == "every" else f"sizes {sizes}"
        return (
            f"task.train_lengths=[{lo},{hi}]: its test set ({t.test_per_size} instances "
            f"of {where}, task.test_multiple={t.test_multiple}) needs "
            f"{test_bytes / 2**30:.1f} GiB, over a quarter of this machine's "
            f"{ram / 2**30:.1f} GiB; lower the largest size, task.test_multiple or "
            f"task.test_per_size"
        )
    on_cpu = cfg.trainer.get("accelerator") == "cpu" or not torch.cuda.is_available()
    longest = algo_longest(cfg, hi) or 0
    m = cfg.model
    scores = t.batch_size * m.n_heads * longest**2 * 4 * m.n_layers
    if on_cpu and scores > ram:
        return (
            f"task.train_lengths=[{lo},{hi}]: a training batch at size {hi} ({longest} "
            f"positions) holds {t.batch_size} x {m.n_heads} heads x {longest}^2 attention "
            f"scores in each of {m.n_layers} layers: {scores / 2**30:.1f} GiB, more than "
            f"this machine's {ram / 2**30:.1f} GiB; lower the largest size or "
            f"task.batch_size"
        )
    return None


def passkey(t: DictConfig, problems: list[str], keys: list[str]) -> None:
    """``task.passkey_mix`` and the values of ``task.eval.passkey`` (off while its
    multipliers are ``[]``); unknown keys are reported by the caller."""
    mix = t.get("passkey_mix", 0.0)
    if not number(mix) or not 0.0 <= mix <= 1.0:
        problems.append(
            f"task.passkey_mix={mix!r}: must be a number in [0, 1] (the fraction "
            f"of training windows replaced by passkey sequences; 0: off)"
        )
    weight = t.get("passkey_answer_weight", 1.0)
    if not number(weight) or not weight > 0:
        problems.append(
            f"task.passkey_answer_weight={weight!r}: must be a number > 0 (the "
            f"loss weight of a training passkey answer's key tokens; 1: as text)"
        )
    p = t.eval.get("passkey")
    if not OmegaConf.is_dict(p):
        problems.append(
            f"task.eval.passkey={p!r}: must be a mapping with keys "
            f"{', '.join(keys)} (see conf/task/lm.yaml)"
        )
        return
    mults = p.get("multipliers", [])
    if not OmegaConf.is_list(mults):
        problems.append(
            f"task.eval.passkey.multipliers={mults!r}: must be a list, e.g. "
            f"[1,2,4,8,16] (lengths = multiplier * task.seq_len; []: off)"
        )
    else:
        for m in mults:
            if not _finite(m) or m <= 0:
                problems.append(
                    f"task.eval.passkey.multipliers contains {m!r}: must be "
                    f"positive numbers (length = multiplier * task.seq_len)"
                )
    example = "[0,0.25,0.5,0.75,1]"
    for d in as_list(problems, "task.eval.passkey.depths", p.get("depths"), example) or []:
        if not number(d) or not 0.0 <= d <= 1.0:
            problems.append(
                f"task.eval.passkey.depths contains {d!r}: must be numbers in "
                f"[0, 1] (0: the key first, 1: right before the question)"
            )
    for key in ("samples", "key_len"):
        value = p.get(key)
        if not _integer(value) or value <= 0:
            problems.append(f"task.eval.passkey.{key}={value!r}: must be a positive integer")
    seed = p.get("seed", 0)
    if not _integer(seed) or seed < 0:
        problems.append(f"task.eval.passkey.seed={seed!r}: must be an integer >= 0")


def passkey_data(
    cfg: DictConfig, lengths: list[int], min_length: int, split_tokens: dict[str, int]
) -> list[str]:
    """Problems with passkey lengths once the data is tokenized (the format's size in
    tokens depends on the tokenizer).

    Args:
        cfg: The validated run config (task=lm).
        lengths: The passkey evaluation lengths.
        min_length: The shortest instance the format allows
            (:meth:`posenc.eval.passkey.PasskeyFormat.min_length`).
        split_tokens: Tokens per split (filler comes from the evaluated splits, the
            training mix's from ``train``).
    """
    problems = []
    short = [n for n in lengths if n < min_length]
    if short:
        problems.append(
            f"task.eval.passkey.multipliers give lengths {short}, shorter than the "
            f"{min_length} tokens a passkey instance needs (needle, question, key, filler); "
            f"drop those multipliers or raise task.seq_len"
        )
    for split in cfg.task.eval.splits if lengths else []:
        if split_tokens[split] < max(lengths):
            problems.append(
                f"task.eval.passkey.multipliers give length {max(lengths)}, longer than the "
                f"{split!r} split ({split_tokens[split]} tokens) the filler comes from"
            )
    mix = cfg.task.get("passkey_mix", 0)
    if mix and not cfg.eval_only and cfg.task.seq_len < min_length:
        problems.append(
            f"task.passkey_mix={mix}: training passkey instances of task.seq_len = "
            f"{cfg.task.seq_len} tokens are shorter than the {min_length} the format "
            f"needs; raise task.seq_len or set task.passkey_mix=0"
        )
    if mix and not cfg.eval_only and split_tokens.get("val", 0) < cfg.task.seq_len:
        problems.append(
            f"task.passkey_mix={mix}: validation checks retrieval at task.seq_len="
            f"{cfg.task.seq_len} with filler from the 'val' split, which has only "
            f"{split_tokens.get('val', 0)} tokens; lower task.seq_len or give the data a "
            f"longer validation split"
        )
    return problems


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on this platform
        return None
