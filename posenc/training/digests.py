"""Digests of a checkpoint's tensors, stored inside the checkpoint.

The run folder's ``checksums.json`` only covers a checkpoint that stays in its run folder;
a copied or downloaded file carries its own check: one digest per tensor (model weights,
optimiser state, everything else Lightning saves), under :data:`KEY`. torch.load checks no
tensor bytes, so a flipped byte would otherwise load as a valid, wrong model.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from posenc.errors import CheckpointError

log = logging.getLogger(__name__)

#: Where a checkpoint keeps its digests: ``{"algorithm": ALGORITHM, "tensors": {name: hex}}``.
KEY = "posenc_digest"
#: blake2b is about twice as fast as sha256 on CPUs without SHA instructions; 128 bits
#: are plenty to detect damage.
ALGORITHM = "blake2b-128"
#: Mismatching tensors named in the message before "and N more".
SHOWN = 3
#: Checkpoints without digests already noted: a run loads one several times (config
#: check, model, resume), and one note says it.
_noted: set[str] = set()
#: Files whose digests matched, as (path, size, mtime): a run loads one checkpoint up to
#: three times (config check, model, Lightning's restore) and hashes it once.
_checked: set[tuple[str, int, int]] = set()


def _stamp(path: str | os.PathLike[str]) -> tuple[str, int, int] | None:
    """The file's identity for :data:`_checked` (None if it cannot be read)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return os.path.realpath(path), st.st_size, st.st_mtime_ns


def _tensors(tree: Any, name: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a nested dict/list/tuple, with its path (``state_dict.model.embed.weight``,
    ``optimizer_states.0.state.3.exp_avg``)."""
    if isinstance(tree, torch.Tensor):
        yield name, tree
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _tensors(value, f"{name}.{key}" if name else str(key))
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from _tensors(value, f"{name}.{i}" if name else str(i))


def _digest(tensor: torch.Tensor) -> str:
    """A tensor's dtype, shape and bytes, hashed (any dtype: its bytes are viewed as uint8)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{tensor.dtype} {tuple(tensor.shape)}".encode())
    flat = tensor.detach().cpu().contiguous().reshape(-1)  # 0-dim tensors cannot be viewed
    h.update(flat.view(torch.uint8).numpy().data)
    return h.hexdigest()


def digests(checkpoint: Mapping[str, Any]) -> dict[str, str]:
    """``{tensor path: digest}`` over every tensor of ``checkpoint`` but its own digests."""
    named = [
        item for key, value in checkpoint.items() if key != KEY for item in _tensors(value, key)
    ]
    # hashlib releases the GIL on large buffers: big checkpoints hash on several cores.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        hexes = list(pool.map(_digest, [t for _, t in named]))
    return {name: hexed for (name, _), hexed in zip(named, hexes, strict=True)}


def weights(module: torch.nn.Module) -> str:
    """One digest of a module's weights: every tensor of its state dict, by name."""
    h = hashlib.blake2b(digest_size=16)
    for name, hexed in sorted(digests({"state_dict": module.state_dict()}).items()):
        h.update(f"{name} {hexed}\n".encode())
    return h.hexdigest()


def seal(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with the digests of its tensors added under :data:`KEY`."""
    return {**checkpoint, KEY: {"algorithm": ALGORITHM, "tensors": digests(checkpoint)}}


def _names(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def mismatches(checkpoint: Mapping[str, Any]) -> str | None:
    """What in ``checkpoint`` differs from the digests stored in it, in words; "" when
    nothing does, None when it stores none (a checkpoint from before the digests)."""
    stored = checkpoint.get(KEY)
    if not isinstance(stored, Mapping) or stored.get("algorithm") != ALGORITHM:
        return None if stored is None else f"its digest record is unreadable ({KEY})"
    expected: Mapping[str, str] = stored.get("tensors") or {}
    found = digests(checkpoint)
    problems = []
    if changed := [k for k in found if k in expected and found[k] != expected[k]]:
        problems.append(f"tensor {_names(changed)} does not match the digest stored in the file")
    if missing := [k for k in expected if k not in found]:
        problems.append(f"tensor {_names(missing)} is missing")
    if added := [k for k in found if k not in expected]:
        problems.append(f"tensor {_names(added)} has no digest")
    return "; ".join(problems)


def check(path: str | os.PathLike[str], checkpoint: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose tensors differ from the digests stored in it; a note
    (one log line) for one without digests.

    Raises:
        CheckpointError: The file and what does not match.
    """
    stamp = _stamp(path)
    if stamp is not None and stamp in _checked:
        return
    problem = mismatches(checkpoint)
    if problem == "" and stamp is not None:
        _checked.add(stamp)
    if problem is None and str(path) not in _noted:
        _noted.add(str(path))
        log.warning("%s predates posenc's tensor digests: its tensors are loaded unchecked", path)
    elif problem:
        raise CheckpointError(
            f"checkpoint {path} is damaged: {problem}. Its numbers cannot be trusted; use "
            f"another copy of the file or another checkpoint of the run (best.ckpt or last.ckpt)."
        )
