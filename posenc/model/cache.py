"""Static key/value cache for incremental decoding with the shared transformer.

Notation: B batch (rows), H heads, T new tokens, S cache slots (its size), D head dim.

The cache is preallocated: every per-key tensor has S slots along its key axis, a step
writes its T new entries at slots ``o .. o+T-1`` by index (``o``, the next free slot,
is a 0-d tensor on the model's device), and attention reads all S slots with the
empty ones masked by causality (query slot i sees slots ``j <= i``). No shape and no
Python value changes from one step to the next, so a compiled decoding step compiles
once and runs every step (tests/model/test_cache.py counts the compilations).

What each layer keeps (:class:`LayerCache`, named per-key buffers):

* ``values``; ``keys`` as the content score uses them (RoPE's rotation, done once per
  key at its position); ``raw`` projected keys where they are needed as well: for score
  terms of a scheme that also moves keys, or for a scheme whose key transform depends
  on the whole pass (``AttentionContext.stable_keys`` False: xPos's centre), which gets
  every key transformed again at each step from them.
* ``cross_keys`` and ``cross_values``, those of the fixed encoder output, computed at
  the first step. (Dict entries, not attributes: under torch 2.13, dynamo drops an
  attribute written after a ``torch.cond`` in the same graph, FIRE's.)

A scheme whose hidden states depend on the length of the pass
(``PositionalEncoder.pass_dependent``: dynamic NTK, whose base follows the length)
cannot reuse any layer's keys once the length changes. Its cache keeps the stack's
inputs instead (:attr:`KVCache.inputs`), and each step runs the stack over all S slots
again, so cached decoding equals a full pass over the prefix exactly, at the cost of
one.

A scheme that needs per-key state of its own (a cumulative gate, an accumulated
penalty) keeps it in the same :class:`LayerCache` under a typed
:class:`~posenc.encoders.base.Slot` of its own, declared at module level (its
``key_dim``: the axis of the slots): :meth:`LayerCache.extend` writes a step's
entries, :meth:`LayerCache.put` replaces a buffer it updates as a whole, and
:meth:`KVCache.select` reorders every buffer's rows (batch dim 0) for beam search.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posenc.encoders.base import Slot

#: The attention's own buffers: values and keys as the content score uses them, projected
#: keys where they are needed as well, an encoder output's keys and values.
VALUES: Slot[Tensor] = Slot("values", key_dim=2)
KEYS: Slot[Tensor] = Slot("keys", key_dim=2)
RAW: Slot[Tensor] = Slot("raw", key_dim=2)
CROSS_KEYS: Slot[Tensor] = Slot("cross_keys")
CROSS_VALUES: Slot[Tensor] = Slot("cross_values")
#: The stack's inputs ``(B, S, C)``, kept for a pass-dependent scheme.
INPUTS: Slot[Tensor] = Slot("inputs", key_dim=1)


class LayerCache:
    """One layer's decoding state: named buffers, batch rows along dim 0, most with
    ``size`` slots along their key axis.

    Args:
        size: Slots S.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        #: Buffers by name, e.g. ``values (B, H, S, D)``, ``cross_keys (B, H, S_src, D)``.
        self.buffers: dict[str, Tensor] = {}
        #: ``(T,)`` int64: the slots of this step's tokens, set by the stack for every
        #: layer before the first runs (an attribute written after a cond, see above).
        self.at: Tensor | None = None

    def extend(self, slot: Slot[Tensor], new: Tensor) -> Tensor:
        """Write ``new``'s T entries along the slot's key axis into slots :attr:`at` of
        its buffer (zeros of ``new``'s dtype with S slots on first use); return the whole
        buffer, S slots along that axis."""
        if self.at is None:
            raise RuntimeError("LayerCache.extend: no slots set for this step (at)")
        if slot.key_dim is None:
            raise TypeError(f"LayerCache.extend: slot {slot.name!r} has no key axis (key_dim)")
        dim = slot.key_dim % new.dim()
        buf = self.buffers.get(slot.name)
        if buf is None:
            shape = list(new.shape)
            shape[dim] = self.size
            buf = self.buffers[slot.name] = new.new_zeros(shape)
        return buf.index_copy_(dim, self.at, new)

    def get(self, slot: Slot[Tensor]) -> Tensor | None:
        """The slot's buffer, or None before its first step."""
        return self.buffers.get(slot.name)

    def put(self, slot: Slot[Tensor], value: Tensor) -> None:
        """Replace the slot's buffer (a scheme's state that a step updates as a whole);
        batch rows along dim 0, as :meth:`select` assumes."""
        self.buffers[slot.name] = value

    def select(self, rows: Tensor) -> None:
        """Keep (and reorder to) batch rows ``rows``."""
        for name, buf in self.buffers.items():
            self.buffers[name] = buf.index_select(0, rows)


class KVCache:
    """The static cache of one stack: a :class:`LayerCache` per layer, the next free slot
    and, for a pass-dependent scheme, the stack's inputs.

    Pass it to ``DecoderLM.forward(ids, cache=...)`` (or ``EncoderDecoder.decode``) with
    the new tokens only; their positions continue from :attr:`length`. It holds at most
    ``size`` tokens in all (prompt and generated ones; writing past them is an index
    error).

    Prompts of different lengths go in left-padded to one length, with ``pad`` their
    padding counts: row b's token in slot i is at position ``i - pad[b]``, so every row's
    positions start at 0 and its padding is never attended (per-row positions take the
    schemes' per-pair path).

    Args:
        n_layers: Layers of the stack.
        size: Slots S, the most tokens the cache holds (>= 1).
        pad: ``(B,)`` left-padding per row, or None for none.
        device: Device of the model (of ``pad`` when given).

    Raises:
        ValueError: ``size`` is not a positive integer.
    """

    def __init__(
        self,
        n_layers: int,
        size: int,
        pad: Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"cache size={size!r}: must be a positive integer, the most tokens the cache "
                f"will hold (prompt plus new tokens), e.g. model.new_cache(prompt_len + new)"
            )
        self.size = size
        self.layers = [LayerCache(size) for _ in range(n_layers)]
        self.pad = pad
        device = pad.device if pad is not None else device
        #: The next free slot, a 0-d int64 tensor (a step moves it in place).
        self.next = torch.zeros((), dtype=torch.long, device=device)
        #: The stack's inputs ``(B, S, C)``, kept for a pass-dependent scheme only.
        self.inputs = LayerCache(size)

    @property
    def length(self) -> int:
        """Slots decoded so far (the next token's slot): one host read, for callers."""
        return int(self.next)

    def select(self, rows: Tensor) -> None:
        """Keep (and reorder to) batch rows ``rows`` (finished sentences, beam reorders)."""
        rows = rows.to(torch.long)
        for layer in [*self.layers, self.inputs]:
            layer.select(rows)
        if self.pad is not None:
            self.pad = self.pad.index_select(0, rows)
