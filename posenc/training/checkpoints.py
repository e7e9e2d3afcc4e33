"""Checkpoints posenc can trust: written atomically, checksummed, and checked against the
config before a run uses them.

- **Atomic, one file per role.** Every checkpoint is written to a temporary file and moved
  into place, so ``best.ckpt`` and ``last.ckpt`` are always whole files, replaced in place
  (never ``best-v1.ckpt`` beside a stale ``best.ckpt``).
- **Checksummed.** ``checkpoints/checksums.json`` holds the sha256 of each checkpoint posenc
  wrote. A checkpoint that no longer matches (a damaged disk, a file edited or cut off) is
  refused on load with the file named. Across a replacement the manifest lists the old and
  the new digest, so a kill at any moment leaves a file that verifies.
- **Self-verifying.** Each checkpoint also carries a digest of every tensor in it
  (:mod:`posenc.training.digests`), checked on every load, so a copy outside its run
  folder is checked too; a checkpoint from before the digests loads with a note.
- **Checked against the config.** Each checkpoint records the config of its run
  (:func:`record`): ``eval_only`` refuses a checkpoint whose model (task, encoder, model
  sizes, tokenizer) differs from the config, ``resume`` refuses any difference except keys
  that may change when a run continues (:data:`RESUME_MAY_CHANGE`).
- **Failed saves stop the run** with the path and the cause, instead of training on and
  losing the result at the end.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import inspect
import json
import logging
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any, cast

import torch
from hydra.utils import get_object
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from omegaconf import DictConfig, OmegaConf

from posenc.errors import CheckpointError
from posenc.training import digests
from posenc.training.rundir import write_text_atomic

log = logging.getLogger(__name__)

MANIFEST = "checksums.json"

#: Config keys (dotted prefixes) that ``resume=true`` may change: how long to train, how
#: and where to evaluate, hardware and speed settings. Anything else would be silently
#: overridden by the checkpoint's optimiser, schedule or weights, so it is refused.
RESUME_MAY_CHANGE = (
    "trainer.max_steps",
    "trainer.val_check_interval",
    "trainer.limit_val_batches",
    "trainer.log_every_n_steps",
    "trainer.enable_progress_bar",
    "trainer.devices",
    "trainer.accelerator",
    "trainer.strategy",
    "trainer.num_nodes",
    "trainer.deterministic",
    "trainer.enable_model_summary",
    "task.eval",
    "task.eval_batch_size",
    "task.decode",
    "task.eval_split",
    "task.eval_max_sentences",
    "task.samples",
    "task.val_bleu_sentences",
    "checkpoint_every_n_steps",
    "paths",
    "resume",
    "ckpt_path",
    "eval_only",
    "init_from",
    "model.compile",
    "model.score_budget_mib",
    "threads",
    "task.learned",
)

#: Training settings that do nothing in an ``eval_only`` run: given there with another
#: value than the checkpoint's, they are reported and ``metrics.json`` keeps the
#: checkpoint's (every other setting, e.g. precision or data, applies as given).
NO_EFFECT_IN_EVAL = (
    "task.optim",
    "task.batch_size",
    "trainer.max_steps",
    "trainer.gradient_clip_val",
    "trainer.val_check_interval",
    "trainer.check_val_every_n_epoch",
    "trainer.accumulate_grad_batches",
    "model.dropout",
    "model.random_positions",
    "seed",
    "checkpoint_every_n_steps",
    "task.passkey_mix",
    "task.passkey_answer_weight",
    "task.learned",
    "tuned",
)

#: Keys added after checkpoints were first written, with the value that behaves as an
#: older checkpoint did: unset in the checkpoint and this value in the config is no change.
#: (The sinusoidal table's amplitude and DeBERTa's far-key rows came with #33, and
#: stick-breaking's remainder later, with defaults that differ from what older runs did;
#: FoX's initial bias, decay times and Pro block, the q/k/v biases and the attention
#: modifiers, kept theirs.)
ADDED_LATER = {
    "task.passkey_mix": 0.0,
    "task.passkey_answer_weight": 1.0,
    "encoder.amplitude": 1.0,
    "encoder.far_keys": "last_bucket",
    "encoder.remainder": "value",
    "encoder.bias_init": "zero",
    "encoder.decay_time_min": 2,
    "encoder.decay_time_max": 128,
    "encoder.pro": False,
    "model.qkv_bias": True,
    "model.qk_norm": False,
    "model.logit_scale": "none",
    "model.sinks": False,
    "model.window": None,
    "model.window_layers": None,
    "label": None,  # a run's name in results; older runs were named by their encoder
    "trainer.accumulate_grad_batches": 1,
}


def added_later(saved: dict[str, Any], group: str, accepts: Any) -> dict[str, Any]:
    """The :data:`ADDED_LATER` keys of ``group`` (``"encoder"``, ``"model"``) that a
    checkpoint's ``saved`` group lacks and ``accepts`` takes, at the value the old run had
    (so today's default never rebuilds an older model differently).

    Args:
        saved: The checkpoint's ``encoder`` or ``model`` group.
        group: Its name.
        accepts: A callable (the encoder's class) whose keyword parameters are the keys
            that apply, or None for every key of the group.

    Returns:
        ``{key within the group: value}``.
    """
    names = set(inspect.signature(accepts).parameters) if accepts is not None else None
    return {
        name: value
        for key, value in ADDED_LATER.items()
        if key.startswith(f"{group}.")
        and (name := key.removeprefix(f"{group}.")) not in saved
        and (names is None or name in names)
    }


def as_trained(hparams: dict[str, Any]) -> dict[str, Any]:
    """An older checkpoint's ``encoder`` and ``model`` hyperparameters with each key added
    since (:func:`added_later`) set as the run had it: what ``load_from_checkpoint`` must be
    given to rebuild that model (empty when nothing is missing)."""
    out: dict[str, Any] = {}
    encoder, model = hparams.get("encoder"), hparams.get("model")
    if isinstance(encoder, dict) and isinstance(name := encoder.get("_target_"), str):
        target = get_object(MOVED.get(name, name))
        if missing := added_later(encoder, "encoder", target):
            out["encoder"] = {**encoder, **missing}
    if isinstance(model, dict) and (missing := added_later(model, "model", None)):
        out["model"] = {**model, **missing}
    return out


#: Functions that moved since checkpoints were first written, old path -> new: a
#: checkpoint's ``_target_`` naming the old path names the same function (#37 moved the
#: parallel corpora from posenc/data/mt.py to posenc/data/sources.py).
MOVED = {
    f"posenc.data.mt.{name}": f"posenc.data.sources.{name}"
    for name in ("multi30k", "parallel_files", "hf_translation")
}

#: What defines the network a checkpoint holds: ``eval_only`` refuses differences here.
MODEL_DEFINING = (
    "task.name",
    "encoder",
    "model",
    "tokenizer",
    "task.problem",
    "task.shape",
    "task.symbols",
)
#: Model keys that change speed, never the function computed.
RUNTIME_ONLY = ("model.compile", "model.score_budget_mib")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_manifest(folder: Path) -> dict[str, list[str]]:
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"{folder / MANIFEST} is unreadable ({err}); it holds the checksums of the "
            f"checkpoints beside it. Restore it, or delete it to load them unchecked."
        ) from err
    return {k: list(v) for k, v in data.items()}


def _write_manifest(folder: Path, manifest: dict[str, list[str]]) -> None:
    write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))


#: Free bytes below which a write cut short is taken for a full disk.
FULL_DISK_BYTES = 1 << 20


def _as_os_error(err: OSError | RuntimeError, path: Path) -> OSError | RuntimeError:
    """torch reports a full disk as a ``RuntimeError`` ("unexpected pos ..."): while the
    cut-short file still takes its space, a disk with (almost) nothing left is the cause,
    named as the ``OSError`` it is (ENOSPC, with the file), so that a sweep's record says
    "no space left on device"; any other failure as it came."""
    if not (isinstance(err, RuntimeError) and "unexpected pos" in str(err)):
        return err
    try:
        fs = os.statvfs(path.parent)
    except OSError:
        return err
    if fs.f_bavail * fs.f_frsize >= FULL_DISK_BYTES:
        return err  # room left: a file-size limit
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    full.__cause__ = err
    return full


def _write_failure(err: OSError | RuntimeError) -> str:
    """What went wrong in a failed write, in words (torch's C++ prefix dropped)."""
    if isinstance(err, OSError):
        return str(err.strerror or err)
    text = str(err).rpartition("] . ")[2] or str(err)
    if "unexpected pos" in text:  # fewer bytes reached the file than were written
        return f"the file was cut short (a full disk or a file-size limit: {text})"
    return text.replace("open file failed with strerror: ", "cannot create the file: ")


def save_atomic(checkpoint: dict[str, Any], path: Path) -> None:
    """Write ``checkpoint`` to ``path`` through a temporary file and record its sha256; the
    file carries the digests of its tensors (:func:`posenc.training.digests.seal`).

    Raises:
        CheckpointError: The file could not be written (the path and the cause).
    """
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(digests.seal(checkpoint), tmp)
        digest = sha256_file(tmp)
        manifest = _read_manifest(path.parent)
        # Old and new digests while the file is replaced: a kill in between verifies.
        manifest[path.name] = [digest, *manifest.get(path.name, [])[:1]]
        _write_manifest(path.parent, manifest)
        os.replace(tmp, path)
        manifest[path.name] = [digest]
        _write_manifest(path.parent, manifest)
    except (OSError, RuntimeError) as err:
        # torch.save reports a failed write as RuntimeError ("unexpected pos 397184 vs
        # 397072" on a full disk or past a file-size limit, "open file failed with
        # strerror: ..."), the rest of the write as OSError.
        cause = _as_os_error(err, path)  # before the cut-short file gives its space back
        with contextlib.suppress(OSError):  # the folder itself may be the problem
            tmp.unlink(missing_ok=True)
        raise CheckpointError(
            f"could not write checkpoint {path}: {_write_failure(cause)}. The run stops "
            f"here so that no result is lost silently; free disk space or make "
            f"{path.parent} writable, then continue with resume=true."
        ) from cause


def verify(path: str | os.PathLike[str]) -> Path:
    """Check that ``path`` is a whole checkpoint: present, not empty, and, if posenc wrote
    it, unchanged since (its sha256 in the folder's ``checksums.json``).

    Raises:
        CheckpointError: What is wrong with the file, and what to do.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    if path.stat().st_size == 0:
        raise CheckpointError(
            f"checkpoint {path} is empty (0 bytes): it was cut off while being written. "
            f"Use another checkpoint of the run (best.ckpt or last.ckpt), or start afresh."
        )
    expected = _read_manifest(path.parent).get(path.name)
    if expected:
        found = sha256_file(path)
        if found not in expected:
            raise CheckpointError(
                f"checkpoint {path} is damaged: its sha256 {found[:16]}... differs from the "
                f"{expected[0][:16]}... recorded when posenc wrote it ({path.parent / MANIFEST}"
                f"). Resume from another checkpoint of the run, or start afresh."
            )
    return path


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A verified checkpoint's contents (tensors on the CPU): the file checked against its
    run folder's manifest, its tensors against the digests stored in it.

    Raises:
        CheckpointError: The file is missing, damaged or not a checkpoint.
    """
    path = verify(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (
        EOFError,
        RuntimeError,
        OSError,
        ValueError,
        zipfile.BadZipFile,
        pickle.UnpicklingError,
    ) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"{path} is not a readable posenc checkpoint ({type(err).__name__}: {first[:200]}"
            f"). Give a .ckpt file written by posenc (<run dir>/checkpoints/last.ckpt or "
            f"best.ckpt)."
        ) from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise CheckpointError(f"{path} is not a posenc checkpoint (no state_dict in it)")
    digests.check(path, ckpt)
    return ckpt


class VerifiedCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO with :func:`save_atomic`, :func:`verify` and the tensors'
    digests (:func:`posenc.training.digests.check`): resuming and testing check them."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        save_atomic(checkpoint, Path(path))

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        verify(path)
        try:
            # posenc's checkpoints hold tensors and plain values only: never unpickle code.
            ckpt = super().load_checkpoint(
                path, map_location=map_location, weights_only=weights_only is not False
            )
        except (EOFError, RuntimeError, zipfile.BadZipFile) as err:
            raise CheckpointError(f"{path} is not a readable checkpoint: {err}") from None
        digests.check(path, ckpt)
        return ckpt

    def remove_checkpoint(self, path: Any) -> None:
        super().remove_checkpoint(path)
        path = Path(path)
        manifest = _read_manifest(path.parent)
        if manifest.pop(path.name, None) is not None:
            _write_manifest(path.parent, manifest)


# -- the config a checkpoint was trained with ------------------------------------------


def record(
    cfg: DictConfig,
    tokenizer_fingerprint: str | None,
    tokenizer_payload: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a checkpoint stores of its run: the resolved config (without ``hydra``), the
    tokenizer's fingerprint and, where given, the tokenizer itself
    (:func:`posenc.data.tokenizers.to_payload`; checkpoints from before 2026-11-26 lack it)."""
    config = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))  # a DictConfig's dict
    config.pop("hydra", None)
    out: dict[str, Any] = {"config": config, "tokenizer": tokenizer_fingerprint}
    if tokenizer_payload is not None:
        out["tokenizer_payload"] = tokenizer_payload
    return out


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict's leaves by dotted key (``{"model.d_model": 16}``)."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out |= flat(v, f"{prefix}{k}.")
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: tree}


def _trains(key: str, cfg: DictConfig) -> bool:
    """An evaluation key that also shapes training: the training mix's key length."""
    return key == "task.eval.passkey.key_len" and bool(cfg.task.get("passkey_mix"))


def _inert(key: str, cfg: DictConfig) -> bool:
    """A training key that does nothing in this run: the passkey answers' loss weight
    without the passkey mix."""
    return key == "task.passkey_answer_weight" and not cfg.task.get("passkey_mix")


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


#: How :func:`differences` shows a key one side does not have.
UNSET = "<unset>"


def differences(saved: dict[str, Any], cfg: DictConfig) -> dict[str, tuple[Any, Any]]:
    """``{key: (checkpoint's value, config's value)}`` for every leaf that differs
    (:data:`UNSET` for a key one side lacks)."""
    now = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))
    now.pop("hydra", None)
    a, b = flat(saved), flat(now)
    a = {k: MOVED.get(v, v) if k.endswith("_target_") and isinstance(v, str) else v
         for k, v in a.items()}  # fmt: skip
    missing = object()
    return {
        k: (a.get(k, UNSET), b.get(k, UNSET))
        for k in sorted(a.keys() | b.keys())
        if a.get(k, missing) != b.get(k, missing)
        and not (k not in a and k in ADDED_LATER and b.get(k) == ADDED_LATER[k])
    }


def _scheme(target: Any) -> Any:
    """An encoder's registry name (``rope``) from its ``_target_``; the value itself when
    it names no scheme (or is :data:`UNSET`)."""
    try:
        return str(get_object(str(target)).name)
    except Exception:  # not importable, or not a registered scheme: show it as it is
        return target


def _collapsed(diff: dict[str, tuple[Any, Any]]) -> dict[str, tuple[Any, Any]]:
    """A checkpoint of another task: its ``task.name`` line alone (the other keys follow
    from the task); of another scheme: one ``encoder`` line naming both schemes, not a
    line for each option of either."""
    if "task.name" in diff:
        return {"task.name": diff["task.name"]}
    target = diff.get("encoder._target_")
    if target is None:
        return diff
    rest = {k: v for k, v in diff.items() if not _under(k, ("encoder",))}
    return {"encoder": (_scheme(target[0]), _scheme(target[1])), **rest}


def _fix(diff: dict[str, tuple[Any, Any]]) -> str:
    """The overrides that give the checkpoint's values (``encoder=rope task=lm``)."""
    given = [
        f"{'task' if k == 'task.name' else k}={v[0]}" for k, v in diff.items() if v[0] != UNSET
    ]
    return " ".join(given[:4]) + (" ..." if len(given) > 4 else "")


def _lines(diff: dict[str, tuple[Any, Any]]) -> str:
    def line(k: str, v: tuple[Any, Any]) -> str:
        text = f"{k}: checkpoint {v[0]!r}, config {v[1]!r}"
        if v[0] == UNSET and k in ADDED_LATER:  # tell the value the old run had
            text += f" (the checkpoint predates the key; it ran as {k}={ADDED_LATER[k]})"
        return text

    return "\n  ".join(line(k, v) for k, v in diff.items())


def check_config(
    path: str, ckpt: dict[str, Any], cfg: DictConfig, resume: bool
) -> dict[str, tuple[Any, Any]]:
    """Refuse a checkpoint that does not fit ``cfg``.

    Args:
        path: The checkpoint's path (for messages).
        ckpt: Its contents.
        cfg: This run's config.
        resume: Continue training (every key but :data:`RESUME_MAY_CHANGE` must match), or
            evaluate (``eval_only``: the model-defining keys must match).

    Returns:
        For evaluation, the keys that differ but have no effect on it
        (:data:`NO_EFFECT_IN_EVAL`), with both values: the caller reports them.

    Raises:
        CheckpointError: Lists each differing key with both values, and how to proceed.
    """
    saved = ckpt.get("posenc")
    if not saved:
        log.warning(
            "%s predates posenc's config records: it is not checked against the config", path
        )
        return {}
    diff = {
        k: v
        for k, v in differences(saved["config"], cfg).items()
        if not _under(k, RUNTIME_ONLY) and not _inert(k, cfg)
    }
    if resume:
        bad = {k: v for k, v in diff.items() if not _under(k, RESUME_MAY_CHANGE) or _trains(k, cfg)}
        bad = _collapsed(bad)
        if bad:
            raise CheckpointError(
                f"resume from {path}: the config differs from the run's in keys the "
                f"checkpoint fixes (its weights, optimiser state and schedule would silently "
                f"win):\n  {_lines(bad)}\nUse the run's values to continue it, or start a new "
                f"run from its weights with init_from={path} (fresh optimiser and schedule)."
            )
        return {}
    bad = _collapsed({k: v for k, v in diff.items() if _under(k, MODEL_DEFINING)})
    if bad:
        fix = _fix(bad)
        raise CheckpointError(
            f"eval_only with {path}: the checkpoint holds another model than the config "
            f"describes:\n  {_lines(bad)}\nGive the settings it was trained with"
            f"{f' ({fix})' if fix else ''}; all are in its run directory's .hydra/config.yaml."
        )
    return {k: v for k, v in diff.items() if _under(k, NO_EFFECT_IN_EVAL)}


def check_tokenizer(path: str, ckpt: dict[str, Any], accepted: tuple[str, ...]) -> None:
    """Refuse a checkpoint trained with another tokenizer than the configured one.

    Args:
        path: The checkpoint's path, for the message.
        ckpt: The loaded checkpoint.
        accepted: The configured tokenizer's fingerprints
            (:func:`posenc.data.tokenizers.fingerprints`); the checkpoint's must be one.

    Raises:
        CheckpointError: The fingerprints differ.
    """
    saved = (ckpt.get("posenc") or {}).get("tokenizer")
    if saved is not None and saved not in accepted:
        raise CheckpointError(
            f"{path} was trained with tokenizer {saved[:12]}, but the configured data and "
            f"tokenizer give {accepted[0][:12]}: its token ids would mean other text. Use the "
            f"data and tokenizer settings it was trained with."
        )
