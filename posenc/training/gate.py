"""The learnability gate: what "learned" means at the training length (``task.learned``),
a callback that records when a run got there and may stop it then, and the fields it
leaves in ``metrics.json``.

A run that never learned its task at the training length says nothing about extrapolation:
the report (:mod:`posenc.report`) leaves such runs out of every cell beyond the training
length. ``task.learned`` is ``{metric, threshold, stop}`` or null (no gate):

- ``metric``: a validation metric the task logs at the training length (:func:`metrics`);
  its direction is fixed by its name (accuracies: at least the threshold; losses and
  perplexities: at most);
- ``threshold``: in the metric's own unit (percent for ``val/seq_acc``, a fraction in
  [0, 1] for ``val/passkey``);
- ``stop``: end training at the first validation that meets it (``trainer.max_steps``
  stays the cap).
"""

from __future__ import annotations

import logging
from typing import Any

import pytorch_lightning as pl

from posenc import results
from posenc.results import MetricName, Record, Standing
from posenc.schema import AlgoTask, Gate, LMTask, MTTask, keys

log = logging.getLogger(__name__)

#: Keys of ``task.learned``.
GATE_KEYS = tuple(keys(Gate))
#: Metrics whose value must fall to the threshold; every other one must rise to it.
LOWER_IS_BETTER = ("val/loss", "val/nll", "val/ppl")
#: Metrics in percent (0..100) and in [0, 1], for the threshold's range check.
PERCENT = ("val/seq_acc", "val/acc")


#: Passkey retrieval at the training length on the validation split, at every validation
#: (:class:`posenc.tasks.lm_passkey.PasskeyValidation`). Like ``val/loss`` it has no
#: ``@L``: validation metrics are at the training length (``val/passkey@L`` is the
#: evaluation grid's, with ``task.eval.splits=[val]``).
PASSKEY = "val/passkey"


def metrics(t: LMTask | MTTask | AlgoTask) -> dict[str, str]:
    """The validation metrics a gate can watch in a run of task ``t``, each with what it
    needs.

    Returns:
        ``{metric: ""}`` for a metric the run logs, ``{metric: why not}`` for one it would
        log with another setting.
    """
    if isinstance(t, AlgoTask):
        return {"val/seq_acc": "", "val/acc": "", "val/loss": ""}
    if isinstance(t, LMTask):
        need = "" if t.passkey_mix else "needs task.passkey_mix > 0 (training passkeys)"
        return {"val/loss": "", "val/ppl": "", PASSKEY: need}
    need = "" if t.val_bleu_sentences else "needs task.val_bleu_sentences > 0"
    return {"val/loss": "", "val/nll": "", "val/ppl": "", "val/bleu": need}


def met(metric: str, value: float, threshold: float) -> bool:
    """Whether ``value`` of ``metric`` meets the threshold (NaN never does)."""
    if metric in LOWER_IS_BETTER:
        return value <= threshold
    return value >= threshold


class LearnedGate(pl.Callback):
    """Records the first validation at which ``metric`` meets ``threshold`` and, with
    ``stop``, ends training there (``trainer.should_stop``; Lightning finishes the step
    and the fit returns as at ``max_steps``).

    A small callback rather than Lightning's ``EarlyStopping(stopping_threshold=...)``:
    that one counts epochs and never says when it fired, and with ``stop=false`` the
    step still has to be recorded.

    Args:
        metric: A validation metric the task logs (see :func:`metrics`).
        threshold: The value that counts as learned.
        stop: End training once it is met.
    """

    def __init__(self, metric: str, threshold: float, stop: bool) -> None:
        self.metric = metric
        self.threshold = float(threshold)
        self.stop = stop
        self.learned_step: int | None = None
        #: The gate as the run's record holds it (the threshold as the config gave it).
        self.record = results.Gate(MetricName(metric), threshold, stop)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self.metric not in trainer.callback_metrics:
            return
        value = float(trainer.callback_metrics[self.metric])
        # Every rank logs the same synced value; agree anyway, as EarlyStopping does.
        reached = trainer.strategy.reduce_boolean_decision(
            met(self.metric, value, self.threshold), all=False
        )
        if reached and self.learned_step is None:
            self.learned_step = trainer.global_step
            log.info(
                "learned at step %d: %s %.4g meets %g%s",
                trainer.global_step,
                self.metric,
                value,
                self.threshold,
                "; stopping (task.learned.stop=true)" if self.stop else "",
            )
        if reached and self.stop:
            trainer.should_stop = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Resumed from the checkpoint saved as the gate stopped the run (a stop during its
        # test): the run has learned and trains no further, so the test scores the weights
        # that met the gate (training on, it would stop only at the next validation).
        if self.stops_at(trainer.global_step):
            trainer.should_stop = True

    def stops_at(self, step: int) -> bool:
        """Whether the gate ends training at ``step``: ``stop``, and first met there."""
        return self.stop and self.learned_step == step

    def state_dict(self) -> dict[str, Any]:
        return {"learned_step": self.learned_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A resumed run takes the step from its checkpoint. Testing an earlier checkpoint
        # after fit restores its callback state too: keep the step this fit found.
        if self.learned_step is None:
            self.learned_step = state_dict.get("learned_step")


def stopped(trainer: pl.Trainer) -> bool:
    """Whether the gate ended this fit at its last validation (``stop`` and learned
    there). The weights in memory are then the ones that met the gate, and the test
    scores them, not an earlier checkpoint with a lower validation loss: a run's
    ``learned`` and its test columns describe the same model."""
    found = [c for c in trainer.callbacks if isinstance(c, LearnedGate)]  # type: ignore[attr-defined]
    return bool(found) and found[0].stops_at(trainer.global_step)


def result(trainer: pl.Trainer, val: dict[str, float]) -> Standing:
    """The run's standing at its gate (the trainer's :class:`LearnedGate`), for its record
    (:class:`posenc.results.Standing`):

    - ``gate``: ``{metric, threshold, stop}``, or None for a task without one;
    - ``learned``: whether the metric met the threshold at the run's last validation (the
      model it ends with; under ``stop``, the validation that stopped it); None without a
      gate or without a validation (``eval_only``);
    - ``learned_step``: the first step at which it met it (None: never). A run can have met
      it once and lost it by the end: ``learned`` false with a ``learned_step``.

    Args:
        trainer: The trainer, with the gate among its callbacks when the run has one.
        val: The last validation's metrics (:class:`posenc.training.trainer.RunState`).
    """
    found = [c for c in trainer.callbacks if isinstance(c, LearnedGate)]  # type: ignore[attr-defined]
    if not found:
        return Standing()
    held = found[0]
    value = val.get(held.metric)
    learned = None if value is None else met(held.metric, value, held.threshold)
    return Standing(held.record, learned, held.learned_step)


def describe(record: Record) -> str | None:
    """One line for a run's summary: learned or not, where, and what that means."""
    gate = record.gate
    if gate is None:
        return None
    metric, threshold = gate.metric, gate.threshold
    value = record.metrics.get(metric)
    shown = "?" if value is None else f"{value:.4g}"
    sign = "<=" if metric in LOWER_IS_BETTER else ">="
    if record.learned is None:
        return f"learned: unknown (no validation of {metric} in this run)"
    if record.learned:
        return (
            f"learned: yes ({metric} {shown} at the last validation; first met {sign} "
            f"{threshold:g} at step {record.learned_step})"
        )
    return (
        f"learned: NO ({metric} {shown} at the last validation, not {sign} {threshold:g}); "
        f"its results beyond the training length are left out of sweep reports"
    )
