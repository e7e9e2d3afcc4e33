"""Sliding-window attention (``model.window``, ``model.window_layers``).

Notation: B batch, H heads, T queries, S keys.

A local layer's query i sees keys j with ``i - window < j <= i``: itself and the
``window - 1`` keys before it (Beltagy et al. 2020's causal sliding window; Mistral,
Gemma). By index, as the causal mask is: with the causal offset ``shift`` (query i sees
keys ``j <= i + shift``) the window keeps keys ``j > i + shift - window``. In a static
cache's step the indices are slots, which differ from positions by a row's left padding
alone, so the window is the same one there; the cache keeps every slot and masks the
old ones (it is not a rolling buffer).

``model.window_layers`` says which layers are local: a list of ``local`` and ``global``
cycled over the layers (Gemma 3's five local layers to one global one is
``[local,local,local,local,local,global]``); null: every layer is local.

Each backend gets the window where it takes its mask: the explicit softmax and SDPA as
one more additive score part of ``-inf`` outside the window (:func:`window_part`, built
once per pass and shared by the layers), FlexAttention in its block mask's
``mask_mod``; the logit scale counts the keys inside the window only
(:func:`posenc.model.modifiers.key_counts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from posenc.choices import layers_problem
from posenc.encoders.base import AttentionContext


def window_problem(window: Any, layers: Any) -> str | None:
    """Why ``model.window`` and ``model.window_layers`` do not make a window, or None."""
    if window is not None and not (
        isinstance(window, int) and not isinstance(window, bool) and window >= 1
    ):
        return f"model.window={window!r}: must be a positive integer (tokens) or null (off)"
    problem = layers_problem(layers)
    if problem or layers is None:
        return problem
    if window is None:
        return (
            f"model.window_layers={list(layers)}: there is no window to place (model.window is "
            f"null); set model.window=<tokens> or drop model.window_layers"
        )
    if "local" not in layers:
        return (
            f"model.window_layers={list(layers)}: names no local layer, so model.window="
            f"{window} applies nowhere; add local or set model.window=null"
        )
    return None


def layer_window(window: int | None, layers: Sequence[str] | None, layer: int) -> int | None:
    """Layer ``layer``'s window: ``window`` where the cycled ``layers`` pattern says
    ``local`` (every layer when ``layers`` is None), else None (global attention)."""
    if window is None or layers is None:
        return window
    return window if layers[layer % len(layers)] == "local" else None


def window_part(
    ctx: AttentionContext,
    *,
    t: int,
    s: int,
    shift: int | Tensor,
    window: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[Tensor, int]:
    """The window as a score part: ``(1, 1, T, S)`` with ``-inf`` for keys
    ``j <= i + shift - window`` (too far back) and 0 elsewhere, at column 0; built once
    per pass (``ctx``'s memo) for every local layer.

    Args:
        ctx: The stack's context (its memo keeps the part for the other layers).
        t: Queries T. s: Keys S.
        shift: The causal offset: an int, or a 0-d tensor (a static cache's slot).
        window: Keys each query sees at most.
        dtype: The scores' dtype. device: Where they live.
    """
    shift_key = shift if isinstance(shift, int) else "slot"

    def make() -> Tensor:
        i = torch.arange(t, device=device)[:, None]
        j = torch.arange(s, device=device)[None, :]
        far = j <= i + shift - window  # (T, S)
        zeros = torch.zeros(t, s, dtype=dtype, device=device)
        return zeros.masked_fill(far, float("-inf"))[None, None]  # (1, 1, T, S)

    key = ("window_part", t, s, shift_key, window, dtype)
    return ctx.shared(key, make), 0
