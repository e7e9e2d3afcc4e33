"""The one shared transformer: a decoder-only LM and an encoder-decoder translator.

Notation: B batch, T target/query length, S source length, C d_model, V vocabulary.

Both are built from :class:`Stack`, which owns one positional encoder, builds its
shared context once per forward pass and hands it to every layer. Positions are
explicit ``(B|1, T)`` integer tensors; by default ``0 .. T-1``, or, in training with
``random_positions=N``, a sorted random subset of ``0 .. N-1`` per sequence
(randomized positional encodings, Ruoss et al. 2023).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from posenc.encoders import registry
from posenc.encoders.base import (
    AttentionContext,
    AttentionPositional,
    AttnKind,
    PositionalEncoder,
    head_dim,
    position_bound,
    positions_like,
)
from posenc.model.cache import INPUTS, KVCache
from posenc.model.layers import Block
from posenc.model.modifiers import Modifiers
from posenc.model.streaming import Streaming, attach, refusal, sizes_problem

EncoderFactory = Callable[..., PositionalEncoder]

#: The refusal of a sliding window in an encoder-decoder.
NO_WINDOW_IN_TRANSLATOR = (
    "model.window={window}: sliding-window attention is for causal decoders (task=lm, "
    "task=algo task.shape=decoder); an encoder-decoder's encoder attends both ways; "
    "set model.window=null"
)


def random_positions(batch: int, length: int, max_position: int, device=None) -> Tensor:
    """Per row, ``length`` distinct positions drawn uniformly from ``0 .. max_position-1``
    and sorted: ``(batch, length)`` int64 (Ruoss et al. 2023, section 3). Uses the global
    torch generator, so a seeded run draws the same positions."""
    if length > max_position:
        raise ValueError(
            f"random_positions={max_position} is smaller than the sequence length {length}; "
            f"it must be at least the longest training sequence (a larger range, e.g. "
            f"8-16x the training length, is the point of the method)"
        )
    keys = torch.rand(batch, max_position, device=device)
    return keys.topk(length, dim=-1, sorted=False).indices.sort(dim=-1).values


def encoder_factory(encoder: str | EncoderFactory) -> EncoderFactory:
    """Accept a registered name (``"rope"``) or a factory (a Hydra ``_partial_``)."""
    return functools.partial(registry.get(encoder)) if isinstance(encoder, str) else encoder


class Stack(nn.Module):
    """Embedding hook, then ``n_layers`` pre-LN blocks, then a final LayerNorm.

    Args:
        encoder: Positional encoder of this stack.
        n_layers: Number of blocks.
        d_model: Width C.
        n_heads: Heads H.
        d_ff: Feed-forward hidden width.
        dropout: Dropout probability.
        causal: Causal (decoder) or bidirectional (encoder) self-attention.
        cross: Whether blocks also attend to an encoder memory.
        random_positions: In training mode, when no positions are given, draw them as a
            sorted random subset of ``0 .. random_positions-1`` per sequence; None: off.
            Evaluation (``.eval()``) always uses ``0 .. T-1``.
        score_budget: CPU query blocking of attention with score terms (bytes; None: off).
        qkv_bias: Biases on the attention's q, k and v projections.
        modifiers: QK-norm, logit scale and sinks of every attention, and the sliding
            window of the layers ``window_layers`` makes local (None: none).
    """

    def __init__(
        self,
        *,
        encoder: PositionalEncoder,
        n_layers: int,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float,
        causal: bool,
        cross: bool = False,
        random_positions: int | None = None,
        score_budget: int | None = 8 * 2**20,
        qkv_bias: bool = True,
        modifiers: Modifiers | None = None,
    ) -> None:
        super().__init__()
        if random_positions is not None and random_positions < 1:
            raise ValueError(
                f"random_positions={random_positions} must be a positive integer or None (off)"
            )
        self.random_positions = random_positions
        self.encoder = encoder
        self.kind = AttnKind.CAUSAL if causal else AttnKind.BIDIRECTIONAL
        self.layers = nn.ModuleList(
            Block(
                d_model=d_model,
                n_heads=n_heads,
                d_ff=d_ff,
                dropout=dropout,
                self_pos=encoder.for_attention(layer=i, kind=self.kind),
                cross_pos=encoder.for_attention(layer=i, kind=AttnKind.CROSS) if cross else None,
                score_budget=score_budget,
                qkv_bias=qkv_bias,
                modifiers=(modifiers or Modifiers()).for_layer(i),
            )
            for i in range(n_layers)
        )
        self.drop = nn.Dropout(dropout)
        self.ln_f = nn.LayerNorm(d_model)
        #: StreamingLLM's sinks and window for causal self-attention (evaluation time,
        #: :meth:`DecoderLM.streaming`); None: off.
        self.streaming: Streaming | None = None

    def forward(
        self,
        x: Tensor,
        positions: Tensor | None = None,
        *,
        offset: int = 0,
        bound: int | None = None,
        valid: Tensor | None = None,
        memory: Tensor | None = None,
        memory_valid: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """Run the stack.

        What is known of the positions is passed on as Python values, never read back
        from the tensors (see :class:`~posenc.encoders.base.AttentionContext`).

        Args:
            x: Token embeddings ``(B, T, C)``.
            positions: ``(B|1, T)`` explicit integer positions (per-row positions); None
                for the default ``offset .. offset+T-1`` (or, in training with
                ``random_positions``, a random sorted draw).
            offset: First default position (a decoding step past a cached prefix).
            bound: With explicit positions, an exclusive upper bound of them; None reads
                it off the tensor (one host read: eager use only).
            valid: ``(B, T)`` True for real tokens (keys that may be attended).
            memory: Encoder output ``(B, S, C)`` for cross-attention.
            memory_valid: ``(B, S)`` True for real source tokens.
            cache: Incremental decoding: ``x`` holds the next tokens, at positions from
                ``cache.length`` on, and attends to every position decoded so far.

        Returns:
            ``(B, T, C)``.
        """
        if cache is not None:
            return self._cached(x, cache, memory=memory, memory_valid=memory_valid)
        t, starts = x.shape[1], None
        if positions is not None:
            bound = position_bound(positions) if bound is None else bound
        elif self.training and self.random_positions is not None:
            positions = random_positions(x.shape[0], t, self.random_positions, x.device)
            bound = self.random_positions
        else:
            positions, starts, bound = positions_like(x, offset), (offset, offset), offset + t
        self.encoder.check_length(bound)
        x = self.drop(self.encoder.embed(x, positions))
        ctx = self.encoder.context(positions, positions, self.kind, starts=starts, bound=bound)
        if self.streaming is not None:
            attach(ctx, self.encoder, self.streaming, positions, bound)
        cross_ctx = self._cross_context(positions, memory, starts, bound)
        for layer in self.layers:
            x = layer(
                x, ctx, valid=valid, memory=memory, cross_ctx=cross_ctx, memory_valid=memory_valid
            )
        return self.ln_f(x)

    def _cross_context(
        self, positions: Tensor, memory: Tensor | None, starts: tuple[int, int] | None, bound: int
    ) -> AttentionContext | None:
        """Decoder queries over the encoder output at ``0 .. S-1`` (None: no memory)."""
        if memory is None:
            return None
        k0 = None if starts is None else (starts[0], 0)
        return self.encoder.context(
            positions,
            positions_like(memory),
            AttnKind.CROSS,
            starts=k0,
            bound=max(bound, memory.shape[1]),
        )

    def _cached(
        self, x: Tensor, cache: KVCache, *, memory: Tensor | None, memory_valid: Tensor | None
    ) -> Tensor:
        """:meth:`forward` with a static cache: the new tokens are slots ``o .. o+T-1``
        (``o = cache.next``, a tensor) of the cache's S slots. Without ``cache.pad`` the
        slots are the positions; with it (left-padded prompts), row b's positions are the
        slots minus ``pad[b]``, and its first ``pad[b]`` slots are padding no query sees.

        Every shape is fixed by S and T and every position is a tensor, so a compiled
        step is the same graph at every step (positions reach the schemes per pair,
        ``starts`` None, with ``bound = S``)."""
        t, size = x.shape[1], cache.size
        slots = cache.next + torch.arange(t, device=x.device)  # (T,)
        k_pos = torch.arange(size, device=x.device)[None]  # (1, S)
        valid: Tensor | None = None
        lengths = slots[-1:] + 1  # (1,): keys written once this step is in
        if cache.pad is not None:
            shifted = k_pos - cache.pad[:, None]  # (B, S)
            valid = shifted >= 0
            k_pos = shifted.clamp(min=0)  # padding slots, never attended, at position 0
            lengths = lengths - cache.pad  # (B,): each row's own length
        positions = k_pos.index_select(1, slots)  # (B|1, T)
        if self.encoder.pass_dependent:
            out = self._replay(x, cache, k_pos, valid, lengths, slots, memory, memory_valid)
        else:
            x = self.drop(self.encoder.embed(x, positions))
            ctx = self.encoder.context(positions, k_pos, self.kind, bound=size, lengths=lengths)
            if self.streaming is not None:
                attach(ctx, self.encoder, self.streaming, k_pos, size)
            cross_ctx = self._cross_context(positions, memory, None, size)
            for layer_cache in cache.layers:  # all before any layer runs (see cache.py)
                layer_cache.at = slots
            for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
                x = layer(
                    x,
                    ctx,
                    valid=valid,
                    memory=memory,
                    cross_ctx=cross_ctx,
                    memory_valid=memory_valid,
                    cache=layer_cache,
                )
            out = x
        cache.next.add_(t)
        return self.ln_f(out)

    def _replay(
        self,
        x: Tensor,
        cache: KVCache,
        k_pos: Tensor,
        valid: Tensor | None,
        lengths: Tensor,
        slots: Tensor,
        memory: Tensor | None,
        memory_valid: Tensor | None,
    ) -> Tensor:
        """A step of a pass-dependent scheme: the new inputs join the cached ones, and
        the stack runs over all S slots with the scheme told the real ``lengths``; the
        causal mask keeps the empty slots from every real query, so the new tokens'
        outputs ``(B, T, C)`` are those of a full pass over the prefix."""
        cache.inputs.at = slots
        inputs = cache.inputs.extend(INPUTS, x)  # (B, S, C)
        starts = (0, 0) if valid is None else None
        h = self.drop(self.encoder.embed(inputs, k_pos))
        ctx = self.encoder.context(
            k_pos, k_pos, self.kind, starts=starts, bound=cache.size, lengths=lengths
        )
        cross_ctx = self._cross_context(k_pos, memory, starts, cache.size)
        for layer in self.layers:
            h = layer(
                h, ctx, valid=valid, memory=memory, cross_ctx=cross_ctx, memory_valid=memory_valid
            )
        return h.index_select(1, slots)


class TokenEmbedding(nn.Embedding):
    """Token embedding, optionally scaled by ``sqrt(C)`` (Vaswani et al. 2017, 3.4)."""

    def __init__(self, vocab_size: int, d_model: int, *, scale: bool) -> None:
        super().__init__(vocab_size, d_model)
        self.scale = math.sqrt(d_model) if scale else 1.0
        nn.init.normal_(self.weight, std=d_model**-0.5 if scale else 0.02)

    def forward(self, ids: Tensor) -> Tensor:
        return super().forward(ids) * self.scale


def _init_weights(stack: nn.Module, n_layers: int) -> None:
    """GPT-2 style for the stack's own layers: N(0, 0.02) linears, residual projections
    scaled by 1/sqrt(2L). A scheme's modules are the scheme's: the encoder initialises
    itself when built, each layer's positional hooks in their ``init_weights``, called
    here at their place in module order."""
    seen: set[int] = set()

    def visit(name: str, m: nn.Module) -> None:
        if id(m) in seen:  # a shared module is initialised once, as named_modules() has it
            return
        seen.add(id(m))
        if isinstance(m, PositionalEncoder):
            return
        if isinstance(m, AttentionPositional):
            m.init_weights()
            return
        if isinstance(m, nn.Linear):
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("out_proj", "ff.2")) else 0.02
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        for child, sub in m.named_children():
            visit(f"{name}.{child}" if name else child, sub)

    visit("", stack)


def _budget(mib: float) -> int | None:
    if not mib >= 0:
        raise ValueError(f"model.score_budget_mib={mib}: must be >= 0 (0 turns blocking off)")
    return int(mib * 2**20) or None


def _check_sizes(
    *, d_model: int, n_heads: int, n_layers: int, d_ff: int, dropout: float, vocab_size: int
) -> None:
    if vocab_size <= 0 or d_model <= 0 or n_heads <= 0 or n_layers <= 0 or d_ff <= 0:
        raise ValueError(
            f"model sizes must be positive: vocab_size={vocab_size}, d_model={d_model}, "
            f"n_heads={n_heads}, n_layers={n_layers}, d_ff={d_ff}"
        )
    head_dim(d_model, n_heads)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"model.dropout={dropout} must be in [0, 1)")


class DecoderLM(nn.Module):
    """Decoder-only language model with a tied output layer.

    Args:
        vocab_size: V.
        encoder: Encoder name or factory taking ``d_model, n_heads, n_layers``.
        n_layers: Blocks.
        d_model: Width C.
        n_heads: Heads H.
        d_ff: Feed-forward width (default 4C).
        dropout: Dropout probability.
        embed_scale: Multiply token embeddings by ``sqrt(C)``.
        random_positions: Train on random sorted positions from ``0 .. N-1`` (Ruoss et
            al. 2023); evaluation uses ``0 .. T-1``. None: off.
        score_budget_mib: On a CPU, attention with score terms goes a block of queries
            at a time once one ``(B, H, T, S)`` score matrix would pass this many MiB
            (same result, less memory and cache traffic); 0: never. GPUs never block.
        qkv_bias: Biases on every attention's q, k and v projections (False: none, as
            in the FoX and PaTH authors' layers).
        qk_norm: RMSNorm of every attention's q and k per head, before the positional
            transform (:mod:`posenc.model.modifiers`).
        logit_scale: ``none``, ``log_length`` (logits times log n, n the keys a query
            sees) or ``ssmax`` (times s log n, s learned per head: Scalable-Softmax).
        sinks: A learned sink logit per head in every attention (gpt-oss).
        window: Sliding-window attention: a query sees itself and the ``window - 1``
            keys before it (:mod:`posenc.model.window`); None: off.
        window_layers: Which layers are local: ``local`` and ``global`` cycled over the
            layers (e.g. ``["local"] * 5 + ["global"]``); None: every layer.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        encoder: str | EncoderFactory,
        n_layers: int = 4,
        d_model: int = 128,
        n_heads: int = 4,
        d_ff: int | None = None,
        dropout: float = 0.0,
        embed_scale: bool = False,
        random_positions: int | None = None,
        score_budget_mib: float = 8.0,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        logit_scale: str = "none",
        sinks: bool = False,
        window: int | None = None,
        window_layers: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        d_ff = d_ff or 4 * d_model
        modifiers = Modifiers(
            qk_norm=qk_norm,
            logit_scale=logit_scale,
            sinks=sinks,
            window=window,
            window_layers=None if window_layers is None else tuple(window_layers),
        )
        _check_sizes(
            d_model=d_model,
            n_heads=n_heads,
            n_layers=n_layers,
            d_ff=d_ff,
            dropout=dropout,
            vocab_size=vocab_size,
        )
        pos = encoder_factory(encoder)(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        pos.match_token_embeddings(scaled=embed_scale)
        self.embed = TokenEmbedding(vocab_size, d_model, scale=embed_scale)
        self.stack = Stack(
            encoder=pos,
            n_layers=n_layers,
            d_model=d_model,
            n_heads=n_heads,
            d_ff=d_ff,
            dropout=dropout,
            causal=True,
            random_positions=random_positions,
            score_budget=_budget(score_budget_mib),
            qkv_bias=qkv_bias,
            modifiers=modifiers,
        )
        _init_weights(self.stack, n_layers)

    @property
    def encoder(self) -> PositionalEncoder:
        return self.stack.encoder

    def new_cache(self, size: int, pad: Tensor | None = None) -> KVCache:
        """An empty static key/value cache for incremental decoding of at most ``size``
        tokens in all (prompt and new ones); ``pad (B,)``: the left padding of prompts of
        different lengths (see :class:`~posenc.model.cache.KVCache`).

        Raises:
            ValueError: ``size`` is not a positive integer, or more positions than the
                encoder can encode.
        """
        cache = KVCache(len(self.stack.layers), size, pad, device=self.embed.weight.device)
        self.encoder.check_length(size)
        return cache

    def forward(
        self,
        ids: Tensor,
        positions: Tensor | None = None,
        *,
        offset: int = 0,
        cache: KVCache | None = None,
    ) -> Tensor:
        """Logits ``(B, T, V)`` for token ids ``(B, T)`` at ``positions`` (default
        ``offset .. offset+T-1``); with a ``cache`` (:meth:`new_cache`), ``ids`` are the
        next tokens after the cached ones."""
        h = self.stack(self.embed(ids), positions, offset=offset, cache=cache)
        return h @ self.embed.weight.T  # tied output layer

    @contextmanager
    def streaming(self, setting: Streaming | None) -> Iterator[None]:
        """StreamingLLM inside the ``with`` block (:mod:`posenc.model.streaming`): every
        query sees the first ``setting.sinks`` tokens and the last ``setting.window``,
        at positions re-indexed inside that cache, in full passes and cached steps
        alike; None: off. The previous setting is restored after the block.

        Raises:
            ValueError: The scheme or the model's attention cannot be re-indexed so
                (:func:`~posenc.model.streaming.refusal`), or the sizes are invalid.
        """
        if setting is not None:
            problem = sizes_problem(setting.sinks, setting.window) or refusal(self)
            if problem:
                raise ValueError(f"streaming: {problem}")
        before, self.stack.streaming = self.stack.streaming, setting
        try:
            yield
        finally:
            self.stack.streaming = before


class EncoderDecoder(nn.Module):
    """Encoder-decoder translator; encoder self-attention is bidirectional, the
    decoder's causal, and decoder blocks cross-attend to the encoder output.

    Args:
        src_vocab_size: Source vocabulary.
        tgt_vocab_size: Target vocabulary.
        encoder: Encoder name or factory; each stack gets its own instance.
        n_layers: Blocks per stack (or use n_enc_layers / n_dec_layers).
        d_model: Width C.
        n_heads: Heads H.
        d_ff: Feed-forward width (default 4C).
        dropout: Dropout probability.
        share_embeddings: One table for source, target and output (joint vocabulary).
        embed_scale: Multiply token embeddings by ``sqrt(C)``.
        n_enc_layers: Encoder blocks (default n_layers).
        n_dec_layers: Decoder blocks (default n_layers).
        random_positions: Train both stacks on random sorted positions from
            ``0 .. N-1`` (Ruoss et al. 2023); decoding uses ``0 .. T-1``. None: off.
        score_budget_mib: CPU query blocking, as in :class:`DecoderLM`.
        qkv_bias: Biases on the q, k and v projections, as in :class:`DecoderLM`.
        qk_norm: QK-norm in every attention, as in :class:`DecoderLM`.
        logit_scale: Every attention's logit scale, as in :class:`DecoderLM`.
        sinks: Sink logits in every attention, as in :class:`DecoderLM`.
        window: Must be None: no sliding window in a translator (its encoder attends
            both ways).
        window_layers: Must be None, as ``window``.

    Raises:
        ValueError: Sizes out of range, or a window.
    """

    #: :meth:`decode` under ``torch.compile``, after :meth:`compile` (else None).
    _compiled_decode: Callable[..., Tensor] | None = None

    def __init__(
        self,
        *,
        src_vocab_size: int,
        tgt_vocab_size: int,
        encoder: str | EncoderFactory,
        n_layers: int = 3,
        d_model: int = 256,
        n_heads: int = 4,
        d_ff: int | None = None,
        dropout: float = 0.1,
        share_embeddings: bool = True,
        embed_scale: bool = True,
        n_enc_layers: int | None = None,
        n_dec_layers: int | None = None,
        random_positions: int | None = None,
        score_budget_mib: float = 8.0,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        logit_scale: str = "none",
        sinks: bool = False,
        window: int | None = None,
        window_layers: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        if window is not None or window_layers is not None:
            raise ValueError(NO_WINDOW_IN_TRANSLATOR.format(window=window))
        d_ff = d_ff or 4 * d_model
        modifiers = Modifiers(qk_norm=qk_norm, logit_scale=logit_scale, sinks=sinks)
        n_enc, n_dec = n_enc_layers or n_layers, n_dec_layers or n_layers
        for v in (src_vocab_size, tgt_vocab_size):
            _check_sizes(
                d_model=d_model,
                n_heads=n_heads,
                n_layers=min(n_enc, n_dec),
                d_ff=d_ff,
                dropout=dropout,
                vocab_size=v,
            )
        if share_embeddings and src_vocab_size != tgt_vocab_size:
            raise ValueError(
                f"share_embeddings needs one joint vocabulary, got source {src_vocab_size} "
                f"and target {tgt_vocab_size}; set share_embeddings=false"
            )
        make = encoder_factory(encoder)
        self.tgt_embed = TokenEmbedding(tgt_vocab_size, d_model, scale=embed_scale)
        self.src_embed = (
            self.tgt_embed
            if share_embeddings
            else TokenEmbedding(src_vocab_size, d_model, scale=embed_scale)
        )

        def positional(n: int) -> PositionalEncoder:
            pos = make(d_model=d_model, n_heads=n_heads, n_layers=n)
            pos.match_token_embeddings(scaled=embed_scale)
            return pos

        shared: dict[str, Any] = dict(
            d_model=d_model,
            n_heads=n_heads,
            d_ff=d_ff,
            dropout=dropout,
            random_positions=random_positions,
            score_budget=_budget(score_budget_mib),
            qkv_bias=qkv_bias,
            modifiers=modifiers,
        )
        self.encoder_stack = Stack(
            encoder=positional(n_enc), n_layers=n_enc, causal=False, **shared
        )
        self.decoder_stack = Stack(
            encoder=positional(n_dec), n_layers=n_dec, causal=True, cross=True, **shared
        )
        _init_weights(self.encoder_stack, n_enc)
        _init_weights(self.decoder_stack, n_dec)

    def new_cache(self, size: int) -> KVCache:
        """An empty static key/value cache of the decoder stack for at most ``size``
        decoder inputs (BOS included).

        Raises:
            ValueError: As :meth:`DecoderLM.new_cache`.
        """
        stack = self.decoder_stack
        cache = KVCache(len(stack.layers), size, device=self.tgt_embed.weight.device)
        stack.encoder.check_length(size)
        return cache

    def encode(
        self, src: Tensor, src_valid: Tensor | None = None, src_positions: Tensor | None = None
    ) -> Tensor:
        """Encoder output ``(B, S, C)`` for source ids ``(B, S)``."""
        return self.encoder_stack(self.src_embed(src), src_positions, valid=src_valid)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``torch.compile`` the forward (in place, as ``nn.Module.compile``) and
        :meth:`decode`, which greedy and beam-search decoding call step by step, with
        the same arguments."""
        super().compile(*args, **kwargs)
        self._compiled_decode = torch.compile(self._decode, *args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # as nn.Module drops its compiled call
        state.pop("_compiled_decode", None)
        return state

    def decode(
        self,
        tgt_in: Tensor,
        memory: Tensor,
        *,
        src_valid: Tensor | None = None,
        tgt_positions: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """Next-token logits ``(B, T, V)`` for decoder input ids ``(B, T)``; with a
        ``cache`` (:meth:`new_cache`), ``tgt_in`` holds the next tokens only. Compiled
        after :meth:`compile` (traced into the forward's graph there)."""
        run = self._decode
        if self._compiled_decode is not None and not torch.compiler.is_compiling():
            run = self._compiled_decode
        return run(tgt_in, memory, src_valid=src_valid, tgt_positions=tgt_positions, cache=cache)

    def _decode(
        self,
        tgt_in: Tensor,
        memory: Tensor,
        *,
        src_valid: Tensor | None = None,
        tgt_positions: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        h = self.decoder_stack(
            self.tgt_embed(tgt_in),
            tgt_positions,
            memory=memory,
            memory_valid=src_valid,
            cache=cache,
        )
        return h @ self.tgt_embed.weight.T

    def forward(self, src: Tensor, tgt_in: Tensor, src_valid: Tensor | None = None) -> Tensor:
        """Teacher-forced logits ``(B, T, V)``.

        Decoder padding needs no key mask: padding sits after the real tokens, and
        the causal mask already keeps real queries from seeing it.
        """
        memory = self.encode(src, src_valid)
        return self.decode(tgt_in, memory, src_valid=src_valid)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters (shared tensors counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
