"""Language-modeling text sources.

Each source returns ``{"train": str, "val": str, "test": str}``: one string per split, which
:class:`posenc.data.lm.LMDataModule` tokenizes into a single token stream.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from posenc.data.download import data_dir, fetch, read_text
from posenc.errors import DataError, DataFileNotFound

__all__ = ["SPLITS", "text_files", "tinyshakespeare", "wikitext103"]

SPLITS = ("train", "val", "test")


def tinyshakespeare(
    root: str | os.PathLike[str] | None = None,
    splits: Sequence[float] = (0.9, 0.05, 0.05),
) -> dict[str, str]:
    """TinyShakespeare split contiguously by characters, in order train | val | test.

    Args:
        root: Data folder from the configuration; ``POSENC_DATA_DIR`` overrides it (see
            :func:`posenc.data.download.data_dir`). The file is downloaded if missing.
        splits: Fractions (train, val, test) of the characters; must sum to 1. A test fraction
            of 0 reproduces nanoGPT's 90/10 setting, which has no test split: then ``"test"``
            is the validation text, so test metrics equal validation metrics.

    Returns:
        ``{"train", "val", "test"}`` -> text.

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
        out["test"] = out["val"]
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
        test: Test text file; ``None`` reuses the validation text as test text.

    Returns:
        ``{"train", "val", "test"}`` -> text.

    Raises:
        DataFileNotFound: A path does not exist or is a directory (the message names the
            split and path).
        DataError: A file is empty, only whitespace, corrupt gzip or not UTF-8.
    """
    paths = {"train": train, "val": val, "test": test if test is not None else val}
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
    try:
        from datasets import load_dataset
    except ImportError as err:
        raise ImportError(
            "wikitext103 needs the Hugging Face 'datasets' package, which is not installed. "
            "Install it with: pip install posenc[hf]"
        ) from err
    return load_dataset(*args, **kwargs)


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
        ImportError: ``datasets`` is not installed (``pip install posenc[hf]``).
        DataError: The loaded dataset lacks a split or a split is empty.
    """
    load = loader if loader is not None else _hf_load_dataset
    ds = load("wikitext", "wikitext-103-raw-v1", cache_dir=str(data_dir(root) / "hf"))
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
