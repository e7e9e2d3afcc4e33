"""Attention modifiers that work with any positional scheme: QK-norm, a length-aware
logit scale and learned sink logits (``model.qk_norm``, ``model.logit_scale``,
``model.sinks``), and the options of a sliding window (``model.window``, whose masks
are in :mod:`posenc.model.window`).

Notation: B batch, H heads, T queries, S keys, D head dim.

* **QK-norm** (:class:`HeadRMSNorm`): RMSNorm of each head's q and k over its D
  channels, with a learned scale per channel, on the projected q and k, before any
  scheme sees them (before RoPE's rotation, as OLMo 2 and Qwen 3 place it).
* **Logit scale** (:meth:`LogitModifiers.factor`): the logits of query i, the whole
  input of its softmax (content score and the scheme's score terms), times
  ``s * log(n_i)``, with ``n_i`` the number of keys query i sees: ``i + 1`` in a
  causal pass, the number of (valid) keys otherwise, and in a cached decoding step
  the query's slot + 1 less its row's left padding; in a local layer
  (:mod:`posenc.model.window`) at most the window. ``ssmax`` is Scalable-Softmax
  (Nakanishi 2025, "Scalable-Softmax Is Superior for Attention", arXiv 2501.19399):
  ``softmax(s log(n) z)`` with a learned ``s`` per head, initialised to
  :data:`SSMAX_INIT`. ``log_length`` fixes ``s = 1``: the log-length scaled attention
  of Chiang & Cholak 2022 ("Overcoming a Theoretical Limitation of Self-Attention",
  section 5), SSMax without its learned scale. A learned sink's logit is not scaled.
* **Sinks** (:meth:`LogitModifiers.sink_column`, :meth:`LogitModifiers.flex_sink`): a
  learned logit per head (gpt-oss) that joins each query's softmax as one more column,
  which takes probability mass and adds no value, so a query may attend to nothing.
  With ``Z = sum_j exp(z_j)`` and ``lse = log Z``, the probabilities become
  ``exp(z_j) / (Z + exp(sink)) = softmax(z)_j * sigmoid(lse - sink)``. SDPA and the
  explicit softmax get the column itself: a key and a value of zeros put before the
  keys (its score ``q . 0 = 0`` plus the sink as a score part), which every query
  sees. FlexAttention returns ``lse``, so its output is scaled by
  ``sigmoid(lse - sink)`` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc.choices import LOGIT_SCALES
from posenc.encoders.base import AttentionPositional, ScoreMod, ScoreParts
from posenc.model.window import layer_window, window_problem

#: SSMax's initial ``s``: the value the paper illustrates SSMax with (its Figure 1),
#: which at n = 256 keys gives a factor of about 2.4 on the logits.
SSMAX_INIT = 0.43
#: ``log_length``'s fixed ``s`` (Chiang & Cholak 2022 multiply the logits by log n).
LOG_LENGTH_S = 1.0
#: QK-norm's eps (OLMo 2's and Qwen 3's RMSNorm eps).
QK_NORM_EPS = 1e-6


@dataclass(frozen=True)
class Modifiers:
    """The model options that modify every attention of a model.

    Args:
        qk_norm: RMSNorm of q and k per head, before the positional transform.
        logit_scale: ``none``, ``log_length`` or ``ssmax`` (module docstring).
        sinks: A learned sink logit per head.
        window: Sliding-window attention: the keys a causal query sees at most
            (:mod:`posenc.model.window`); None: off.
        window_layers: Which layers are local: ``local``/``global`` cycled over the
            layers; None: every layer (:meth:`for_layer` resolves it).

    Raises:
        ValueError: ``logit_scale`` is not one of :data:`LOGIT_SCALES`, or the window
            options do not make a window (:func:`~posenc.model.window.window_problem`).
    """

    qk_norm: bool = False
    logit_scale: str = "none"
    sinks: bool = False
    window: int | None = None
    window_layers: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if self.logit_scale not in LOGIT_SCALES:
            raise ValueError(f"logit_scale={self.logit_scale!r}: allowed {', '.join(LOGIT_SCALES)}")
        problem = window_problem(self.window, self.window_layers)
        if problem:
            raise ValueError(problem)

    def for_layer(self, layer: int) -> Modifiers:
        """These options for layer ``layer``: its own window (None on a global layer)."""
        return replace(
            self, window=layer_window(self.window, self.window_layers, layer), window_layers=None
        )

    @property
    def on_logits(self) -> bool:
        """Whether the softmax's logits change (a logit scale or sinks)."""
        return self.logit_scale != "none" or self.sinks

    def refusal(self, pos: AttentionPositional) -> str | None:
        """Why these options cannot apply to a scheme's attention, or None: a scheme
        that computes its own attention weights has no softmax of posenc's to modify,
        nor a mask of posenc's to narrow to a window."""
        if not (pos.owns_attention and (self.on_logits or self.window is not None)):
            return None
        given = [f"logit_scale={self.logit_scale}"] if self.logit_scale != "none" else []
        given += ["sinks=true"] if self.sinks else []
        given += [f"window={self.window}"] if self.window is not None else []
        return (
            f"model.{' and model.'.join(given)}: the {pos.scheme} encoder computes its own "
            f"attention weights, not the softmax and mask these options change; drop the "
            f"option or choose another encoder"
        )


class HeadRMSNorm(nn.Module):
    """RMSNorm of ``x (B, H, T, D)`` over D: ``x / sqrt(mean(x^2) + eps) * weight``, one
    learned ``weight (D,)`` shared by the heads (initialised to ones), as Qwen 3 and
    Gemma 3 do; OLMo 2 normalises all heads' channels together instead.

    Args:
        head_dim: D.
    """

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))

    def forward(self, x: Tensor) -> Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)
        y = F.rms_norm(x.to(acc), (x.shape[-1],), self.weight.to(acc), QK_NORM_EPS)
        return y.to(x.dtype)


def key_counts(
    t: int,
    s: int,
    *,
    shift: int | Tensor | None,
    key_valid: Tensor | None,
    device: torch.device,
    window: int | None = None,
) -> Tensor:
    """How many keys each query sees: ``(B|1, T)`` for causal attention (query i sees
    keys ``shift + i - window < j <= i + shift``), ``(B|1, 1)`` otherwise; int64, no
    host read.

    Args:
        t: Queries T. s: Keys S.
        shift: The causal offset (an int, or a 0-d tensor for a static cache's slot), or
            None when attention is not causal.
        key_valid: ``(B, S)`` True for real keys, or None.
        device: Where the counts live.
        window: A causal query's sliding window (:mod:`posenc.model.window`), or None.
    """
    if shift is None:
        if key_valid is None:
            return torch.full((1, 1), s, device=device)
        return key_valid.sum(-1, keepdim=True)  # (B, 1)
    last = torch.arange(t, device=device) + shift  # (T,): each query's last visible key
    # keys up to `last`, less those up to `last - window` (the window's first unseen one)
    count = _keys_up_to(last, s, key_valid)
    return count if window is None else count - _keys_up_to(last - window, s, key_valid)


def _keys_up_to(last: Tensor, s: int, key_valid: Tensor | None) -> Tensor:
    """The (valid) keys ``j <= last[i]`` among S: ``(B|1, T)``."""
    if key_valid is None:
        return (last + 1).clamp(0, s)[None]  # (1, T)
    seen = key_valid.long().cumsum(-1)  # (B, S): valid keys up to each one
    return seen.index_select(1, last.clamp(0, s - 1)) * (last >= 0)  # (B, T)


class LogitModifiers(nn.Module):
    """One attention module's logit scale and sinks, with what each backend needs.

    Args:
        n_heads: H.
        logit_scale: ``none``, ``log_length`` or ``ssmax``.
        sinks: A learned sink logit per head (initialised to 0: a column whose logit
            is that of a key orthogonal to the query, so no random draw is taken).
    """

    def __init__(self, n_heads: int, *, logit_scale: str, sinks: bool) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.scaled = logit_scale != "none"
        #: SSMax's learned s per head, or None (fixed s, or no scale).
        self.s = (
            nn.Parameter(torch.full((n_heads,), SSMAX_INIT)) if logit_scale == "ssmax" else None
        )
        #: The sink logit per head, or None.
        self.sink = nn.Parameter(torch.zeros(n_heads)) if sinks else None

    def factor(
        self,
        t: int,
        s: int,
        *,
        shift: int | Tensor | None,
        key_valid: Tensor | None,
        q: Tensor,
        window: int | None = None,
    ) -> Tensor | None:
        """``s * log(n_i)`` per query, ``(B|1, H|1, T|1, 1)`` in ``q``'s dtype (a query
        that sees no key gets 0), or None without a logit scale (see
        :func:`key_counts` for the arguments)."""
        if not self.scaled:
            return None
        n = key_counts(t, s, shift=shift, key_valid=key_valid, device=q.device, window=window)
        log_n = n.clamp(min=1).to(torch.promote_types(q.dtype, torch.float32)).log()
        f = log_n[:, None, :, None]  # (B|1, 1, T|1, 1)
        f = f * (LOG_LENGTH_S if self.s is None else self.s.to(f.dtype)[:, None, None])
        return f.to(q.dtype)

    def sink_column(
        self,
        k: Tensor,
        v: Tensor,
        parts: ScoreParts | None,
        *,
        t: int,
        shift: int | Tensor | None,
        key_valid: Tensor | None,
    ) -> tuple[Tensor, Tensor, ScoreParts | None, int | Tensor | None, Tensor | None]:
        """The sink as key 0 (SDPA and the explicit softmax): zeros prepended to ``k``
        and ``v (B, H, S, D)``, the sink logit a score part on column 0 and the other
        parts one column on, the causal shift one more (every query sees column 0), key
        padding with column 0 valid. Without sinks, the arguments as given."""
        if self.sink is None:
            return k, v, parts, shift, key_valid
        h = k.shape[1]
        k = F.pad(k, (0, 0, 1, 0))  # (B, H, 1 + S, D)
        v = F.pad(v, (0, 0, 1, 0))
        column = self.sink.to(k.dtype)[None, :, None, None].expand(1, h, t, 1)  # (1, H, T, 1)
        parts = [(column, 0), *((term, c0 + 1) for term, c0 in parts or [])]
        shift = None if shift is None else shift + 1
        if key_valid is not None:
            key_valid = F.pad(key_valid, (1, 0), value=True)
        return k, v, parts, shift, key_valid

    def flex_mod(
        self, score_mod: ScoreMod | None, factor: Tensor | None, *, b: int, t: int
    ) -> ScoreMod | None:
        """The scheme's ``score_mod`` with the whole logit times ``factor`` (FlexAttention,
        whose queries stay unscaled) for ``b`` rows of ``t`` queries; the scheme's own
        without a logit scale."""
        if factor is None:
            return score_mod
        table = factor[..., 0].expand(b, self.n_heads, t).contiguous()  # (B, H, T)

        def scaled(score: Tensor, b_i: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            logit = score if score_mod is None else score_mod(score, b_i, h, q_idx, kv_idx)
            return logit * table[b_i, h, q_idx]

        return scaled

    def flex_sink(self, out: Tensor, lse: Tensor) -> Tensor:
        """FlexAttention's ``out (B, H, T, D)`` with the sink's share taken out:
        ``out * sigmoid(lse - sink)``, ``lse (B, H, T)`` the log of each query's sum of
        exponentiated logits (-inf for a query that sees no key: its zeros stay)."""
        if self.sink is None:
            return out
        acc = torch.promote_types(out.dtype, torch.float32)
        keep = torch.sigmoid(lse.to(acc) - self.sink.to(acc)[:, None])  # (B, H, T)
        return out * keep.to(out.dtype)[..., None]


def sink_probs(probs: Tensor, mods: LogitModifiers | None) -> Tensor:
    """The keys' probabilities ``(B, H, T, S)`` out of the explicit softmax's, without the
    sink's column 0 (when there is one)."""
    return probs if mods is None or mods.sink is None else probs[..., 1:]
