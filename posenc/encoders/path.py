"""PaTH attention (Yang, Shen, Wen, Tan, Mishra, Ren, Panda and Kim 2025, "PaTH
Attention: Position Encoding via Accumulating Householder Transformations",
arXiv:2505.16381).

Notation: B batch, H heads, T queries (new tokens), S keys, C d_model, D head dim;
i a query, j a key, t a token in between.

Each token t carries a data-dependent Householder-like reflection per head,

    H_t = I - beta_t w_t w_t^T,    beta_t = 2 sigmoid(b . x_t + c) in (0, 2),
    w_t = l2norm(silu(conv(W x_t)))   (a causal depthwise convolution of width 3),

and the score of query i for key j multiplies the reflections of the tokens after the
key, up to and including the query:

    z_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j / sqrt(D)            (j < i; z_ii = q_i . k_i)

followed by the causal softmax. With a unit ``w_t``, ``beta`` near 2 makes H_t a
reflection (eigenvalue -1), so the product can rotate and flip the key, not only shrink
it: a position encoding that the content writes. (The normalisation's eps keeps ``|w|``
below 1 when the convolution's outputs are small, as at initialisation: mean 0.78 at
d_model 64, 0.91 at 128, so ``beta = 2`` then gives eigenvalues near -0.2.) No other
positional information.

As the authors' layer (fla-org/flash-linear-attention ``fla/layers/path_attn.py``, the
defaults of ``PaTHAttention``): ``W`` is low rank (``C -> 32 -> H D``, no biases), the
convolution has no bias and a SiLU, ``w`` is normalised per head with eps 1e-6, ``b``
and ``c`` are one ``Linear(C, H)``; every weight starts N(0, 0.02) and every bias 0,
as in their ``_init_weights`` (``_PaTH.init_weights``, called by the model, for the
Linears; the convolution when built). ``forget_gate=true`` adds FoX's
gate ``G_i - G_j`` (``G`` the running sum of ``logsigmoid(g . x_t + e)``) *inside* the
1/sqrt(D) scale, as their kernels and reference (``naive_path_attn``) do, unlike FoX's
own (posenc/encoders/fox.py, outside).

Computation: exact, by rewriting keys a chunk of new tokens at a time (``CHUNK`` = 64,
the authors' chunk size). Rewriting ``k_j <- H_t k_j`` for each token t after j gives
``z_ij = q_i . k_j - sum_{j<t<=i} beta_t (q_i . w_t) a_tj`` with
``a_tj = w_t . k_j - sum_{j<s<t} beta_s (w_t . w_s) a_sj`` (w_t against k_j as rewritten
by the tokens before t). Over a chunk of c tokens that recursion is one unit lower
triangular solve, ``A = (I + G)^-1 M(W K^T)`` with ``G_ts = beta_s w_t . w_s`` (s < t) and
``M`` keeping j < t; then ``Z = Q K^T - tril(Q W^T diag(beta)) A`` and the keys leave
the chunk as ``K - A^T diag(beta) W``, the keys the next chunk starts from. This is the
UT form of a product of Householder matrices, computed with matmuls and
``torch.linalg.solve_triangular``, not the authors' fused kernel: O(T S (D + c)) per layer.
In a full pass a chunk reads only the keys up to its last token's own (a later key is
neither seen nor rewritten yet), half the work of reading all S. With one thread on a
shared 2-core CPU, ``python experiments/bench.py --sections steps --encoders
none,stickbreak,path --modes eager --lengths 256 --threads 1`` measures a training step
at 8x256 at 0.29x ``none``'s tokens/s (stick-breaking 0.44x). Decoding
keeps the rewritten keys in the layer's cache (``path_keys``, ``(B, H, S, D)``) with the
convolution's inputs (``path_u``), so a step rewrites the S cached keys once and
equals a full pass over the prefix; beam search reorders both with the cache.

Padding (left-padded prompts): a padding token's ``beta`` is 0 (its H is the
identity) and its convolution input is 0, so a row decodes the same alone or padded.
Causal attention only: the product runs from a key to the query after it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc.encoders.base import (
    AttentionContext,
    AttentionPositional,
    CausalOnly,
    Slot,
    normal_linears,
)
from posenc.encoders.registry import register
from posenc.encoders.softmax import softmax_values

# What with_input leaves for attend: the reflections w (B, H, T, D), their strengths beta
# (B, H, T), and with a gate its cumulative log sums, as fox.py.
W: Slot[Tensor] = Slot("path_w", query_dim=2)
BETA: Slot[Tensor] = Slot("path_beta", query_dim=2)
GATE_Q: Slot[Tensor] = Slot("path_gate_q", query_dim=2)
GATE_K: Slot[Tensor] = Slot("path_gate_k", key_dim=2)
#: In a layer's decoding cache: every slot's u (B, S, H D), the forget gate's running total
#: (B, H, 1) and its G_j (B, H, S), and the keys as transformed so far.
U_KEYS: Slot[Tensor] = Slot("path_u", key_dim=1)
GATE_TOTAL: Slot[Tensor] = Slot("path_gate_total")
GATE_KEYS: Slot[Tensor] = Slot("path_gate_keys", key_dim=2)
KEYS_BUF: Slot[Tensor] = Slot("path_keys")

#: The authors' ``l2_norm`` epsilon (inside the square root).
L2_EPS = 1e-6


def short_conv(u: Tensor, at: Tensor, weight: Tensor) -> Tensor:
    """Causal depthwise convolution and SiLU at slots ``at`` of ``u``.

    Args:
        u: ``(B, S, C)`` inputs by slot (zeros where there is no token).
        at: ``(T,)`` int64, the slots of the tokens to convolve.
        weight: ``(C, 1, K)``, ``nn.Conv1d``'s layout: tap ``K - 1`` is the token's
            own slot, tap 0 the slot ``K - 1`` before it.

    Returns:
        ``(B, T, C)``: ``silu(sum_k weight[:, 0, k] * u[at - (K - 1) + k])``, slots
        before 0 counting as zeros.
    """
    taps = weight.shape[-1]
    idx = at[:, None] + torch.arange(1 - taps, 1, device=at.device)  # (T, K)
    win = u[:, idx.clamp(min=0)] * (idx >= 0)[None, :, :, None].to(u.dtype)  # (B, T, K, C)
    return F.silu(torch.einsum("btkc,ck->btc", win, weight[:, 0, :].to(u.dtype)))


#: New tokens per step of :func:`path_scores` (the authors' kernels use chunks of 64).
CHUNK = 64


def _chunk(
    q: Tensor, keys: Tensor, w: Tensor, beta: Tensor, before: Tensor
) -> tuple[Tensor, Tensor]:
    """:func:`path_scores` for ``c`` consecutive new tokens (the module docstring's
    "Computation")."""
    wk = (w @ keys.transpose(-1, -2)).masked_fill(~before, 0.0)  # (B, H, c, S): j < t only
    g = (w @ w.transpose(-1, -2) * beta[..., None, :]).tril(-1)  # (B, H, c, c): s < t only
    a = torch.linalg.solve_triangular(g, wk, upper=False, unitriangular=True)  # (I + G)^-1 wk
    qw = (q @ w.transpose(-1, -2) * beta[..., None, :]).tril()  # (B, H, c, c): t <= i only
    z = q @ keys.transpose(-1, -2) - qw @ a
    return z, keys - (a * beta[..., None]).transpose(-1, -2) @ w


def path_scores(
    q: Tensor,
    keys: Tensor,
    w: Tensor,
    beta: Tensor,
    before: Tensor,
    shift: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``q_t^T H_t ... H_{j+1} k_j`` for every new token t and key j, by rewriting keys
    :data:`CHUNK` new tokens at a time (module docstring's "Computation").

    Args:
        q: ``(B, H, T, D)`` queries of the new tokens.
        keys: ``(B, H, S, D)`` keys as rewritten by every token before this call (a
            new token's own key as projected).
        w: ``(B, H, T, D)`` unit vectors of the new tokens.
        beta: ``(B, H, T)`` in [0, 2).
        before: ``(T, S)`` bool, key j before new token t (token t rewrites it); a
            key before a token is before every later one (the chunk's solve relies on
            it), as ``key_offsets() < 0`` gives.
        shift: When ``before`` is ``j < t + shift`` with a Python int ``shift`` (a full
            pass), a chunk of new tokens reads only the keys up to its last token's own
            and leaves the later ones as they are (half the work of a causal pass); None
            (a cached step, whose shift is a tensor): every key.

    Returns:
        ``((B, H, T, S) scores, (B, H, S, D) keys rewritten by every new token)``;
        unscaled, of ``q``'s dtype. With ``shift``, the scores past the keys a chunk
        reads are 0 (past every query's own key: the causal mask hides them).
    """
    s, parts = keys.shape[-2], []
    src, read = keys, 0  # keys[:read]: as rewritten so far; src[read:]: as given
    for a in range(0, q.shape[-2], CHUNK):
        part = slice(a, a + CHUNK)
        e = s if shift is None else max(1, min(s, a + CHUNK + shift))  # keys this chunk reads
        if e > read:
            keys = src[..., :e, :] if read == 0 else torch.cat((keys, src[..., read:e, :]), -2)
            read = e
        z, keys = _chunk(q[:, :, part], keys, w[:, :, part], beta[:, :, part], before[part, :e])
        parts.append(z if e == s else F.pad(z, (0, s - e)))
    return torch.cat(parts, -2), keys if read == s else torch.cat((keys, src[..., read:, :]), -2)


class _PaTH(AttentionPositional):
    """Per-layer hooks: the token's reflection (from x) and the whole attention call."""

    owns_attention = True

    def init_weights(self) -> None:
        """Every Linear N(0, 0.02), biases 0, as the authors' ``_init_weights``; the
        convolution is set when built."""
        normal_linears(self)

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        w_rank: int | None,
        conv_size: int,
        forget_gate: bool,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        head_dim = d_model // n_heads
        self.w_proj: nn.Module
        if w_rank is None:
            self.w_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        else:  # the authors' default: low rank, to keep MHA's parameter count down
            self.w_proj = nn.Sequential(
                nn.Linear(d_model, w_rank, bias=False),
                nn.Linear(w_rank, n_heads * head_dim, bias=False),
            )
        self.conv = None
        if conv_size > 0:
            c = n_heads * head_dim
            self.conv = nn.Conv1d(c, c, conv_size, groups=c, bias=False, padding=conv_size - 1)
            nn.init.normal_(self.conv.weight, std=0.02)  # the authors' init of Conv1d
        self.beta_proj = nn.Linear(d_model, n_heads)
        self.gate_proj = nn.Linear(d_model, n_heads) if forget_gate else None

    def with_input(
        self, x: Tensor, ctx: AttentionContext, *, key_valid: Tensor | None, cache=None
    ) -> AttentionContext:
        b, t, _ = x.shape
        acc = torch.promote_types(x.dtype, torch.float32)
        valid = None
        if key_valid is not None:
            valid = key_valid if cache is None else key_valid.index_select(1, cache.at)
        u = self.w_proj(x)  # (B, T, H D)
        if valid is not None:  # padding: no convolution input, no reflection
            u = u.masked_fill(~valid[..., None], 0.0)
        if self.conv is not None:
            at = torch.arange(t, device=x.device) if cache is None else cache.at
            u_all = u if cache is None else cache.extend(U_KEYS, u)  # (B, S, H D)
            u = short_conv(u_all, at, self.conv.weight)
        w = u.to(acc).unflatten(-1, (self.n_heads, -1)).transpose(1, 2)  # (B, H, T, D)
        w = w * torch.rsqrt((w * w).sum(-1, keepdim=True) + L2_EPS)
        beta = 2.0 * torch.sigmoid(self.beta_proj(x).to(acc)).transpose(1, 2)  # (B, H, T)
        if valid is not None:
            beta = beta.masked_fill(~valid[:, None, :], 0.0)
        out = ctx.grown()
        out.put(W, w)
        out.put(BETA, beta)
        if self.gate_proj is not None:  # FoX's gate, as fox.py accumulates it
            log_f = F.logsigmoid(self.gate_proj(x).to(acc)).transpose(1, 2)  # (B, H, T)
            if valid is not None:
                log_f = log_f.masked_fill(~valid[:, None, :], 0.0)
            g = log_f.cumsum(-1)
            g_keys = g
            if cache is not None:
                total = cache.get(GATE_TOTAL)  # (B, H, 1), updated in place
                if total is None:
                    total = g.new_zeros(g.shape[:-1] + (1,))
                    cache.put(GATE_TOTAL, total)
                g = g + total
                total.copy_(g[..., -1:])
                g_keys = cache.extend(GATE_KEYS, g)  # (B, H, S)
            out.put(GATE_Q, g)
            out.put(GATE_K, g_keys)
        return out

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
        """``(B, H, T, D)`` from ``q (B, H, T, D)``, ``k``, ``v (B, H, S, D)``; in a cached
        step ``k`` holds every slot as projected, and ``cache`` the keys as rewritten by
        the tokens of earlier steps (``path_keys``)."""
        acc = torch.promote_types(q.dtype, torch.float32)
        keys = k.to(acc)
        buf = None
        if cache is not None:  # earlier slots: as rewritten so far; new slots: as projected
            buf = cache.get(KEYS_BUF)
            if buf is None:
                buf = keys.new_zeros(keys.shape)
                cache.put(KEYS_BUF, buf)
            keys = buf.index_copy(2, cache.at, keys.index_select(2, cache.at))
        before = ctx.key_offsets() < 0  # (T, S)
        shift = ctx.own_key()  # an int in a full pass: each chunk reads keys up to its own
        known = shift if isinstance(shift, int) and cache is None else None
        z, rewritten = path_scores(q.to(acc), keys, ctx[W], ctx[BETA], before, known)
        if buf is not None:
            buf.copy_(rewritten)  # in place: a compiled step stays one graph
        # z is this call's own: scaled and masked in place, no (B, H, T, S) copy
        if self.gate_proj is not None:  # inside the scale, as the authors' kernels
            z = z.add_(ctx[GATE_Q][..., :, None]).sub_(ctx[GATE_K][..., None, :])
        logits = z.mul_(self.scale(q.shape[-1])).masked_fill_(~ctx.visible(), float("-inf"))
        out, _, _ = softmax_values(logits, v, dtype=acc, dropout=p_drop)
        return out


@register("path")
class PaTH(CausalOnly):
    """PaTH attention (module docstring).

    Args:
        w_rank: Rank of the projection to ``w`` (the authors' default 32); None: a
            full ``Linear(C, C)``.
        conv_size: Width of the causal convolution on ``w`` (the authors' 3); 0: none
            (and no SiLU).
        forget_gate: Add FoX's forget gate (the paper's PaTH-FoX).

    Raises:
        ValueError: A setting out of range, or bidirectional attention.
    """

    causal_reason = (
        "PaTH multiplies the reflections of the tokens from each key up to the query "
        "after it, an order an encoder's keys do not have"
    )
    data_dependent = True
    uses_positions = False

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_layers: int,
        w_rank: int | None = 32,
        conv_size: int = 3,
        forget_gate: bool = False,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if w_rank is not None and (
            isinstance(w_rank, bool) or not isinstance(w_rank, int) or w_rank < 1
        ):
            raise ValueError(
                f"path: w_rank must be a positive integer or null (a full projection), got "
                f"{w_rank!r}; the authors use 32"
            )
        if isinstance(conv_size, bool) or not isinstance(conv_size, int) or conv_size < 0:
            raise ValueError(
                f"path: conv_size must be an integer >= 0 (0: no convolution), got "
                f"{conv_size!r}; the authors use 3"
            )
        self.w_rank, self.conv_size, self.forget_gate = w_rank, conv_size, forget_gate

    def causal_hooks(self, *, layer: int) -> AttentionPositional:
        return _PaTH(
            d_model=self.d_model,
            n_heads=self.n_heads,
            w_rank=self.w_rank,
            conv_size=self.conv_size,
            forget_gate=self.forget_gate,
        )


__all__ = ["L2_EPS", "PaTH", "path_scores", "short_conv"]
