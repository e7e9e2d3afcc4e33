"""Typed run configs: one frozen dataclass per config group (``model``, ``task`` of each
task, ``task.optim``, ``task.eval``, ``task.eval.passkey``, ``task.decode``,
``task.learned``, ``tokenizer``) and one for the run itself.

A field declares a key once: its type, its rule (with the one-line message a wrong value
gets) and its default, the only one (:func:`register` hands each task's and each model's
group to Hydra's ConfigStore, and ``conf/task/*.yaml`` and ``conf/model/*.yaml`` extend
them, setting no value of their own; other presets set only what they change). A field
typed ``bool`` takes true or false and nothing else, whatever its rule, and so does every
``bool`` parameter of a class an instantiated group builds (:func:`boolean`).
:func:`problems` walks a composed ``DictConfig`` against a group and lists every unknown
key (with a did-you-mean) and every value its rule refuses; :func:`typed` turns a
checked config into the typed :class:`Run` a job reads (``Run[LMTask]`` for the LM job). The groups
Hydra instantiates (``encoder``, ``trainer``, ``data``) stay mappings: their keys are the
parameters of the classes they build.

The schema Hydra composes with types every value ``Any`` (:func:`loose`): composition
refuses a key a file sets that the group lacks, but converts no value, so ``yes`` or
``"128"`` reach posenc's own rules, which list every problem of a command in one message
before anything is written.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, Generic, TypeVar, cast, get_args

from omegaconf import DictConfig, ListConfig, OmegaConf

from posenc.choices import LOGIT_SCALES, SCALINGS, SCHEDULES, layers_problem
from posenc.data.algo_problems import (
    DEFAULTS,
    GRIDS,
    PROBLEMS,
    SHAPES,
    Options,
    longest_sequence,
    problem_default,
)
from posenc.data.algo_retrieval import HAYSTACKS
from posenc.data.buckets import check_edges
from posenc.data.tokenizers import TOKENIZER_KINDS
from posenc.errors import suggest

# --- rules: a field's spec says what its value must be, and the message if it is not ---

Check = Callable[[str, Any], list[str]]


def integer(value: Any) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def number(value: Any) -> bool:
    """An int or float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def finite(value: Any) -> bool:
    """A finite int or float."""
    return number(value) and math.isfinite(value)


#: spec -> (test, message): the values a key takes.
SPECS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int>0": (lambda v: integer(v) and v > 0, "must be a positive integer"),
    "int>=0": (lambda v: integer(v) and v >= 0, "must be an integer >= 0"),
    "int>=8": (lambda v: integer(v) and v >= 8, "must be an integer >= 8"),
    "num>=0": (lambda v: number(v) and v >= 0, "must be a number >= 0"),
    "num>0": (lambda v: number(v) and v > 0, "must be a number > 0"),
    "finite>0": (lambda v: finite(v) and v > 0, "must be a positive number"),
    "finite>=0": (lambda v: finite(v) and v >= 0, "must be a number >= 0"),
    "finite>=1": (lambda v: finite(v) and v >= 1, "must be a number >= 1"),
    "finite": (finite, "must be a finite number"),
    "[0,1)": (lambda v: number(v) and 0 <= v < 1, "must be a number in [0, 1)"),
    "[0,1]": (lambda v: number(v) and 0 <= v <= 1, "must be a number in [0, 1]"),
    "finite[0,1]": (lambda v: finite(v) and 0 <= v <= 1, "must be a number in [0, 1]"),
    "(0,1]": (lambda v: number(v) and 0 < v <= 1, "must be a number in (0, 1]"),
    "bool": (lambda v: isinstance(v, bool), "must be true or false"),
    "betas": (
        lambda v: (
            isinstance(v, ListConfig | list)
            and len(v) == 2
            and all(finite(b) and 0 <= b < 1 for b in v)
        ),
        "must be two numbers in [0, 1) (Adam's beta1, beta2)",
    ),
    "int[2,26]": (lambda v: integer(v) and 2 <= v <= 26, "must be an integer in 2..26"),
    "auto|bool": (lambda v: isinstance(v, bool) or v == "auto", "allowed auto, true or false"),
    "auto|finite>=1": (lambda v: v == "auto" or (finite(v) and v >= 1), "must be auto or >= 1"),
}


def rule(
    spec: str | tuple[str, ...], hint: str = "", says: str = "", optional: bool = False
) -> Check:
    """``key=value: <message><hint>`` unless the value meets ``spec`` (a name of
    :data:`SPECS`, or a tuple of allowed strings); None passes when ``optional``."""
    if isinstance(spec, tuple):
        test, message = (lambda v: v in spec), f"allowed {', '.join(spec)}"
    else:
        test, message = SPECS[spec]

    def check(key: str, value: Any) -> list[str]:
        if (optional and value is None) or test(value):
            return []
        near = (
            suggest(value, list(spec)) if isinstance(spec, tuple) and isinstance(value, str) else ""
        )
        return [f"{key}={value!r}: {near}{says or message}{hint}"]

    return check


#: Annotations of a boolean that may be null, as a string (``from __future__ import
#: annotations``) reads once spaces are dropped.
_NULLABLE_BOOL = {"bool|None", "None|bool", "Optional[bool]", "typing.Optional[bool]"}


def nullable_bool(annotation: Any) -> bool | None:
    """Whether a boolean's annotation admits null: False for ``bool``, True for
    ``bool | None``, None when the annotation is not a boolean's (``int | bool`` and the
    like take more than true or false, so they are not)."""
    if isinstance(annotation, str):
        text = annotation.replace(" ", "")
        return False if text == "bool" else (True if text in _NULLABLE_BOOL else None)
    if annotation is bool:
        return False
    return True if set(get_args(annotation)) == {bool, type(None)} else None


def boolean(key: str, annotation: Any, value: Any) -> list[str]:
    """``key=value: must be true or false`` when ``annotation`` is a boolean's and
    ``value`` is not one (null passes where the annotation admits it). YAML and Hydra read
    only ``true`` and ``false`` as booleans: ``maybe``, ``flase``, ``1`` or a quoted
    ``'true'`` would otherwise be truthy and silently switch an option on."""
    nullable = nullable_bool(annotation)
    if nullable is None:
        return []
    return rule("bool", " (or null)" if nullable else "", optional=nullable)(key, value)


def parameter_problems(node: Any, fn: Callable[..., Any], prefix: str) -> list[str]:
    """The boolean parameters of ``fn`` (a class an instantiated group builds: an
    encoder, Lightning's ``Trainer``) whose value in ``node`` is not true or false."""
    params = inspect.signature(fn).parameters.values()
    return [
        p
        for q in params
        if q.name in node
        for p in boolean(prefix + q.name, q.annotation, node[q.name])
    ]


def items(
    example: str, spec: str | tuple[str, ...] = "", says: str = "", empty: bool = False
) -> Check:
    """A list (non-empty unless ``empty``) whose items meet ``spec``: a wrong item gets
    ``key contains item: <says>`` (the spec's message by default), a value that is not a
    list an example of one."""
    each = rule(spec, says=says) if spec else (lambda k, v: [])

    def check(key: str, value: Any) -> list[str]:
        if not isinstance(value, ListConfig | list | tuple):
            return [f"{key}={value!r}: must be a list, e.g. {key}={example}"]
        if not len(value) and not empty:
            return [f"{key}=[]: must list at least one value, e.g. {key}={example}"]
        return [p.replace(f"{key}=", f"{key} contains ", 1) for x in value for p in each(key, x)]

    return check


def key(default: Any, check: str | tuple[str, ...] | Check = "", hint: str = "", **kw: Any) -> Any:
    """A field: its default (a list is copied per instance) and its rule (a spec for
    :func:`rule`, or a check of its own)."""
    if isinstance(check, str | tuple):
        check = rule(check, hint, **kw) if check else (lambda k, v: [])
    meta = {"check": check}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def group(
    cls: type[Group], says: str = "must be a mapping", optional: bool = False, **defaults: Any
) -> Any:
    """A nested group; ``says``: the message when the value is not a mapping (``{keys}``
    in it: the group's keys). Its default: ``cls`` with ``defaults`` (the task's own, e.g.
    its optimiser), or None when ``optional`` and none are given."""
    says = says.replace("{keys}", ", ".join(cast(Any, cls).__dataclass_fields__))
    meta = {"group": cls, "says": says, "optional": optional}
    if optional and not defaults:
        return field(default=None, metadata=meta)
    return field(default_factory=lambda: cls(**defaults), metadata=meta)


def preset(cls: type[G], name: str, **defaults: Any) -> type[G]:
    """``cls`` with other defaults (a model preset's sizes): the same keys and rules."""
    own = dataclasses.fields(cast(Any, cls))
    changed = [
        (f.name, f.type, field(default=defaults[f.name], metadata=f.metadata))
        for f in own
        if f.name in defaults
    ]
    return cast(type[G], dataclasses.make_dataclass(name, changed, bases=(cls,), frozen=True))


# --- the groups ---

G = TypeVar("G", bound="Group")


class Group:
    """A typed config group: its keys are fields, read as ``g.key``."""

    #: Fields that are not keys of the config (set by :func:`build`).
    internal: tuple[str, ...] = ()
    #: Keys whose default is the chosen problem's own (``${posenc_problem:task.<key>}``;
    #: a nested group's dotted, ``optim.lr``).
    per_problem: tuple[str, ...] = ()

    def given(self) -> tuple[str, ...]:
        """The keys the config set (the others hold the field's default)."""
        return cast(tuple[str, ...], getattr(self, "_given", keys(type(self))))

    def as_dict(self) -> dict[str, Any]:
        """The keys the config set and their values (e.g. a model's constructor arguments)."""
        return {k: getattr(self, k) for k in self.given()}


@dataclass(frozen=True)
class Optim(Group):
    """``task.optim``: AdamW and its learning-rate schedule (every task)."""

    lr: float = key(1e-3, "finite>0", " (finite; e.g. 1e-3)")
    betas: list[float] = key([0.9, 0.99], "betas", ", e.g. [0.9, 0.99]")
    weight_decay: float = key(0.1, "finite>=0", " (0: no decay)")
    warmup_steps: int = key(100, "int>=0", " (0: no warmup)")
    schedule: str = key("cosine", SCHEDULES)
    min_lr_ratio: float = key(
        0.1, "finite[0,1]", " (the cosine schedule ends at lr * min_lr_ratio)"
    )


@dataclass(frozen=True)
class Gate(Group):
    """``task.learned``: what "learned" means for the task (:mod:`posenc.training.gate`);
    the metric and threshold are checked against the task in :mod:`posenc.config`."""

    metric: str = key("val/loss")
    threshold: float = key(0.0, "finite")
    stop: bool = key(False)


GATE = "must be null (no gate) or {metric, threshold, stop}, e.g. " + (
    "task.learned.metric=val/seq_acc task.learned.threshold=95"
)


@dataclass(frozen=True)
class Passkey(Group):
    """``task.eval.passkey``: passkey retrieval at ``multiplier * task.seq_len`` tokens."""

    multipliers: list[float] = key(
        [],
        items(
            "[1,2,4,8,16] (lengths = multiplier * task.seq_len; []: off)",
            "finite>0",
            "must be positive numbers (length = multiplier * task.seq_len)",
            empty=True,
        ),
    )
    depths: list[float] = key(
        [0, 0.25, 0.5, 0.75, 1.0],
        items(
            "[0,0.25,0.5,0.75,1]",
            "[0,1]",
            "must be numbers in [0, 1] (0: the key first, 1: right before the question)",
        ),
    )
    samples: int = key(20, "int>0")
    key_len: int = key(5, "int>0")
    seed: int = key(0, "int>=0")
    measure_unlearned: bool = key(False)


#: Context-extension methods for ``task.eval.context_extension``: RoPE's scalings, and
#: StreamingLLM's sinks and window (:mod:`posenc.model.streaming`), which any scheme whose
#: scores depend on the query-key distance alone can take.
EXTENSIONS = (*SCALINGS[1:], "streaming")


def _extension_methods(key: str, value: Any) -> list[str]:
    allowed = ", ".join(EXTENSIONS)
    if not isinstance(value, ListConfig | list):
        return [f"{key}={value!r}: must be a list, e.g. {key}=[{value}]; allowed methods {allowed}"]
    out = [f"{key} contains {m!r}: allowed {allowed}" for m in value if m not in EXTENSIONS]
    twice = sorted({m for m in value if list(value).count(m) > 1})
    if twice:
        out.append(f"{key} lists {', '.join(twice)} twice; give each method once")
    return out


@dataclass(frozen=True)
class StreamingEval(Group):
    """``task.eval.streaming``: the cache of ``context_extension=[streaming]``
    (StreamingLLM, Xiao et al. 2024): every query sees the first ``sinks`` tokens and the
    last ``window``; their sum may not pass ``task.seq_len`` (checked in
    :mod:`posenc.config`)."""

    sinks: int = key(4, "int>=0", " (the paper's 4)")
    window: int | None = key(
        None, "int>0", " (null: task.seq_len - sinks, the training length in all)", optional=True
    )

    def window_at(self, seq_len: int) -> int:
        """The window, its null read as ``seq_len - sinks`` (``task.seq_len``)."""
        return seq_len - self.sinks if self.window is None else self.window


LM_GROUP = "must be a mapping with keys {keys} (see conf/task/lm.yaml)"


@dataclass(frozen=True)
class LMEval(Group):
    """``task.eval``: perplexity beyond the training length, and passkey retrieval."""

    splits: list[str] = key(["test"], items("[test]", ("train", "val", "test")))
    multipliers: list[float] = key(
        [1, 2, 4, 8, 16],
        items(
            "[1,2,4]",
            "finite>0",
            "must be positive numbers (evaluation length = multiplier * task.seq_len)",
        ),
    )
    protocols: list[str] = key(
        ["nonoverlap", "sliding"], items("[nonoverlap]", ("nonoverlap", "sliding"))
    )
    sliding_stride: int | None = key(None, "int>0", optional=True)
    max_tokens: int | None = key(32768, "int>0", optional=True)
    skip_unsupported: bool = key(True)
    context_extension: list[str] = key([], _extension_methods)
    extension_factor: float | str = key(
        "auto",
        "auto|finite>=1",
        says="must be auto (s = max(1, eval length / task.seq_len)) or a number >= 1",
    )
    streaming: StreamingEval = group(StreamingEval, LM_GROUP)
    passkey: Passkey = group(Passkey, LM_GROUP)


@dataclass(frozen=True)
class LMTask(Group):
    """``task`` for ``task=lm``."""

    #: What ``best.ckpt`` keeps: fixed for this task (translation's are keys).
    monitor: ClassVar[str] = "val/loss"
    monitor_mode: ClassVar[str] = "min"
    name: str = key("lm")
    seq_len: int = key(128, "int>0")
    batch_size: int = key(16, "int>0")
    eval_batch_size: int = key(8, "int>0")
    optim: Optim = group(Optim)
    eval: LMEval = group(LMEval)
    passkey_mix: float = key(
        0.0,
        "[0,1]",
        " (the fraction of training windows replaced by passkey sequences; 0: off)",
    )
    passkey_answer_weight: float = key(
        100.0, "num>0", " (the loss weight of a training passkey answer's key tokens; 1: as text)"
    )
    learned: Gate | None = group(Gate, GATE, optional=True)


def eval_lengths(task: Any) -> list[int]:
    """Perplexity's evaluation lengths in tokens, ``multiplier * seq_len``, of an LM
    ``task`` (an :class:`LMTask`, or the ``task`` node of a composed config)."""
    return [int(m * task.seq_len) for m in task.eval.multipliers]


def passkey_lengths(task: Any) -> list[int]:
    """Passkey lengths in tokens, ``multiplier * seq_len`` (empty: the evaluation is off)."""
    return [int(m * task.seq_len) for m in task.eval.passkey.multipliers]


def _buckets(key: str, value: Any) -> list[str]:
    out = items("[0,10,20,1000]")(key, value)
    try:
        if not out:
            check_edges(list(value))
    except (ValueError, TypeError) as err:
        return [f"{key}={list(value)}: {err}"]
    return out


@dataclass(frozen=True)
class Decode(Group):
    """``task.decode``: beam search for the translation test."""

    beam_size: int = key(4, "int>0")
    length_penalty: float = key(0.6, "num>=0")
    max_len_a: float = key(1.2, "num>=0")
    max_len_b: int = key(10, "int>=0")
    use_cache: bool = key(True)


MONITORS = {"val/loss": "min", "val/nll": "min", "val/ppl": "min", "val/bleu": "max"}


@dataclass(frozen=True)
class MTTask(Group):
    """``task`` for ``task=mt``."""

    name: str = key("mt")
    max_tokens: int = key(4096, "int>0")
    max_len: int = key(256, "int>0")
    max_train_src_len: int | None = key(None, "int>0", optional=True)
    length_buckets: list[int] = key([0, 10, 20, 30, 1000], _buckets)
    label_smoothing: float = key(0.1, "[0,1)", says="must be in [0, 1)")
    share_embeddings: bool = key(True)
    val_bleu_sentences: int = key(200, "int>=0")
    monitor: str = key("val/bleu", tuple(MONITORS))
    monitor_mode: str = key("max")
    eval_split: str = key("test", ("test", "val"))
    eval_max_sentences: int | None = key(None, "int>0", optional=True)
    samples: int = key(8, "int>=0")
    learned: Gate | None = group(Gate, GATE, optional=True)
    optim: Optim = group(
        Optim, betas=[0.9, 0.98], weight_decay=1e-4, warmup_steps=200, schedule="inverse_sqrt"
    )
    decode: Decode = group(Decode)


def _train_lengths(key: str, value: Any) -> list[str]:
    out = items("[1,16]")(key, value)
    if out or (len(value) == 2 and all(integer(x) for x in value) and 1 <= value[0] <= value[1]):
        return out
    return [f"{key}={list(value)}: must be [lo, hi] with integers 1 <= lo <= hi, e.g. {key}=[1,16]"]


def _generic(name: str) -> Any:
    """``task.<name>``'s value for a problem without one of its own
    (:data:`posenc.data.algo_problems.DEFAULTS`, the one home of those numbers)."""
    return problem_default(None, f"task.{name}")


@dataclass(frozen=True)
class AlgoTask(Group):
    """``task`` for ``task=algo``: a generated algorithmic problem."""

    per_problem = tuple(k.removeprefix("task.") for k in DEFAULTS if k.startswith("task."))
    #: What ``best.ckpt`` keeps: fixed for this task (translation's are keys).
    monitor: ClassVar[str] = "val/loss"
    monitor_mode: ClassVar[str] = "min"
    name: str = key("algo")
    problem: str = key("copy", tuple(PROBLEMS))
    shape: str = key(
        "decoder",
        SHAPES,
        says="allowed decoder (decoder-only: prompt, separator, answer) or encdec "
        "(encoder-decoder: prompt -> answer)",
    )
    train_lengths: list[int] = key(_generic("train_lengths"), _train_lengths)
    test_multiple: float = key(
        _generic("test_multiple"),
        "finite>=1",
        " (test sizes go up to test_multiple * the largest training size)",
    )
    test_sizes: str = key(
        "auto", ("auto", *GRIDS), says=f"allowed auto (the problem's own), {', '.join(GRIDS)}"
    )
    bucket_width: int = key(_generic("bucket_width"), "int>0")
    symbols: int = key(
        _generic("symbols"),
        "int[2,26]",
        " (letters of the problems that draw letters, e.g. copy, reverse_string; "
        "variables of count)",
    )
    reverse_digits: bool = key(_generic("reverse_digits"))
    data_tokens: int = key(_generic("data_tokens"), "int>0")
    pairs: int = key(_generic("pairs"), "int>0")
    queries: int = key(_generic("queries"), "int>0")
    key_vocab: int = key(_generic("key_vocab"), "int>0")
    value_vocab: int = key(_generic("value_vocab"), "int>0")
    haystack: str = key("noise", HAYSTACKS)
    chains: int = key(_generic("chains"), "int>0")
    hops: int = key(_generic("hops"), "int>=0")
    lm_loss: bool = key(False)
    batch_size: int = key(64, "int>0")
    eval_batch_size: int = key(128, "int>0")
    val_per_size: int = key(_generic("val_per_size"), "int>0")
    test_per_size: int = key(_generic("test_per_size"), "int>0")
    learned: Gate | None = group(
        Gate, GATE, optional=True, metric="val/seq_acc", threshold=95.0, stop=True
    )
    optim: Optim = group(
        Optim, lr=_generic("optim.lr"), betas=[0.9, 0.98], weight_decay=0.0, warmup_steps=50
    )

    def options(self) -> Options:
        """The instance options (:class:`posenc.data.algo.Options`)."""
        mine = keys(type(self))
        return Options(**{k: getattr(self, k) for k in Options.__dataclass_fields__ if k in mine})

    def longest(self, size: int) -> int:
        """Positions an instance of ``size`` takes."""
        return longest_sequence(PROBLEMS[self.problem], size, self.shape, self.options())


TASKS: dict[str, type[Group]] = {"lm": LMTask, "mt": MTTask, "algo": AlgoTask}


@dataclass(frozen=True)
class Model(Group):
    """``model``: the shared transformer (``conf/model/{lm,mt,algo}.yaml``)."""

    n_layers: int = key(4, "int>0")
    d_model: int = key(128, "int>0")
    n_heads: int = key(4, "int>0")
    d_ff: int | None = key(512, "int>0", optional=True)
    dropout: float = key(0.0, "[0,1)")
    embed_scale: bool = key(False)
    random_positions: int | None = key(
        None,
        "int>0",
        " (the range positions are drawn from in training) or null (off)",
        optional=True,
    )
    # true, false, or auto (posenc/training/compiling.py)
    compile: bool | str = key(
        "auto", "auto|bool", " (auto: compiled when training on a GPU where measured faster)"
    )
    score_budget_mib: float = key(8, "num>=0", " (MiB; 0: no query blocking)")
    qkv_bias: bool = key(True)
    # attention modifiers for any scheme (posenc/model/modifiers.py)
    qk_norm: bool = key(False)
    logit_scale: str = key("none", LOGIT_SCALES)
    sinks: bool = key(False)
    # sliding-window attention (posenc/model/window.py): the keys a query sees at most,
    # on the layers window_layers (local/global, cycled; null: all) makes local
    window: int | None = key(None, "int>0", " (tokens) or null (off)", optional=True)
    window_layers: list[str] | None = key(None, lambda k, v: [p for p in [layers_problem(v)] if p])
    # an encoder-decoder's: blocks of each stack (n_layers when null), one embedding table
    n_enc_layers: int | None = key(None, "int>0", optional=True)
    n_dec_layers: int | None = key(None, "int>0", optional=True)
    share_embeddings: bool = key(True)


@dataclass(frozen=True)
class Tokenizer(Group):
    """``tokenizer``: its kind and, for SentencePiece (``bpe``, ``unigram``), its training
    settings (null: :mod:`posenc.data.tokenizers`' defaults). ``kind=char`` ignores
    ``vocab_size`` (its vocabulary is the text's characters; a task's preset sets one for
    SentencePiece) and takes no other setting."""

    kind: str = key("char", TOKENIZER_KINDS)
    vocab_size: int | None = key(None, "int>=8", optional=True)
    character_coverage: float | None = key(None, "(0,1]", optional=True)
    input_sentence_size: int | None = key(None, "int>=0", " (0: every sentence)", optional=True)
    num_threads: int | None = key(None, "int>0", optional=True)


T = TypeVar("T", bound=Group)


@dataclass(frozen=True)
class Run(Group, Generic[T]):
    """A whole run: its own keys, the typed groups, the instantiated groups (``encoder``,
    ``trainer``, ``data``) as mappings, and ``raw``: the composed config as given, which
    ``metrics.json`` and checkpoints record."""

    internal = ("raw",)
    seed: int = key(0, "int>=0")
    threads: int | None = key(
        None,
        "int>0",
        " (CPU threads per process) or null (torch's default: one per core)",
        optional=True,
    )
    eval_only: bool = key(False)
    resume: bool = key(False)
    ckpt_path: str | None = key(None)
    init_from: str | None = key(None)
    checkpoint_every_n_steps: int = key(250, "int>0")
    tuned: Any = key(None)
    tuned_allow_partial: bool = key(False)
    #: The scheme's name in results when not its encoder choice: a sweep arm that changes
    #: the model (``+variant=rope_qknorm``) sets it so its rows stand beside the parent's.
    label: str | None = key(None)
    task: T = cast(Any, None)  # LMTask, MTTask or AlgoTask: a job's Run[LMTask] says which
    model: Model = field(default_factory=Model)
    tokenizer: Any = None
    encoder: Any = None
    trainer: Any = None
    data: Any = None
    paths: Any = None
    raw: Any = None


# --- walking a composed config ---


def unknown(prefix: str, given: list[str], allowed: list[str]) -> list[str]:
    """``prefix.key: unknown key; did you mean ...? allowed: ...`` for each stray key."""
    return [
        f"{prefix}{k}: unknown key; {suggest(k, allowed)}allowed: {', '.join(sorted(allowed))}"
        for k in given
        if k not in allowed
    ]


def group_choice(cfg: Any, group: str) -> str:
    """The Hydra group choice (``rope``); outside a Hydra run (a config composed by
    hand), the registered name of the configured class."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_class

    if HydraConfig.initialized():
        return HydraConfig.get().runtime.choices[group]
    cls = get_class(getattr(cfg, group)._target_)
    return getattr(cls, "name", cls.__name__)


def encoder_label(cfg: Any) -> str:
    """The scheme's name in results: ``label`` when the run sets one (a sweep arm such as
    ``+variant=rope_qknorm``), else the encoder choice (:func:`group_choice`)."""
    label = cfg.get("label") if isinstance(cfg, DictConfig) else getattr(cfg, "label", None)
    return str(label) if label else group_choice(cfg, "encoder")


def result_name(cfg: Any) -> str:
    """The scheme's row in results, reports and tuned-rate files: :func:`encoder_label`,
    plus ``_rand`` when the run trains on randomized positions (``model.random_positions``),
    so such runs never share a row with the scheme trained on plain positions."""
    random = getattr(cfg.model, "random_positions", None)
    return encoder_label(cfg) + ("_rand" if random else "")


#: A value not known (a key named by an error that does not give it).
UNKNOWN = object()


def unknown_key(cfg: Any, key: str, value: Any = UNKNOWN) -> str:
    """The line that refuses ``key`` (dotted, with its ``value`` where known), which the
    composed ``cfg`` has no place for: a translation option under ``task=lm`` says so,
    any other key gets its group's keys and the nearest one."""
    parent, _, leaf = key.rpartition(".")
    given = "" if value is UNKNOWN else f"={value!r}"
    mt_only = {f"task.{k}" for k in MT_TASK_KEYS} | {f"model.{k}" for k in MT_MODEL_KEYS}
    if key in mt_only and cfg.task.name == "lm":
        return f"{key}{given}: a translation option, but task.name=lm; remove it or run task=mt"
    node = OmegaConf.select(cfg, parent) if parent else cfg
    allowed = [str(k) for k in node.keys()] if OmegaConf.is_dict(node) else []  # noqa: SIM118
    return unknown(f"{parent}." if parent else "", [leaf], allowed)[0]


def keys(cls: type[Group]) -> list[str]:
    """The keys ``cls`` accepts."""
    return [f.name for f in dataclasses.fields(cast(Any, cls)) if f.name not in cls.internal]


#: Each task's model (``conf/model/<task>.yaml``): the LM's sizes are :class:`Model`'s.
MODELS: dict[str, type[Model]] = {
    "lm": Model,
    "mt": preset(
        Model, "MTModel", n_layers=3, d_model=256, d_ff=1024, dropout=0.1, embed_scale=True
    ),
    "algo": preset(Model, "AlgoModel", n_layers=2, d_model=64, d_ff=256),
}
#: Keys only the translation task reads (``task.*``, ``model.*``).
MT_TASK_KEYS = tuple(k for k in keys(MTTask) if k not in keys(LMTask))
MT_MODEL_KEYS = ("n_enc_layers", "n_dec_layers")
#: The model keys each task's model takes (the others are refused).
MODEL_KEYS = {
    "lm": tuple(k for k in keys(Model) if k not in (*MT_MODEL_KEYS, "share_embeddings")),
    "mt": tuple(k for k in keys(Model) if k != "share_embeddings"),  # task.share_embeddings
}
MODEL_KEYS["algo"] = MODEL_KEYS["lm"]


def problems(
    node: Any,
    cls: type[Group],
    prefix: str,
    *,
    skip: tuple[str, ...] = (),
    refuse: tuple[str, ...] = (),
) -> list[str]:
    """Every problem of ``node`` (a mapping) against ``cls``: unknown keys first, then
    each field's rule in field order, nested groups walked in turn. Keys in ``skip`` are
    neither refused nor checked (their caller reports them); keys in ``refuse`` are
    unknown here (fields of the group another task reads)."""
    allowed = [k for k in keys(cls) if k not in refuse]
    out = unknown(prefix, [str(k) for k in node if k not in skip], allowed)
    for f in dataclasses.fields(cast(Any, cls)):
        if f.name not in node or f.name in skip:
            continue
        value = node[f.name]
        sub = f.metadata.get("group")
        if sub is not None:
            if value is None and f.metadata["optional"]:
                continue
            if not isinstance(value, DictConfig | Mapping):
                out.append(f"{prefix}{f.name}={value!r}: {f.metadata['says']}")
                continue
            out += problems(value, sub, f"{prefix}{f.name}.")
        elif "check" in f.metadata:
            out += boolean(f"{prefix}{f.name}", f.type, value)  # a field typed bool
            out += f.metadata["check"](f"{prefix}{f.name}", value)
    return out


def build(cls: type[Group], node: Any, **extra: Any) -> Any:
    """The typed ``cls`` of a checked ``node``: its keys, nested groups built in turn,
    lists as Python lists; a missing key takes the field's default."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cast(Any, cls)):
        if f.name not in node or f.name in extra:
            continue
        value = node[f.name]
        sub = f.metadata.get("group")
        if sub is not None and value is not None:
            value = build(sub, value)
        elif isinstance(value, ListConfig | DictConfig):
            value = OmegaConf.to_container(value, resolve=True)
        values[f.name] = value
    made = cls(**values, **extra)
    object.__setattr__(made, "_given", tuple(k for k in keys(cls) if k in values or k in extra))
    return made


def untyped(cfg: Run[Any] | DictConfig) -> DictConfig:
    """The composed config behind ``cfg`` (a :class:`Run`, or already a ``DictConfig``)."""
    return cast(DictConfig, cfg.raw if isinstance(cfg, Run) else cfg)


def typed(cfg: DictConfig) -> Run[Any]:
    """The typed run of a validated config (:func:`posenc.config.validate`)."""
    name, groups = cfg.task.name, ("tokenizer", "encoder", "trainer", "data", "paths")
    task, model = build(TASKS[name], cfg.task), build(MODELS[name], cfg.model)
    mappings = {k: cfg.get(k) for k in groups}  # the instantiated groups stay mappings
    return cast(Run[Any], build(Run, cfg, task=task, model=model, raw=cfg, **mappings))


# --- the schema Hydra composes with ---


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def loose(
    cls: type[Group],
    name: str,
    drop: tuple[str, ...] = (),
    base: Any = None,
    per_problem: tuple[str, ...] | None = None,
    path: str = "task.",
) -> type:
    """The structured config Hydra composes a group with: ``cls``'s keys (less ``drop``)
    and defaults (``base``'s values, an instance of ``cls``, where given), every value
    typed ``Any``. Composition then refuses a key the group lacks, and leaves each value
    as written (OmegaConf would read ``yes`` as true and ``"128"`` as 128, and posenc's
    rules could no longer refuse them); :func:`problems` checks the values. Keys in
    ``per_problem`` (``cls.per_problem`` by default; dotted for a nested group's, e.g.
    ``optim.lr``) default to the chosen problem's own, ``${posenc_problem:<path><key>}``."""
    per_problem = cls.per_problem if per_problem is None else per_problem
    fields: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(cast(Any, cls)):
        if f.name in cls.internal or f.name in drop:
            continue
        default = getattr(base, f.name) if base is not None else _default(f)
        sub = f.metadata.get("group")
        if sub is not None:
            # a value that is not a mapping reaches the group's own message
            mine = tuple(
                k.removeprefix(f"{f.name}.") for k in per_problem if k.startswith(f"{f.name}.")
            )
            inner = loose(
                sub, f"{name}_{f.name}", base=default, per_problem=mine, path=f"{path}{f.name}."
            )
            made = field(default=None) if default is None else field(default_factory=inner)
            fields.append((f.name, Any, made))
        elif f.name in per_problem:  # resolved when the problem is known
            fields.append((f.name, Any, field(default=f"${{posenc_problem:{path}{f.name}}}")))
        elif isinstance(default, list):
            fields.append((f.name, Any, field(default_factory=partial(list, default))))
        else:
            fields.append((f.name, Any, field(default=default)))
    return dataclasses.make_dataclass(name, fields)


def register() -> None:
    """Register each task's and each model's schema in Hydra's ConfigStore, as the
    ``schema/task`` and ``schema/model`` options ``conf/task/*.yaml`` and
    ``conf/model/*.yaml`` extend: the dataclasses are the one home of every default."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name, task in TASKS.items():
        store.store(group="schema/task", name=name, node=loose(task, f"{task.__name__}Schema"))
    for name, model in MODELS.items():
        drop = tuple(k for k in keys(model) if k not in MODEL_KEYS[name])
        node = loose(model, f"{name.capitalize()}ModelSchema", drop)
        store.store(group="schema/model", name=name, node=node)
