"""DAPE, data-adaptive positional encoding (Zheng et al. 2024, "DAPE: Data-Adaptive
Positional Encoding for Length Extrapolation", NeurIPS), as its authors' code
(chuanyang-Zheng/DAPE: ``AliBi_DAPE``, ``ParallelKerpleLog_DAPE``, ``FIRE_DAPE``) runs it.

Notation: B batch, H heads, T queries, S keys, D head dim, W the MLP's hidden width; i
query and j key position.

A score-bias scheme (ALiBi, KERPLE or FIRE, the *base*) gives a bias ``B (H, T, S)``.
DAPE adds to the logits a learned function of that bias and of the content scores of
the same pair, so what a position means can depend on what the tokens are:

    A = Q K^T / sqrt(D)  +  B  +  f([Q K^T / sqrt(D) ; B])

``f`` is an MLP applied to each (i, j) pair on its own, over the heads: input the 2H
values of that pair (content scores of every head, then the base's bias of every head,
the authors' order), a hidden layer of W units, a LeakyReLU (slope 0.01), and H
outputs, one per head. As in the authors' code:

* the content scores that enter ``f`` are the scaled scores before the causal mask; ``f``
  acts on each pair alone, so a masked pair's output lands on a masked pair and the mask
  still hides every later key;
* W = 32 (their ``mlp_width``); both layers have biases and PyTorch's default
  ``nn.Linear`` initialisation (posenc's GPT-2 initialisation of the stack leaves a
  scheme's weights alone);
* every layer has its own MLP, and its own base parameters (they build the base in each
  attention layer): ``per_layer=true`` by default, passed to a base that has the option
  (KERPLE, FIRE; ALiBi has no parameters).

The base is posenc's own scheme, built with its options (``base_options``), so its bias
is exactly what ``encoder=<base>`` adds; with ``f``'s output layer zeroed DAPE is that
scheme. Where posenc's base differs from the authors' copy of it, the base's convention
holds (FIRE's ``f_theta`` uses the paper's ReLU; the authors' DAPE-FIRE a LeakyReLU).

What the MLP sees are the content scores of the explicit softmax: after QK-norm (when
``model.qk_norm``), before a logit scale (``model.logit_scale`` multiplies the whole
logit, this term included). The term mixes heads, which FlexAttention's ``score_mod``
(one head at a time) cannot, so DAPE always takes the explicit path.

Bidirectional self-attention: the same (posenc's extension; the paper is about causal
language models), on the base's bidirectional bias. Cross-attention: nothing.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc.encoders import registry
from posenc.encoders.base import (
    AttentionContext,
    AttentionPositional,
    AttnKind,
    PositionalEncoder,
)
from posenc.errors import unknown_value

#: The score-bias schemes DAPE's paper and code put the MLP on.
BASES = ("alibi", "kerple", "fire")
_SIZES = ("self", "d_model", "n_heads", "n_layers")


class DapeMLP(nn.Module):
    """``f``: ``2H -> W -> H`` over the heads of each (query, key) pair, LeakyReLU.

    Args:
        n_heads: H.
        width: W.
    """

    def __init__(self, n_heads: int, width: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.hidden = nn.Linear(2 * n_heads, width)
        self.out = nn.Linear(width, n_heads)

    def forward(self, content: Tensor, bias: Tensor) -> Tensor:
        """``f([content; bias])``.

        Args:
            content: ``(B, H, T, S)`` scaled content scores.
            bias: ``(B|1, H, T, S)`` the base's bias.

        Returns:
            ``(B, H, T, S)``.
        """
        # The concatenation's first layer as two products: the bias part is computed
        # once for the whole batch, and no (B, 2H, T, S) copy is made.
        w_content, w_bias = self.hidden.weight.split(self.n_heads, dim=1)  # (W, H) each
        pre = torch.einsum("wh,bhts->bwts", w_content, content)  # (B, W, T, S)
        pre = pre + torch.einsum("wh,bhts->bwts", w_bias, bias) + self.hidden.bias[:, None, None]
        act = F.leaky_relu(pre, negative_slope=0.01)  # nn.LeakyReLU's default, as the authors
        return torch.einsum("hw,bwts->bhts", self.out.weight, act) + self.out.bias[:, None, None]


class _DapeAttention(AttentionPositional):
    """Per-layer hook: the base's hooks, plus this layer's MLP on their bias."""

    score_term = True

    def __init__(self, base: AttentionPositional, *, n_heads: int, width: int) -> None:
        super().__init__()
        self.base = base
        self.mlp = DapeMLP(n_heads, width)

    @property
    def scheme(self) -> str:
        return "dape"

    def init_weights(self) -> None:
        self.base.init_weights()

    def scale(self, head_dim: int) -> float:
        return self.base.scale(head_dim)

    def transform_qk(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        return self.base.transform_qk(q, k, ctx)

    def score_bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        bias = self.base.score_bias(q, k, ctx)
        if bias is None:  # every base in BASES adds a term
            raise TypeError(f"dape: the base {self.base.scheme} adds no score term")
        q_c, k_c = self.base.transform_qk(q, k, ctx)
        content = (q_c @ k_c.transpose(-1, -2)) * self.scale(q.shape[-1])  # (B, H, T, S)
        return bias + self.mlp(content, bias.to(content.dtype))


@registry.register("dape")
class Dape(PositionalEncoder):
    """DAPE: a base score-bias scheme plus a per-pair MLP of its bias and the content
    scores (see the module docstring).

    Args:
        base: The scheme whose bias DAPE adapts: ``alibi``, ``kerple`` or ``fire``.
        mlp_width: W, the MLP's hidden width.
        per_layer: Each layer its own base parameters (the authors' code); passed to a
            base that takes it (KERPLE, FIRE).
        base_options: Options of the base scheme, as ``encoder=<base>`` takes them (e.g.
            ``{form: power}`` for KERPLE, ``{threshold: 512}`` for FIRE).
        length: The training length (the YAML gives ``task.seq_len``): FIRE's threshold L
            where ``base_options`` sets none, as ``encoder=fire`` starts it, so DAPE's FIRE
            is the FIRE arm's; None: FIRE's class default (512).

    Raises:
        ValueError: An unknown base, an option the base does not take (or
            ``per_layer`` among them), a width below 1, or the base's own refusals.
    """

    # The class declares what the default (conf/encoder/dape.yaml: KERPLE) is, which the
    # tests group schemes by; an instance declares what its base is.
    relative = True
    #: The MLP reads the content scores q . k of every pair.
    data_dependent = True

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_layers: int,
        base: str = "kerple",
        mlp_width: int = 32,
        per_layer: bool = True,
        base_options: Mapping[str, Any] | None = None,
        length: int | None = None,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if base not in BASES:
            raise ValueError(
                f"dape: {unknown_value('base', base, BASES)} (the score-bias "
                f"scheme the MLP adapts), e.g. encoder.base=kerple"
            )
        if isinstance(mlp_width, bool) or not isinstance(mlp_width, int) or mlp_width < 1:
            raise ValueError(
                f"dape: mlp_width must be an integer >= 1, got {mlp_width!r}; the default is 32"
            )
        options = _base_options(base, base_options, per_layer)
        if base == "fire" and length is not None:
            options.setdefault("threshold", length)
        self.base_name = base
        self.mlp_width = mlp_width
        sizes = dict(d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        self.base = registry.build(base, **sizes, **options)
        self.relative = self.base.relative
        self.relative_below = self.base.relative_below

    def prepare(self, ctx: AttentionContext) -> None:
        self.base.prepare(ctx)

    def check_length(self, bound: int) -> None:
        self.base.check_length(bound)

    def for_attention(self, *, layer: int, kind: AttnKind) -> AttentionPositional:
        hooks = self.base.for_attention(layer=layer, kind=kind)
        if kind is AttnKind.CROSS:
            return hooks
        return _DapeAttention(hooks, n_heads=self.n_heads, width=self.mlp_width)


def _base_options(base: str, given: Mapping[str, Any] | None, per_layer: bool) -> dict[str, Any]:
    """The keyword arguments of the base's class: ``given``, checked, and ``per_layer``
    where the class takes it.

    Raises:
        ValueError: One line naming an option the base does not take.
    """
    if given is not None and not isinstance(given, Mapping):
        raise ValueError(
            f"dape: encoder.base_options={given!r}: must be a mapping of the base's options, "
            f"e.g. encoder.base_options={{form:power}} for kerple"
        )
    options = {str(k): v for k, v in (given or {}).items()}
    params = inspect.signature(registry.get(base).__init__).parameters
    allowed = [p for p in params if p not in _SIZES]
    for key in options:
        if key == "per_layer" or key not in allowed:
            rest = [a for a in allowed if a != "per_layer"]
            hint = "; set encoder.per_layer instead" if key == "per_layer" else ""
            raise ValueError(
                f"dape: encoder.base_options.{key}: {base} has no option {key!r} here; "
                f"allowed: {', '.join(rest) or 'none'}{hint}"
            )
    if "per_layer" in allowed:
        options["per_layer"] = per_layer
    return options
