"""Checks of a composed config, run before any data is loaded. The checks that need the
loaded data (the LM batch, the passkey lengths, the splits a source gave) live beside the
data modules that own it (:mod:`posenc.data`).

Keys, types, choices and ranges are declared once, in :mod:`posenc.schema`; this module
walks the config against it and adds the rules that tie keys together (``n_heads``
divides ``d_model``, a training length fits a ``learned`` table, a gate's metric exists
for its task, ...) on the typed groups whose own keys passed. Each problem is one line:
the key, the value, what is allowed. The problems found are reported together, so a sweep
with a typo fails in a second, not after a download.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import re
import warnings
from collections.abc import Callable, Iterator
from copy import deepcopy
from functools import partial
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from posenc import schema
from posenc.data.algo import PROBLEMS, memory_problem
from posenc.data.algo_problems import check as check_problem
from posenc.data.sources import missing_splits, missing_test
from posenc.data.tokenizers import SP_DEFAULTS, cache_problems
from posenc.encoders import registry
from posenc.encoders.base import AttnKind
from posenc.errors import ConfigError, problem_message
from posenc.model.modifiers import Modifiers
from posenc.model.streaming import sizes_problem
from posenc.model.transformer import NO_WINDOW_IN_TRANSLATOR
from posenc.model.window import window_problem
from posenc.schema import MT_MODEL_KEYS, MT_TASK_KEYS, integer
from posenc.training.gate import PASSKEY, PERCENT, metrics
from posenc.training.rundir import missing_checkpoint
from posenc.training.trainer import on_cpu, validation_in_batches

#: Lightning's time-based ``val_check_interval``, ``DD:HH:MM:SS``.
_DURATION = re.compile(r"\d+:\d{1,2}:\d{1,2}:\d{1,2}")

#: A typed task (one whose own keys passed).
Task = schema.LMTask | schema.MTTask | schema.AlgoTask


def validate(cfg: DictConfig, machine: bool = True, copy: bool = True) -> None:
    """Raise :class:`ConfigError` listing every problem found in ``cfg``.

    First each group's own keys against the schema; then the rules that tie keys
    together, on the typed groups whose own keys passed (:func:`_cross`). Each check runs
    under :func:`guarded`, so a value of a type no check expected becomes a problem line
    naming its group, never a traceback.

    Args:
        cfg: The composed run config.
        machine: Also check what depends on the machine the job runs on: the cache
            folder is writable, an algorithmic task's test set and attention scores fit
            its memory (which asks torch whether CUDA is there). False for a sweep's
            check before launch (:class:`posenc.cli.SweepCheck`): its jobs may run on
            other machines, and a CUDA query in the process that forks them would break
            CUDA in every job.
        copy: False: ``cfg`` is the caller's to spend, and its interpolations are
            replaced by their values in place (a copy less for each job of a sweep).
    """
    cfg = resolved(cfg, copy)
    problems: list[str] = []
    guarded(problems, "config", lambda: _missing(cfg))
    name = cfg.task.name
    if name not in schema.TASKS:
        problems.append(
            f"task.name={name!r}: allowed lm, mt, algo (choose with task=lm, task=mt or task=algo)"
        )
    for section, keys in [
        ("config keys", _unknown_keys),
        ("eval_only, ckpt_path, init_from", _run_keys),
        ("trainer", trainer),
        *([("paths.cache_dir", lambda c: cache_problems(c.paths.cache_dir))] if machine else []),
        *([("tokenizer", _tokenizer)] if name in ("lm", "mt") else []),
    ]:
        guarded(problems, section, partial(keys, cfg))
    cls = schema.MODELS.get(name, schema.Model)
    model = _typed(problems, "model", partial(_model_keys, cfg), cls, cfg.model)
    task = _typed(problems, "task", partial(_task_keys, cfg), schema.TASKS.get(name), cfg.task)
    for section, check in _cross(cfg, model, task, machine):
        guarded(problems, section, check)
    if not problems and model is not None and task is not None:
        guarded(problems, "encoder", lambda: _try_encoder(cfg, model, task))
    if not problems and machine:
        guarded(problems, "trainer", lambda: _try_trainer(cfg))
    if problems:
        raise ConfigError(problem_message(problems), problems)


def _typed(
    problems: list[str], section: str, check: Callable[[], list[str]], cls: Any, node: Any
) -> Any:
    """The typed group ``cls`` of ``node`` when ``check`` (its own keys against the
    schema) finds nothing, else None, the problems added to ``problems``."""
    if cls is None:
        return None
    found: list[str] = []
    guarded(found, section, check)
    problems += found
    return None if found else schema.build(cls, node)


def resolved(cfg: DictConfig, copy: bool = True) -> DictConfig:
    """``cfg``, or a copy (``cfg`` itself unless ``copy``) with each interpolation outside
    ``hydra`` replaced by its value.

    The checks read many keys more than once, and OmegaConf parses an interpolation again
    at every read (``task.*`` of ``task=algo`` are ``${posenc_problem:...}``): checking a
    sweep's jobs spent most of its time there. An interpolation that does not resolve
    (a missing value, an unknown problem) stays as it was, for the checks to report.
    """
    if not any(OmegaConf.is_interpolation(node, key) for node, key in _leaves(cfg)):
        return cfg
    out = deepcopy(cfg) if copy else cfg
    for node, key in _leaves(out):
        if OmegaConf.is_interpolation(node, key):
            with contextlib.suppress(Exception):
                value = node[key]
                node[key] = (
                    OmegaConf.to_container(value, resolve=True)
                    if OmegaConf.is_config(value)
                    else value
                )
    return out


def _leaves(cfg: DictConfig) -> Iterator[tuple[Any, Any]]:
    """(container, key) of every value in ``cfg`` outside ``hydra``, interpolations not
    followed, missing and None groups not entered."""
    pending: list[DictConfig | ListConfig] = [cfg]
    while pending:
        node = pending.pop()
        keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
        for key in [k for k in keys if not (node is cfg and k == "hydra")]:
            child = node._get_node(key)  # type: ignore[arg-type]
            if not OmegaConf.is_interpolation(node, key) and (  # type: ignore[arg-type]
                isinstance(child, DictConfig | ListConfig)
                and not (child._is_missing() or child._is_none())
            ):
                pending.append(child)
            yield node, key


def guarded(problems: list[str], section: str, check: Callable[[], list[str]]) -> None:
    """Add the problems ``check()`` finds; if it raises on an unexpected value, report
    ``section`` instead.

    The checks test the types they know about, so this is the net for the ones they do
    not: validation lists problems, it never crashes with a traceback of its own.
    """
    try:
        problems += check()
    except Exception as err:
        if isinstance(err, InterpolationResolutionError):  # one line, however many checks read it
            said = str(err).splitlines()[0]
            line = f"{err.full_key}: its interpolation does not resolve ({said}); set a value"
        else:
            line = (
                f"{section}: a value has the wrong type ({type(err).__name__}: {err}); "
                f"compare it with conf/ and the README"
            )
        problems += [line] if line not in problems else []


def _missing(cfg: DictConfig) -> list[str]:
    return [
        f"{k}: required but not set (add {k}=... to the command)"
        for k in sorted(OmegaConf.missing_keys(cfg))
    ]


def _params(fn: Any, drop: tuple[str, ...] = ()) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p not in drop + ("self",)]


def _mix_entry_problems(encoder: DictConfig) -> list[str]:
    """The boolean options of ``encoder=mix``'s entries (``{name: fox, rope: maybe}``)
    that are not true or false, as :func:`_unknown_keys` checks the encoder's own."""
    entries = [
        (f"encoder.{key}[{i}].", entry)
        for key in ("layers", "heads")
        if OmegaConf.is_list(encoder.get(key))
        for i, entry in enumerate(encoder[key])
        # the mix itself names what is wrong with another entry
        if OmegaConf.is_dict(entry) and entry.get("name") in registry.available()
    ]
    out: list[str] = []
    for at, entry in entries:
        out += schema.parameter_problems(entry, registry.get(entry.name).__init__, at)
    return out


def _unknown_keys(cfg: DictConfig) -> list[str]:
    """Misspelled or unknown keys would be ignored or crash late: name them now. The
    instantiated groups take their classes' parameters."""
    out = schema.problems(cfg, schema.Run, "", skip=("hydra",))  # and seed, threads, ...
    try:
        cls: type[Any] = get_class(cfg.encoder._target_)
    except Exception as err:
        out.append(f"encoder._target_={cfg.encoder.get('_target_')!r}: {err}")
    else:
        allowed = _params(cls.__init__, ("d_model", "n_heads", "n_layers"))
        out += schema.unknown("encoder.", list(cfg.encoder), allowed + ["_target_", "_partial_"])
        out += schema.parameter_problems(cfg.encoder, cls.__init__, "encoder.")
        out += _mix_entry_problems(cfg.encoder)
    allowed = _params(pl.Trainer.__init__) + ["_target_"]
    out += schema.unknown("trainer.", list(cfg.trainer), allowed)
    return out + schema.parameter_problems(cfg.trainer, pl.Trainer.__init__, "trainer.")


def _run_keys(cfg: DictConfig) -> list[str]:
    out: list[str] = []
    ckpt, init = cfg.ckpt_path, cfg.get("init_from")
    if cfg.eval_only is True and not ckpt:
        out.append("eval_only=true: needs ckpt_path=/path/to/checkpoint.ckpt")
    for name, value in (("ckpt_path", ckpt), ("init_from", init)):
        if value and not Path(str(value)).is_file():
            out.append(missing_checkpoint(Path(str(value)), name))
    if init and (cfg.eval_only or ckpt):
        out.append(
            f"init_from={init}: starts a new run from a checkpoint's weights, but "
            f"{'eval_only=true' if cfg.eval_only else 'ckpt_path'} is set too; use ckpt_path "
            f"alone to evaluate or continue a run, init_from alone to fine-tune from one"
        )
    return out


def _model_keys(cfg: DictConfig) -> list[str]:
    """``model``: the schema's keys for this task's model."""
    name = cfg.task.name
    refuse: tuple[str, ...] = () if name == "mt" else ("share_embeddings",)
    if name == "algo":  # the two shapes share conf/model/algo.yaml
        refuse += MT_MODEL_KEYS
    # under task=lm, _task_keys names them as translation options
    skip = MT_MODEL_KEYS if name == "lm" else ()
    return schema.problems(cfg.model, schema.Model, "model.", skip=skip, refuse=refuse)


def _tokenizer(cfg: DictConfig) -> list[str]:
    """The tokenizer's keys; a SentencePiece setting under ``kind=char`` is refused."""
    t = cfg.tokenizer
    out = schema.problems(t, schema.Tokenizer, "tokenizer.")
    given = [k for k in SP_DEFAULTS if k != "vocab_size" and t.get(k) is not None]
    if out or t.kind != "char" or not given:
        return out
    return [
        f"tokenizer.{given[0]}={t[given[0]]!r}: a SentencePiece setting, but tokenizer.kind="
        "char takes none; drop it, or choose tokenizer=bpe or tokenizer=unigram"
    ]


def _task_keys(cfg: DictConfig) -> list[str]:
    """The task's own keys against its schema; under ``task=lm`` a translation key (of
    ``task`` or ``model``) is named as one."""
    t, name = cfg.task, cfg.task.name
    out = schema.problems(t, schema.TASKS[name], "task.", skip=MT_TASK_KEYS if name == "lm" else ())
    if name == "lm":
        out += [
            schema.unknown_key(cfg, k, OmegaConf.select(cfg, k))
            for k in [f"task.{k}" for k in MT_TASK_KEYS if k in t]
            + [f"model.{k}" for k in MT_MODEL_KEYS if k in cfg.model]
        ]
    return out


#: A rule between keys: the section a failure names, and the check.
Rule = tuple[str, Callable[[], list[str]]]


def _cross(
    cfg: DictConfig, model: schema.Model | None, task: Task | None, machine: bool
) -> list[Rule]:
    """The rules that tie keys together, as (section, check), each on the typed groups it
    reads: only those whose own keys passed (None: refused)."""
    out: list[Rule] = []
    if model is not None:
        out += [("model", partial(_model, model, cfg.task.name))]
        out += [("model.window", partial(_window, model, task))]
    if model is not None and task is not None:
        out += [("model.random_positions", partial(_random_positions, model, task))]
    if task is not None:
        rules: dict[str, Callable[..., list[str]]] = {"lm": _lm, "mt": _mt}
        rules["algo"] = partial(_algo, cfg, model, machine)
        out += [("task", partial(rules[cfg.task.name], task))]
        out += [("task.learned", partial(_gate, task))]
        if not isinstance(task, schema.AlgoTask):
            out += [("data", partial(_data, task, cfg.data))]
    if model is not None and cfg.encoder.get("max_len") is not None:
        out += [("encoder.max_len", partial(_max_len, cfg.encoder.max_len, model, task))]
    return out


def _model(m: schema.Model, name: str) -> list[str]:
    """``n_heads`` divides ``d_model``; a translation model has a feed-forward size."""
    out = []
    if m.d_model % m.n_heads:
        out.append(f"model.n_heads={m.n_heads}: must divide model.d_model={m.d_model}")
    if name == "mt" and m.d_ff is None:
        out.append("model.d_ff=None: must be a positive integer")
    return out


def _data(t: schema.LMTask | schema.MTTask, data: DictConfig) -> list[str]:
    """The splits the task evaluates must be in the data: a test split is refused here,
    before anything is read, where the source's arguments leave it out (own files
    without a test file, a test fraction of 0)."""
    source = data.get("source")
    missing = missing_test(source) if OmegaConf.is_dict(source) else None
    if not missing:
        return []
    wanted = [t.eval_split] if isinstance(t, schema.MTTask) else t.eval.splits
    return missing_splits(t.name, wanted, ("train", "val"), data.get("name"), *missing)


def _gate(t: Task) -> list[str]:
    """``task.learned`` against the task: a metric it logs, a threshold on its scale."""
    if t.learned is None:
        return []
    allowed, metric, threshold = metrics(t), t.learned.metric, t.learned.threshold
    out = []
    if metric not in allowed:
        out.append(
            f"task.learned.metric={metric!r}: allowed for task {t.name}: "
            f"{', '.join(allowed)} (validation at the training length)"
        )
    elif allowed[metric]:
        out.append(f"task.learned.metric={metric}: {allowed[metric]}")
    if metric in PERCENT and not 0 <= threshold <= 100:
        out.append(f"task.learned.threshold={threshold}: {metric} is in percent (0..100)")
    elif metric == PASSKEY and not 0 <= threshold <= 1:
        out.append(
            f"task.learned.threshold={threshold}: {metric} is a fraction in [0, 1]; "
            f"e.g. 0.9 for 90% retrieval"
        )
    return out


def _longest(t: Task) -> tuple[int, str, str]:
    """The longest training sequence, how a message names it, and its key: an LM's
    ``task.seq_len``, a translation's ``task.max_len``, or an algorithmic task's largest
    training instance in positions."""
    if isinstance(t, schema.AlgoTask):
        longest = t.longest(t.train_lengths[-1])
        where = f"{longest} positions at the largest of task.train_lengths"
        return longest, f"the longest training sequence ({where})", "train_lengths"
    key = "seq_len" if isinstance(t, schema.LMTask) else "max_len"
    return getattr(t, key), f"task.{key}={getattr(t, key)}", key


def _lm(t: schema.LMTask) -> list[str]:
    """Lengths: each evaluation length at least a token; StreamingLLM's cache within the
    training length."""
    out = [
        f"task.eval.multipliers contains {m!r}: {m} * task.seq_len={t.seq_len} is below one "
        f"token; give multipliers >= {1 / t.seq_len:.3g}"
        for m in t.eval.multipliers
        if int(m * t.seq_len) < 1
    ]
    sinks = t.eval.streaming.sinks
    if "streaming" not in t.eval.context_extension:
        return out
    if t.eval.streaming.window is None and sinks >= t.seq_len:
        return out + [
            f"task.eval.streaming.sinks={sinks}: leaves no window within task.seq_len="
            f"{t.seq_len} (window null is seq_len - sinks); give sinks < {t.seq_len}"
        ]
    window = t.eval.streaming.window_at(t.seq_len)
    problem = sizes_problem(sinks, window, t.seq_len, "task.eval.streaming.")
    return out + ([problem] if problem else [])


def _mt(t: schema.MTTask) -> list[str]:
    """A batch holds the longest training pair; the checkpoint monitor's mode is its
    metric's."""
    out = []
    if t.max_tokens < t.max_len:
        out.append(
            f"task.max_tokens={t.max_tokens}: smaller than task.max_len={t.max_len}, so the "
            "longest training pair would not fit in a batch"
        )
    needs = schema.MONITORS[t.monitor]
    if t.monitor_mode != needs:
        out.append(f"task.monitor_mode={t.monitor_mode!r}: {t.monitor} needs {needs}")
    if t.monitor == "val/bleu" and t.val_bleu_sentences == 0:
        out.append(
            "task.monitor=val/bleu: needs task.val_bleu_sentences > 0 (it is 0); "
            "raise it or monitor val/loss"
        )
    return out


def _algo(
    cfg: DictConfig, model: schema.Model | None, machine: bool, t: schema.AlgoTask
) -> list[str]:
    """The problem's own rules for these sizes and (with ``machine`` and a checked
    ``model``) the memory of the test set."""
    if t.reverse_digits and t.problem != "addition":
        return [
            f"task.reverse_digits=true: only the addition problem has digits to "
            f"reverse (task.problem={t.problem}); drop it"
        ]
    lo, hi = t.train_lengths
    out = check_problem(PROBLEMS[t.problem], t.shape, lo, hi, t.options(), t.lm_loss)
    if not machine or model is None:
        return out
    test_hi = int(math.floor(t.test_multiple * hi))
    problem = memory_problem(t, model.n_heads, model.n_layers, on_cpu(cfg), test_hi)
    return out + ([problem] if problem else [])


def _encdec(t: Task) -> bool:
    """Whether task ``t`` trains an encoder-decoder (translation, or ``shape=encdec``)."""
    return isinstance(t, schema.MTTask) or (isinstance(t, schema.AlgoTask) and t.shape == "encdec")


def _random_positions(m: schema.Model, t: Task) -> list[str]:
    """``model.random_positions`` (Ruoss et al. 2023) must cover the longest training
    sequence."""
    n = m.random_positions
    longest, context, key = _longest(t)
    if n is None or n >= longest:
        return []
    at_least = "that" if key == "train_lengths" else "the longest training sequence"
    scale = "" if key == "train_lengths" else f" task.{key}"
    return [
        f"model.random_positions={n}: smaller than {context}; it must be at least {at_least} "
        f"(e.g. 8-16x{scale})"
    ]


def _window(m: schema.Model, t: Task | None) -> list[str]:
    """``model.window``: with ``model.window_layers``, a window somewhere; in a causal
    decoder only; shorter than the training sequences (a window that long is none); the
    last two once the task's keys passed (``t`` not None)."""
    problem = window_problem(m.window, m.window_layers)
    if problem or m.window is None or t is None:
        return [problem] if problem else []
    if _encdec(t):
        return [NO_WINDOW_IN_TRANSLATOR.format(window=m.window)]
    longest, context, _ = _longest(t)
    if m.window >= longest:
        return [
            f"model.window={m.window}: not smaller than {context}, so every query would see "
            f"every key (no window); give model.window < {longest}, or model.window=null"
        ]
    return []


def _try_encoder(cfg: DictConfig, m: schema.Model, t: Task) -> list[str]:
    """Build the encoder once with the model sizes and make the attention hooks the task
    needs: the encoder's own checks (and refusals, e.g. causal-only schemes in a
    translation encoder) run here, before any data is loaded, and so does the model's
    refusal of attention modifiers the scheme's attention has no place for."""
    kinds = [AttnKind.CAUSAL]
    if _encdec(t):
        kinds += [AttnKind.BIDIRECTIONAL, AttnKind.CROSS]
    mods = Modifiers(qk_norm=m.qk_norm, logit_scale=m.logit_scale, sinks=m.sinks)
    windowed = Modifiers(window=m.window, window_layers=m.window_layers)
    try:
        enc = instantiate(cfg.encoder)(d_model=m.d_model, n_heads=m.n_heads, n_layers=m.n_layers)
        # every layer: a mix gives each its own scheme
        hooks = [enc.for_attention(layer=i, kind=kind) for kind in kinds for i in range(m.n_layers)]
        # the window's layers (a mix's layers may differ in owning their attention)
        local = [i for i in range(m.n_layers) if windowed.for_layer(i).window is not None]
        causal = [enc.for_attention(layer=i, kind=AttnKind.CAUSAL) for i in local]
    except (ValueError, TypeError) as err:
        return [f"encoder: {err}"]
    # the model options that cannot change a scheme's attention (one line for them all)
    refusals = [*map(mods.refusal, hooks), *map(Modifiers(window=m.window).refusal, causal)]
    return [refusal for refusal in refusals if refusal][:1]


def _try_trainer(cfg: DictConfig) -> list[str]:
    """Build Lightning's Trainer once and drop it: its own checks of ``trainer.*`` on this
    machine (an accelerator it lacks, an unknown strategy, ``devices=0``) run here, not
    when the job builds it, after the run folder exists."""
    t = cfg.trainer
    quiet = {"logger": False, "callbacks": [], "enable_checkpointing": False}
    quiet |= {"enable_progress_bar": False, **validation_in_batches(t)}
    logging.disable(logging.INFO)  # its lines and warnings: the job's Trainer says them
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            instantiate(t, **quiet)
    except Exception as err:  # Lightning's, through Hydra's instantiate
        said = str(err.__cause__ or err).splitlines()[0]
        given = ", ".join(f"{k}={t.get(k)}" for k in ("accelerator", "devices", "strategy"))
        return [f"trainer: {said} (Lightning, on this machine, with {given})"]
    finally:
        logging.disable(logging.NOTSET)
    return []


def _max_len(max_len: Any, m: schema.Model, t: Task | None) -> list[str]:
    """Every position a ``learned`` table (``encoder.max_len``) must hold: the drawn
    random positions, then, once the task's own keys are valid (``t`` not None), the
    training length, the evaluation lengths (unless those past the table are skipped) and
    an algorithmic task's largest test instance."""
    out, n = [], m.random_positions
    if n is not None and n > max_len:
        out.append(
            f"model.random_positions={n}: larger than encoder.max_len={max_len}, so the "
            f"learned table cannot embed the drawn positions; raise encoder.max_len to {n}"
        )
    if t is None:
        return out
    if isinstance(t, schema.AlgoTask):
        longest = t.longest(int(math.floor(t.test_multiple * t.train_lengths[-1])))
        if longest > max_len:
            out.append(
                f"task.test_multiple={t.test_multiple}: the largest test instance takes "
                f"{longest} positions, more than encoder.max_len={max_len}; raise "
                f"encoder.max_len or lower task.test_multiple"
            )
        return out
    longest, _, key = _longest(t)
    if longest > max_len:
        return out + [
            f"task.{key}={longest}: longer than encoder.max_len={max_len}; raise "
            f"encoder.max_len or lower task.{key}"
        ]
    if isinstance(t, schema.MTTask) or t.eval.skip_unsupported:
        return out
    for where, lengths in (
        ("task.eval.multipliers", schema.eval_lengths(t)),
        ("task.eval.passkey.multipliers", schema.passkey_lengths(t)),
    ):
        too_long = [L for L in lengths if max_len < L]
        if too_long:
            out.append(
                f"{where} give lengths {too_long} past encoder.max_len={max_len}; drop "
                f"those multipliers, raise encoder.max_len, or set "
                f"task.eval.skip_unsupported=true to record NaN for them"
            )
    return out


#: Lightning's ``precision`` values (an int is read as its string: 16, 32, 64).
PRECISIONS = (
    "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true", "32", "16", "bf16",
    "64", "transformer-engine", "transformer-engine-float16",
)  # fmt: skip

#: Lightning's knobs whose rule is the value's own (null: Lightning's default). Its
#: positive-integer knobs at 0 fail deep inside it (ZeroDivisionError).
TRAINER: dict[str, schema.Check] = {
    "gradient_clip_val": schema.rule("finite>=0", ", or null for no clipping", optional=True),
    "precision": lambda key, v: schema.rule(PRECISIONS)(key, str(v)) if v is not None else [],
    **dict.fromkeys(
        ("accumulate_grad_batches", "log_every_n_steps", "num_nodes"),
        schema.rule("int>0", optional=True),
    ),
}


def trainer(cfg: DictConfig) -> list[str]:
    """``trainer.*`` values posenc relies on: a positive step budget, validation by steps,
    gradient clipping."""
    t, problems = cfg.trainer, []
    steps = t.get("max_steps")
    if not integer(steps):
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
    problems += [p for k, check in TRAINER.items() for p in check(f"trainer.{k}", t.get(k))]
    _val_check_interval(t, problems)
    return problems


def _val_check_interval(t: DictConfig, problems: list[str]) -> None:
    every = t.get("val_check_interval")
    if every is None or (integer(every) and every > 0):
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
