"""The Trainer every task's job uses, with posenc's logger, callbacks and checkpoints;
what a checkpoint keeps besides Lightning's state; loading a model for evaluation."""

from __future__ import annotations

import logging
import math
import signal
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar, cast

import pytorch_lightning as pl
import torch
from hydra.utils import instantiate
from lightning_fabric.plugins.environments import SLURMEnvironment
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.exceptions import SIGTERMException
from torch import nn

from posenc import stop
from posenc.errors import CheckpointError
from posenc.results import MetricName
from posenc.schema import Group, Run, encoder_label, untyped
from posenc.training import checkpoints, compiling, gate
from posenc.training.callbacks import PlainProgress, StepProgressBar, Throughput

log = logging.getLogger(__name__)

Task = TypeVar("Task", bound=pl.LightningModule)


class _DropNoise(logging.Filter):
    """Lightning's advertisement for a cloud logger: nothing a user can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


def quiet_third_party() -> None:
    """Silence what libraries print on every run that the user cannot act on: Lightning's
    logger tip, its ``_pytree`` deprecation warning (from inside Lightning), its warning
    that a run resumed inside an epoch may draw other batches (posenc's training samplers
    start where the trainer's step says: :class:`posenc.data.samplers.TrainingSampler`),
    and, when training goes on from a checkpoint in a new folder (``ckpt_path=``), that
    the old folder's best score is not carried over: the new folder's ``best.ckpt`` is the
    best of its own validations, as intended; and, on every resumed run, that its
    checkpoint folder is not empty (it holds the checkpoint the run continues from; a run
    that does not resume is refused a folder with checkpoints,
    :func:`posenc.training.rundir.guard_run_dir`)."""
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning_fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise())
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended")
    warnings.filterwarnings("ignore", message=r"The dirpath has changed from")
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")


class RunState(pl.Callback):
    """What posenc keeps in every checkpoint besides Lightning's own state:

    - the run's config and tokenizer fingerprint (:func:`posenc.training.checkpoints.record`), so a
      checkpoint is checked against the config that loads it;
    - the torch RNG state, so a resumed run draws the same dropout masks as an
      uninterrupted one;
    - the last validation metrics, so ``metrics.json`` keeps them when a finished run is
      resumed only to redo its final evaluation.

    It also keeps a stop (SIGTERM, or Ctrl-C passed on as one) that lands during a
    validation inside training waiting until that validation ends: Lightning's validation
    loop would stop at its next batch, outside the training step where ``last.ckpt`` is
    saved, so the run would end with the progress since its last ``best.ckpt`` lost. Held,
    the stop is taken where training goes on after the validation, and saved there.

    Args:
        record: :func:`posenc.training.checkpoints.record` of this run.
        tokenizer: The fingerprints a resumed checkpoint's tokenizer may have (see
            :func:`posenc.data.tokenizers.fingerprints`); None skips the check.
    """

    def __init__(self, record: dict[str, Any], tokenizer: tuple[str, ...] | None = None) -> None:
        self.record = record
        self.tokenizer = tokenizer
        self.val: dict[str, float] = {}
        self._rng: dict[str, Any] | None = None  # a resumed run's, until training starts
        self._held = False  # a stop asked for during this validation

    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int, dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        if (
            trainer.received_sigterm
            and trainer.state.fn == TrainerFn.FITTING
            and not trainer.sanity_checking
        ):
            trainer._signal_connector.received_sigterm = False
            self._held = True

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._held:  # training stops after this validation, saving last.ckpt
            trainer._signal_connector.received_sigterm = True
            self._held = False
        if not trainer.sanity_checking:
            self.val = {
                k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")
            }

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # SIGTERM (a scheduler's preemption or time limit; Ctrl-C is passed on as one):
        # Lightning stops between two steps; keep the progress up to here for resume=true.
        if isinstance(exception, SIGTERMException) and trainer.training:
            path = Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"
            trainer.save_checkpoint(path, weights_only=False)  # (every rank takes part)
            if trainer.is_global_zero:
                log.warning("%s at step %d: saved %s", stop.stopped_by(), trainer.global_step, path)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint["posenc"] = {**self.record, "val": self.val}
        checkpoint["posenc_rng"] = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            checkpoint["posenc_rng"]["cuda"] = torch.cuda.get_rng_state_all()

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.tokenizer is not None:
            checkpoints.check_tokenizer(str(trainer.ckpt_path), checkpoint, self.tokenizer)
        align_loop_state(checkpoint, int(trainer.accumulate_grad_batches))
        self.val = dict((checkpoint.get("posenc") or {}).get("val") or {}) or self.val
        self._rng = checkpoint.get("posenc_rng")
        _set_rng(self._rng)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Resumed inside an epoch: Lightning has just built the epoch's iterator again, and
        # a loader without a generator of its own draws its seed from the global one. An
        # uninterrupted run drew it when the epoch began, before the checkpoint: set the
        # state again. (At an epoch's start the draw is the one it would make now.)
        if self._rng is not None and trainer.fit_loop.epoch_loop.batch_progress.current.ready:
            _set_rng(self._rng)
        self._rng = None


class RanksStopTogether(pl.Callback):
    """SIGTERM (or Ctrl-C, passed on as one) to a run of several processes (DDP): every
    rank stops after the same batch and saves ``last.ckpt`` with the others.

    Lightning's handler exchanges a tensor between the ranks inside the signal handler,
    wherever each rank happens to be when its signal lands, and each rank then stops where
    its own flag says. Ranks signalled at different moments (SLURM signals every rank; a
    ``kill`` or ``timeout`` signals the first process, which passes it on) then wait in
    different collectives and hang, with nothing saved. Here the handler only records the
    request (:func:`posenc.stop.request_stop`; the first process also passes the signal on
    to the ranks it started), and after each training batch the ranks agree whether any
    was asked to stop: then Lightning's stop flag is set on all of them at once, and they
    stop at that batch's end, where a single process stops.
    """

    def __init__(self) -> None:
        self._passed_on = False

    def _take_the_signal(self, trainer: pl.Trainer) -> None:
        if trainer.world_size < 2:
            return
        launcher = trainer.strategy.launcher

        def handler(signum: int, frame: FrameType | None) -> None:
            stop.request_stop()
            if launcher is not None and not self._passed_on:  # (the other ranks' own: none)
                self._passed_on = True
                launcher.kill(signum)

        signal.signal(signal.SIGTERM, handler)

    # Lightning sets its handler as training (or its sanity check) begins, and restores
    # the one from before when training ends.
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_the_signal(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_the_signal(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        if trainer.world_size > 1 and trainer.strategy.reduce_boolean_decision(
            stop.stop_requested(), all=False
        ):
            trainer._signal_connector.received_sigterm = True


def _set_rng(state: dict[str, Any] | None) -> None:
    if state is None:
        return
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def align_loop_state(checkpoint: dict[str, Any], accumulate: int) -> None:
    """Make a checkpoint's batch counts agree with where its training samplers go on.

    The samplers go on from the trainer's step (:func:`posenc.data.samplers.position`);
    Lightning from its own counts of the epoch's batches, which two kinds of checkpoint
    leave elsewhere:

    - saved after ``fit`` returned at the last batch of an epoch (posenc's final
      ``last.ckpt`` when ``max_steps`` falls on an epoch's end): the counts of the epoch
      just done, with the epoch marked complete. Lightning would take them as the next
      epoch's, end it after one batch and, with gradient accumulation, step on that batch
      alone. They are zeroed, as Lightning does when an epoch starts.
    - saved inside an accumulation window (SIGTERM between two batches of one step): the
      window's batches had no step, so the samplers draw them again; the counts go back to
      the window's start, or the epoch would end that many batches early. (Their dropout
      masks differ from the first time: the RNG state is the one after them.)
    """
    loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    batches, epochs = loop.get("epoch_loop.batch_progress"), loop.get("epoch_progress")
    if not batches or not epochs:
        return
    current = batches["current"]
    epoch_done = epochs["current"]["completed"] == epochs["current"]["ready"]
    if batches.get("is_last_batch") and current["completed"] == current["ready"] and epoch_done:
        batches["current"] = dict.fromkeys(current, 0)
        batches["is_last_batch"] = False
        return
    back = current["completed"] % accumulate
    if back and current["completed"] == current["ready"]:
        for counts in (current, batches["total"]):
            for key in counts:
                counts[key] -= back


def run_state(trainer: pl.Trainer) -> RunState:
    """The trainer's :class:`RunState` callback."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # not declared on Trainer
    return next(c for c in callbacks if isinstance(c, RunState))


def build_trainer(
    cfg: Run[Any],
    run_dir: Path,
    throughput: Throughput,
    tokenizer: tuple[str, ...] | None = None,
    tokenizer_payload: dict[str, Any] | None = None,
    extra: Sequence[pl.Callback] = (),
) -> pl.Trainer:
    """Lightning Trainer from ``cfg.trainer`` plus posenc's logger and callbacks.

    Checkpoints (:mod:`posenc.training.checkpoints`: atomic, checksummed, replaced in place):
    ``best.ckpt`` by the task's ``monitor`` metric at each validation, and ``last.ckpt``
    every ``checkpoint_every_n_steps`` steps and at the end of training, for resuming.
    With ``task.learned`` set, the learnability gate (:mod:`posenc.training.gate`) watches
    every validation; with ``model.compile=auto``, :mod:`posenc.training.compiling`
    decides at the start of training whether to compile the model.

    Args:
        cfg: The run's config.
        run_dir: The run directory.
        throughput: The throughput callback the job reads.
        tokenizer: The tokenizer's fingerprints (:func:`posenc.data.tokenizers.fingerprints`):
            the first is recorded in every checkpoint, and a resumed one must carry one.
        tokenizer_payload: The tokenizer itself (:func:`posenc.data.tokenizers.to_payload`),
            carried by every checkpoint so it generates text without the training data.
        extra: The task's own callbacks (e.g. a validation metric the gate watches).
    """
    logger = TensorBoardLogger(
        save_dir=str(run_dir), name="tb", version="", default_hp_metric=False
    )
    ckpt_dir = run_dir / "checkpoints"
    callbacks = [
        ModelCheckpoint(
            dirpath=ckpt_dir,
            filename="best",
            monitor=cfg.task.monitor,
            mode=cfg.task.monitor_mode,
            save_top_k=1,
            enable_version_counter=False,
        ),
        ModelCheckpoint(
            dirpath=ckpt_dir,
            save_last=True,
            save_top_k=0,
            every_n_train_steps=cfg.checkpoint_every_n_steps,
            enable_version_counter=False,
        ),
        LearningRateMonitor(logging_interval="step"),
        RunState(
            checkpoints.record(
                untyped(cfg), tokenizer[0] if tokenizer else None, tokenizer_payload
            ),
            tokenizer,
        ),
        RanksStopTogether(),
        throughput,
        *extra,
    ]
    learned = cfg.task.learned
    if learned is not None:
        callbacks.append(gate.LearnedGate(learned.metric, learned.threshold, learned.stop))
    auto = compiling.callback(cfg.model.compile, encoder_label(cfg))
    if auto is not None:
        callbacks.append(auto)
    bar = bool(cfg.trainer.get("enable_progress_bar", True)) and sys.stdout.isatty()
    # Without a bar (a log file, or the bar turned off) a plain line every few steps, so
    # a run never shows nothing until its end.
    callbacks.append(StepProgressBar() if bar else PlainProgress(throughput))
    plugins: list[Any] = [checkpoints.VerifiedCheckpointIO()]
    if SLURMEnvironment.detect():
        # SIGUSR1 before the time limit: Lightning saves a checkpoint and requeues the job.
        plugins.append(SLURMEnvironment(auto_requeue=True))
    return instantiate(
        cfg.trainer,
        logger=logger,
        callbacks=callbacks,
        default_root_dir=str(run_dir),
        plugins=plugins,
        enable_progress_bar=bar,
        **validation_in_batches(cfg.trainer),
    )


def validation_in_batches(trainer: Any) -> dict[str, Any]:
    """``trainer.val_check_interval`` in batches, as Lightning counts it: posenc's is in
    optimizer steps, like ``max_steps`` and ``checkpoint_every_n_steps``, so that
    ``trainer.accumulate_grad_batches`` does not make a run validate more often. A time or
    a fraction of an epoch passes unchanged (empty: nothing to override)."""
    every = trainer.get("val_check_interval")
    accumulate = int(trainer.get("accumulate_grad_batches") or 1)
    if accumulate == 1 or isinstance(every, bool) or not isinstance(every, int):
        return {}
    return {"val_check_interval": every * accumulate}


def best_checkpoint(trainer: pl.Trainer) -> str:
    """The path of this run's ``best.ckpt`` (empty before the first one is saved): the
    trainer's first checkpoint callback is :func:`build_trainer`'s ``best`` ModelCheckpoint.

    Training on from a checkpoint of another folder (``ckpt_path=``), Lightning restores
    that folder's best path; until this run validates, it is not this run's best."""
    callback = cast(ModelCheckpoint, trainer.checkpoint_callback)
    best = callback.best_model_path
    if (
        best
        and callback.dirpath
        and Path(best).parent.resolve() != Path(callback.dirpath).resolve()
    ):
        return ""
    return best


def to_dict(node: Group | DictConfig) -> dict[str, Any]:
    """A config section as a plain, resolved dict (what the tasks' hyperparameters take):
    a typed group's keys as the config set them."""
    if isinstance(node, Group):
        return node.as_dict()
    return cast(dict[str, Any], OmegaConf.to_container(node, resolve=True))


def on_cpu(cfg: Any) -> bool:
    """Whether the run trains on the CPU (``trainer.accelerator=cpu``, or no GPU here):
    where memory checks compare with this machine's memory."""
    return cfg.trainer.get("accelerator") == "cpu" or not torch.cuda.is_available()


def save_last(trainer: pl.Trainer, run_dir: Path) -> None:
    """``last.ckpt`` at the end of training (after the final validation), so a run killed
    during its final evaluation resumes straight to it with every metric."""
    trainer.save_checkpoint(run_dir / "checkpoints" / "last.ckpt", weights_only=False)


def command_line_keys(cfg: Any) -> set[str] | None:
    """The config keys the command line set (``model.d_model=32``, ``+encoder.x=1``) and,
    for a group choice (``encoder=rope``), its ``_target_``; None outside a Hydra run (a
    config composed by hand, whose overrides are unknown)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return override_keys(HydraConfig.get().overrides.task)
    given = OmegaConf.select(untyped(cfg), "hydra.overrides.task")
    return None if given is None else override_keys(given)


def override_keys(overrides: Iterable[str]) -> set[str]:
    """The config keys a list of overrides sets (``model.d_model=32``, ``+encoder.x=1``)
    and, for a group choice (``encoder=rope``), its ``_target_``."""
    keys = {o.partition("=")[0].lstrip("+~") for o in overrides}
    return {k if "." in k else f"{k}._target_" for k in keys}


#: Config keys in every run's HParams besides the model's and the encoder's: what most
#: often tells two runs of a sweep apart.
HPARAM_KEYS = ("task.optim.lr", "trainer.max_steps", "seed")


def config_hparams(cfg: Run[Any]) -> dict[str, Any]:
    """The config's part of a run's HParams, as flat scalars by dotted key: the learning
    rate, the steps, every ``model.*`` and ``encoder.*`` option and every key the command
    line set (a sweep's swept keys), so runs that differ in any of them are told apart in
    TensorBoard. Lists become their text."""
    plain = cast(dict[str, Any], OmegaConf.to_container(untyped(cfg), resolve=True))
    plain.pop("hydra", None)
    flat = checkpoints.flat(plain)
    given = command_line_keys(cfg) or set()
    keep = {
        k
        for k in flat
        if k in HPARAM_KEYS
        or k in given
        or k.startswith(("model.", "encoder."))
        and not k.endswith(("._target_", "._partial_"))
    }
    scalar = (int, float, str, bool)
    return {k: flat[k] if isinstance(flat[k], scalar) else str(flat[k]) for k in sorted(keep)}


def log_hparams(
    trainer: pl.Trainer,
    cfg: Run[Any],
    hparams: dict[str, Any],
    metrics: Mapping[MetricName, float | None],
) -> None:
    """HParams (the task's ``hparams`` and :func:`config_hparams`) linked to the final
    metrics, so runs compare in TensorBoard's HParams tab."""
    if isinstance(trainer.logger, TensorBoardLogger):
        # Under hp/: the same names as the logged curves would add a point at step 0.
        finite = {f"hp/{k}": v for k, v in metrics.items() if v is not None and math.isfinite(v)}
        trainer.logger.log_hyperparams(hparams | config_hparams(cfg), finite)
        trainer.logger.finalize("success")


def load_for_eval(
    task_cls: type[Task],
    cfg: Run[Any],
    vocab_size: int,
    tokenizer: tuple[str, ...] | None = None,
    ckpt: dict[str, Any] | None = None,
) -> Task:
    """The task stored in ``cfg.ckpt_path`` (for ``eval_only``), checked against the data.

    Args:
        task_cls: The task's LightningModule class.
        cfg: The run's config.
        vocab_size: The configured tokenizer's vocabulary size.
        tokenizer: Its fingerprints; the checkpoint's must be one of them.
        ckpt: The file's contents if the caller has already loaded (and so verified) them
            with :func:`posenc.training.checkpoints.load`.

    Raises:
        CheckpointError: The file is damaged, or was trained with another tokenizer.
        ValueError: The checkpoint's vocabulary differs from the configured tokenizer's.
    """
    if ckpt is None:
        ckpt = checkpoints.load(str(cfg.ckpt_path))
    if tokenizer is not None:
        checkpoints.check_tokenizer(str(cfg.ckpt_path), ckpt, tokenizer)
    # An older checkpoint's hyperparameters lack the keys added since: rebuild its model
    # as it ran, never with today's defaults.
    task = task_cls.load_from_checkpoint(
        str(cfg.ckpt_path),
        map_location="cpu",
        **checkpoints.as_trained(ckpt.get("hyper_parameters") or {}),
    )
    if task.hparams["vocab_size"] != vocab_size:
        raise ValueError(
            f"checkpoint {cfg.ckpt_path} has vocab_size={task.hparams['vocab_size']} but the "
            f"configured data/tokenizer give {vocab_size}; use the data and tokenizer "
            f"settings it was trained with"
        )
    return task


def init_from_checkpoint(task: pl.LightningModule, path: str) -> None:
    """Initialise ``task.model`` with the model weights (only) of checkpoint ``path``.

    This is ``init_from=...``: a new run (fresh optimiser, schedule and step counter) that
    starts from another run's weights, e.g. a short fine-tune at a longer context. The
    checkpoint's optimiser state, step and settings are not used.

    Raises:
        CheckpointError: The checkpoint's model does not match this run's (sizes,
            vocabulary, or an encoder with other parameters); loading is strict.
    """
    ckpt = checkpoints.load(path)
    state = {
        k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")
    }
    model = cast(nn.Module, task.model)
    ours = model.state_dict()
    differ = [
        f"{k} is {tuple(v.shape)} there, {tuple(ours[k].shape)} here"
        for k, v in state.items()
        if k in ours and v.shape != ours[k].shape
    ]
    differ += [f"{k} only there" for k in state if k not in ours]
    differ += [f"{k} only here" for k in ours if k not in state]
    if differ:
        more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
        raise CheckpointError(
            f"init_from={path}: the checkpoint's model does not match this run's "
            f"({'; '.join(differ[:3])}{more}); use the model sizes, data/tokenizer and "
            f"encoder it was trained with"
        )
    model.load_state_dict(state, strict=True)
    theirs = ckpt.get("hyper_parameters", {}).get("encoder", {}).get("_target_")
    ours = task.hparams.get("encoder", {}).get("_target_")
    if theirs != ours:
        log.warning("init_from=%s: weights of a %s model initialise a %s model", path, theirs, ours)
    log.info(
        "model weights initialised from %s (step %s of that run)", path, ckpt.get("global_step")
    )
