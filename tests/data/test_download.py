"""Tests for posenc.data.download: the file table, sha256 checks, downloads and read_text."""

from __future__ import annotations

import gzip
import hashlib
import io
import re
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from posenc.data import download
from posenc.data.download import (
    FILES,
    DataUnavailableError,
    data_dir,
    fetch,
    read_text,
)

SHAKES = "tinyshakespeare/input.txt"
SMALL_GZ = "multi30k/val.en.gz"


@pytest.fixture
def shared() -> Path:
    root = data_dir()
    if not all((root / rel).is_file() for rel in (SHAKES, SMALL_GZ)):
        pytest.skip(f"shared data not found in {root}; set POSENC_DATA_DIR")
    return root


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each test starts with no cached sha256 verdicts so it sees real hashing.
    monkeypatch.setattr(download, "_VERIFIED", set())


def _count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []
    real = download.sha256_file

    def spy(path: Path) -> str:
        calls.append(Path(path))
        return real(path)

    monkeypatch.setattr(download, "sha256_file", spy)
    return calls


class FakeResponse(io.BytesIO):
    """Minimal stand-in for the object urlopen returns."""

    def __init__(self, payload: bytes, length: int | None = None) -> None:
        super().__init__(payload)
        n = len(payload) if length is None else length
        self.headers = {"Content-Length": str(n)}


def test_files_table_matches_shared_readme(shared: Path) -> None:
    readme = (shared / "README.md").read_text()
    rows = re.findall(r"^\| (\S+) \| (https://\S+) \| ([0-9a-f]{64}) \|$", readme, re.M)
    assert len(rows) == 7
    assert {rel: (url, sha) for rel, url, sha in rows} == FILES


def test_data_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("POSENC_DATA_DIR", raising=False)
    assert data_dir() == Path("~/.cache/posenc/data").expanduser()
    assert data_dir(str(tmp_path)) == tmp_path
    monkeypatch.setenv("POSENC_DATA_DIR", str(tmp_path / "env"))
    assert data_dir(str(tmp_path)) == tmp_path / "env"


def test_fetch_verifies_shared_file_once(shared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_hashes(monkeypatch)
    path = fetch(SHAKES, shared)
    assert path == shared / SHAKES
    assert path.stat().st_size == 1_115_394
    assert fetch(SHAKES, shared) == path
    assert calls == [path]  # the second call reused the verdict


def test_fetch_rejects_tampered_copy(shared: Path, tmp_path: Path) -> None:
    target = tmp_path / SHAKES
    target.parent.mkdir(parents=True)
    shutil.copyfile(shared / SHAKES, target)
    data = bytearray(target.read_bytes())
    data[1000] ^= 0x01
    target.write_bytes(bytes(data))
    actual = hashlib.sha256(bytes(data)).hexdigest()
    with pytest.raises(ValueError) as info:
        fetch(SHAKES, tmp_path)
    msg = str(info.value)
    assert str(target) in msg and FILES[SHAKES][1] in msg and actual in msg
    assert "Delete" in msg


def test_fetch_unknown_relpath_lists_known_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown data file 'nope.txt'") as info:
        fetch("nope.txt", tmp_path)
    assert all(rel in str(info.value) for rel in FILES)


def test_offline_error_names_file_folder_url_and_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def offline(*args: object, **kwargs: object) -> None:
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(DataUnavailableError) as info:
        fetch(SHAKES, tmp_path)
    assert isinstance(info.value, FileNotFoundError)
    msg = str(info.value)
    assert SHAKES in msg and str(tmp_path / "tinyshakespeare") in msg
    assert FILES[SHAKES][0] in msg and "POSENC_DATA_DIR" in msg and "by hand" in msg
    assert list((tmp_path / "tinyshakespeare").iterdir()) == []  # temp file cleaned up


def test_download_writes_verified_file_atomically(
    shared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    payload = (shared / SMALL_GZ).read_bytes()
    requested: list[str] = []

    def serve(url: str, timeout: float) -> FakeResponse:
        requested.append(url)
        # Nothing may be at the destination while the body is still being streamed.
        assert not (tmp_path / SMALL_GZ).exists()
        return FakeResponse(payload)

    monkeypatch.setattr(urllib.request, "urlopen", serve)
    calls = _count_hashes(monkeypatch)
    path = fetch(SMALL_GZ, tmp_path)
    assert requested == [FILES[SMALL_GZ][0]]
    assert path == tmp_path / SMALL_GZ and path.read_bytes() == payload
    assert [p.name for p in path.parent.iterdir()] == ["val.en.gz"]  # no leftover temp file
    assert "100%" in capsys.readouterr().err
    fetch(SMALL_GZ, tmp_path)
    assert calls == []  # hashed while streaming; the verdict is reused, not recomputed
    assert read_text(path).splitlines()[0].startswith("A group of men are loading cotton")


def test_download_with_wrong_hash_leaves_nothing(
    shared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tampered = bytearray((shared / SMALL_GZ).read_bytes())
    tampered[-1] ^= 0xFF
    served = FakeResponse(bytes(tampered))
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: served)
    with pytest.raises(ValueError, match="sha256") as info:
        fetch(SMALL_GZ, tmp_path)
    assert FILES[SMALL_GZ][1] in str(info.value) and FILES[SMALL_GZ][0] in str(info.value)
    assert list((tmp_path / "multi30k").iterdir()) == []


def test_download_cut_short_is_unavailable(
    shared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = (shared / SMALL_GZ).read_bytes()
    half = FakeResponse(payload[: len(payload) // 2], length=len(payload))
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: half)
    with pytest.raises(DataUnavailableError, match="val.en.gz"):
        fetch(SMALL_GZ, tmp_path)
    assert list((tmp_path / "multi30k").iterdir()) == []


def test_read_text_plain_and_gzip(shared: Path, tmp_path: Path) -> None:
    text = read_text(shared / SHAKES)
    assert len(text) == 1_115_394 and text.startswith("First Citizen:\n")
    lines = read_text(shared / SMALL_GZ).splitlines()
    assert len(lines) == 1014  # Multi30k validation size
    p = tmp_path / "u.txt.gz"
    p.write_bytes(gzip.compress("naïve — ok\n".encode()))
    assert read_text(p) == "naïve — ok\n"


def test_read_text_errors_name_the_file(shared: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.txt is empty"):
        read_text(empty)

    empty_gz = tmp_path / "empty.txt.gz"
    empty_gz.write_bytes(gzip.compress(b""))
    with pytest.raises(ValueError, match="empty after decompression"):
        read_text(empty_gz)

    cut = tmp_path / "cut.gz"
    cut.write_bytes((shared / SMALL_GZ).read_bytes()[:5000])
    with pytest.raises(ValueError, match=r"cut\.gz is not a complete gzip file"):
        read_text(cut)

    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"abc" + "é".encode("latin-1") + b"def")
    with pytest.raises(ValueError, match=r"latin1\.txt is not valid UTF-8: byte offset 3"):
        read_text(bad)

    with pytest.raises(FileNotFoundError, match="missing.txt"):
        read_text(tmp_path / "missing.txt")
