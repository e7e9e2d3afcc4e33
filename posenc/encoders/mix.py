"""A mix of positional schemes: one per layer of the stack, or one per group of heads.

Notation: B batch, H heads, G head groups, T queries, S keys, D head dim.

``layers=[rope, rope, rope, none]`` gives layer i the scheme of entry ``i % 4`` (RoPE
with NoPE every fourth layer, as Llama 4 and SmolLM3); ``heads=[rope, none]`` splits
every layer's H heads into G equal contiguous groups, group g using entry g (as
x-transformers' ``rotate_num_heads``). An entry is a scheme's name or a mapping with its
options, ``{name: rope, base: 1000000}``.

Equal entries are one member scheme, built once with the stack's sizes (in a head
split: with ``n_heads = H / G`` and ``d_model = C / G``, a stack of those heads alone),
so what the scheme shares across layers it shares across the layers that use it; each
layer's hooks come from ``member.for_attention`` with the layer's own index. Each member
prepares its own context once per pass, and its entries go into the stack's context
under the member's prefix (two RoPEs of different bases both name a table ``cos``): a
layer's hooks read their member's entries back under the names the member gave them
(:func:`member_view`). A mix of one scheme is that scheme, weight for weight and bit
for bit.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from posenc.encoders import registry
from posenc.encoders.base import (
    AttentionContext,
    AttentionPositional,
    AttnKind,
    PositionalEncoder,
    ScoreMod,
    ScoreParts,
    Slot,
    dense_parts,
)
from posenc.errors import suggest

#: For each member, the names of its context entries and whether its keys are stable.
MEMBERS: Slot[tuple[tuple[tuple[str, ...], bool], ...]] = Slot("mix.members")

#: A mix entry: the scheme's name and its options.
Entry = tuple[str, dict[str, Any]]


def _prefix(member: int) -> str:
    return f"mix.{member}/"


def member_view(ctx: AttentionContext, member: int) -> AttentionContext:
    """The context ``member`` prepared, as it named its entries, read out of the stack's
    context (or a slice of it); a context that is already a member's comes back as is.
    Its memo is the member's own for the pass, so what it keeps there never meets
    another member's."""
    members = ctx.get(MEMBERS)
    if members is None:
        return ctx
    names, stable = members[member]
    pre = _prefix(member)
    extra = {n: ctx.extra[pre + n] for n in names}
    q_dims = {n: ctx.query_dims[pre + n] for n in names if pre + n in ctx.query_dims}
    k_dims = {n: ctx.key_dims[pre + n] for n in names if pre + n in ctx.key_dims}
    memo = ctx.shared(("mix", member), dict)
    return replace(
        ctx, extra=extra, query_dims=q_dims, key_dims=k_dims, stable_keys=stable, memo=memo
    )


def parse_entries(key: str, entries: Any) -> list[Entry]:
    """``encoder.layers`` or ``encoder.heads`` as ``(name, options)`` pairs, each name a
    scheme that can be mixed and each option one its class takes.

    Raises:
        ValueError: One line naming the entry, what is allowed and the fix.
    """
    if isinstance(entries, str) or not isinstance(entries, Sequence):
        raise ValueError(f"{key}={entries!r}: must be a list of schemes, e.g. {key}=[rope,none]")
    if not len(entries):
        raise ValueError(f"{key}=[]: must list at least one scheme, e.g. {key}=[rope,none]")
    return [_entry(f"{key}[{i}]", e) for i, e in enumerate(entries)]


def _entry(key: str, entry: Any) -> Entry:
    if isinstance(entry, Mapping):
        options = {str(k): v for k, v in entry.items()}
        name = options.pop("name", None)
        if not isinstance(name, str):
            raise ValueError(
                f"{key}={dict(entry)!r}: a mapping names its scheme, e.g. "
                f"{{name: rope, base: 1000000}}"
            )
    elif isinstance(entry, str):
        name, options = entry, {}
    else:
        raise ValueError(f"{key}={entry!r}: a scheme's name or {{name: <scheme>, <option>: ...}}")
    cls = _mixable(key, name)
    allowed = [p for p in inspect.signature(cls.__init__).parameters if p not in _SIZES + ("self",)]
    for option in options:
        if option not in allowed:
            raise ValueError(
                f"{key}.{option}: {name} has no option {option!r}; allowed: "
                f"{', '.join(allowed) or 'none'}"
            )
    return name, options


_SIZES = ("d_model", "n_heads", "n_layers")

#: The mix when neither ``layers`` nor ``heads`` is given: RoPE with NoPE every fourth
#: layer (Llama 4's iRoPE, SmolLM3).
DEFAULT_LAYERS = ("rope", "rope", "rope", "none")


def mixable() -> list[str]:
    """The schemes a mix can hold: every registered one but the mix itself and those
    that add to the token embeddings."""
    return [n for n in registry.available() if n != "mix" and not _embeds(registry.get(n))]


def _embeds(cls: type[PositionalEncoder]) -> bool:
    return cls.embed is not PositionalEncoder.embed


def _mixable(key: str, name: str) -> type[PositionalEncoder]:
    if name == "mix":
        raise ValueError(f"{key}='mix': a mix cannot hold a mix; list its schemes instead")
    if name not in registry.available():
        raise ValueError(
            f"{key}={name!r}: unknown scheme; {suggest(name, mixable())}"
            f"allowed: {', '.join(mixable())}"
        )
    cls = registry.get(name)
    if _embeds(cls):
        raise ValueError(
            f"{key}={name!r}: adds to the token embeddings, once per stack, not per layer or "
            f"head, so it cannot be mixed; use it alone (encoder={name}) or pick from "
            f"{', '.join(mixable())}"
        )
    return cls


def _same(a: Entry, b: Entry) -> bool:
    return a[0] == b[0] and repr(sorted(a[1].items())) == repr(sorted(b[1].items()))


@registry.register("mix")
class Mix(PositionalEncoder):
    """Positional schemes mixed across layers or heads (see the module docstring).

    Args:
        d_model: Width C. n_heads: Heads H. n_layers: Layers of the stack.
        layers: Per layer, cycled: a scheme's name or ``{name: ..., <option>: ...}``.
        heads: Per group of heads, in every layer (G entries, G dividing H); not with
            ``layers``. Neither given: ``layers`` = :data:`DEFAULT_LAYERS`.

    Raises:
        ValueError: An entry that names no scheme that can be mixed, or an option its
            scheme does not take; both or neither of ``layers`` and ``heads``; a head
            split that does not divide the heads, or a scheme in it that computes from
            the tokens.
    """

    # The class declares what the default mix (conf/encoder/mix.yaml: RoPE with NoPE
    # every fourth layer) is, which the tests group schemes by; an instance declares
    # what its own members are.
    relative = True

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_layers: int,
        layers: Sequence[Any] | None = None,
        heads: Sequence[Any] | None = None,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if layers is not None and heads is not None:
            raise ValueError(
                f"encoder=mix: set one of encoder.layers=[...] (a scheme per layer) and "
                f"encoder.heads=[...] (a scheme per group of heads), not both (got "
                f"layers={layers!r}, heads={heads!r})"
            )
        if heads is None and layers is None:
            layers = DEFAULT_LAYERS
        key = "encoder.layers" if heads is None else "encoder.heads"
        entries = parse_entries(key, layers if heads is None else heads)
        groups = len(entries) if heads is not None else 1
        if n_heads % groups:
            raise ValueError(
                f"encoder.heads lists {groups} schemes but model.n_heads={n_heads}: the heads "
                f"split into equal groups, so list a number of schemes that divides {n_heads}"
            )
        distinct: list[Entry] = []
        self.slot_member: list[int] = []  # per layer (or group) of the list: its member
        for entry in entries:
            found = [i for i, e in enumerate(distinct) if _same(e, entry)]
            if not found:
                distinct.append(entry)
            self.slot_member.append(found[0] if found else len(distinct) - 1)
        self.split_heads = heads is not None
        if self.split_heads:
            for i, (name, _) in enumerate(entries):
                if registry.get(name).data_dependent:
                    raise ValueError(_token_refusal(f"encoder.heads[{i}]", name))
        sizes = dict(d_model=d_model // groups, n_heads=n_heads // groups, n_layers=n_layers)
        self.names = [name for name, _ in distinct]
        built = []
        for m, (name, options) in enumerate(distinct):
            try:
                built.append(registry.build(name, **sizes, **options))
            except (ValueError, TypeError) as err:  # named by the entry it first came from
                raise type(err)(f"{key}[{self.slot_member.index(m)}]: {err}") from None
        self.members = nn.ModuleList(built)  # trained and saved with the model
        self.schemes = built  # the same modules, typed
        self._declare(built)

    def _declare(self, members: list[PositionalEncoder]) -> None:
        """What the mix is, from what its members are."""
        positional = [m for m in members if m.uses_positions]
        self.uses_positions = bool(positional)
        below = [m.relative_below for m in positional if m.relative_below]
        self.relative = bool(positional) and not below and all(m.relative for m in positional)
        self.relative_below = (
            below[0] if below and all(m.relative or m.relative_below for m in positional) else None
        )
        self.causal_only = any(m.causal_only for m in members)
        self.data_dependent = any(m.data_dependent for m in members)
        limits = [m.max_length for m in members if m.max_length is not None]
        self.max_length = min(limits) if limits else None

    @property
    def pass_dependent(self) -> bool:
        return any(m.pass_dependent for m in self.schemes)

    def check_length(self, bound: int) -> None:
        for member in self.schemes:
            member.check_length(bound)

    def match_token_embeddings(self, *, scaled: bool) -> None:
        for member in self.schemes:
            member.match_token_embeddings(scaled=scaled)

    def prepare(self, ctx: AttentionContext) -> None:
        """Each member's own context, its entries put under the member's prefix."""
        record = []
        for i, member in enumerate(self.schemes):
            own = replace(ctx, extra={}, query_dims={}, key_dims={}, memo={})
            member.prepare(own)
            pre = _prefix(i)
            ctx.extra.update({pre + n: v for n, v in own.extra.items()})
            ctx.query_dims.update({pre + n: d for n, d in own.query_dims.items()})
            ctx.key_dims.update({pre + n: d for n, d in own.key_dims.items()})
            record.append((tuple(own.extra), own.stable_keys))
        ctx.stable_keys = all(stable for _, stable in record)
        ctx.put(MEMBERS, tuple(record))

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        if kind is AttnKind.BIDIRECTIONAL:
            self._refuse_causal_only()
        if not self.split_heads:
            member = self.slot_member[layer % len(self.slot_member)]
            return layer_hooks(self.schemes[member].for_attention(layer=layer, kind=kind), member)
        hooks = []
        for g, member in enumerate(self.slot_member):
            made = self.schemes[member].for_attention(layer=layer, kind=kind)
            if _reads_tokens(made):
                raise ValueError(_token_refusal(f"encoder.heads[{g}]", self.names[member]))
            hooks.append((made, member))
        if all(type(h) is AttentionPositional for h, _ in hooks):
            return AttentionPositional()
        return HeadSplit(hooks, head_dim=self.head_dim)

    def _refuse_causal_only(self) -> None:
        for name, member in zip(self.names, self.schemes, strict=True):
            if member.causal_only:
                raise ValueError(
                    f"encoder=mix holds {name}, which is causal only, so it cannot be in an "
                    f"encoder stack (bidirectional self-attention, task=mt or an "
                    f"encoder-decoder); drop {name} from the mix or run task=lm"
                )


def _token_refusal(key: str, name: str) -> str:
    return (
        f"{key}={name!r}: computes from the tokens (its own per-layer state or attention), "
        f"so it cannot share a layer's heads; mix it per layer with encoder.layers=[...]"
    )


def _reads_tokens(hooks: AttentionPositional) -> bool:
    """Hooks that see more than one group's q, k and v (the block's input, its own
    attention, the output): a head split cannot hand them their heads alone."""
    base = AttentionPositional
    own = [
        n
        for n in ("with_input", "transform_kv", "transform_output")
        if getattr(type(hooks), n) is not getattr(base, n)
    ]
    return bool(own) or hooks.owns_attention


def layer_hooks(inner: AttentionPositional, member: int) -> AttentionPositional:
    """A layer's hooks of ``member``, reading the member's own context (hooks that do
    nothing, cross-attention's of most schemes, as they are)."""
    if type(inner) is AttentionPositional:
        return inner
    cls = OwningLayerHooks if inner.owns_attention else LayerHooks
    return cls(inner, member)


class LayerHooks(AttentionPositional):
    """One member's hooks for a layer: each hook reads the member's own context."""

    score_term = True  # as the inner hooks' (adds_scores says whether they have one)

    def __init__(self, inner: AttentionPositional, member: int) -> None:
        super().__init__()
        self.inner = inner
        self.member = member
        self.needs_probs = inner.needs_probs
        self.flex_trains = inner.flex_trains

    @property
    def scheme(self) -> str:
        return self.inner.scheme

    def init_weights(self) -> None:
        self.inner.init_weights()

    @property
    def adds_scores(self) -> bool:
        return self.inner.adds_scores

    def scale(self, head_dim: int) -> float:
        return self.inner.scale(head_dim)

    def _own(self, ctx: AttentionContext) -> AttentionContext:
        return member_view(ctx, self.member)

    def with_input(
        self, x: Tensor, ctx: AttentionContext, *, key_valid: Tensor | None, cache: Any | None
    ) -> AttentionContext:
        return self.inner.with_input(x, self._own(ctx), key_valid=key_valid, cache=cache)

    def score_bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor | None:
        return self.inner.score_bias(q, k, self._own(ctx))

    def score_parts(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreParts | None:
        return self.inner.score_parts(q, k, self._own(ctx))

    def score_mod(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreMod | None:
        return self.inner.score_mod(q, k, self._own(ctx))

    def transform_qk(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        return self.inner.transform_qk(q, k, self._own(ctx))

    def value_term(self, probs: Tensor, ctx: AttentionContext) -> Tensor | None:
        return self.inner.value_term(probs, self._own(ctx))

    def transform_kv(
        self, x: Tensor, k: Tensor, v: Tensor, *, key_valid: Tensor | None, cache: Any | None
    ) -> tuple[Tensor, Tensor]:
        return self.inner.transform_kv(x, k, v, key_valid=key_valid, cache=cache)

    def transform_output(self, x: Tensor, out: Tensor) -> Tensor:
        return self.inner.transform_output(x, out)

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
        return self.inner.attend(q, k, v, self._own(ctx), p_drop=p_drop, cache=cache)


class OwningLayerHooks(LayerHooks):
    """:class:`LayerHooks` of a scheme that computes its own attention."""

    owns_attention = True


class HeadSplit(AttentionPositional):
    """A layer's heads in G contiguous groups, group g under its member's hooks.

    Softmax is per head, so each group's heads attend exactly as under their scheme
    alone: q and k transformed group by group, the score terms of the groups side by
    side along the head axis (zeros for a group without one), the value terms likewise.
    A group whose content score has another scale than group 0's (DeBERTa's
    ``1/sqrt(3D)``) has it folded into its queries. No ``score_mod``: a split attends
    through the explicit path on every device.

    Args:
        hooks: Per group, its hooks and the member they belong to.
        head_dim: D.
    """

    score_term = True

    def __init__(self, hooks: list[tuple[AttentionPositional, int]], *, head_dim: int) -> None:
        super().__init__()
        wide = [h.scheme for h, _ in hooks if h.widens_qk]
        if wide:
            raise ValueError(
                f"encoder.heads: {wide[0]} widens its queries and keys (xl with fold=true), "
                f"so its heads cannot join a split; give it encoder.heads=[{{name: xl, "
                f"fold: false}}, ...] or use encoder.layers"
            )
        self.hooks = nn.ModuleList(h for h, _ in hooks)  # trained and saved with the layer
        self.groups = [h for h, _ in hooks]  # the same modules, typed
        self.members = [m for _, m in hooks]
        self.head_dim = head_dim
        self.needs_probs = any(h.needs_probs for h, _ in hooks)
        scales = [h.scale(head_dim) for h, _ in hooks]
        self._scale = scales[0]
        #: Per group, the factor on its queries that gives it its own content scale.
        self.q_factor = [s / scales[0] for s in scales]

    def init_weights(self) -> None:
        for hooks in self.groups:
            hooks.init_weights()

    @property
    def adds_scores(self) -> bool:
        return self.needs_probs or any(h.adds_scores for h in self.groups)

    def scale(self, head_dim: int) -> float:
        return self._scale

    def _split(self, x: Tensor) -> tuple[Tensor, ...]:
        return x.chunk(len(self.groups), dim=1)  # G x (B, H/G, *, *)

    def _views(self, ctx: AttentionContext) -> list[AttentionContext]:
        return [member_view(ctx, m) for m in self.members]

    def score_parts(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreParts | None:
        s, views = k.shape[-2], self._views(ctx)
        q_g, k_g = self._split(q), self._split(k)
        parts = [
            h.score_parts(a, b, c) for h, a, b, c in zip(self.groups, q_g, k_g, views, strict=True)
        ]
        if all(p is None for p in parts):
            return None
        terms = [None if p is None else dense_parts(p, s) for p in parts]
        batch = max(t.shape[0] for t in terms if t is not None)
        dtype = next(t.dtype for t in terms if t is not None)
        t_len, heads = q.shape[-2], q_g[0].shape[1]
        full = [
            q.new_zeros(batch, heads, t_len, s, dtype=dtype)
            if t is None
            else t.expand(batch, heads, t_len, s)
            for t in terms
        ]
        return [(torch.cat(full, dim=1), 0)]  # (B|1, H, T, S)

    def score_bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor | None:
        parts = self.score_parts(q, k, ctx)
        return None if parts is None else parts[0][0]

    def score_mod(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> ScoreMod | None:
        return None

    def transform_qk(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        views = self._views(ctx)
        pairs = [
            h.transform_qk(a, b, c)
            for h, a, b, c in zip(self.groups, self._split(q), self._split(k), views, strict=True)
        ]
        qs = [p[0] if f == 1.0 else p[0] * f for p, f in zip(pairs, self.q_factor, strict=True)]
        return torch.cat(qs, dim=1), torch.cat([p[1] for p in pairs], dim=1)

    def value_term(self, probs: Tensor, ctx: AttentionContext) -> Tensor | None:
        views, p_g = self._views(ctx), self._split(probs)
        terms = [
            h.value_term(p, c) if h.needs_probs else None
            for h, p, c in zip(self.groups, p_g, views, strict=True)
        ]
        if all(t is None for t in terms):
            return None
        b, _, t_len, _ = probs.shape
        full = [
            probs.new_zeros(b, p.shape[1], t_len, self.head_dim) if t is None else t
            for t, p in zip(terms, p_g, strict=True)
        ]
        return torch.cat(full, dim=1)  # (B, H, T, D)
