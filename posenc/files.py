"""Writing a file so that no reader ever sees half of it."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` through a temporary file and ``os.replace``: never a half-written
    file, and no temporary file left behind when the write fails (a full disk).

    Raises:
        OSError: The file could not be written; ``path`` is as it was.
    """
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):  # gone once replaced; the folder may be the problem
            tmp.unlink(missing_ok=True)
