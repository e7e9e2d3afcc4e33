"""Tokenizers: a character vocabulary and SentencePiece (BPE or unigram), both cached on disk.

All tokenizers share the special ids pad=0, bos=1, eos=2, unk=3 so models and losses never
need to know which tokenizer produced a batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from posenc.errors import CacheError, DataError

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "TOKENIZER_KINDS",
    "UNK_ID",
    "CharTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "build_tokenizer",
]

log = logging.getLogger(__name__)

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
TOKENIZER_KINDS = ("char", "bpe", "unigram")

# Bump when the on-disk format or the training recipe changes so old caches are not reused.
_CACHE_VERSION = 1


@runtime_checkable
class Tokenizer(Protocol):
    """What every posenc tokenizer provides."""

    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    unk_id: int

    def encode(self, text: str) -> list[int]:
        """Map text to token ids (no bos/eos added)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Map token ids back to text, dropping pad/bos/eos."""
        ...


class CharTokenizer:
    """Character-level tokenizer: ids 0-3 are pad/bos/eos/unk, then the sorted characters.

    Args:
        chars: Characters of the vocabulary; duplicates are removed and the rest sorted so the
            same character set always yields the same ids.

    Raises:
        ValueError: ``chars`` holds a string that is not exactly one character.
    """

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    unk_id = UNK_ID
    # What an unknown id decodes to: visible in samples, but never confused with real text.
    unk_text = "\ufffd"

    def __init__(self, chars: Iterable[str]) -> None:
        unique = sorted(set(chars))
        bad = [c for c in unique if len(c) != 1]
        if bad:
            raise ValueError(
                f"CharTokenizer vocabulary entries must be single characters, got {bad[:5]!r}."
            )
        self.chars: list[str] = unique
        self._offset = UNK_ID + 1
        self._to_id = {c: i + self._offset for i, c in enumerate(unique)}
        self.vocab_size: int = len(unique) + self._offset

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> CharTokenizer:
        """Build the vocabulary from every character that occurs in ``texts``.

        Args:
            texts: Training texts.

        Returns:
            The tokenizer.
        """
        seen: set[str] = set()
        for text in texts:
            seen.update(text)
        return cls(seen)

    def encode(self, text: str) -> list[int]:
        """Map each character to its id; characters outside the vocabulary map to ``unk_id``.

        Args:
            text: Any string, including megabyte-long ones.

        Returns:
            One id per character, ``len(text)`` ids.
        """
        get = self._to_id.get
        return [get(c, UNK_ID) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        """Map ids back to characters, dropping pad/bos/eos; unk becomes U+FFFD.

        Args:
            ids: Token ids in ``[0, vocab_size)``.

        Returns:
            The decoded string.

        Raises:
            ValueError: An id is outside ``[0, vocab_size)``.
        """
        out: list[str] = []
        for i in ids:
            i = int(i)
            if i >= self._offset and i < self.vocab_size:
                out.append(self.chars[i - self._offset])
            elif i == UNK_ID:
                out.append(self.unk_text)
            elif i not in (PAD_ID, BOS_ID, EOS_ID):
                raise ValueError(
                    f"token id {i} is outside this CharTokenizer's vocabulary "
                    f"[0, {self.vocab_size}); was it produced by another tokenizer?"
                )
        return "".join(out)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the vocabulary as JSON, atomically (temp file then rename).

        Args:
            path: Destination ``.json`` file; parent folders are created.
        """
        payload = {"kind": "char", "version": _CACHE_VERSION, "chars": self.chars}
        _atomic_write_text(Path(path), json.dumps(payload, ensure_ascii=False))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CharTokenizer:
        """Read a vocabulary written by :meth:`save`.

        Args:
            path: JSON file.

        Returns:
            The tokenizer.

        Raises:
            ValueError: The file is not a CharTokenizer JSON file.
        """
        try:
            payload = json.loads(Path(path).read_text(encoding="utf-8"))
            chars = payload["chars"]
            if payload.get("kind") != "char" or not isinstance(chars, list):
                raise TypeError("not a char tokenizer payload")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"{path} is not a valid CharTokenizer file ({err}); delete it to rebuild it."
            ) from err
        return cls(chars)


class SentencePieceTokenizer:
    """Wrapper around a trained SentencePiece model with posenc's special ids.

    Newlines are handled outside SentencePiece (which would normalise them to spaces): text is
    split at ``"\\n"``, each line is encoded, and the reserved control symbol ``<nl>`` is put
    between lines, so multi-line text (e.g. a whole LM corpus) round-trips its line structure.
    Within a line SentencePiece's default normalisation applies (NFKC, leading/trailing and
    repeated spaces removed), so ``decode(encode(t)) == t`` holds for normalised text only.

    Args:
        model_file: Path of a ``.model`` file trained by :meth:`train` (with
            ``model_proto``: only the name messages give the model).
        model_proto: The model's bytes, instead of reading ``model_file`` (a checkpoint
            carries them: :func:`to_payload`).

    Raises:
        ValueError: The file cannot be loaded as a SentencePiece model or lacks posenc's ids.
    """

    NEWLINE = "<nl>"

    def __init__(
        self, model_file: str | os.PathLike[str], *, model_proto: bytes | None = None
    ) -> None:
        import sentencepiece as spm

        self.model_file = Path(model_file)
        try:
            if model_proto is not None:
                self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
            else:
                self._sp = spm.SentencePieceProcessor(model_file=str(self.model_file))
        except (OSError, RuntimeError) as err:
            raise ValueError(
                f"cannot load SentencePiece model {self.model_file} ({err}); delete it so it is "
                "retrained."
            ) from err
        sp = self._sp
        self.vocab_size: int = sp.get_piece_size()
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = (
            sp.pad_id(),
            sp.bos_id(),
            sp.eos_id(),
            sp.unk_id(),
        )
        if (self.pad_id, self.bos_id, self.eos_id, self.unk_id) != (PAD_ID, BOS_ID, EOS_ID, UNK_ID):
            raise ValueError(
                f"SentencePiece model {self.model_file} has pad/bos/eos/unk ids "
                f"{(self.pad_id, self.bos_id, self.eos_id, self.unk_id)}, posenc needs "
                f"{(PAD_ID, BOS_ID, EOS_ID, UNK_ID)}; train it with SentencePieceTokenizer.train."
            )
        nl = sp.piece_to_id(self.NEWLINE)
        # piece_to_id answers unk for absent pieces; then newlines fall back to spaces.
        self.newline_id: int | None = None if nl == UNK_ID else nl

    @staticmethod
    def train(
        texts: Sequence[str],
        model_file: str | os.PathLike[str],
        *,
        model_type: str = "bpe",
        vocab_size: int = 8000,
        character_coverage: float = 1.0,
        input_sentence_size: int = 200_000,
        num_threads: int = 2,
    ) -> SentencePieceTokenizer:
        """Train a model on ``texts`` and write it atomically to ``model_file``.

        Args:
            texts: Training texts; each is split into lines and empty lines are dropped, so a
                1 MB single-string corpus trains as ordinary sentences.
            model_file: Destination ``.model`` path; parent folders are created.
            model_type: ``"bpe"`` or ``"unigram"``.
            vocab_size: Number of pieces including the 4 specials and ``<nl>``.
            character_coverage: Fraction of characters covered by the vocabulary; 1.0 keeps
                every character (right for small alphabets), ~0.9995 suits CJK.
            input_sentence_size: At most this many lines are sampled (shuffled) for training,
                which bounds training time on large corpora.
            num_threads: Trainer threads.

        Returns:
            The trained tokenizer, loaded from ``model_file``.

        Raises:
            ValueError: Bad settings, no non-empty training line, or SentencePiece rejected the
                settings (e.g. ``vocab_size`` larger than the corpus supports).
        """
        import sentencepiece as spm

        if model_type not in ("bpe", "unigram"):
            raise ValueError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}.")
        if not isinstance(vocab_size, int) or vocab_size < 8:
            raise ValueError(f"vocab_size must be an int >= 8, got {vocab_size!r}.")
        if not 0.0 < character_coverage <= 1.0:
            raise ValueError(f"character_coverage must be in (0, 1], got {character_coverage!r}.")
        model_file = Path(model_file)
        model_file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=model_file.parent, prefix=".spm-train-") as tmp:
            corpus = Path(tmp) / "corpus.txt"
            n_lines = 0
            with corpus.open("w", encoding="utf-8") as f:
                for text in texts:
                    for line in text.splitlines():
                        if line.strip():
                            f.write(line)
                            f.write("\n")
                            n_lines += 1
            if n_lines == 0:
                raise ValueError("cannot train SentencePiece: the training texts hold no text.")
            prefix = Path(tmp) / "model"
            try:
                spm.SentencePieceTrainer.train(
                    input=str(corpus),
                    model_prefix=str(prefix),
                    model_type=model_type,
                    vocab_size=vocab_size,
                    character_coverage=character_coverage,
                    pad_id=PAD_ID,
                    bos_id=BOS_ID,
                    eos_id=EOS_ID,
                    unk_id=UNK_ID,
                    control_symbols=[SentencePieceTokenizer.NEWLINE],
                    input_sentence_size=input_sentence_size,
                    shuffle_input_sentence=True,
                    num_threads=num_threads,
                    minloglevel=2,
                )
            except RuntimeError as err:
                # its reason without the source location: "... [check] Vocabulary size is ..."
                reason = str(err).rpartition("] ")[2].split(". Increase")[0].strip().rstrip(".")
                fix = (
                    "raise vocab_size"
                    if "smaller" in reason
                    else "lower vocab_size, or supply more text"
                )
                raise DataError(
                    f"vocab_size={vocab_size}: SentencePiece cannot train a {model_type} "
                    f"vocabulary of that size on these {n_lines} lines ({reason}); {fix}"
                ) from err
            # Rename from the same folder tree: readers never see a partially written model.
            os.replace(prefix.with_suffix(".model"), model_file)
        return SentencePieceTokenizer(model_file)

    def encode(self, text: str) -> list[int]:
        """Encode text; newlines become the ``<nl>`` id.

        Args:
            text: Any string; long texts are encoded line by line in one batched call.

        Returns:
            Token ids (no bos/eos added).
        """
        lines = text.split("\n")
        if self.newline_id is None:
            return list(self._sp.encode(" ".join(lines)))
        pieces = self._sp.encode(lines)
        out: list[int] = list(pieces[0])
        for piece in pieces[1:]:
            out.append(self.newline_id)
            out.extend(piece)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids, dropping pad/bos/eos; ``<nl>`` becomes ``"\\n"``.

        Args:
            ids: Token ids in ``[0, vocab_size)``.

        Returns:
            The decoded text.

        Raises:
            ValueError: An id is outside ``[0, vocab_size)``.
        """
        drop = (PAD_ID, BOS_ID, EOS_ID)
        lines: list[list[int]] = [[]]
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"token id {i} is outside this SentencePiece vocabulary [0, {self.vocab_size})."
                )
            if i == self.newline_id:
                lines.append([])
            elif i not in drop:
                lines[-1].append(i)
        return "\n".join(self._sp.decode(line) for line in lines)


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _cache_key(kind: str, texts: Sequence[str], settings: dict[str, Any]) -> str:
    """sha256 over the kind, settings and every training text (length-prefixed, unambiguous)."""
    h = hashlib.sha256()
    header = {"kind": kind, "settings": settings, "version": _CACHE_VERSION}
    h.update(json.dumps(header, sort_keys=True).encode())
    for text in texts:
        data = text.encode("utf-8", errors="surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


#: SentencePiece's settings and their defaults (the config's ``tokenizer.*`` keys besides ``kind``).
SP_DEFAULTS: dict[str, Any] = {
    "vocab_size": 8000,
    "character_coverage": 1.0,
    "input_sentence_size": 200_000,
    "num_threads": 2,
}


def tokenizer_settings(kind: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The settings a tokenizer of ``kind`` is built with from a config's: a character
    tokenizer's vocabulary is its text's characters, so the ``vocab_size`` that a task's
    preset sets for SentencePiece (``task=mt``) is dropped for ``kind=char``. A null
    setting is the tokenizer's default."""
    return {
        k: v for k, v in settings.items() if v is not None and (kind != "char" or k != "vocab_size")
    }


def build_tokenizer(
    kind: str, texts: Sequence[str], cache_dir: str | os.PathLike[str], **settings: Any
) -> Tokenizer:
    """Build (or load from cache) a tokenizer trained on ``texts`` only.

    The cache file is ``cache_dir/<key>.json`` (char) or ``cache_dir/<key>.model``
    (SentencePiece), where ``key`` is a sha256 over the kind, the settings and the training
    texts: changed data or settings retrain, unchanged ones reuse the file. A cached file that
    fails to load, or whose vocabulary size disagrees with ``vocab_size``, is logged as a
    warning and rebuilt.

    Args:
        kind: ``"char"``, ``"bpe"`` or ``"unigram"``.
        texts: Training texts (e.g. ``[train_split]``); never pass validation or test text.
        cache_dir: Folder for cached tokenizers; created if missing.
        **settings: For ``"bpe"``/``"unigram"``: ``vocab_size`` (8000),
            ``character_coverage`` (1.0), ``input_sentence_size`` (200000), ``num_threads`` (2).
            ``"char"`` takes none.

    Returns:
        The tokenizer.

    Raises:
        ValueError: Unknown ``kind`` or setting, or empty ``texts``.
    """
    if kind not in TOKENIZER_KINDS:
        raise ValueError(
            f"unknown tokenizer kind {kind!r}; allowed kinds are {list(TOKENIZER_KINDS)}."
        )
    if isinstance(texts, str):
        # A bare string would be hashed and trained on character by character by accident.
        texts = [texts]
    if not any(texts):
        raise ValueError(f"cannot build a {kind!r} tokenizer from empty training texts.")
    cache_dir = Path(cache_dir).expanduser()
    allowed = {} if kind == "char" else SP_DEFAULTS
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown settings {unknown} for tokenizer kind {kind!r}; allowed settings are "
            f"{sorted(allowed) or 'none'}."
        )
    resolved = {**allowed, **settings}
    key = _cache_key(kind, texts, resolved)

    if kind == "char":
        path = cache_dir / f"{key}.json"
        if cache_usable(path):
            try:
                return CharTokenizer.load(path)
            except ValueError as err:
                log.warning("rebuilding corrupt cached char tokenizer %s: %s", path, err)
        tok = CharTokenizer.from_texts(texts)
        tok.save(path)
        write_checksum(path)
        return tok

    path = cache_dir / f"{key}.model"
    if cache_usable(path):
        try:
            sp_tok = SentencePieceTokenizer(path)
        except ValueError as err:
            log.warning("rebuilding corrupt cached SentencePiece model %s: %s", path, err)
        else:
            if sp_tok.vocab_size == resolved["vocab_size"]:
                return sp_tok
            log.warning(
                "rebuilding cached SentencePiece model %s: vocab size %d, expected %d",
                path,
                sp_tok.vocab_size,
                resolved["vocab_size"],
            )
    sp_tok = SentencePieceTokenizer.train(texts, path, model_type=kind, **resolved)
    write_checksum(path)
    return sp_tok


def _checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):  # a GB-sized id file: by blocks
            h.update(block)
    return h.hexdigest()


def write_checksum(path: Path) -> None:
    """Write ``path``'s sha256 beside it (``<name>.sha256``), for :func:`cache_usable`."""
    _atomic_write_text(_checksum_path(path), _sha256(path) + "\n")


def cache_usable(path: Path, what: str = "cached tokenizer") -> bool:
    """Whether the cached file ``path`` can be used: it exists with the checksum
    written beside it. One without a checksum (an older posenc's) is rebuilt.

    Args:
        path: The cached file.
        what: What it is, for messages.

    Raises:
        CacheError: The file changed since posenc wrote it.
    """
    if not path.exists():
        return False
    check = _checksum_path(path)
    if not check.exists():
        log.info("%s %s has no checksum beside it: rebuilding it", what, path)
        return False
    expected = check.read_text().strip()
    if _sha256(path) != expected:
        raise CacheError(
            f"{what} {path} changed since posenc wrote it (its sha256 differs from "
            f"{check.name}). Token ids from it would not be the ones the data was trained on. "
            f"Delete {path} and {check} to rebuild it."
        )
    return True


def _records(buf: bytes) -> Iterator[tuple[int, bytes, bytes]]:
    """The records of a serialized protobuf message: (field number, the record's bytes,
    the payload of a length-delimited record or b"")."""

    def varint(i: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            byte = buf[i]
            value |= (byte & 0x7F) << shift
            i, shift = i + 1, shift + 7
            if byte < 0x80:
                return value, i

    i = 0
    while i < len(buf):
        start = i
        key, i = varint(i)
        wire = key & 7
        payload = b""
        if wire == 0:
            _, i = varint(i)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        elif wire == 2:
            n, i = varint(i)
            payload, i = buf[i : i + n], i + n
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} in a SentencePiece model")
        yield key >> 3, buf[start:i], payload


def _without_training_paths(model: bytes) -> bytes:
    """A serialized SentencePiece ``ModelProto`` without its ``trainer_spec`` (field 2)'s
    ``input`` (1) and ``model_prefix`` (2): the temporary paths training wrote into it.
    Read at the wire level, so no protobuf package (or version) is needed."""
    out = bytearray()
    for field, record, payload in _records(model):
        if field != 2:
            out += record
            continue
        spec = b"".join(r for f, r, _ in _records(payload) if f not in (1, 2))
        out += record[:1] + _varint_bytes(len(spec)) + spec  # key 0x12 is one byte
    return bytes(out)


def _varint_bytes(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def to_payload(tok: Tokenizer) -> dict[str, Any]:
    """The tokenizer as plain values that a checkpoint carries (and a ``weights_only``
    load reads back), so a checkpoint encodes and decodes text without the data it was
    trained on: :func:`from_payload`."""
    if isinstance(tok, CharTokenizer):
        return {"kind": "char", "chars": list(tok.chars)}
    if isinstance(tok, SentencePieceTokenizer):
        return {"kind": "sentencepiece", "model": tok._sp.serialized_model_proto()}
    raise TypeError(f"no payload for tokenizer type {type(tok).__name__}")


def from_payload(payload: dict[str, Any], where: str) -> Tokenizer:
    """The tokenizer :func:`to_payload` stored.

    Args:
        payload: What :func:`to_payload` returned.
        where: Where it was read from, for messages (a checkpoint's path).

    Raises:
        ValueError: The payload is not a tokenizer's.
    """
    kind = payload.get("kind")
    if kind == "char" and isinstance(payload.get("chars"), list):
        return CharTokenizer(payload["chars"])
    if kind == "sentencepiece" and isinstance(payload.get("model"), bytes):
        return SentencePieceTokenizer(where, model_proto=payload["model"])
    raise ValueError(f"{where}: the stored tokenizer is damaged (kind {kind!r})")


def fingerprint(tok: Tokenizer) -> str:
    """sha256 of a tokenizer's vocabulary: equal fingerprints encode text identically.
    Checkpoints store it, so a model is never run with another tokenizer's ids.

    For SentencePiece it hashes the model without the paths SentencePiece writes into it
    (the training corpus and output prefix, which are temporary files), so the same model
    trained in another folder or on another machine has the same fingerprint."""
    if isinstance(tok, CharTokenizer):
        data = json.dumps(tok.chars, ensure_ascii=False).encode()
    elif isinstance(tok, SentencePieceTokenizer):
        data = _without_training_paths(tok._sp.serialized_model_proto())
    else:
        raise TypeError(f"no fingerprint for tokenizer type {type(tok).__name__}")
    return hashlib.sha256(data).hexdigest()


def fingerprints(tok: Tokenizer) -> tuple[str, ...]:
    """The fingerprints a checkpoint trained with ``tok`` may carry: :func:`fingerprint`
    first (what new checkpoints record), then, for SentencePiece, the hash of the whole
    model file that checkpoints recorded before 2026-11-25 (it includes the temporary
    training paths, so it matches only the cached model file it was computed from)."""
    if isinstance(tok, SentencePieceTokenizer):
        whole = hashlib.sha256(tok._sp.serialized_model_proto()).hexdigest()
        return (fingerprint(tok), whole)
    return (fingerprint(tok),)


def cache_problems(path: Any) -> list[str]:
    """``paths.cache_dir`` (``POSENC_CACHE_DIR``) must be a folder posenc can write to: it is
    created if missing, and a temporary file is written and removed."""
    key = "paths.cache_dir"
    if not isinstance(path, str) or not path:
        return [f"{key}={path!r}: must be a folder path (or set POSENC_CACHE_DIR)"]
    folder = Path(path).expanduser()
    blocker = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        where = "is a file" if blocker == folder else f"is inside {blocker}, which is a file"
        return [
            f"{key}={path}: {where}, not a folder; point paths.cache_dir (or "
            f"POSENC_CACHE_DIR) at a folder"
        ]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        return [
            f"{key}={path}: cannot write there ({err.strerror or err}); point "
            f"paths.cache_dir (or POSENC_CACHE_DIR) at a writable folder"
        ]
    return []
