"""Key/value cache for incremental decoding with the shared transformer.

Notation: B batch (rows), H heads, S cached keys, D head dim.

Each layer keeps its projected keys and values and the keys as its scheme transformed
them (RoPE's rotation, done once per key at its position). A scheme whose key transform
depends on the whole pass (``AttentionContext.stable_keys`` False: dynamic NTK, xPos)
gets every key transformed again at each step, so cached decoding equals a full pass.
Score terms read the new query rows against every cached key; cross-attention keys and
values of the fixed encoder output are computed once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LayerCache:
    """One layer's cached ``(B, H, S, D)`` tensors (None before the first step): ``keys``
    as the content score uses them (None when they are transformed anew each step),
    projected keys ``raw`` (kept only when needed: for a new transform each step, or
    for score terms of a scheme that also moves keys), ``values``, and the
    cross-attention keys and values of the encoder output."""

    raw: Tensor | None = None
    keys: Tensor | None = None
    values: Tensor | None = None
    cross: tuple[Tensor, Tensor] | None = None

    def select(self, rows: Tensor) -> None:
        """Keep (and reorder to) batch rows ``rows``."""
        for name in ("raw", "keys", "values"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows))
        if self.cross is not None:
            k, v = self.cross
            self.cross = (k.index_select(0, rows), v.index_select(0, rows))


class KVCache:
    """The cache of one stack: a :class:`LayerCache` per layer and the decoded length.

    Pass it to ``DecoderLM.forward(ids, cache=...)`` (or ``EncoderDecoder.decode``) with
    the new tokens only; their positions continue from :attr:`length`.

    Prompts of different lengths go in left-padded to one length, with ``pad`` their
    padding counts: row b's token in slot i is at position ``i - pad[b]``, so every row's
    positions start at 0 and its padding is never attended (per-row positions take the
    schemes' per-pair path).

    Args:
        n_layers: Layers of the stack.
        pad: ``(B,)`` left-padding per row, or None for none.
    """

    def __init__(self, n_layers: int, pad: Tensor | None = None) -> None:
        self.layers = [LayerCache() for _ in range(n_layers)]
        #: Slots decoded so far (the next token's slot; its position without padding).
        self.length = 0
        self.pad = pad

    def select(self, rows: Tensor) -> None:
        """Keep (and reorder to) batch rows ``rows`` (finished sentences, beam reorders)."""
        rows = rows.to(torch.long)
        for layer in self.layers:
            layer.select(rows)
        if self.pad is not None:
            self.pad = self.pad.index_select(0, rows)
