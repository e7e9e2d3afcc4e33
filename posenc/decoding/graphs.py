"""A decoding step captured once as a CUDA graph and replayed for every further token.

A cached decoding step of a small model is launch-bound on a GPU: hundreds of tiny
kernels, each waiting for Python to launch it, so the cache made greedy decoding slower
than recomputing the whole sequence on an H200 (docs/performance.md). The static cache
fixes every shape and keeps every position in a tensor, so one step's kernels can be
recorded once (``torch.cuda.CUDAGraph``) and replayed with the next token copied into
the recorded input: one launch per token.

A step can be replayed only if it changes nothing on the host: it must read no tensor
back (a host read inside a capture is an error) and replace no cache buffer with a new
tensor (a replay would keep reading the old one). :class:`GraphedStep` runs two steps
eagerly (the first compiles what the step compiles) and watches the second for both; a
scheme that does either (FIRE's eager step reads its learned threshold) decodes eagerly,
with the same tokens.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from posenc.model.cache import KVCache, LayerCache

log = logging.getLogger(__name__)


def _layers(cache: KVCache) -> list[tuple[int, LayerCache]]:
    """Every buffer holder of the cache, numbered (the stack's inputs as -1)."""
    return [*enumerate(cache.layers), (-1, cache.inputs)]


def _buffers(cache: KVCache) -> dict[tuple[int, str], int]:
    """The identity of every cache buffer, by layer and name."""
    return {(i, n): id(b) for i, layer in _layers(cache) for n, b in layer.buffers.items()}


class GraphedStep:
    """``step(ids)`` for single-token steps against one static cache, replayed from a
    CUDA graph from the third step on, once an eager one shows it can be.

    Args:
        step: The eager step: ``(B, 1)`` token ids to ``(B, V)`` logits, writing the
            cache in place.
        cache: The static cache ``step`` writes (checked for replaced buffers).

    The logits returned by a replay live in the graph's output tensor, which the next
    replay overwrites: use them before the next call.
    """

    def __init__(self, step: Callable[[Tensor], Tensor], cache: KVCache) -> None:
        self.step = step
        self.cache = cache
        self.graph: torch.cuda.CUDAGraph | None = None
        self.ids: Tensor | None = None
        self.logits: Tensor | None = None
        #: Why the step stays eager (None while it may be captured).
        self.eager_because: str | None = None
        self._steps = 0

    def __call__(self, ids: Tensor) -> Tensor:
        if self.graph is not None:
            assert self.ids is not None and self.logits is not None
            self.ids.copy_(ids)
            self.graph.replay()
            return self.logits
        self._steps += 1
        if self.eager_because is not None:
            return self.step(ids)
        if self._steps <= 2:
            return self._probe(ids, watch=self._steps == 2)
        return self._capture(ids)

    def _probe(self, ids: Tensor, *, watch: bool) -> Tensor:
        """An eager step on a side stream (CUDA graphs' warm-up). The first compiles
        what the step compiles (its benchmarking reads the device); the second is
        watched for host reads and replaced buffers."""
        if not watch:
            return self._on_side_stream(ids)
        before = _buffers(self.cache)
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                logits = self._on_side_stream(ids)
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
        if syncs:
            self._stay_eager(f"the step waits for the device ({str(syncs[0].message)[:160]})")
        elif _buffers(self.cache) != before:
            self._stay_eager("the step replaces cache buffers")
        return logits

    def _on_side_stream(self, ids: Tensor) -> Tensor:
        """The eager step on a side stream, ordered after and before the current one."""
        side = torch.cuda.Stream(ids.device)
        side.wait_stream(torch.cuda.current_stream(ids.device))
        with torch.cuda.stream(side):
            logits = self.step(ids)
        torch.cuda.current_stream(ids.device).wait_stream(side)
        return logits

    def _capture(self, ids: Tensor) -> Tensor:
        """Record the step (which runs nothing), then replay it for this token."""
        before = {i: dict(layer.buffers) for i, layer in _layers(self.cache)}
        identities = _buffers(self.cache)
        self.ids = ids.clone()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.logits = self.step(self.ids)
        except RuntimeError as e:  # a capture that failed ran nothing: undo and go on eagerly
            self._restore(before)
            self._stay_eager(f"its capture failed ({str(e).splitlines()[0][:160]})")
            return self.step(ids)
        if _buffers(self.cache) != identities:  # replaced after all: never computed
            self._restore(before)
            self._stay_eager("the step replaces cache buffers")
            return self.step(ids)
        self.graph = graph
        graph.replay()
        return self.logits

    def _stay_eager(self, why: str) -> None:
        """Decode eagerly from now on, and say why (once per generation, at INFO)."""
        self.eager_because = why
        log.info("decoding without a CUDA graph: %s", why)

    def _restore(self, before: dict[int, dict[str, Tensor]]) -> None:
        """Put back the buffers a capture replaced (its tensors were never computed)."""
        for i, layer in _layers(self.cache):
            layer.buffers = dict(before[i])
        self.logits = None
