"""``model.compile=auto`` (the default): compile the model where that was measured to pay.

``true`` compiles the model when it is built and ``false`` never does
(:meth:`posenc.training.module.TaskModule.build_model`). ``auto`` decides when training
starts, once Lightning has moved the model to its device (:class:`AutoCompile`): compiled
on a GPU for a scheme whose compiled training step beat its eager one there
(:data:`COMPILED_OVER_EAGER`), eager everywhere else. On a CPU the compilation takes
minutes for a training step 1.02x-1.26x faster (docs/performance.md), which a short run
does not win back; a scheme never measured on a GPU (a mix, a labelled variant, a new
encoder) stays eager until it is. ``model.compile=true`` compiles either anyway.
"""

from __future__ import annotations

import logging
from typing import Any

import pytorch_lightning as pl

log = logging.getLogger(__name__)

#: Where :data:`COMPILED_OVER_EAGER` was measured, as the log line says it.
MEASURED_ON = "an H200"
#: How the log line points to the other choice.
FORCE, EAGER = "model.compile=true compiles", "model.compile=false trains eager"

#: Speed of each scheme's compiled bf16 training step over its eager one, on a GPU: the
#: column "compiled / eager" of docs/performance.md's "Fourth run, NVIDIA H200" table
#: (2026-11-27; a 4-layer, d_model 256 model at 4x4096, ``experiments/bench.py
#: --sections steps``), FIRE's from a later run (its comment). Above 1, ``auto`` compiles
#: the scheme on a GPU; a scheme that is not here was not measured and trains eager.
COMPILED_OVER_EAGER: dict[str, float] = {
    "none": 1.26,  # 1.2 M tokens/s compiled, 0.95 M eager
    "learned": 1.23,
    "sinusoidal": 1.27,
    "rope": 1.26,
    "xpos": 1.38,
    "alibi": 1.50,
    "t5": 1.03,
    "xl": 1.69,
    "shaw": 2.98,
    "deberta": 3.26,
    # FIRE: measured again in one run on 2026-11-30 (docs/gpu/2026-11-30-h200-2.json):
    # eager 0.38x `none`, compiled 0.66x its eager step (the 85 of the fourth run was
    # against an eager step that gathered per pair, 3.7 s, since fixed): auto trains eager.
    "fire": 0.66,
    "fox": 1.99,
    "cope": 0.14,
}


def auto_compile(scheme: str, device_type: str) -> tuple[bool, str]:
    """Whether ``model.compile=auto`` compiles a run of ``scheme`` training on a device of
    ``device_type``, and why, as the run's log line says it.

    Args:
        scheme: The scheme's name in results (the encoder choice, or the run's ``label``).
        device_type: ``torch.device.type`` of the model in training (``cuda``, ``cpu``).

    Returns:
        ``(compile, reason)``, e.g. ``(True, "compiled (rope trains 1.26x faster compiled
        on an H200)")``.
    """
    if device_type == "cpu":
        return False, f"eager (CPU: auto compiles on a GPU only; {FORCE})"
    if device_type != "cuda":
        return False, f"eager ({device_type}: compiling not measured there)"
    speed = COMPILED_OVER_EAGER.get(scheme)
    if speed is None:
        return False, f"eager ({scheme}: not measured compiled on a GPU; {FORCE})"
    on = f"compiled on {MEASURED_ON}"
    if speed <= 1:
        return False, f"eager ({scheme} trains at {speed:.2f}x its eager speed {on})"
    return True, f"compiled ({scheme} trains {speed:.3g}x faster {on}; {EAGER})"


class AutoCompile(pl.Callback):
    """``model.compile=auto``: at the start of training, on the device the model trains
    on, compile it in place (:meth:`torch.nn.Module.compile`: checkpoints keep their keys)
    when :func:`auto_compile` says so, and log one line either way.

    Args:
        scheme: The scheme's name in results (:func:`posenc.schema.encoder_label`).
    """

    def __init__(self, scheme: str) -> None:
        self.scheme = scheme

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning has moved the module to its device by now, and no step has run.
        compiled, reason = auto_compile(self.scheme, pl_module.device.type)
        log.info("model.compile=auto: %s", reason)
        if compiled:
            model: Any = pl_module.model
            model.compile()


def callback(setting: Any, scheme: str) -> AutoCompile | None:
    """The run's :class:`AutoCompile` when ``model.compile`` is ``auto`` (else None:
    ``true`` and ``false`` are settled when the model is built)."""
    return AutoCompile(scheme) if setting == "auto" else None
