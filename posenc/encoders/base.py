"""The plug-point contract between positional encoders and the shared transformer.

Notation: B batch, H heads, T query length, S key length, D head dim, C d_model.

A positional scheme is split in two objects:

* :class:`PositionalEncoder`, one per transformer stack. It owns what the whole
  stack shares (tables, global vectors), may act on the token embeddings
  (:meth:`PositionalEncoder.embed`), and once per forward pass fills, in
  :meth:`PositionalEncoder.prepare`, the :class:`AttentionContext` that every layer of
  the stack reads (so tables and gather indices are computed once, not once per
  layer). The context carries what the caller knows of the positions as Python values
  (``starts``, ``bound``): no hook ever reads a tensor back to the host, so the model
  traces as one graph under ``torch.compile``.
* :class:`AttentionPositional`, one per attention module, made by
  :meth:`PositionalEncoder.for_attention`. It owns per-layer parameters and
  implements the hooks that attention calls, always in this order:

  0. ``with_input(x, ctx, key_valid=..., cache=...)`` -> the context this layer's
     other hooks read, grown with what the scheme computes from the block's input ``x``
     (FoX's forget gates): entries put with a query or key dim follow every slice of
     the context (blocks of queries, a cache's new keys);
  1. ``score_bias(q, k, ctx)`` -> additive logits ``(B|1, H|1, T, S)`` or None,
     computed from the *projected* q and k (attention calls ``score_parts``, which
     wraps it unless a scheme hands over its term in column pieces), or, on the
     FlexAttention path, ``score_mod(q, k, ctx)``, the same term read by index from
     small tables;
  2. ``transform_qk(q, k, ctx)`` -> the q and k used for the content score;
  3. the content score ``q @ k^T * scale(D)`` plus the bias, masked, softmaxed;
  4. ``value_term(probs, ctx)`` -> ``(B, H, T, D)`` added to ``probs @ v``
     (only when ``needs_probs`` is true).

:mod:`posenc.model.backends` runs step 3: ``scaled_dot_product_attention`` without a
score term or a value term, FlexAttention for a score term on a GPU, otherwise one
explicit softmax. A scheme adds a score term when it overrides ``score_bias`` or
``score_parts``, which it declares (``score_term = True``: a class that overrides either
without it is refused when it is defined).
A scheme that replaces steps 1-4 (stick-breaking's weights instead of a softmax, a
penalty carried from one query to the next) declares ``owns_attention`` and implements
``attend(q, k, v, ctx, p_drop=..., cache=...)``; inside every hook, ``ctx.key_valid``
and ``ctx.shift`` say which keys each query may see (:meth:`AttentionContext.visible`).
What counts is the softmax of step 3: a scheme may shift a query row of its bias by
one constant, or move a part of its term that is a product with k into q in step 2
(DeBERTa does both, so its bias alone is not the paper's term).

Every hook defaults to "nothing", so a scheme overrides only what it uses.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, ClassVar, Generic, Protocol, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class AttnKind(str, Enum):
    """Which attention a context is for."""

    CAUSAL = "causal"  # decoder self-attention
    BIDIRECTIONAL = "bidirectional"  # encoder self-attention
    CROSS = "cross"  # decoder queries over encoder keys


V = TypeVar("V")


@dataclass(frozen=True)
class Slot(Generic[V]):
    """The typed name of a value one hook leaves for another: in the context (a table
    ``prepare`` builds, a gate ``with_input`` computes) or in a layer's decoding cache (a
    running total). A scheme declares its slots once, at module level, so a misspelt name
    fails at import and a type checker sees each value's type.

    Attributes:
        name: The entry's name, unique within one context or layer cache.
        query_dim: The value's query axis, along which a block of queries cuts it; None
            when it has none.
        key_dim: The value's key axis, along which a block's visible keys (or a cache's
            slots) cut it; None when it has none.
    """

    name: str
    query_dim: int | None = None
    key_dim: int | None = None


@dataclass
class AttentionContext:
    """Per-forward state shared by all layers of one stack for one attention kind.

    What the caller knows of the positions comes as Python values (``starts``,
    ``bound``), never read back from the position tensors: a forward pass makes no host
    read, so it traces as one graph under ``torch.compile`` and never stalls a GPU.

    Attributes:
        q_pos: Query positions, ``(B|1, T)`` int64.
        k_pos: Key positions, ``(B|1, S)`` int64.
        kind: Causal, bidirectional or cross attention.
        starts: ``(q0, k0)`` when the positions are one shared run of consecutive
            integers, ``q_pos = q0 + arange(T)`` and ``k_pos = k0 + arange(S)`` (the
            default positions, at an offset): relative terms can then be read off a
            per-offset table as a strided view (:mod:`posenc.encoders.offsets`). None for
            per-row or randomized positions, which take a per-pair gather.
        bound: Every position is in ``[0, bound)``: the size of a per-distance table
            when ``starts`` is None.
        stable_keys: True when a key's transform (``transform_qk``) depends on its own
            position only, so a key/value cache may keep transformed keys; a scheme whose
            key transform depends on the whole pass (dynamic NTK's base, xPos's centre)
            sets it False in ``prepare``, and a cache then transforms every key again.
        lengths: ``(B|1,)`` int64 when the key axis is a static cache's slots
            (:mod:`posenc.model.cache`): how many keys of each row are written, the rest
            being empty slots that no query sees; a scheme whose transform depends on the
            length of the pass (dynamic NTK) reads it instead of the key count. None: every
            key is real.
        extra: Scheme-specific shared values (tables, gather indices, gates) by
            :class:`Slot` name, put there by :meth:`PositionalEncoder.prepare` or
            :meth:`AttentionPositional.with_input` (:meth:`put`) and read as
            ``ctx[slot]``.
        query_dims: For each entry of ``extra`` indexed by query, the dim that is, so
            attention can cut the context into blocks of queries (see
            :meth:`slice_queries`); :meth:`put` fills it from the slot.
        key_dims: The same for entries indexed by key (see :meth:`slice_keys`).
        memo: Per-forward results a layer computes once and reuses for every block of
            queries (see :meth:`once`). Slices of a context share it.
        key_valid: ``(B, S)`` True for real keys (not padding), or None: set for each
            attention call (:func:`posenc.model.backends.attend`), so a hook can leave
            padding out of what it accumulates (a left-padded prompt's gates).
        shift: The causal offset of the call, query i seeing keys ``j <= i + shift`` by
            index (an int, or a 0-d tensor for a static cache's slot), or None when
            attention is not causal; set with ``key_valid``.
    """

    q_pos: Tensor
    k_pos: Tensor
    kind: AttnKind
    starts: tuple[int, int] | None = None
    bound: int | None = None
    stable_keys: bool = True
    lengths: Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    query_dims: dict[str, int] = field(default_factory=dict)
    key_dims: dict[str, int] = field(default_factory=dict)
    memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    key_valid: Tensor | None = None
    shift: int | Tensor | None = None

    def put(self, slot: Slot[V], value: V) -> None:
        """Store a shared entry; the slot's query or key axis, if any, is where blocks of
        queries (and their visible keys) cut it."""
        self.extra[slot.name] = value
        if slot.query_dim is not None:
            self.query_dims[slot.name] = slot.query_dim
        if slot.key_dim is not None:
            self.key_dims[slot.name] = slot.key_dim

    def __getitem__(self, slot: Slot[V]) -> V:
        """The entry put under ``slot`` (KeyError if none was)."""
        return cast(V, self.extra[slot.name])

    def get(self, slot: Slot[V]) -> V | None:
        """The entry put under ``slot``, or None."""
        return cast(V | None, self.extra.get(slot.name))

    def grown(self) -> AttentionContext:
        """A copy whose entries can be added to without touching this context's (the
        tensors themselves are shared): what :meth:`AttentionPositional.with_input`
        returns."""
        return replace(
            self,
            extra=dict(self.extra),
            query_dims=dict(self.query_dims),
            key_dims=dict(self.key_dims),
        )

    def slice_queries(self, start: int, stop: int) -> AttentionContext:
        """The context of queries ``start:stop`` only (keys unchanged)."""
        stop = min(stop, self.q_pos.shape[-1])
        extra = dict(self.extra)
        for key, dim in self.query_dims.items():
            extra[key] = extra[key].narrow(dim, start, stop - start)
        starts = None if self.starts is None else (self.starts[0] + start, self.starts[1])
        return replace(self, q_pos=self.q_pos[:, start:stop], extra=extra, starts=starts)

    def slice_keys(self, stop: int) -> AttentionContext:
        """The context of the first ``stop`` keys only (queries unchanged): what a block
        of causal queries can see."""
        return self.key_range(0, stop)

    def tail_keys(self, n: int) -> AttentionContext:
        """The context of the last ``n`` keys only (queries unchanged): the keys a cached
        decoding step adds."""
        s = self.k_pos.shape[-1]
        return self.key_range(s - n, s)

    def key_range(self, start: int, stop: int) -> AttentionContext:
        """The context of keys ``start:stop`` only (queries unchanged, ``stop`` clipped to
        S): what a block of queries with a sliding window can see. ``shift`` is left to
        the caller (it counts key slots from the first key kept)."""
        stop = min(stop, self.k_pos.shape[-1])
        extra = dict(self.extra)
        for key, dim in self.key_dims.items():
            extra[key] = extra[key].narrow(dim, start, stop - start)
        starts = None if self.starts is None else (self.starts[0], self.starts[1] + start)
        valid = None if self.key_valid is None else self.key_valid[:, start:stop]
        return replace(
            self, k_pos=self.k_pos[:, start:stop], extra=extra, starts=starts, key_valid=valid
        )

    def keys_at(self, index: Tensor) -> AttentionContext:
        """The context of the keys at ``index`` only, ``(n,)`` int64 (queries unchanged):
        the keys a step of a static cache writes, at slots given as a tensor (no host
        read). Per-pair from then on (``starts`` None)."""
        extra = dict(self.extra)
        for key, dim in self.key_dims.items():
            extra[key] = extra[key].index_select(dim, index)
        k_pos = self.k_pos.index_select(1, index)
        valid = None if self.key_valid is None else self.key_valid.index_select(1, index)
        return replace(self, k_pos=k_pos, extra=extra, starts=None, key_valid=valid)

    def once(self, owner: nn.Module, name: str, make: Any) -> Any:
        """``make()`` computed once per forward pass for ``owner``, e.g. a layer's
        projection of a shared table that every block of queries reads. The context
        lives one forward pass, so the result never outlives the weights it used."""
        return self.shared((id(owner), name), make)

    def shared(self, key: Any, make: Any) -> Any:
        """``make()`` computed once per forward pass under ``key`` for every layer and
        block of queries: what depends on the pass alone, such as the attention mask
        (:func:`posenc.model.backends.block_mask`)."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def offset_range(self) -> tuple[int, int]:
        """Smallest and largest key-minus-query offset ``n = k_pos[j] - q_pos[i]`` a
        relative table must cover for :func:`offset_view` (needs ``starts``).

        Bidirectional: every pair's offset. Causal: from the smallest offset up to 1
        only, since keys past the query (n > 0) are masked; the one extra offset keeps
        the view's rows from overlapping (see :func:`offset_view`).
        """
        if self.starts is None:
            raise ValueError("offset_range needs consecutive positions (ctx.starts)")
        (q0, k0), t, s = self.starts, self.q_pos.shape[-1], self.k_pos.shape[-1]
        lo, hi = k0 - (q0 + t - 1), k0 + s - 1 - q0
        if self.kind is AttnKind.CAUSAL:
            hi = max(lo, min(hi, 1))
        return lo, hi

    def toeplitz_range(self) -> tuple[int, int]:
        """:meth:`offset_range` for a per-head table read through
        :func:`~posenc.encoders.offsets.toeplitz`: causal attention with fewer queries
        than keys (a block of queries, the rows before FIRE's threshold) widened to
        ``S + 1`` offsets, the width the view needs to fit. The extra offsets are masked
        keys' (a table holds finite values there); without them the caller would gather
        per pair, whose backward on a GPU (an index_put over ``T * S`` indices into a few
        thousand entries) took 3.6 s of a 3.7 s training step at 4x4096."""
        lo, hi = self.offset_range()
        if self.kind is AttnKind.CAUSAL and self.starts is not None:
            (q0, k0), s = self.starts, self.k_pos.shape[-1]
            hi = max(hi, min(lo + s, k0 + s - 1 - q0))
        return lo, hi

    def distance_range(self) -> tuple[int, int]:
        """Smallest and largest query-minus-key distance ``i - j`` of any pair, as Python
        ints: exact from ``starts``, else the widest ``bound`` allows."""
        if self.starts is not None:
            (q0, k0), t, s = self.starts, self.q_pos.shape[-1], self.k_pos.shape[-1]
            return q0 - (k0 + s - 1), q0 + t - 1 - k0
        if self.bound is None:
            raise ValueError("distance_range needs ctx.starts or ctx.bound")
        return -(self.bound - 1), self.bound - 1

    def own_key(self) -> int | Tensor:
        """The index among the keys of query 0's own token: :attr:`shift`, or ``S - T``
        without a causal shift (a 0-d tensor in a cached step; an int in a full pass)."""
        return self.k_pos.shape[-1] - self.q_pos.shape[-1] if self.shift is None else self.shift

    def key_offsets(self) -> Tensor:
        """``(T, S)`` int64: key index minus the index of the query's own token among the
        keys (``i +`` :meth:`own_key`): 0 at its own token, negative for earlier keys. No
        host read."""
        t, s = self.q_pos.shape[-1], self.k_pos.shape[-1]
        device = self.q_pos.device
        i = torch.arange(t, device=device)[:, None]
        j = torch.arange(s, device=device)[None, :]
        return j - (i + self.own_key())

    def visible(self) -> Tensor:
        """``(B|1, 1, T, S)`` bool: the keys each query may see in this call, by index
        (causality from :attr:`shift`) and :attr:`key_valid`."""
        t, s = self.q_pos.shape[-1], self.k_pos.shape[-1]
        ok = torch.ones(1, 1, t, s, dtype=torch.bool, device=self.q_pos.device)
        if self.shift is not None:
            ok = ok & (self.key_offsets() <= 0)
        if self.key_valid is not None:
            ok = ok & self.key_valid[:, None, None, :]
        return ok

    def rel(self) -> Tensor:
        """Relative distance ``i - j`` (query minus key position), ``(B|1, T, S)``."""
        return self.q_pos[:, :, None] - self.k_pos[:, None, :]


#: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score``.
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

ScoreParts = list[tuple[Tensor, int]]
"""A score term as parts: ``(term (B|1, H|1, T, n), c0)`` adds ``term`` onto the score
columns ``c0 .. c0 + n - 1``. One ``(term, 0)`` of width S is a plain ``(T, S)`` term;
several parts let a scheme add, e.g., per-block terms without first summing them into
a ``(T, S)`` tensor of their own."""


def dense_parts(parts: ScoreParts, s: int) -> Tensor:
    """The ``(B|1, H|1, T, S)`` sum of score parts (for consumers of one tensor)."""
    out = None
    for term, c0 in parts:
        full = F.pad(term, (c0, s - c0 - term.shape[-1]))
        out = full if out is None else out + full
    if out is None:
        raise ValueError("dense_parts: no score parts")
    return out


class AttentionPositional(nn.Module):
    """Per-attention-module hooks; the base class does nothing at every hook."""

    #: True when the scheme needs the attention probabilities (a value term);
    #: attention then takes its explicit-softmax path instead of the fused kernel.
    needs_probs: bool = False
    #: True when FlexAttention also trains the scheme on a GPU (its backward beats the
    #: explicit path). No scheme does yet: on an H200 (torch 2.11, bf16, 4x4096,
    #: docs/performance.md) ALiBi's training step ran at 0.66x ``none``'s through
    #: FlexAttention and 0.88x through the explicit path, T5's at 0.04x and 0.68x;
    #: DeBERTa's at 0.29x through FlexAttention, and FIRE's did not compile. A term
    #: whose gradient lands in a small table (a value per bucket or offset, a few
    #: scalars) gets it from every (query, key) pair by atomic adds, which serialise.
    #: So on a GPU every scheme trains through the explicit path (SDPA with the term as
    #: an additive mask) and evaluates and decodes through FlexAttention, which never
    #: writes the ``(B, H, T, S)`` scores; ``bench.py --sections flex`` measures both.
    flex_trains: bool = False

    #: Declared by a scheme that adds a score term (overrides ``score_bias`` or
    #: ``score_parts``; checked when the class is defined).
    score_term: ClassVar[bool] = False
    #: Declared by a scheme that replaces the attention computation itself
    #: (:meth:`attend`): stick-breaking's weights, selective attention's carried penalty.
    owns_attention: ClassVar[bool] = False
    #: Declared by a scheme whose ``transform_qk`` returns q and k wider than ``D``
    #: (Transformer-XL's folded position term): the heads' widths then differ.
    widens_qk: ClassVar[bool] = False

    @property
    def scheme(self) -> str:
        """The scheme these hooks belong to, as a message names it (a wrapper, such as a
        mix's layer, names the scheme it wraps)."""
        return type(self).__name__.lstrip("_")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        overrides = [
            name
            for name in ("score_bias", "score_parts")
            if getattr(cls, name) is not getattr(AttentionPositional, name)
        ]
        if overrides and not cls.score_term:
            raise TypeError(
                f"{cls.__name__} overrides {' and '.join(overrides)} but does not declare "
                f"score_term = True; declare it, so attention and the tests know"
            )
        if cls.owns_attention and cls.attend is AttentionPositional.attend:
            raise TypeError(f"{cls.__name__} declares owns_attention but has no attend()")

    def init_weights(self) -> None:
        """Hook: the scheme's own initialisation of the weights it holds here, called once
        by the model when it initialises its stack, at this module's place in module
        order (so the random draws keep the model's order). The stack's initialisation
        never touches a scheme's weights. Default: nothing (weights set at construction,
        or none)."""

    @property
    def adds_scores(self) -> bool:
        """Whether the scheme materialises ``(B, H, T, S)`` terms (a score term, the
        probabilities, or its own attention); attention then works through the queries
        in blocks when that matrix would be large."""
        return self.needs_probs or self.score_term

    def scale(self, head_dim: int) -> float:
        """Multiplier of the content score ``q @ k^T`` (and of nothing else)."""
        return head_dim**-0.5

    def score_bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor | None:
        """Additive attention logits, already in the units of the scaled score.

        Args:
            q: Projected queries ``(B, H, T, D)``.
            k: Projected keys ``(B, H, S, D)``.
            ctx: The stack's shared context.

        Returns:
            ``(B|1, H|1, T, S)`` or None.
        """
        return None

    def score_parts(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreParts | None:
        """The score term as :data:`ScoreParts`, what attention calls. By default the one
        part ``(score_bias(q, k, ctx), 0)``; a scheme whose term is naturally a sum of
        pieces on column ranges overrides it (and makes ``score_bias`` their sum)."""
        bias = self.score_bias(q, k, ctx)
        return None if bias is None else [(bias, 0)]

    def score_mod(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreMod | None:
        """The score term as a FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)``
        that reads small tables built here from q and k (the GPU path, see
        :mod:`posenc.model.backends`); it must add what :meth:`score_parts` adds. None:
        the scheme has no such form, and attention uses the explicit path."""
        return None

    def transform_qk(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        """Return the queries and keys that enter the content score."""
        return q, k

    def value_term(self, probs: Tensor, ctx: AttentionContext) -> Tensor | None:
        """Extra output ``(B, H, T, D)`` from the probabilities ``(B, H, T, S)``."""
        return None

    def transform_kv(
        self,
        x: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        key_valid: Tensor | None,
        cache: Any | None,
    ) -> tuple[Tensor, Tensor]:
        """The new tokens' keys and values of self-attention, right after projection and
        before anything else sees them (a cache stores what this returns): FoX Pro's
        shift towards the previous token's.

        Args:
            x: The block's normalised input ``(B, T, C)`` (the new tokens, with a cache).
            k: Projected keys ``(B, H, T, D)`` of those tokens.
            v: Projected values ``(B, H, T, D)``.
            key_valid: As for :meth:`with_input` (over all S slots in a cached step).
            cache: This layer's cache, or None; state carried from one step to the
                next goes there under the scheme's own names.
        """
        return k, v

    def transform_output(self, x: Tensor, out: Tensor) -> Tensor:
        """The attention output ``out (B, H, T, D)`` before the heads are merged and
        projected, given the block's normalised input ``x (B, T, C)`` of the same
        queries: FoX Pro's output normalisation and gate."""
        return out

    def with_input(
        self,
        x: Tensor,
        ctx: AttentionContext,
        *,
        key_valid: Tensor | None,
        cache: Any | None,
    ) -> AttentionContext:
        """The context this layer's other hooks read, from the block's input.

        Called once per forward pass (or decoding step) by each attention module, before
        anything else, with its input ``x (B, T, C)`` (the new tokens only, with a
        cache). A scheme that reads the content of the tokens (FoX's forget gate)
        returns ``ctx`` with its per-layer entries added (:meth:`AttentionContext.put`
        on a copy, with the query and key dims, so blocks of queries and a cache's new
        keys get their slices); its running state across decoding steps goes in the
        layer's cache (:class:`posenc.model.cache.LayerCache`, under the scheme's own
        names; ``cache.at`` holds the new tokens' slots).

        Args:
            x: The block's normalised input ``(B, T, C)``.
            ctx: The stack's shared context (the same object for every layer).
            key_valid: ``(B, S)`` True for real keys, or None (in a cached step, over all
                S slots).
            cache: This layer's :class:`~posenc.model.cache.LayerCache`, or None.
        """
        return ctx

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        ctx: AttentionContext,
        *,
        p_drop: float,
        cache: Any | None,
    ) -> Tensor:
        """The whole attention of a scheme that declares :attr:`owns_attention`:
        ``(B, H, T, D)`` from projected ``q (B, H, T, D)``, ``k`` and ``v (B, H, S, D)``
        (keys as :meth:`transform_qk` leaves them); ``ctx.visible()`` says which keys
        each query may see, and ``cache`` is the layer's cache in a decoding step (or
        None), for state carried from one step to the next."""
        raise NotImplementedError(f"{type(self).__name__}.attend")


class Constrained(nn.Module):
    """Parameters that live in a set an optimizer step can leave (KERPLE's r > 0): the
    training loop calls :meth:`project_` right after every optimizer step, so every
    forward pass, validation and checkpoint sees values inside the set."""

    def project_(self) -> None:
        """Bring the parameters back into their set, in place."""
        raise NotImplementedError


class PositionalEncoder(nn.Module):
    """One per stack. Subclasses take keyword arguments ``d_model``, ``n_heads``,
    ``n_layers`` (filled in by the model builder) plus their own settings."""

    #: The registry name, set by :func:`posenc.encoders.registry.register`.
    name: ClassVar[str]
    # What a scheme declares about itself. The conformance tests read these, so a new
    # scheme is checked for what it claims without a list in the tests to edit.
    #: True for schemes whose attention scores depend only on relative positions.
    relative: bool = False
    #: False only for a scheme that ignores positions altogether (NoPE).
    uses_positions: bool = True
    #: A scheme that is relative only while positions stay below a learned bound (FIRE's
    #: threshold L) names that bound's parameter here; ``relative`` is then False.
    relative_below: str | None = None
    #: True for schemes defined for causal attention only (subclasses of
    #: :class:`CausalOnly`): they raise ValueError for bidirectional attention, so
    #: translation (an encoder stack) cannot use them.
    causal_only: bool = False
    #: Longest sequence the scheme can encode, or None for no limit.
    max_length: int | None = None
    #: True for schemes whose positions depend on the content (FoX's forget gates,
    #: CoPE's counted gates, stick-breaking, selective attention): their score terms are
    #: computed from the tokens, not read off a table of positions.
    data_dependent: bool = False

    @property
    def pass_dependent(self) -> bool:
        """True when a token's representation depends on the length of the whole pass,
        not on positions alone (dynamic NTK: the base follows the length). The hidden
        states a key/value cache keeps would then be stale once the length changes, so
        a cached step runs the stack over every slot again (:mod:`posenc.model.cache`)."""
        return False

    #: Context-extension methods the scheme can apply to a trained model at evaluation
    #: time (RoPE: linear, ntk, dynamic_ntk, yarn). A scheme that lists any must provide
    #: ``scaled(method, factor, original_length)``, a context manager that applies the
    #: method inside the ``with`` block and restores the previous setting after it.
    scaling_methods: tuple[str, ...] = ()

    def __init__(self, *, d_model: int, n_heads: int, n_layers: int) -> None:
        super().__init__()
        if d_model <= 0 or n_heads <= 0 or n_layers <= 0:
            raise ValueError(
                f"d_model, n_heads and n_layers must be positive, got {d_model}, {n_heads}, "
                f"{n_layers}"
            )
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_layers = n_layers
        self.head_dim = head_dim(d_model, n_heads)

    def check_length(self, bound: int) -> None:
        """Refuse positions reaching ``bound`` (exclusive) that the scheme cannot encode.
        Called by the stack before the forward pass, with Python ints only.

        Raises:
            ValueError: ``bound`` exceeds :attr:`max_length`.
        """
        if self.max_length is not None and bound > self.max_length:
            raise ValueError(
                f"{type(self).__name__}: positions up to {bound - 1} but it encodes at most "
                f"{self.max_length}; evaluate at lengths <= {self.max_length}"
            )

    def match_token_embeddings(self, *, scaled: bool) -> None:
        """Told once by the model, before training, whether the token embeddings that
        :meth:`embed` receives are multiplied by ``sqrt(C)`` (``model.embed_scale``,
        Vaswani et al. 2017, section 3.4), so that a table added to them can take the
        size its convention gives it next to them. Default: nothing."""

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        """Hook (a): act on token embeddings ``x (B, T, C)`` at ``positions (B|1, T)``."""
        return x

    def context(
        self,
        q_pos: Tensor,
        k_pos: Tensor,
        kind: AttnKind,
        *,
        starts: tuple[int, int] | None = None,
        bound: int | None = None,
        lengths: Tensor | None = None,
    ) -> AttentionContext:
        """Build the shared per-forward state for one attention kind of the stack.

        Args:
            q_pos: ``(B|1, T)`` query positions.
            k_pos: ``(B|1, S)`` key positions.
            kind: The attention kind.
            starts: ``(q0, k0)`` when both are consecutive runs (see
                :class:`AttentionContext`); the stack passes it for its default positions.
            bound: Exclusive upper bound of all positions. When neither is given (a
                direct call with explicit positions) it is read off the tensors: one
                host read, for eager use; the stack always passes one or the other.
            lengths: ``(B|1,)`` written keys of a static cache's slots (see
                :class:`AttentionContext`); None when every key is real.
        """
        if starts is None and bound is None:
            bound = position_bound(q_pos, k_pos)
        ctx = AttentionContext(
            q_pos=q_pos, k_pos=k_pos, kind=kind, starts=starts, bound=bound, lengths=lengths
        )
        self.prepare(ctx)
        return ctx

    def prepare(self, ctx: AttentionContext) -> None:
        """Hook: put what every layer shares into ``ctx`` (:meth:`AttentionContext.put`),
        once per forward pass and attention kind (``ctx.kind``)."""

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        """Make the per-layer hooks for attention module ``layer`` of ``kind``."""
        return AttentionPositional()


def normal_linears(module: nn.Module, std: float = 0.02) -> None:
    """N(0, ``std``) weights and zero biases for every ``nn.Linear`` under ``module``, in
    module order: the initialisation of the reference code of Transformer-XL
    (``init_std`` 0.02), DeBERTa and PaTH (``initializer_range`` 0.02)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class CausalOnly(PositionalEncoder):
    """A scheme defined for causal attention only: its positions run from each key up to
    the query after it, an order that an encoder's keys do not have. It refuses
    bidirectional attention with :attr:`causal_reason` (so a translation model fails at
    construction, and the config checks before any data) and adds nothing to
    cross-attention. A subclass writes :meth:`causal_hooks` and, for per-pass state,
    :meth:`prepare_causal`."""

    causal_only = True
    #: Why, one clause completing "bidirectional (encoder) self-attention was requested,
    #: but ...".
    causal_reason: ClassVar[str]
    #: What a translation model can use instead.
    causal_instead: ClassVar[str] = "another encoder for task=mt (alibi, rope, t5, ...)"

    def bidirectional_refusal(self) -> ValueError:
        """The one-line refusal: the scheme, the reason and what to use instead."""
        return ValueError(
            f"{self.name} is causal only: bidirectional (encoder) self-attention was "
            f"requested, but {self.causal_reason}. Use encoder={self.name} with task=lm or "
            f"task=algo (decoder-only), or {self.causal_instead}."
        )

    def prepare(self, ctx: AttentionContext) -> None:
        if ctx.kind is AttnKind.BIDIRECTIONAL:
            raise self.bidirectional_refusal()
        if ctx.kind is AttnKind.CAUSAL:
            self.prepare_causal(ctx)

    def prepare_causal(self, ctx: AttentionContext) -> None:
        """Hook: :meth:`PositionalEncoder.prepare` for causal self-attention only."""

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        if kind is AttnKind.BIDIRECTIONAL:
            raise self.bidirectional_refusal()
        if kind is AttnKind.CROSS:
            return AttentionPositional()
        return self.causal_hooks(layer=layer)

    def causal_hooks(self, *, layer: int) -> AttentionPositional:
        """Hook: :meth:`PositionalEncoder.for_attention` for causal self-attention."""
        raise NotImplementedError(f"{type(self).__name__}.causal_hooks")


class Scalable(Protocol):
    """What a scheme with :attr:`PositionalEncoder.scaling_methods` provides: ``scaled``
    applies a context-extension method for the duration of a ``with`` block."""

    def scaled(
        self, method: str, factor: float = 1.0, original_length: int | None = None
    ) -> AbstractContextManager[None]: ...


def head_dim(d_model: int, n_heads: int) -> int:
    """D, the width of one head, for modules built with these sizes (a run's config is
    refused before, in one line, by :func:`posenc.config.validate`).

    Raises:
        ValueError: ``n_heads`` does not divide ``d_model``.
    """
    if d_model % n_heads:
        raise ValueError(
            f"n_heads={n_heads} must divide d_model={d_model}; pick a divisor of {d_model}"
        )
    return d_model // n_heads


def position_bound(*positions: Tensor) -> int:
    """``1 + max`` over explicit position tensors: one host read, for callers that pass
    explicit positions without saying their bound (tests, eager use). The model never
    calls it on its own paths: default positions have ``starts``, randomized ones the
    range they were drawn from."""
    return 1 + max([int(torch.max(p)) for p in positions if p.numel()] + [0])


def positions_like(x: Tensor, offset: int = 0) -> Tensor:
    """Default positions ``offset .. offset+T-1`` for ``x (B, T, ...)``, shape ``(1, T)``."""
    return torch.arange(offset, offset + x.shape[1], device=x.device)[None]
