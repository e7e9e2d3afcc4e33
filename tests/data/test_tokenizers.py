"""Tests for posenc.data.tokenizers: round trips on real text, caching and cache repair."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import sentencepiece as spm

from posenc.data.download import data_dir
from posenc.data.tokenizers import (
    CharTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    _without_training_paths,
    build_tokenizer,
    fingerprint,
    fingerprints,
)
from posenc.errors import CacheError, DataError


@pytest.fixture(scope="module")
def shakespeare() -> str:
    path = data_dir() / "tinyshakespeare/input.txt"
    if not path.is_file():
        pytest.skip(f"{path} not found; set POSENC_DATA_DIR")
    return path.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def small_train(shakespeare: str) -> str:
    return shakespeare[:200_000]


@pytest.fixture(scope="module")
def small_heldout(shakespeare: str) -> str:
    # Start at a line boundary: SentencePiece drops a line's leading space by design.
    tail = shakespeare[-20_000:]
    return tail[tail.index("\n") + 1 :]


def test_char_round_trip_on_shakespeare(shakespeare: str) -> None:
    tok = CharTokenizer.from_texts([shakespeare])
    assert isinstance(tok, Tokenizer)
    # TinyShakespeare famously has 65 distinct characters; 4 specials come first.
    assert tok.vocab_size == 4 + 65
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    ids = tok.encode(shakespeare)
    assert len(ids) == len(shakespeare) and min(ids) >= 4 and max(ids) == tok.vocab_size - 1
    assert tok.decode(ids) == shakespeare
    # Sorted vocabulary: "\n" < " " < "!" are the three smallest characters.
    assert tok.encode("\n !") == [4, 5, 6]


def test_char_unknown_and_specials() -> None:
    tok = CharTokenizer.from_texts(["abc"])
    assert tok.encode("abz") == [4, 5, 3]
    assert tok.decode([1, 4, 3, 5, 2, 0, 0]) == "a\ufffdb"
    with pytest.raises(ValueError, match="token id 7 is outside"):
        tok.decode([7])


def test_char_cache_reused_and_repaired(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, small_train: str
) -> None:
    tok = build_tokenizer("char", [small_train], tmp_path)
    (cached,) = tmp_path.glob("*.json")
    assert CharTokenizer.load(cached).chars == tok.chars
    mtime = cached.stat().st_mtime_ns
    again = build_tokenizer("char", [small_train], tmp_path)
    assert again.encode(small_train[:500]) == tok.encode(small_train[:500])
    assert cached.stat().st_mtime_ns == mtime
    # Different training text -> different key -> a second cache file.
    build_tokenizer("char", [small_train + "#"], tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2

    # A cache changed since posenc wrote it is refused, naming the file (#27 point 6) ...
    checksum = cached.with_name(cached.name + ".sha256")
    cached.write_text("{not json")
    with pytest.raises(CacheError, match=f"cached tokenizer {cached} changed.*Delete"):
        build_tokenizer("char", [small_train], tmp_path)
    # ... and rebuilt once deleted, as the message says.
    cached.unlink()
    checksum.unlink()
    repaired = build_tokenizer("char", [small_train], tmp_path)
    assert repaired.chars == tok.chars
    assert CharTokenizer.load(cached).chars == tok.chars and checksum.exists()
    # A cache from before checksums (none beside it) is rebuilt, not trusted.
    cached.write_text("{not json")
    checksum.unlink()
    with caplog.at_level(logging.INFO):
        assert build_tokenizer("char", [small_train], tmp_path).chars == tok.chars
    assert "has no checksum beside it: rebuilding it" in caplog.text


def test_build_tokenizer_rejects_bad_kind_and_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown tokenizer kind 'wordpiece'.*'char', 'bpe'"):
        build_tokenizer("wordpiece", ["abc"], tmp_path)
    with pytest.raises(ValueError, match=r"unknown settings \['vocab'\].*vocab_size"):
        build_tokenizer("bpe", ["abc"], tmp_path, vocab=100)
    with pytest.raises(ValueError, match="unknown settings"):
        build_tokenizer("char", ["abc"], tmp_path, vocab_size=10)
    with pytest.raises(ValueError, match="empty training texts"):
        build_tokenizer("char", [""], tmp_path)


def test_bpe_round_trip_compresses_and_keeps_newlines(
    tmp_path: Path, small_train: str, small_heldout: str
) -> None:
    tok = build_tokenizer("bpe", [small_train], tmp_path, vocab_size=500)
    assert isinstance(tok, SentencePieceTokenizer) and isinstance(tok, Tokenizer)
    assert tok.vocab_size == 500
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    ids = tok.encode(small_heldout)
    assert all(0 <= i < 500 for i in ids)
    # Held-out Shakespeare decodes back exactly, line structure included.
    assert tok.decode(ids) == small_heldout
    assert ids.count(tok.newline_id) == small_heldout.count("\n")
    # Subwords: clearly fewer tokens than characters.
    assert len(ids) < 0.6 * len(small_heldout)
    assert tok.decode([1, *tok.encode("To be, or not"), 2, 0]) == "To be, or not"


def test_unigram_trains_with_exact_vocab(tmp_path: Path, small_train: str) -> None:
    tok = build_tokenizer("unigram", [small_train], tmp_path, vocab_size=300)
    assert tok.vocab_size == 300
    text = "ROMEO:\nBut soft, what light"
    assert tok.decode(tok.encode(text)) == text


def test_sentencepiece_cache_is_reused_not_retrained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_train: str, small_heldout: str
) -> None:
    first = build_tokenizer("bpe", [small_train], tmp_path, vocab_size=400)
    (model,) = tmp_path.glob("*.model")
    mtime = model.stat().st_mtime_ns

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("SentencePiece retrained although a valid cache exists")

    monkeypatch.setattr(spm.SentencePieceTrainer, "train", no_training)
    second = build_tokenizer("bpe", [small_train], tmp_path, vocab_size=400)
    assert second.encode(small_heldout) == first.encode(small_heldout)
    assert model.stat().st_mtime_ns == mtime
    # No temp leftovers: the model and its checksum only.
    assert sorted(p.name for p in tmp_path.iterdir()) == [model.name, model.name + ".sha256"]
    # A different setting is a different cache key, so it must train.
    with pytest.raises(AssertionError, match="retrained"):
        build_tokenizer("bpe", [small_train], tmp_path, vocab_size=401)


def test_a_changed_sentencepiece_cache_is_refused_then_rebuilt(
    tmp_path: Path, small_train: str, small_heldout: str
) -> None:
    good = build_tokenizer("bpe", [small_train], tmp_path, vocab_size=400)
    reference = good.encode(small_heldout)
    (model,) = tmp_path.glob("*.model")
    checksum = model.with_name(model.name + ".sha256")
    # Garbage, or a loadable model of another size, under this key: both refused by name.
    other = tmp_path / "other"
    build_tokenizer("bpe", [small_train], other, vocab_size=300)
    for content in (b"\x00garbage, not a protobuf", next(other.glob("*.model")).read_bytes()):
        model.write_bytes(content)
        with pytest.raises(CacheError, match=f"cached tokenizer {model} changed"):
            build_tokenizer("bpe", [small_train], tmp_path, vocab_size=400)
    model.unlink()
    checksum.unlink()
    rebuilt = build_tokenizer("bpe", [small_train], tmp_path, vocab_size=400)
    assert rebuilt.vocab_size == 400 and rebuilt.encode(small_heldout) == reference


def test_a_vocabulary_sentencepiece_cannot_train_is_one_line_saying_which_way(
    tmp_path: Path,
) -> None:
    """Too large for the text, or too small for its characters: a DataError (one line, no
    traceback at the terminal) with SentencePiece's reason and which way to move."""
    text = ["a tiny corpus\nwith two lines"]
    with pytest.raises(DataError, match=r"vocab_size=5000: .*too high.*; lower vocab_size"):
        build_tokenizer("bpe", text, tmp_path, vocab_size=5000)
    with pytest.raises(DataError, match=r"vocab_size=8: .*smaller than required_chars[^;]*; raise"):
        build_tokenizer("bpe", text, tmp_path, vocab_size=8)
    assert list(tmp_path.glob("*.model")) == []


def test_sentencepiece_fingerprint_ignores_where_it_was_trained(
    tmp_path: Path, small_train: str
) -> None:
    """SentencePiece writes its temporary corpus path into the model file, so the same model
    trained in two folders differs byte for byte; the fingerprint must not."""
    a = build_tokenizer("bpe", [small_train], tmp_path / "a", vocab_size=300)
    b = build_tokenizer("bpe", [small_train], tmp_path / "b", vocab_size=300)
    files = [next((tmp_path / d).glob("*.model")).read_bytes() for d in ("a", "b")]
    assert files[0] != files[1]
    assert fingerprint(a) == fingerprint(b)
    # The older whole-file hash is offered second and tells the two files apart.
    assert fingerprints(a)[0] == fingerprint(a) and fingerprints(a)[1] != fingerprints(b)[1]
    # What is hashed is the same model, paths removed: it loads and encodes as before.
    stripped = _without_training_paths(files[0])
    assert b"spm-train" in files[0] and b"spm-train" not in stripped
    again = spm.SentencePieceProcessor(model_proto=stripped)
    assert again.encode(small_train[:5000]) == a._sp.encode(small_train[:5000])
    other = build_tokenizer("bpe", [small_train], tmp_path / "c", vocab_size=301)
    assert fingerprint(other) != fingerprint(a)
    chars = CharTokenizer.from_texts([small_train])
    assert fingerprints(chars) == (fingerprint(chars),)


def test_a_char_tokenizer_drops_the_vocab_size_a_task_preset_sets() -> None:
    """``task=mt tokenizer=char``: the MT preset's SentencePiece ``vocab_size`` does not
    reach the character tokenizer (it raised a traceback); other kinds keep it."""
    from posenc.data.tokenizers import tokenizer_settings

    assert tokenizer_settings("char", {"vocab_size": 8000}) == {}
    assert tokenizer_settings("bpe", {"vocab_size": 8000}) == {"vocab_size": 8000}


def test_a_null_tokenizer_setting_is_the_tokenizers_default() -> None:
    """``tokenizer.vocab_size=null`` (the config's way to say "the default") reached
    SentencePiece as None and raised a traceback; it is left out, so the default holds."""
    from posenc.data.tokenizers import tokenizer_settings

    assert tokenizer_settings("bpe", {"vocab_size": None, "num_threads": 1}) == {"num_threads": 1}


def test_the_configs_tokenizer_keys_are_the_settings_the_tokenizer_takes() -> None:
    """``tokenizer.*`` (the schema) and SentencePiece's settings (this module) name the
    same keys, so a key the config accepts reaches the tokenizer and none is refused late."""
    from posenc.data.tokenizers import SP_DEFAULTS
    from posenc.schema import Tokenizer, keys

    assert keys(Tokenizer) == ["kind", *SP_DEFAULTS]
