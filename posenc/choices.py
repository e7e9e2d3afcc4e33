"""The allowed values of keys that the schema shares with the code that acts on them.

They live here, on the lowest floor and without torch, so that ``run.py`` can check a
command line against the schema before it imports torch and Lightning (a typo is
answered in a second): the schema reads them from here, and so do RoPE's scalings, the
logit modifiers, the sliding window and the optimiser's schedules (the GPU benchmarks
import those without Hydra or OmegaConf).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: RoPE's context-extension methods (``encoder.scaling``; :mod:`posenc.encoders.rope`).
SCALINGS = ("none", "linear", "ntk", "dynamic_ntk", "yarn", "llama3")
#: Context-extension methods set at build time only: their settings come from a search
#: for a trained model, not from the evaluation length.
TRAINED_SCALINGS = ("longrope",)
#: The values of ``model.logit_scale`` (:mod:`posenc.model.modifiers`).
LOGIT_SCALES = ("none", "log_length", "ssmax")
#: The entries of ``model.window_layers`` (:mod:`posenc.model.window`).
LAYER_KINDS = ("local", "global")
#: Learning-rate schedules (``task.optim.schedule``;
#: :func:`posenc.training.optim.configure_adamw`).
SCHEDULES = ("cosine", "inverse_sqrt")


def layers_problem(layers: Any) -> str | None:
    """Why ``model.window_layers`` is not a pattern of layers, or None (null passes)."""
    if layers is None:
        return None
    if isinstance(layers, str) or not isinstance(layers, Sequence) or not layers:
        bad = True
    else:
        bad = any(k not in LAYER_KINDS for k in layers)
    if not bad:
        return None
    shown = list(layers) if isinstance(layers, Sequence) and not isinstance(layers, str) else layers
    return (
        f"model.window_layers={shown!r}: must be a non-empty list of local and global "
        f"(cycled over the layers), e.g. [local,local,local,local,local,global], or null "
        f"(every layer local)"
    )
