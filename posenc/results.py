"""What a run leaves in ``metrics.json``: one typed, versioned record per task, written and
read here and nowhere else.

A job builds an :class:`LMRecord`, :class:`MTRecord` or :class:`AlgoRecord` and
:func:`write`\\ s it; the report, its figures and the run's summary :func:`read` it back and
use its fields. Metric names (``test/ppl+yarn@512``, ``test/bleu@len10-20``, ``val/loss``)
are :class:`MetricName`\\ s: strings as before on disk and in TensorBoard, with their
split, kind, context-extension method and length as fields, so no reader splits them.

Versions: a file without ``version`` is version 1 (every ``metrics.json`` written before
the field existed has this shape, with fewer keys); a version this posenc does not know
is refused with one line (:class:`~posenc.errors.RecordError`).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from posenc.errors import RecordError
from posenc.files import write_text_atomic

#: The version :func:`write` writes; :func:`read` reads it and files without a version.
VERSION = 1
#: The record's file name in a run directory.
FILE = "metrics.json"

#: The compute columns of a report (:meth:`Record.costs`).
COST_KEYS = ("n_params", "tokens_per_s", "peak_memory_mb", "train_time_s")

#: Display order of metric kinds within a split (:meth:`MetricName.sort_key`).
_KIND_ORDER = {
    "ppl": 0,
    "ppl_sw": 1,
    "passkey": 2,
    "bleu": 0,
    "chrf": 1,
    "seq_acc": 0,
    "acc": 1,
    "loss": 2,
}


class MetricName(str):
    """A metric's name, ``<split>/<kind>[+<extension>][@<where>]``, with its parts as fields.

    It is the string itself (what ``metrics.json`` and TensorBoard hold), so it compares and
    hashes like its text; readers use :attr:`split_name`, :attr:`kind`, :attr:`extension`,
    :attr:`where`, :attr:`length` and :attr:`start` instead of splitting it.
    """

    __slots__ = ()

    @classmethod
    def of(cls, split: str, kind: str, where: str | int = "", extension: str = "") -> MetricName:
        """``of("test", "ppl", 512, "yarn")`` is ``test/ppl+yarn@512``."""
        ext = f"+{extension}" if extension else ""
        at = f"@{where}" if where != "" else ""
        return cls(f"{split}/{kind}{ext}{at}")

    def _parts(self) -> tuple[str, str, str, str]:
        head, _, where = self.partition("@")
        split, _, kind = head.partition("/")
        base, _, extension = kind.partition("+")
        return split, base, extension, where

    @property
    def split_name(self) -> str:
        """``test``, ``val``."""
        return self._parts()[0]

    @property
    def kind(self) -> str:
        """What is measured: ``ppl``, ``ppl_sw``, ``passkey``, ``bleu``, ``seq_acc``, ``loss``."""
        return self._parts()[1]

    @property
    def extension(self) -> str:
        """The RoPE context-extension method (``yarn``), "" for a plain metric."""
        return self._parts()[2]

    @property
    def where(self) -> str:
        """After ``@``: a length (``512``), a bucket (``len10-20``, ``len25+``), or ""."""
        return self._parts()[3]

    @property
    def length(self) -> int | None:
        """The evaluation length of ``test/ppl@512`` (None for a bucket or no ``@``)."""
        where = self.where
        return int(where) if where.isdigit() else None

    @property
    def start(self) -> int | None:
        """The first number after ``@``: ``512``, or ``10`` of ``len10-20`` (None if none)."""
        found = re.search(r"\d+", self.where)
        return int(found.group()) if found else None

    @property
    def plain(self) -> MetricName:
        """The name without its context-extension method (``test/ppl@64`` of
        ``test/ppl+yarn@64``)."""
        split, kind, _, where = self._parts()
        return MetricName.of(split, kind, where)

    def sort_key(self) -> tuple[Any, ...]:
        """Test before val, then kind (ppl, ppl_sw / bleu, chrf), then context-extension
        method (plain first), then numeric length or bucket start, overall (no ``@``)
        first: ``test/ppl@128`` < ``test/ppl@1024`` < ``test/ppl+yarn@128``."""
        split, kind, extension, where = self._parts()
        start = self.start
        return (
            {"test": 0, "val": 1}.get(split, 2),
            split,
            _KIND_ORDER.get(kind, 9),
            kind,
            extension,
            -1 if start is None else start,
            where,
        )


#: Metric values as read: a number, NaN for a length not run, or null.
Metrics = dict[MetricName, float | None]
V = TypeVar("V")


def names(mapping: Mapping[str, V]) -> dict[MetricName, V]:
    """``mapping`` with its keys as :class:`MetricName` (its order kept)."""
    return {MetricName(k): v for k, v in mapping.items()}


@dataclass(frozen=True)
class Gate:
    """The learnability gate a run was held to (``task.learned``)."""

    metric: MetricName
    threshold: float
    stop: bool = False


@dataclass(frozen=True)
class Standing:
    """A run's standing at its learnability gate (:func:`posenc.training.gate.result`).

    Attributes:
        gate: The gate, or None for a task without one.
        learned: Whether the gate's metric met it at the last validation (None: no gate,
            or no validation).
        learned_step: The first step at which it met it (None: never).
    """

    gate: Gate | None = None
    learned: bool | None = None
    learned_step: int | None = None


@dataclass(frozen=True, kw_only=True)
class Passkey:
    """An LM run's passkey-retrieval grid: ``accuracy[split][length index][depth index]``,
    and the settings of its instances (:func:`posenc.tasks.lm_passkey.evaluate`)."""

    doc: str = ""
    key_len: int | None = None
    samples: int | None = None
    seed: int | None = None
    lengths: list[int] = field(default_factory=list)
    depths: list[float] = field(default_factory=list)
    accuracy: dict[str, list[list[float]]] = field(default_factory=dict)


def task_key(task: str, problem: Any = None, shape: Any = None) -> str:
    """``lm``, ``mt``, or ``algo_<problem>`` (``..._encdec`` for the encoder-decoder): each
    algorithmic problem is a table of its own, and a tuned learning rate is per table."""
    if task == "algo":
        name = "?" if problem is None else problem
        return f"algo_{name}_encdec" if shape == "encdec" else f"algo_{name}"
    return task


@dataclass(frozen=True, kw_only=True)
class Record:
    """What every run records (and all a record of an unknown task has).

    Attributes:
        task: ``lm``, ``mt``, ``algo`` (another name: a record of a task this posenc lacks).
        metrics: Every scalar result by name, test first, then validation.
        gate_recorded: False for a file from before the learnability gate (no ``gate``,
            ``learned``, ``learned_step`` keys): its standing is unknown, not "no gate".
        config: The resolved config of the run.
        extra: Keys this posenc does not know, kept as they were.
    """

    task: str = "?"
    encoder: str = "?"
    encoder_class: str | None = None
    seed: int | None = None
    metrics: Metrics = field(default_factory=dict)
    gate: Gate | None = None
    learned: bool | None = None
    learned_step: int | None = None
    gate_recorded: bool = True
    n_params: int | None = None
    train_steps: int | None = None
    train_time_s: float | None = None
    decode_time_s: float | None = None
    tokens_per_s: float | None = None
    tokens_per_s_kind: str | None = None
    peak_memory_mb: float | None = None
    peak_memory_kind: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    #: The file's keys in order: the task's own, then every run's.
    HEAD: ClassVar[tuple[str, ...]] = ("task", "encoder", "encoder_class", "seed")
    BODY: ClassVar[tuple[str, ...]] = ("metrics",)
    TAIL: ClassVar[tuple[str, ...]] = (
        "gate",
        "learned",
        "learned_step",
        "n_params",
        "train_steps",
        "train_time_s",
        "decode_time_s",
        "tokens_per_s",
        "tokens_per_s_kind",
        "peak_memory_mb",
        "peak_memory_kind",
        "config",
    )

    @classmethod
    def layout(cls) -> tuple[str, ...]:
        return (*cls.HEAD, *cls.BODY, *cls.TAIL)

    @property
    def table(self) -> str:
        """The report table of the run (:func:`task_key`)."""
        return task_key(self.task)

    @property
    def training_limit(self) -> int | None:
        """The largest length, size or source length trained on (None: not known)."""
        return None

    def beyond_training(self, name: MetricName) -> bool:
        """Whether ``name`` is measured past the training length: an LM length over
        ``seq_len``, an algorithmic size bucket starting past the largest trained size, a
        translation bucket starting past ``max_train_src_len``."""
        start, limit = name.start, self.training_limit
        return start is not None and limit is not None and start > limit

    @property
    def lr(self) -> float | None:
        """The peak learning rate the run trained with (``task.optim.lr``)."""
        optim = (self.config.get("task") or {}).get("optim") or {}
        return _number(optim.get("lr"))

    @property
    def tuned(self) -> dict[str, Any] | None:
        """Where its learning rate came from when tuned (``+tuned=...``), else None."""
        tuned = self.config.get("tuned")
        return tuned if isinstance(tuned, dict) else None

    @property
    def label(self) -> str | None:
        """The run's ``label`` (a sweep arm that changes the model, ``+variant=...``,
        named apart from its encoder), else None."""
        label = self.config.get("label")
        return str(label) if label else None

    @property
    def builds_on(self) -> str | None:
        """The scheme the run's encoder options name as its base, where they name one: a
        mix's most common scheme among its layers' or heads' entries (the first on a
        tie), DAPE's ``base``; else None."""
        encoder = self.config.get("encoder") or {}
        if self.encoder_class == "Dape":
            return encoder.get("base")
        entries = (
            (encoder.get("layers") or encoder.get("heads")) if self.encoder_class == "Mix" else []
        )
        schemes = [e if isinstance(e, str) else e.get("name") for e in entries or []]
        return Counter(schemes).most_common(1)[0][0] if schemes else None

    def costs(self) -> dict[str, float | None]:
        """What the run cost, by :data:`COST_KEYS` (the report averages them per group)."""
        values = (self.n_params, self.tokens_per_s, self.peak_memory_mb, self.train_time_s)
        return dict(zip(COST_KEYS, map(_number, values), strict=True))

    def validation(self) -> Metrics:
        """The last validation's overall metrics (``val/loss``; none by length)."""
        return {k: v for k, v in self.metrics.items() if k.split_name == "val" and not k.where}


@dataclass(frozen=True, kw_only=True)
class LMRecord(Record):
    """A language-modeling run: perplexity by length, protocol and extension method."""

    task: str = "lm"
    seq_len: int | None = None
    eval_lengths: list[int] = field(default_factory=list)
    protocols: dict[str, str] = field(default_factory=dict)
    context_extension: dict[str, str] = field(default_factory=dict)
    extension_settings: dict[MetricName, dict[str, Any]] = field(default_factory=dict)
    scored_tokens: dict[MetricName, int] = field(default_factory=dict)
    skipped: dict[MetricName, str] = field(default_factory=dict)
    loss_by_position: dict[MetricName, list[float]] = field(default_factory=dict)
    passkey: Passkey | None = None

    BODY: ClassVar[tuple[str, ...]] = (
        "seq_len",
        "eval_lengths",
        "protocols",
        "context_extension",
        "extension_settings",
        "metrics",
        "scored_tokens",
        "skipped",
        "loss_by_position",
        "passkey",
    )

    @property
    def training_limit(self) -> int | None:
        return self.seq_len


@dataclass(frozen=True, kw_only=True)
class MTRecord(Record):
    """A translation run: BLEU and chrF overall and by source-length bucket."""

    task: str = "mt"
    data: str | None = None
    eval_split: str = "test"
    n_sentences: int | None = None
    buckets: dict[str, int] = field(default_factory=dict)
    bucket_doc: str = ""
    bleu_signature: str = ""
    decode: dict[str, Any] = field(default_factory=dict)
    max_train_src_len: int | None = None
    data_stats: dict[str, Any] = field(default_factory=dict)

    BODY: ClassVar[tuple[str, ...]] = (
        "data",
        "eval_split",
        "n_sentences",
        "metrics",
        "buckets",
        "bucket_doc",
        "bleu_signature",
        "decode",
        "max_train_src_len",
        "data_stats",
    )

    @property
    def training_limit(self) -> int | None:
        return self.max_train_src_len


#: Per instance size: ``count``, ``seq_acc``, ``acc`` and the problem's other kinds.
BySize = dict[int, dict[str, float]]


@dataclass(frozen=True, kw_only=True)
class AlgoRecord(Record):
    """An algorithmic-task run: the problem's metrics by size bucket and by size.

    Attributes:
        variant_pairs: Key-value pairs of each test variant (``""``: the training
            distribution's), for a problem tested at several numbers of pairs (mqar); empty
            for the others and in files written before it was recorded.
    """

    task: str = "algo"
    problem: str | None = None
    shape: str | None = None
    train_lengths: list[int] = field(default_factory=list)
    size_means: str = ""
    source: str = ""
    test_sizes: str = ""
    buckets: list[str] = field(default_factory=list)
    metric_doc: dict[str, str] = field(default_factory=dict)
    table_metrics: list[str] = field(default_factory=lambda: ["seq_acc", "acc"])
    by_size: BySize = field(default_factory=dict)
    by_size_variants: dict[str, BySize] = field(default_factory=dict)
    variant_pairs: dict[str, int] = field(default_factory=dict)

    HEAD: ClassVar[tuple[str, ...]] = (
        "task",
        "problem",
        "shape",
        "encoder",
        "encoder_class",
        "seed",
    )
    BODY: ClassVar[tuple[str, ...]] = (
        "train_lengths",
        "size_means",
        "source",
        "test_sizes",
        "buckets",
        "metric_doc",
        "table_metrics",
        "metrics",
        "by_size",
        "by_size_variants",
        "variant_pairs",
    )

    @property
    def table(self) -> str:
        return task_key(self.task, self.problem, self.shape)

    @property
    def training_limit(self) -> int | None:
        return self.train_lengths[-1] if self.train_lengths else None

    def bucket_metric(self, kind: str, bucket: str) -> MetricName:
        """``test/<kind>@<bucket>``: a kind's name in a size bucket (``len5-8``)."""
        return MetricName.of("test", kind, bucket)

    def variant_metric(self, kind: str, variant: str, bucket: str) -> MetricName:
        """A kind's name in a bucket on a test variant: ``test/acc_pairs_x2@len16-31``
        (the training distribution's, ``""``, keeps the plain ``test/acc@len16-31``)."""
        return self.bucket_metric(f"{kind}_{variant}" if variant else kind, bucket)

    def size_metric(self, kind: str, size: int) -> MetricName:
        """The name of the one-size bucket of ``size``, ``test/<kind>@len<n>-<n>``."""
        return self.bucket_metric(kind, f"len{size}-{size}")


RECORDS: dict[str, type[Record]] = {"lm": LMRecord, "mt": MTRecord, "algo": AlgoRecord}


# ----------------------------------------------------------------------------- encoding
def _number(value: Any) -> float | None:
    """A number as float; None for null, strings, booleans and other non-numbers."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _gate(value: Any) -> Gate | None:
    if not isinstance(value, dict) or not value:
        return None
    metric, threshold = MetricName(value.get("metric", "")), float(value.get("threshold", 0.0))
    return Gate(metric, threshold, bool(value.get("stop")))


def _passkey(value: Any) -> Passkey | None:
    if not isinstance(value, dict) or not value:
        return None
    known = {f.name for f in fields(Passkey)}
    return Passkey(**{k: v for k, v in value.items() if k in known})


def _by_size(value: Any) -> BySize:
    return {int(n): dict(row) for n, row in (value or {}).items()}


def _metrics(value: Any) -> Metrics:
    """The ``metrics`` mapping, every value a number, NaN or null.

    Raises:
        RecordError: A value that is not a number (a malformed result, never a skipped cell).
    """
    bad = {k: v for k, v in value.items() if v is not None and _number(v) is None}
    if bad:
        name, wrong = next(iter(bad.items()))
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise RecordError(f"metric {name!r} is {wrong!r}, not a number{more}")
    return names(value)


def _to_list_keys(by: BySize) -> dict[str, Any]:
    return {str(n): row for n, row in by.items()}


#: Per field that is not stored as it is: (from the file, to the file).
_CODECS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "metrics": (_metrics, dict),
    "extension_settings": (names, dict),
    "scored_tokens": (names, dict),
    "skipped": (names, dict),
    "loss_by_position": (names, dict),
    "gate": (_gate, lambda g: None if g is None else {**vars(g), "metric": str(g.metric)}),
    "passkey": (_passkey, lambda p: {} if p is None else vars(p)),  # {}: the evaluation was off
    "by_size": (_by_size, _to_list_keys),
    "by_size_variants": (
        lambda v: {k: _by_size(b) for k, b in (v or {}).items()},
        lambda v: {k: _to_list_keys(b) for k, b in v.items()},
    ),
    "variant_pairs": (lambda v: {str(k): int(n) for k, n in (v or {}).items()}, dict),
    "seed": (_int, lambda v: v),
    "seq_len": (_int, lambda v: v),
    "max_train_src_len": (_int, lambda v: v),
    "config": (lambda v: v if isinstance(v, dict) else {}, lambda v: v),
}
#: Keys written only when they hold a value (a task's optional timing and throughput kind).
_OPTIONAL = ("decode_time_s", "tokens_per_s_kind")
_GATE_KEYS = ("gate", "learned", "learned_step")


def to_json(record: Record) -> dict[str, Any]:
    """The record as ``metrics.json`` holds it, keys in the task's order, ``version`` first."""
    out: dict[str, Any] = {"version": VERSION}
    for key in record.layout():
        value = getattr(record, key)
        if (key in _OPTIONAL and value is None) or (key in _GATE_KEYS and not record.gate_recorded):
            continue
        out[key] = _CODECS[key][1](value) if key in _CODECS else value
    return out | record.extra


def from_json(data: Any, where: Path | str = FILE) -> Record:
    """The record a ``metrics.json`` object holds (:func:`read`, without the file).

    Raises:
        RecordError: Not a posenc result, a version this posenc does not read, or a metric
            that is not a number.
    """
    if not isinstance(data, dict) or not isinstance(data.get("metrics", {}), dict):
        raise RecordError("not a posenc result (expected an object with 'metrics')")
    version = data.get("version", 1)  # no version: written before the field, version 1
    if version != VERSION or isinstance(version, bool):
        raise RecordError(
            f"{where}: metrics.json version {version!r} is not one this posenc reads (it reads "
            f"version {VERSION}, and files without a version); read it with the posenc that "
            f"wrote it, or update posenc"
        )
    cls = RECORDS.get(str(data.get("task")), Record)
    known = {f.name for f in fields(cls)} - {"extra", "gate_recorded"}
    values: dict[str, Any] = {}
    for key in known & data.keys():
        value = data[key]
        values[key] = _CODECS[key][0](value) if key in _CODECS else value
    if "task" in values:
        values["task"] = str(values["task"])
    extra = {k: v for k, v in data.items() if k not in known and k != "version"}
    return cls(**values, gate_recorded="learned" in data, extra=extra)


def read(path: Path) -> Record:
    """The record in ``path`` (a run's ``metrics.json``).

    Raises:
        OSError: Unreadable.
        ValueError: Not JSON (:class:`json.JSONDecodeError`).
        RecordError: See :func:`from_json`.
    """
    return from_json(json.loads(Path(path).read_text()), path)


def write(path: Path, record: Record) -> None:
    """Write ``record`` to ``path`` through a temporary file: never a half-written file."""
    write_text_atomic(path, json.dumps(to_json(record), indent=2, default=str))


__all__ = [
    "FILE",
    "VERSION",
    "AlgoRecord",
    "Gate",
    "LMRecord",
    "MTRecord",
    "MetricName",
    "Metrics",
    "Passkey",
    "Record",
    "from_json",
    "names",
    "read",
    "task_key",
    "to_json",
    "write",
]
