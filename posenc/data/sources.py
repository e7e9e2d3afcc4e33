"""Where the data comes from: text for language modeling, parallel corpora for translation.

A text source returns ``{"train": str, "val": str, "test": str}`` (``"test"`` only where
the data has a test part): one string per split, which
:class:`posenc.data.lm.LMDataModule` tokenizes into a single token stream. A parallel
source (:func:`multi30k`, :func:`parallel_files`, :func:`hf_translation`, or any callable
alike) returns ``{split: (sources, targets)}`` with splits ``"train"``, ``"val"`` and
optionally ``"test"``, which :class:`posenc.data.mt.MTDataModule` tokenizes. No source
stands one split in for another: a run that evaluates a split the data lacks is refused
(:func:`missing_test` tells from the config, before anything is read).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posenc.data.download import data_dir, fetch, read_text
from posenc.errors import DataError, DataFileNotFound, refuse, unknown_value

__all__ = [
    "REQUIRED",
    "SPLITS",
    "ParallelCorpus",
    "hf_translation",
    "missing_test",
    "multi30k",
    "parallel_files",
    "text_files",
    "tinyshakespeare",
    "wikitext103",
]

SPLITS = ("train", "val", "test")
#: The splits every source gives (training, and validation during it).
REQUIRED = ("train", "val")


def tinyshakespeare(
    root: str | os.PathLike[str] | None = None,
    splits: Sequence[float] = (0.9, 0.05, 0.05),
) -> dict[str, str]:
    """TinyShakespeare split contiguously by characters, in order train | val | test.

    Args:
        root: Data folder from the configuration; ``POSENC_DATA_DIR`` overrides it (see
            :func:`posenc.data.download.data_dir`). The file is downloaded if missing.
        splits: Fractions (train, val, test) of the characters; must sum to 1. A test fraction
            of 0 reproduces nanoGPT's 90/10 setting, which has no test split.

    Returns:
        ``{"train", "val", "test"}`` -> text; no ``"test"`` for a test fraction of 0.

    Raises:
        DataError: ``splits`` does not have 3 non-negative entries summing to 1, or gives
            train or val no characters.
    """
    fractions = [float(f) for f in splits]
    if len(fractions) != 3 or any(f < 0 or not math.isfinite(f) for f in fractions):
        raise DataError(
            f"splits must be 3 non-negative fractions (train, val, test), got {tuple(splits)!r}; "
            "e.g. (0.9, 0.05, 0.05) or nanoGPT's (0.9, 0.1, 0.0)."
        )
    if not math.isclose(sum(fractions), 1.0, abs_tol=1e-6):
        raise DataError(
            f"splits must sum to 1, got {tuple(splits)!r} (sum {sum(fractions):.6g}); "
            "e.g. (0.9, 0.05, 0.05)."
        )
    text = read_text(fetch("tinyshakespeare/input.txt", data_dir(root)))
    n = len(text)
    train_end = int(n * fractions[0])
    # With no test fraction the validation part runs to the end, regardless of float rounding.
    val_end = n if fractions[2] == 0 else int(n * (fractions[0] + fractions[1]))
    if train_end == 0 or val_end <= train_end:
        raise DataError(
            f"splits {tuple(splits)!r} leave the train or val split of TinyShakespeare "
            f"({n} characters) empty; give both a positive fraction."
        )
    out = {"train": text[:train_end], "val": text[train_end:val_end], "test": text[val_end:]}
    if fractions[2] == 0:
        del out["test"]
    return out


def text_files(
    train: str | os.PathLike[str],
    val: str | os.PathLike[str],
    test: str | os.PathLike[str] | None = None,
) -> dict[str, str]:
    """The user's own UTF-8 text files (plain or ``.gz``), one per split.

    Args:
        train: Training text file.
        val: Validation text file.
        test: Test text file; ``None``: the data has no test split.

    Returns:
        ``{"train", "val", "test"}`` -> text (no ``"test"`` without a test file).

    Raises:
        DataFileNotFound: A path does not exist or is a directory (the message names the
            split and path).
        DataError: A file is empty, only whitespace, corrupt gzip or not UTF-8.
    """
    paths = {"train": train, "val": val} | ({"test": test} if test is not None else {})
    for key, p in paths.items():
        path = Path(p).expanduser()
        if not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "does not exist"
            raise DataFileNotFound(
                f"text_files: the {key!r} file {str(p)!r} {what}; "
                f"fix data.source.{key} in your configuration."
            )
    texts = {key: read_text(Path(p).expanduser()) for key, p in paths.items()}
    for key, text in texts.items():
        if not text.strip():
            raise DataError(
                f"text_files: the {key!r} file {str(paths[key])!r} holds only whitespace "
                f"({len(text)} characters), nothing to train or score on; give "
                f"data.source.{key} a file with text."
            )
    return texts


@dataclass(frozen=True)
class OptionalTest:
    """A source whose arguments may leave the test split out.

    Attributes:
        given: Whether its arguments (``data.source``) give a test split.
        absent: What leaves it out, for the message.
        give: The arguments that give one.
    """

    given: Callable[[Mapping[str, Any]], bool]
    absent: str
    give: str


def _test_fraction(args: Mapping[str, Any]) -> float:
    try:
        return float(args.get("splits", (0.9, 0.05, 0.05))[2])
    except (TypeError, ValueError, IndexError, KeyError):
        return 1.0  # malformed: tinyshakespeare refuses it itself, naming the value


#: The sources of this module whose test split is optional, by name.
OPTIONAL_TEST = {
    "text_files": OptionalTest(
        lambda a: a.get("test") is not None,
        "no test file: data.source.test=null",
        "data.source.test=<file>",
    ),
    "parallel_files": OptionalTest(
        lambda a: a.get("test_src") is not None or a.get("test_tgt") is not None,
        "no test files: data.source.test_src and test_tgt are null",
        "data.source.test_src=<file> data.source.test_tgt=<file>",
    ),
    "tinyshakespeare": OptionalTest(
        lambda a: _test_fraction(a) > 0,
        "a test fraction of 0 in data.source.splits",
        "a test fraction, e.g. data.source.splits=[0.9,0.05,0.05]",
    ),
}


def missing_test(source: Mapping[str, Any]) -> tuple[str, str] | None:
    """Why the source a config describes gives no test split, and how to give it one;
    None when it gives one or only loading it can tell (a hub dataset, a source of your
    own).

    Args:
        source: ``data.source``: the source's ``_target_`` and arguments.
    """
    module, _, name = str(source.get("_target_", "")).rpartition(".")
    optional = OPTIONAL_TEST.get(name) if module == __name__ else None
    if optional is None or optional.given(source):
        return None
    return optional.absent, f"give one with {optional.give}"


def _join_wikitext(rows: Sequence[str]) -> str:
    """Join WikiText rows into one text.

    Hugging Face yields one row per line of the original file, with its trailing newline, and
    empty rows where the file had blank lines. Rows are stripped (the leading space is an
    artefact of WikiText's tokenisation), runs of blank rows collapse into one blank line so
    paragraphs stay separated, and the text ends with a newline. The ``@-@``-style escapes are
    kept, as in published WikiText-103 perplexities.
    """
    lines: list[str] = []
    for row in rows:
        line = row.strip()
        if line:
            lines.append(line)
        elif lines and lines[-1]:
            lines.append("")
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n" if lines else ""


def _hf_load_dataset(*args: Any, **kwargs: Any) -> Any:
    """``datasets.load_dataset(*args, **kwargs)``, imported lazily.

    Raises:
        ImportError: ``datasets`` is not installed.
    """
    from datasets import load_dataset

    return load_dataset(*args, **kwargs)


def _wikitext_fix(cache: Path) -> str:
    """How to get WikiText-103 into ``cache`` (the Hugging Face cache under the data folder)."""
    return (
        f'install it with pip install "posenc[hf]" and run once with network: the first run '
        f"downloads WikiText-103 (a few hundred MB) into {cache}; without network here, copy that "
        f"folder from a machine that has it and set HF_DATASETS_OFFLINE=1, or train on your "
        f"own text with data=text_files"
    )


def wikitext103(
    root: str | os.PathLike[str] | None = None,
    loader: Callable[..., Any] | None = None,
) -> dict[str, str]:
    """WikiText-103 (raw) through Hugging Face ``datasets``.

    Args:
        root: Data folder; the Hugging Face cache goes to ``data_dir(root) / "hf"``.
        loader: Stand-in for ``datasets.load_dataset``, called as
            ``loader("wikitext", "wikitext-103-raw-v1", cache_dir=...)`` and returning a
            mapping with splits ``"train"``, ``"validation"``, ``"test"``, each indexable by
            ``"text"`` to give the list of rows. ``None`` imports ``datasets`` lazily.

    Returns:
        ``{"train", "val", "test"}`` -> text (see :func:`_join_wikitext` for the cleaning).

    Raises:
        DataError: ``datasets`` is not installed, the data could not be downloaded or found
            in the cache (one line each, saying how to get it), the loaded dataset lacks a
            split, or a split is empty.
    """
    cache = data_dir(root) / "hf"
    load = loader if loader is not None else _hf_load_dataset
    try:
        ds = load("wikitext", "wikitext-103-raw-v1", cache_dir=str(cache))
    except ImportError as err:
        raise DataError(
            f"data=wikitext103 needs the Hugging Face 'datasets' package, which is not "
            f"installed; {_wikitext_fix(cache)}."
        ) from err
    except OSError as err:  # no network (ConnectionError), not in the cache (FileNotFoundError)
        raise DataError(
            f"data=wikitext103: WikiText-103 could not be loaded ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else 'no message'}); {_wikitext_fix(cache)}."
        ) from err
    out: dict[str, str] = {}
    for ours, theirs in (("train", "train"), ("val", "validation"), ("test", "test")):
        try:
            rows = ds[theirs]["text"]
        except (KeyError, TypeError) as err:
            raise DataError(
                f"wikitext103: the loaded dataset has no {theirs!r} split with a 'text' column "
                f"({err!r}); expected splits train/validation/test."
            ) from err
        text = _join_wikitext(rows)
        if not text:
            raise DataError(f"wikitext103: the {theirs!r} split holds no text.")
        out[ours] = text
    return out


# Parallel corpora (translation)

#: split name -> (source sentences, target sentences), aligned line by line.
ParallelCorpus = dict[str, tuple[list[str], list[str]]]

MULTI30K_DIRECTIONS = ("en-de", "de-en")
# Multi30k task 1 file stems per split; the 2016 Flickr test set is the standard test split.
_MULTI30K_STEMS = {"train": "train", "val": "val", "test": "test_2016_flickr"}
# Hugging Face split names -> posenc split names.
_HF_SPLITS = {"train": "train", "validation": "val", "test": "test"}


def _lines(text: str) -> list[str]:
    """Split file text into lines on ``\\n`` only.

    ``str.splitlines`` also breaks on characters such as U+2028 or U+0085 that can occur inside
    a sentence, which would silently misalign a parallel corpus, so it is not used.
    """
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _read_pair(
    src_path: str | os.PathLike[str], tgt_path: str | os.PathLike[str]
) -> tuple[list[str], list[str]]:
    src, tgt = _lines(read_text(src_path)), _lines(read_text(tgt_path))
    if len(src) != len(tgt):
        raise DataError(
            f"parallel files differ in line count: {src_path} has {len(src)} lines but "
            f"{tgt_path} has {len(tgt)}; line i of one must translate line i of the other. "
            "Check that the two files belong together and that neither is truncated."
        )
    return src, tgt


def multi30k(
    root: str | os.PathLike[str] | None = None, direction: str = "en-de"
) -> ParallelCorpus:
    """Multi30k task 1 (Elliott et al., 2016): 29,000 / 1,014 / 1,000 raw cased pairs.

    Files are fetched (downloaded and sha256-verified if missing) with
    :func:`posenc.data.download.fetch`; the test split is the 2016 Flickr test set.

    Args:
        root: Data folder; ``None`` means :func:`posenc.data.download.data_dir`.
        direction: ``"en-de"`` (English source) or ``"de-en"`` (German source).

    Returns:
        ``{"train": (src, tgt), "val": (src, tgt), "test": (src, tgt)}`` in file order.

    Raises:
        ValueError: Unknown direction, or a file pair differs in line count.
    """
    if direction not in MULTI30K_DIRECTIONS:
        raise ValueError(
            unknown_value("Multi30k direction", direction, MULTI30K_DIRECTIONS)
            + " (source-target language codes)."
        )
    src_lang, tgt_lang = direction.split("-")
    out: ParallelCorpus = {}
    for split, stem in _MULTI30K_STEMS.items():
        src_path = fetch(f"multi30k/{stem}.{src_lang}.gz", root=root)
        tgt_path = fetch(f"multi30k/{stem}.{tgt_lang}.gz", root=root)
        out[split] = _read_pair(src_path, tgt_path)
    return out


def parallel_files(
    train_src: str | os.PathLike[str],
    train_tgt: str | os.PathLike[str],
    val_src: str | os.PathLike[str],
    val_tgt: str | os.PathLike[str],
    test_src: str | os.PathLike[str] | None = None,
    test_tgt: str | os.PathLike[str] | None = None,
) -> ParallelCorpus:
    """Read a parallel corpus from local text files, one sentence per line (plain or ``.gz``).

    Args:
        train_src: Training source sentences.
        train_tgt: Training target sentences, line-aligned with ``train_src``.
        val_src: Validation source sentences.
        val_tgt: Validation target sentences.
        test_src: Optional test source sentences; give both test files or neither.
        test_tgt: Optional test target sentences.

    Returns:
        ``{"train": ..., "val": ..., "test": ...}`` (``"test"`` only if test files are given).

    Raises:
        ValueError: A source/target pair differs in line count, or only one test file is given.
    """
    if (test_src is None) != (test_tgt is None):
        given, missing = ("test_src", "test_tgt") if test_tgt is None else ("test_tgt", "test_src")
        raise DataError(
            f"{given} was given but {missing} was not; pass both test files or neither."
        )
    out: ParallelCorpus = {
        "train": _read_pair(train_src, train_tgt),
        "val": _read_pair(val_src, val_tgt),
    }
    if test_src is not None and test_tgt is not None:
        out["test"] = _read_pair(test_src, test_tgt)
    return out


def _translation_column(split_data: Any) -> Sequence[Mapping[str, str]]:
    # A Hugging Face Dataset returns a whole column at once (fast, Arrow-backed); anything else
    # is treated as an iterable of rows.
    if hasattr(split_data, "column_names"):
        if "translation" not in split_data.column_names:
            raise ValueError(
                f"dataset split has columns {list(split_data.column_names)} but no 'translation' "
                "column; hf_translation expects the WMT/IWSLT layout "
                "{'translation': {lang: sentence}}."
            )
        return split_data["translation"]
    return [row["translation"] for row in split_data]


def hf_translation(
    name: str,
    config: str,
    src_lang: str,
    tgt_lang: str,
    loader: Callable[..., Mapping[str, Any]] | None = None,
) -> ParallelCorpus:
    """A translation corpus from the Hugging Face hub (e.g. WMT14, IWSLT2017).

    Rows must have the WMT/IWSLT layout ``{"translation": {src_lang: ..., tgt_lang: ...}}``.
    Hugging Face splits ``train``/``validation``/``test`` become ``train``/``val``/``test``;
    other splits are ignored.

    Args:
        name: Dataset name, e.g. ``"wmt14"`` or ``"iwslt2017"``.
        config: Dataset configuration, e.g. ``"de-en"`` or ``"iwslt2017-en-de"``.
        src_lang: Language code of the source side, e.g. ``"en"``.
        tgt_lang: Language code of the target side, e.g. ``"de"``.
        loader: Called as ``loader(name, config)`` and must return a mapping of split name to
            rows; ``None`` means ``datasets.load_dataset``. Pass e.g.
            ``functools.partial(datasets.load_dataset, trust_remote_code=True)`` for datasets
            that need it, or a stand-in for tests.

    Returns:
        ``{"train": (src, tgt), "val": ..., "test": ...}`` for the splits present.

    Raises:
        ImportError: ``loader`` is None and ``datasets`` is not installed.
        ValueError: Same language on both sides, no train split, or a language missing from
            the rows.
    """
    if src_lang == tgt_lang:
        raise ValueError(
            f"src_lang and tgt_lang are both {src_lang!r}; give two different language codes."
        )
    if loader is None:
        try:
            from datasets import load_dataset
        except ImportError as err:
            raise ImportError(
                "hf_translation needs the Hugging Face 'datasets' package, which is not "
                "installed; install it with `pip install posenc[hf]` (or `pip install datasets`)."
            ) from err
        loader = load_dataset
    data = loader(name, config)
    if "train" not in data:
        raise ValueError(
            f"dataset {name!r} (config {config!r}) has splits {sorted(data)} but no 'train'; "
            "hf_translation needs a train split to build the tokenizer."
        )
    out: ParallelCorpus = {}
    for hf_split, split in _HF_SPLITS.items():
        if hf_split not in data:
            continue
        column = _translation_column(data[hf_split])
        src: list[str] = []
        tgt: list[str] = []
        for i, pair in enumerate(column):
            if src_lang not in pair or tgt_lang not in pair:
                raise DataError(
                    f"row {i} of split {hf_split!r} of {name!r} ({config!r}) has languages "
                    f"{sorted(pair)} but src_lang={src_lang!r}, tgt_lang={tgt_lang!r} were "
                    "asked for; pick codes from those languages or another config."
                )
            src.append(pair[src_lang])
            tgt.append(pair[tgt_lang])
        out[split] = (src, tgt)
    return out


def missing_splits(
    task: str, wanted: Sequence[str], available: Collection[str], data: str, why: str, fix: str
) -> list[str]:
    """A line for each split a task evaluates that the data lacks: the key that asks for
    it (``task.eval.splits`` of an LM, ``task.eval_split`` of a translation), the data,
    ``why`` it lacks the split and ``fix`` (how to give one), or how to evaluate the rest.

    Args:
        task: ``lm`` or ``mt`` (which key names the splits).
        wanted: The splits the task evaluates.
        available: The splits the data has.
        data: The data's name (``data=<name>``).
        why: Why it has no more (e.g. "no test file: data.source.test=null").
        fix: How to give it the split (e.g. "give one with data.source.test=<file>").
    """
    lacking = [s for s in wanted if s not in available]
    if task == "mt":
        return [
            f"task.eval_split={s!r}: data={data} has no {s} split ({why}); {fix}, or "
            f"set task.eval_split=val"
            for s in lacking
        ]
    left = [s for s in wanted if s in available] or ["val"]
    return [
        f"task.eval.splits contains {s!r}: data={data} has no {s} split ({why}); {fix}, or "
        f"set task.eval.splits=[{','.join(left)}]"
        for s in lacking
    ]


def check_splits(task: str, wanted: Sequence[str], available: Collection[str], data: str) -> None:
    """Refuse evaluating a split the loaded data lacks (a source that only says so once
    read: a hub dataset, a source of your own); run once the data is loaded, before
    training.

    Raises:
        ConfigError: One line per missing split, naming the key and the fix.
    """
    given = ", ".join(s for s in ("train", "val", "test") if s in available)
    refuse(missing_splits(task, wanted, available, data, f"the source gave {given}", "give it one"))
