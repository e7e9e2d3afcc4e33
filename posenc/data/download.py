"""Locate, download and verify the datasets posenc uses.

Every file posenc knows about has a canonical URL and a sha256 in :data:`FILES`. A file is
looked up under a data folder (see :func:`data_dir`); if it is missing it is downloaded,
verified and moved into place atomically, so an interrupted download never leaves a
half-written file that later runs would trust.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import os
import sys
import tempfile
import urllib.error
import urllib.request
import zlib
from pathlib import Path

from posenc.errors import DataError, DataFileNotFound, UserError

__all__ = [
    "FILES",
    "DataUnavailableError",
    "data_dir",
    "fetch",
    "read_text",
    "sha256_file",
]

ENV_VAR = "POSENC_DATA_DIR"
DEFAULT_DIR = Path("~/.cache/posenc/data")

_M30K = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw"

#: Relative path -> (canonical URL, sha256 of the file's bytes).
FILES: dict[str, tuple[str, str]] = {
    "tinyshakespeare/input.txt": (
        "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
    ),
    "multi30k/train.en.gz": (
        f"{_M30K}/train.en.gz",
        "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    ),
    "multi30k/train.de.gz": (
        f"{_M30K}/train.de.gz",
        "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    ),
    "multi30k/val.en.gz": (
        f"{_M30K}/val.en.gz",
        "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    ),
    "multi30k/val.de.gz": (
        f"{_M30K}/val.de.gz",
        "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    ),
    "multi30k/test_2016_flickr.en.gz": (
        f"{_M30K}/test_2016_flickr.en.gz",
        "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    ),
    "multi30k/test_2016_flickr.de.gz": (
        f"{_M30K}/test_2016_flickr.de.gz",
        "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    ),
}

_CHUNK = 1 << 20

# Verdicts of files already hashed in this process. The key includes size and mtime so that a
# file replaced on disk (e.g. after the user fixed a corrupt copy) is hashed again.
_VERIFIED: set[tuple[str, int, int]] = set()


class DataUnavailableError(UserError, FileNotFoundError):
    """A data file is missing locally and could not be downloaded."""


def data_dir(configured: str | os.PathLike[str] | None = None) -> Path:
    """Return the folder that holds posenc's data files.

    Args:
        configured: Folder from the configuration, used when ``POSENC_DATA_DIR`` is unset.

    Returns:
        The environment variable ``POSENC_DATA_DIR`` if set and non-empty, else ``configured``,
        else ``~/.cache/posenc/data``; ``~`` is expanded. The folder may not exist yet.
    """
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    if configured is not None and str(configured) != "":
        return Path(configured).expanduser()
    return DEFAULT_DIR.expanduser()


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Return the hex sha256 of a file's bytes, read in chunks so large files stay cheap.

    Args:
        path: File to hash.

    Returns:
        64-character lowercase hex digest.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _lookup(relpath: str) -> tuple[str, str]:
    try:
        return FILES[relpath]
    except KeyError:
        known = ", ".join(sorted(FILES))
        raise DataError(
            f"unknown data file {relpath!r}; known files are: {known}. "
            "Use one of these relative paths, or read your own files with "
            "posenc.data.sources.text_files."
        ) from None


def _verify_existing(path: Path, relpath: str, expected: str) -> None:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _VERIFIED:
        return
    actual = sha256_file(path)
    if actual != expected:
        raise DataError(
            f"data file {path} ({relpath}) is corrupt or a different version: "
            f"expected sha256 {expected}, got {actual}. Delete it so posenc downloads a "
            f"fresh copy from {FILES[relpath][0]}, or replace it with the correct file."
        )
    _VERIFIED.add(key)


def _progress(name: str, done: int, total: int | None) -> None:
    if total:
        pct = 100 * done // total
        msg = f"\rdownloading {name}: {pct:3d}% ({done / 1e6:.1f}/{total / 1e6:.1f} MB)"
    else:
        msg = f"\rdownloading {name}: {done / 1e6:.1f} MB"
    sys.stderr.write(msg)
    sys.stderr.flush()


def _download(url: str, dest: Path, relpath: str, expected: str) -> None:
    """Stream ``url`` into a temp file beside ``dest``, verify it, then rename it into place."""
    unavailable_hint = (
        f"data file {relpath!r} is not in {dest.parent} and downloading it from {url} failed"
    )
    fix = (
        f"Fix: connect to the network and retry, or download the file by hand to {dest} "
        f"(sha256 {expected}), or set {ENV_VAR} to a folder that already holds {relpath}."
    )
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        # Same folder as the destination so os.replace is a same-filesystem atomic rename.
        fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    except OSError as err:
        raise DataUnavailableError(
            f"{unavailable_hint}: cannot write there ({err}). {fix}"
        ) from err
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=60) as resp:
            length = resp.headers.get("Content-Length") if resp.headers is not None else None
            total = int(length) if length and length.isdigit() else None
            done, last_pct = 0, -1
            while chunk := resp.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                pct = 100 * done // total if total else done // _CHUNK
                if pct != last_pct:
                    _progress(relpath, done, total)
                    last_pct = pct
            if total is not None and done != total:
                raise http.client.IncompleteRead(b"", total - done)
        sys.stderr.write("\n")
    except (OSError, http.client.HTTPException) as err:
        tmp.unlink(missing_ok=True)
        raise DataUnavailableError(f"{unavailable_hint}: {err}. {fix}") from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    actual = digest.hexdigest()
    if actual != expected:
        tmp.unlink(missing_ok=True)
        raise DataError(
            f"downloaded {relpath} from {url} but its sha256 is {actual}, expected {expected}; "
            "the file was discarded. The upstream file may have changed or the transfer was "
            f"altered. Download it by hand to {dest} after checking it, or set {ENV_VAR}."
        )
    os.replace(tmp, dest)
    stat = dest.stat()
    _VERIFIED.add((str(dest.resolve()), stat.st_size, stat.st_mtime_ns))


def fetch(relpath: str, root: str | os.PathLike[str] | None = None) -> Path:
    """Return the local path of a known data file, downloading it if it is missing.

    An existing file is sha256-verified once per process (the verdict is cached). A missing
    file is downloaded from its canonical URL into a temporary file in the same folder,
    verified, and atomically renamed into place.

    Args:
        relpath: Key of :data:`FILES`, e.g. ``"tinyshakespeare/input.txt"``.
        root: Data folder used as given; ``None`` means :func:`data_dir` (which honours
            ``POSENC_DATA_DIR``).

    Returns:
        ``root / relpath``, verified.

    Raises:
        DataError: ``relpath`` is unknown, or the local or downloaded file has the wrong sha256.
        DataUnavailableError: The file is missing and could not be downloaded.
    """
    url, expected = _lookup(relpath)
    folder = data_dir() if root is None else Path(root).expanduser()
    path = folder / relpath
    if path.is_file():
        _verify_existing(path, relpath, expected)
        return path
    _download(url, path, relpath, expected)
    return path


def read_text(path: str | os.PathLike[str]) -> str:
    """Read a plain or gzip-compressed (``.gz``) UTF-8 text file.

    Args:
        path: File to read; gzip is detected from the ``.gz`` suffix.

    Returns:
        The decoded text, unchanged (no newline or whitespace normalisation).

    Raises:
        DataFileNotFound: The file does not exist or is not a file.
        DataError: The file is empty, a truncated or corrupt gzip stream, or not valid UTF-8
            (the message gives the byte offset of the first bad byte).
    """
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise DataFileNotFound(f"text file {path} {what}; check the path.")
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as err:
            raise DataError(
                f"{path} is not a complete gzip file ({err}); it is truncated or corrupt. "
                "Delete it and download or recompress it again."
            ) from err
    if not raw:
        after = " after decompression" if path.suffix == ".gz" else ""
        raise DataError(
            f"{path} is empty{after}; expected UTF-8 text. Replace it with a non-empty file."
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        where = "decompressed byte" if path.suffix == ".gz" else "byte"
        raise DataError(
            f"{path} is not valid UTF-8: {where} offset {err.start} holds "
            f"{raw[err.start : err.start + 4]!r} ({err.reason}). Convert the file to UTF-8, e.g. "
            "with iconv."
        ) from err
