"""Language-modeling data: random training windows and length-generalisation eval windows.

Each split is tokenized once into a single 1-D token stream. A window of length ``L`` starting
at ``s`` has ``input = tokens[s : s + L]`` and ``target = tokens[s + 1 : s + L + 1]``; target
position ``p`` (an index into the stream, ``1 <= p < n``) is predicted from the ``p - s``
tokens ``tokens[s : p]``.

Two evaluation protocols are offered for every evaluation length ``L``:

* ``ppl@L`` - non-overlapping windows: every target is scored once, but the first tokens of
  each window see little context, so the average mixes all context sizes ``1..L``.
* ``ppl_sw@L`` - sliding windows advanced by ``stride``: after the first window only the last
  ``stride`` targets of each window are scored, so every scored token has at least
  ``L - stride + 1`` tokens of context (the first window scores all of its targets). Costs
  about ``L / stride`` times more compute than ``ppl@L``.

Both protocols at a given ``L`` score exactly the same target tokens, so they are comparable.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from posenc.data.passkey import PasskeyFormat, seeded
from posenc.data.samplers import EPOCH_STEPS, BatchIndexSampler, Progress, trainer_progress
from posenc.data.sources import REQUIRED, SPLITS
from posenc.data.tokenizers import (
    CharTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    build_tokenizer,
    cache_usable,
    fingerprint,
    tokenizer_settings,
    write_checksum,
)
from posenc.errors import CacheError, ConfigError, DataError

__all__ = [
    "EvalWindows",
    "LMDataModule",
    "PasskeyDraw",
    "PasskeyMixWindows",
    "RandomOffsetSampler",
    "RandomWindows",
    "eval_stream_length",
    "first_scored",
    "score_masks",
    "window_starts",
]

Batch = dict[str, torch.Tensor]


def window_starts(n_tokens: int, length: int, stride: int) -> list[int]:
    """Start offsets of evaluation windows over a stream of ``n_tokens`` tokens.

    Windows advance by ``stride``. If that does not land the last window exactly on the end of
    the stream, one more window aligned to the end is added, so that together with
    :func:`score_masks` every target position ``1..n_tokens-1`` is scored exactly once.
    With ``stride == length`` and ``n_tokens == 1 + k * length`` this is exactly ``k``
    non-overlapping windows.

    Args:
        n_tokens: Length of the token stream.
        length: Window length ``L`` (number of inputs, and of targets, per window).
        stride: Step between window starts, ``1 <= stride <= length``.

    Returns:
        Strictly increasing start offsets; the last equals ``n_tokens - length - 1``.

    Raises:
        ValueError: ``length`` or ``stride`` out of range, or fewer than ``length + 1`` tokens.
    """
    if length < 1:
        raise ValueError(f"window length must be >= 1, got {length}.")
    if not 1 <= stride <= length:
        raise ValueError(
            f"stride must be in [1, length={length}] so no token is skipped, got {stride}."
        )
    last = n_tokens - length - 1
    if last < 0:
        raise ValueError(
            f"a window of length {length} needs {length + 1} tokens, the stream has {n_tokens}."
        )
    starts = list(range(0, last + 1, stride))
    if starts[-1] != last:
        starts.append(last)
    return starts


def first_scored(starts: Sequence[int], length: int) -> list[int]:
    """Index (within each window) of the first target that window scores.

    A window scores only the targets that no earlier window scored, so the first window scores
    from index 0 and a window at ``s`` after one at ``s'`` scores from ``s' + length - s``.

    Args:
        starts: Strictly increasing window starts with no gap larger than ``length``
            (e.g. from :func:`window_starts`).
        length: Window length ``L``.

    Returns:
        One index in ``[0, length)`` per window.

    Raises:
        ValueError: ``starts`` is not increasing or leaves targets unscored between windows.
    """
    out: list[int] = []
    scored_until = 0  # last stream position already scored; position 0 is never a target
    for s in starts:
        first = scored_until - s
        if s < 0 or first >= length or (out and first < 0):
            raise ValueError(
                f"window starts must be increasing, >= 0 and at most {length} apart, got {s} "
                f"after positions up to {scored_until} were scored."
            )
        out.append(max(first, 0))
        scored_until = s + length
    return out


def score_masks(starts: Sequence[int], length: int) -> torch.Tensor:
    """Which targets of each window are scored.

    Args:
        starts: Window starts, see :func:`first_scored`.
        length: Window length ``L``.

    Returns:
        Bool tensor of shape ``(len(starts), length)``; ``True`` marks a scored target.
    """
    first = torch.tensor(first_scored(starts, length), dtype=torch.long)
    return torch.arange(length).unsqueeze(0) >= first.unsqueeze(1)


def eval_stream_length(n_tokens: int, length: int, max_tokens: int | None) -> int:
    """How many leading tokens of a stream are evaluated at window length ``length``.

    The stream is cut to whole non-overlapping windows (the last partial window is dropped)
    and, with a cap, to ``max(1, max_tokens // length)`` windows, so a cap smaller than one
    window still evaluates one full-length window rather than a truncated one.

    Args:
        n_tokens: Length of the token stream.
        length: Window length ``L``.
        max_tokens: Cap on scored targets, or ``None`` for the whole stream.

    Returns:
        ``1 + k * length`` for ``k >= 1`` windows, or 0 when not even one window fits.
    """
    windows = (n_tokens - 1) // length
    if windows < 1:
        return 0
    if max_tokens is not None:
        windows = min(windows, max(1, max_tokens // length))
    return 1 + windows * length


class EvalWindows(Dataset[Batch]):
    """Evaluation windows over one token stream.

    Args:
        tokens: 1-D token stream of shape ``(n,)``.
        length: Window length ``L``.
        stride: Step between windows; ``length`` gives non-overlapping windows.

    Items are dicts with ``input`` and ``target`` of shape ``(L,)`` (int64) and ``loss_mask``
    of shape ``(L,)`` (bool, ``True`` = scored).
    """

    def __init__(self, tokens: torch.Tensor, length: int, stride: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}.")
        self.tokens = tokens
        self.length = length
        self.stride = stride
        self.starts = window_starts(tokens.numel(), length, stride)
        self.first = first_scored(self.starts, length)
        self._positions = torch.arange(length)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> Batch:
        s = self.starts[i]
        window = self.tokens[s : s + self.length + 1]
        return {
            "input": window[:-1],
            "target": window[1:],
            "loss_mask": self._positions >= self.first[i],
        }


class RandomWindows(Dataset[Batch]):
    """Training windows indexed by their start offset (nanoGPT-style random crops).

    Pair it with :class:`RandomOffsetSampler`, which draws the offsets.

    Args:
        tokens: 1-D token stream of shape ``(n,)`` with ``n >= seq_len + 1``.
        seq_len: Training context ``T``.

    Items are dicts with ``input`` and ``target`` of shape ``(T,)`` (int64).
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.dim() != 1 or tokens.numel() < seq_len + 1:
            raise ValueError(
                f"training needs a 1-D stream of at least seq_len + 1 = {seq_len + 1} tokens, "
                f"got shape {tuple(tokens.shape)}."
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return self.tokens.numel() - self.seq_len

    def __getitem__(self, offset: int) -> Batch:
        window = self.tokens[offset : offset + self.seq_len + 1]
        return {"input": window[:-1], "target": window[1:]}


class PasskeyDraw(NamedTuple):
    """A training slot given to a passkey sequence instead of a text window.

    Attributes:
        slot: The slot's global window index (``step * batch_size + i``); it seeds the
            instance, so a resumed run draws the same one.
    """

    slot: int


def is_passkey_slot(index: int, mix: float) -> bool:
    """Whether global window ``index`` is a passkey sequence at mix fraction ``mix``.

    Slot g is one iff ``floor((g + 1) * mix) > floor(g * mix)``: evenly spread, and the
    first n windows hold exactly ``floor(n * mix)`` of them (the sum telescopes).
    """
    return math.floor((index + 1) * mix) > math.floor(index * mix)


class RandomOffsetSampler(BatchIndexSampler):
    """Uniform window offsets where batch ``j`` of a run depends only on ``(seed, j)``.

    The batches follow the trainer (:class:`posenc.data.samplers.BatchIndexSampler`): one
    process draws batch ``j`` at its ``j``-th training batch, also after a resume or with
    gradient accumulation, and DDP ranks draw distinct batches. Draws happen in the main
    process, so the result does not depend on ``num_workers``.

    Args:
        num_offsets: Number of valid offsets (``len(RandomWindows)``).
        steps: Batches per epoch (per rank).
        batch_size: Offsets per batch.
        seed: Base seed.
        progress: :func:`posenc.data.samplers.trainer_progress`, or None (an iteration is
            epoch 0, or the one ``set_epoch`` chose).
        passkey_mix: Fraction of slots that yield a :class:`PasskeyDraw` instead of their
            offset (see :func:`is_passkey_slot`); the other slots keep the offsets a run
            without the mix draws. For :class:`PasskeyMixWindows`.
    """

    def __init__(
        self,
        num_offsets: int,
        steps: int,
        batch_size: int,
        seed: int,
        progress: Progress | None = None,
        passkey_mix: float = 0.0,
    ) -> None:
        super().__init__(steps, progress, seed)
        self.num_offsets = num_offsets
        self.batch_size = batch_size
        self.passkey_mix = passkey_mix

    def __len__(self) -> int:
        return self.epoch_steps() * self.batch_size

    def offsets(self, batch: int) -> list[int]:
        """The window offsets of batch ``batch``."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + batch) % (1 << 63))
        return torch.randint(self.num_offsets, (self.batch_size,), generator=gen).tolist()

    def items(self, epoch: int, step: int) -> Iterator[int | PasskeyDraw]:
        batch = self.batch_index(epoch, step)
        for i, offset in enumerate(self.offsets(batch)):
            g = batch * self.batch_size + i
            mixed = self.passkey_mix and is_passkey_slot(g, self.passkey_mix)
            yield PasskeyDraw(g) if mixed else offset


class PasskeyMixWindows(RandomWindows):
    """Training windows where a :class:`PasskeyDraw` gives a passkey sequence in place of
    a text window (see :mod:`posenc.data.passkey`): an instance of ``seq_len`` tokens
    (filler from this stream, a uniform random depth), then the first token of the
    needle's tail (". ") as the ``seq_len + 1``-th. So the answer sits at the positions it
    has in an evaluation instance at 1x (its last letter predicted from position
    ``seq_len - 2``), and a model that ties the answer to absolute positions is tested
    where it was trained (instances of ``seq_len + 1`` tokens put every answer one
    position later: a ``learned`` model that retrieved every key there scored 0 at 1x).

    Every item also has ``weight``, the loss weight of each target: 1, but
    ``answer_weight`` on the answer's key tokens of a passkey sequence (the targets that
    need retrieval; :meth:`posenc.tasks.lm.LMTask.training_step` normalises by the sum).

    Args:
        tokens: The training stream.
        seq_len: Training context ``T``.
        passkeys: The passkey format (tokenizer and key length).
        seed: Base seed; instance ``g`` depends only on ``(seed, g)``.
        answer_weight: Loss weight of the answer's key tokens (> 0).
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_len: int,
        passkeys: PasskeyFormat,
        seed: int,
        answer_weight: float = 1.0,
    ) -> None:
        super().__init__(tokens, seq_len)
        if not answer_weight > 0:
            raise ValueError(f"answer_weight must be > 0, got {answer_weight!r}.")
        self.passkeys = passkeys
        self.seed = seed
        self.answer_weight = float(answer_weight)

    def __getitem__(self, item: int | PasskeyDraw) -> Batch:
        weight = torch.ones(self.seq_len)
        if not isinstance(item, PasskeyDraw):
            return {**super().__getitem__(item), "weight": weight}
        gen = seeded(self.seed, 7, item.slot)  # 7: a stream of its own, apart from offsets
        depth = float(torch.rand((), generator=gen))
        inst = self.passkeys.sample(self.tokens, self.seq_len, [depth], gen)[0]
        after = torch.tensor(self.passkeys.tail[:1], dtype=torch.long)  # "." as in the needle
        tokens = torch.cat((inst.tokens, after))
        weight[-inst.answer_len - 1 : -1] = self.answer_weight
        return {"input": tokens[:-1], "target": tokens[1:], "weight": weight}


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return value


log = logging.getLogger(__name__)

#: The ids' layout and encoding rules, in the cache key: a posenc that encodes text
#: differently (newlines, say) reads none of an older one's cached ids.
IDS_VERSION = 1
#: Characters of text encoded at once when a split is tokenized (cut after a newline):
#: one chunk's ids are a Python list, a split's are a tensor, never a list.
ENCODE_CHUNK = 1 << 22


def _line_wise(tok: Tokenizer) -> bool:
    """Whether ``tok`` encodes text line by line, so that encoding it in pieces cut
    after a newline gives the ids of encoding it whole."""
    return isinstance(tok, CharTokenizer) or (
        isinstance(tok, SentencePieceTokenizer) and tok.newline_id is not None
    )


def encode_split(tok: Tokenizer, text: str, chunk: int = ENCODE_CHUNK) -> torch.Tensor:
    """``tok.encode(text)`` as an int64 tensor, encoded ``chunk`` characters at a time
    (each piece ends after a newline) where the tokenizer encodes line by line, so a
    corpus is never one Python list of ids; other tokenizers encode it whole."""
    if len(text) <= chunk or not _line_wise(tok):
        return torch.tensor(tok.encode(text), dtype=torch.long)
    parts, start = [], 0
    while start < len(text):
        cut = text.find("\n", start + chunk)
        end = len(text) if cut < 0 else cut + 1
        parts.append(torch.tensor(tok.encode(text[start:end]), dtype=torch.long))
        start = end
    return torch.cat(parts)


def cached_ids(tok: Tokenizer, text: str, folder: Path) -> torch.Tensor:
    """The ids of ``text`` under ``tok``, from ``folder/tokens/`` when an earlier run
    encoded the same text with the same vocabulary, else encoded and stored there.

    The file holds the int64 ids and nothing else, written whole or not at all (a
    temporary file, then a rename) with its sha256 beside it, checked at every use, and
    is memory-mapped copy-on-write: the jobs of a sweep, and the processes of a
    multi-GPU run, share one copy of the pages. A file changed since it was written is
    encoded again (the ids follow from the text: nothing is lost), with a warning.
    """
    key = hashlib.sha256(f"posenc ids v{IDS_VERSION}\n".encode())
    key.update(fingerprint(tok).encode())
    key.update(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest())
    path = folder / "tokens" / f"{key.hexdigest()}.int64"
    try:
        if cache_usable(path, "cached token ids"):
            n = path.stat().st_size // 8
            return torch.from_file(str(path), shared=False, size=n, dtype=torch.long)
    except CacheError as err:
        log.warning("%s; encoding the text again", str(err).split(". ")[0])
    ids = encode_split(tok, text)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        ids.numpy().tofile(tmp)
        os.replace(tmp, path)
        write_checksum(path)
    except OSError:  # a read-only or full cache: the ids are here all the same
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return ids


def physical_memory() -> int | None:
    """This machine's memory in bytes, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on this platform
        return None


def batch_problem(
    batch: int, seq_len: int, train_tokens: int, vocab_size: int, on_cpu: bool
) -> str | None:
    """The problem with a training batch of ``batch`` windows of ``seq_len`` tokens, or None.

    A batch of more windows than the training split holds without overlap would repeat
    the whole text within every step and only grow memory. On CPU, a batch whose logits
    alone (``batch x seq_len x vocab`` floats, with their gradient) exceed the machine's
    memory is refused too.

    Args:
        batch: ``task.batch_size``.
        seq_len: ``task.seq_len``.
        train_tokens: Tokens in the training split.
        vocab_size: The tokenizer's vocabulary.
        on_cpu: Whether the run trains on the CPU.
    """
    windows = (train_tokens - 1) // seq_len
    if batch > windows:
        return (
            f"task.batch_size={batch}: larger than the {windows} windows of task.seq_len="
            f"{seq_len} in the training split ({train_tokens} tokens), so every step would "
            f"repeat the whole text; lower task.batch_size to at most {windows}"
        )
    need = batch * seq_len * vocab_size * 4 * 2
    ram = physical_memory()
    if on_cpu and ram and need > ram:
        return (
            f"task.batch_size={batch}: its logits alone ({batch} x {seq_len} x vocab "
            f"{vocab_size}, with their gradient) need {need / 2**30:.1f} GiB, more than "
            f"this machine's {ram / 2**30:.1f} GiB; lower task.batch_size"
        )
    return None


class LMDataModule(pl.LightningDataModule):
    """Language-modeling data: one token stream per split, random training windows and
    evaluation windows at several lengths (for perplexity beyond the training length).

    Args:
        source: Returns ``{"train", "val", "test"}`` -> text, e.g.
            ``functools.partial(posenc.data.sources.tinyshakespeare, root=...)``.
        tokenizer: ``{"kind": "char" | "bpe" | "unigram", **settings}`` for
            :func:`posenc.data.tokenizers.build_tokenizer`; trained on the train split only.
        cache_dir: Folder for cached tokenizers and token ids (:func:`cached_ids`).
        seq_len: Training context ``T``.
        batch_size: Training batch size.
        eval_batch_size: Batch size of validation/evaluation loaders (default ``batch_size``);
            lower it for long evaluation lengths.
        eval_lengths: Absolute evaluation lengths in tokens (default ``[seq_len]``).
        sliding_stride: Stride of the sliding-window protocol, or ``None`` to disable it. At a
            length ``L <= sliding_stride`` it degenerates to non-overlapping windows.
        eval_max_tokens: Cap on scored tokens per evaluation length (rounded down to whole
            windows, at least one); ``None`` evaluates the whole split. Also caps the
            validation loader.
        train_steps_per_epoch: Training batches per epoch.
        num_workers: DataLoader workers.
        seed: Seed of the training window offsets.
        passkey_mix: Fraction of training windows replaced by passkey sequences of
            ``seq_len`` inputs (:class:`PasskeyMixWindows`); 0 turns it off.
        passkey_key_len: Letters per key of those sequences.
        passkey_answer_weight: Loss weight of their answers' key tokens (text tokens: 1).

    Raises:
        ValueError: A size is not a positive int, the tokenizer settings lack ``kind``, or
            ``passkey_mix`` is outside [0, 1], or ``passkey_answer_weight`` is not > 0.
    """

    def __init__(
        self,
        *,
        source: Callable[[], dict[str, str]],
        tokenizer: dict[str, Any],
        cache_dir: str | Path,
        seq_len: int,
        batch_size: int,
        eval_batch_size: int | None = None,
        eval_lengths: Sequence[int] | None = None,
        sliding_stride: int | None = None,
        eval_max_tokens: int | None = None,
        train_steps_per_epoch: int = EPOCH_STEPS,
        num_workers: int = 0,
        seed: int = 0,
        passkey_mix: float = 0.0,
        passkey_key_len: int = 5,
        passkey_answer_weight: float = 1.0,
    ) -> None:
        super().__init__()
        if not 0.0 <= passkey_mix <= 1.0:
            raise ValueError(f"passkey_mix must be in [0, 1], got {passkey_mix!r}.")
        self.passkey_mix = float(passkey_mix)
        self.passkey_key_len = _positive_int("passkey_key_len", passkey_key_len)
        if not passkey_answer_weight > 0:
            raise ValueError(f"passkey_answer_weight must be > 0, got {passkey_answer_weight!r}.")
        self.passkey_answer_weight = float(passkey_answer_weight)
        if not callable(source):
            raise ValueError(
                f"source must be a callable returning split texts, got {type(source).__name__}; "
                "pass e.g. functools.partial(posenc.data.sources.tinyshakespeare)."
            )
        settings = dict(tokenizer)
        if "kind" not in settings:
            raise ValueError(
                f"tokenizer settings need a 'kind' ('char', 'bpe' or 'unigram'), got {settings}."
            )
        self.source = source
        self.tokenizer_kind: str = settings.pop("kind")
        self.tokenizer_settings = tokenizer_settings(self.tokenizer_kind, settings)
        self.cache_dir = Path(cache_dir).expanduser()
        self.seq_len = _positive_int("seq_len", seq_len)
        self.batch_size = _positive_int("batch_size", batch_size)
        self.eval_batch_size = _positive_int(
            "eval_batch_size", batch_size if eval_batch_size is None else eval_batch_size
        )
        lengths = [seq_len] if eval_lengths is None else list(eval_lengths)
        if not lengths:
            raise ValueError("eval_lengths is empty; give at least one length, e.g. [seq_len].")
        self.eval_lengths = [_positive_int("each of eval_lengths", L) for L in lengths]
        self.sliding_stride = (
            None if sliding_stride is None else _positive_int("sliding_stride", sliding_stride)
        )
        self.eval_max_tokens = (
            None if eval_max_tokens is None else _positive_int("eval_max_tokens", eval_max_tokens)
        )
        self.train_steps_per_epoch = _positive_int("train_steps_per_epoch", train_steps_per_epoch)
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}.")
        self.num_workers = num_workers
        self.seed = int(seed)
        self._tokenizer: Tokenizer | None = None
        self._tokens: dict[str, torch.Tensor] | None = None

    # ----------------------------------------------------------------- setup and accessors
    def setup(self, stage: str | None = None) -> None:
        """Load the texts, build the tokenizer and tokenize every split (once; later calls
        are no-ops).

        Args:
            stage: Lightning stage, unused: all splits are prepared together.

        Raises:
            ValueError: The source misses a split, the train split is only whitespace, or a
                split is too short for training at ``seq_len`` or for one window at some
                evaluation length.
        """
        if self._tokens is not None:
            return
        texts = self.source()
        missing = [s for s in REQUIRED if not isinstance(texts.get(s), str)]
        if missing:
            raise ValueError(
                f"the data source returned no text for splits {missing}; it must return a dict "
                f"with string values for {list(REQUIRED)} (and 'test' if the data has one), "
                f"got keys {sorted(texts)}."
            )
        texts = {s: texts[s] for s in SPLITS if isinstance(texts.get(s), str)}
        if not texts["train"].strip():
            raise DataError(
                f"the train split holds only whitespace ({len(texts['train'])} characters): "
                "nothing to learn from; check the data source."
            )
        tok = build_tokenizer(
            self.tokenizer_kind, [texts["train"]], self.cache_dir, **self.tokenizer_settings
        )
        tokens = {s: cached_ids(tok, text, self.cache_dir) for s, text in texts.items()}
        n_train = tokens["train"].numel()
        if n_train < self.seq_len + 1:
            raise DataError(
                f"the train split has {n_train} tokens, fewer than seq_len + 1 = "
                f"{self.seq_len + 1}; lower task.seq_len or use more training text."
            )
        # Fail before training, not hours later at evaluation time.
        for split in [s for s in ("val", "test") if s in tokens]:
            for L in sorted({self.seq_len, *self.eval_lengths}):
                self._check_fits(split, tokens[split].numel(), L)
        self._tokenizer = tok
        self._tokens = tokens

    def _check_fits(self, split: str, n_tokens: int, length: int) -> None:
        """Refuse a length the split cannot fill, naming the keys that set it: the
        training length (``task.seq_len``) or a multiple of it (``task.eval.multipliers``)."""
        if n_tokens >= length + 1:
            return
        if length == self.seq_len:
            fix = f"lower task.seq_len (now {self.seq_len})"
        else:
            m = length / self.seq_len
            fix = (
                f"drop {m:g} from task.eval.multipliers (L = {m:g} x task.seq_len), or "
                f"lower task.seq_len (now {self.seq_len})"
            )
        raise DataError(
            f"the {split!r} split has {n_tokens} tokens, too few for one evaluation window "
            f"of length L={length} (needs {length + 1}); {fix}, or use a longer split."
        )

    def check_batch(self, on_cpu: bool) -> None:
        """Refuse a training batch the loaded data or this machine cannot hold
        (:func:`batch_problem`); run once the data is tokenized, before the model is built.

        Raises:
            ConfigError: One line naming ``task.batch_size``, the limit and the fix.
        """
        train = self.lm_split_tokens("train").numel()
        problem = batch_problem(self.batch_size, self.seq_len, train, self.vocab_size, on_cpu)
        if problem:
            raise ConfigError(problem)

    def _require_setup(self) -> dict[str, torch.Tensor]:
        if self._tokens is None:
            raise RuntimeError("LMDataModule is not set up yet; call setup() first.")
        return self._tokens

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer trained on the train split (after :meth:`setup`)."""
        self._require_setup()
        assert self._tokenizer is not None
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of :attr:`tokenizer` (after :meth:`setup`)."""
        return self.tokenizer.vocab_size

    @property
    def splits(self) -> tuple[str, ...]:
        """The splits the data has (after :meth:`setup`): train, val, and test if given."""
        return tuple(self._require_setup())

    def lm_split_tokens(self, split: str) -> torch.Tensor:
        """The whole token stream of a split.

        Args:
            split: ``"train"``, ``"val"`` or ``"test"``.

        Returns:
            Int64 tensor of shape ``(n_tokens,)``.

        Raises:
            ValueError: Unknown split, or one the data does not have.
            RuntimeError: :meth:`setup` was not called.
        """
        tokens = self._require_setup()
        if split not in tokens:
            raise ValueError(f"unknown split {split!r}; this data has {list(tokens)}.")
        return tokens[split]

    # ------------------------------------------------------------------------- loaders
    def _loader(self, dataset: Dataset[Batch], **kwargs: Any) -> DataLoader[Batch]:
        # A loader's own generator: creating an iterator must not draw from the global
        # RNG, or a resumed run (one extra iterator) would get other dropout masks.
        return DataLoader(
            dataset,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            generator=torch.Generator().manual_seed(self.seed),
            **kwargs,
        )

    def train_dataloader(self) -> DataLoader[Batch]:
        """Random training windows.

        Returns:
            ``train_steps_per_epoch`` batches of dicts with ``input`` and ``target`` of shape
            ``(batch_size, seq_len)``; offsets are uniform and depend only on (seed, global step).
            With ``passkey_mix``, that fraction of windows are passkey sequences, and every
            batch has ``weight`` too (:class:`PasskeyMixWindows`).
        """
        tokens = self.lm_split_tokens("train")
        dataset = (
            PasskeyMixWindows(
                tokens,
                self.seq_len,
                PasskeyFormat(self.tokenizer, self.passkey_key_len),
                self.seed,
                self.passkey_answer_weight,
            )
            if self.passkey_mix
            else RandomWindows(tokens, self.seq_len)
        )
        sampler = RandomOffsetSampler(
            len(dataset),
            self.train_steps_per_epoch,
            self.batch_size,
            self.seed,
            progress=trainer_progress(self),
            passkey_mix=self.passkey_mix,
        )
        return self._loader(dataset, batch_size=self.batch_size, sampler=sampler)

    def eval_windows(self, split: str, length: int, stride: int | None = None) -> EvalWindows:
        """Evaluation windows of one split at one length.

        Args:
            split: ``"train"``, ``"val"`` or ``"test"``.
            length: Window length ``L``.
            stride: ``None`` for non-overlapping windows, else the sliding stride (clamped to
                ``L``).

        Returns:
            The dataset over the first :func:`eval_stream_length` tokens of the split, the same
            prefix for both protocols.

        Raises:
            ValueError: The split is too short for one window of length ``L``.
        """
        tokens = self.lm_split_tokens(split)
        self._check_fits(split, tokens.numel(), length)
        n = eval_stream_length(tokens.numel(), length, self.eval_max_tokens)
        step = length if stride is None else min(stride, length)
        return EvalWindows(tokens[:n], length, step)

    def val_dataloader(self) -> DataLoader[Batch]:
        """Non-overlapping validation windows at ``seq_len`` (fast check during training).

        Returns:
            Batches with ``input``, ``target``, ``loss_mask`` of shape
            ``(eval_batch_size, seq_len)``.
        """
        return self._loader(self.eval_windows("val", self.seq_len), batch_size=self.eval_batch_size)

    def test_dataloader(self) -> DataLoader[Batch]:
        """Non-overlapping test windows at ``seq_len``; see :meth:`eval_dataloaders` for the
        length-generalisation evaluation.

        Returns:
            Batches like :meth:`val_dataloader`.
        """
        return self._loader(
            self.eval_windows("test", self.seq_len), batch_size=self.eval_batch_size
        )

    def eval_dataloaders(self, split: str) -> dict[str, DataLoader[Batch]]:
        """Loaders for the length-generalisation evaluation of one split.

        Args:
            split: ``"val"`` or ``"test"`` (``"train"`` works too).

        Returns:
            For each ``L`` in ``eval_lengths``: ``"ppl@L"`` (non-overlapping windows) and, if
            ``sliding_stride`` is set, ``"ppl_sw@L"``. Batches hold ``input``, ``target``
            (int64) and ``loss_mask`` (bool), each of shape ``(B, L)``.

        Raises:
            ValueError: The split is too short for one window at some ``L``.
        """
        out: dict[str, DataLoader[Batch]] = {}
        for L in self.eval_lengths:
            out[f"ppl@{L}"] = self._loader(
                self.eval_windows(split, L), batch_size=self.eval_batch_size
            )
            if self.sliding_stride is not None:
                out[f"ppl_sw@{L}"] = self._loader(
                    self.eval_windows(split, L, self.sliding_stride),
                    batch_size=self.eval_batch_size,
                )
        return out
