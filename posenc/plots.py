"""Figures of the sweep report (:mod:`posenc.report`): PNG files and TensorBoard.

- ``lm_<split>_ppl_vs_length.png``: perplexity against evaluation length per encoder,
  log-log, mean with std error bars, one panel per protocol, training length marked; a RoPE
  context-extension method is one more (dashed) curve, ``rope+yarn``, in its protocol's panel.
- ``lm_<split>_variants_vs_parents.png``: the same perplexity (non-overlapping windows),
  one panel per scheme that has variants in the report (runs with a ``label``, e.g.
  ``+variant=rope_qknorm``), the scheme (in black) beside its variants (:func:`variant_parents`).
- ``lm_<split>_loss_by_position.png``: mean loss by position in the window (over log-spaced
  bands of positions) at the longest length each encoder (and each of its context-extension
  methods) was evaluated at.
- ``lm_<split>_passkey.png``: passkey-retrieval accuracy by length and depth, one heatmap
  per encoder, mean over seeds (runs with ``task.eval.passkey`` on).
- ``mt_<split>_bleu_by_length.png``: BLEU per source-length bucket per encoder.
- ``algo_<problem>_accuracy_vs_size.png``: exact-match and per-token accuracy against
  instance size per encoder, mean over seeds with a band of one std, trained sizes shaded;
  with several problems, ``algo_seq_acc_vs_size.png`` puts their exact-match panels side
  by side.
- ``algo_mqar_acc_by_length_and_pairs.png``: per-query accuracy by length (size bucket) and
  number of key-value pairs, one heatmap per encoder, mean over seeds (runs that record
  their test variants' pairs).
- ``suite_score.png``: with two or more algorithmic tasks, each task x scheme's score past
  training as a heat map (:mod:`posenc.report.suite` draws it with
  :func:`score_grid_figure`).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import matplotlib

matplotlib.use("Agg")  # files and TensorBoard only, never a window

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter

from posenc.results import AlgoRecord, LMRecord, MetricName, MTRecord, Record
from posenc.runs import LEARNED, NOT_LEARNED, Row, Run, summarize

R = TypeVar("R", bound=Record)

#: (mean, std or None) of one point.
Point = tuple[float, float | None]


# ------------------------------------------------------------ one run's figures


def ppl_vs_length_figure(
    ppl: Mapping[str, Mapping[int, float]], train_len: int, title: str = ""
) -> Figure:
    """Perplexity against evaluation length, one line per protocol (or encoder).

    A value a log axis cannot show (NaN: a length that was not run; inf: a model whose
    loss overflowed) is left out, and a note under the plot names it with its value.

    Args:
        ppl: Label -> {length: perplexity}; NaN marks a length that was not run.
        train_len: Training context, drawn as a vertical line.
        title: Figure title.
    """
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    left_out = []
    for label, curve in ppl.items():
        xs = sorted(x for x in curve if _drawable(curve[x]))
        left_out += [f"{label}@{x} = {curve[x]}" for x in sorted(curve) if x not in xs]
        if xs:
            ax.plot(xs, [curve[x] for x in xs], marker="o", label=label)
    ax.axvline(train_len, color="grey", linestyle="--", label=f"train length {train_len}")
    ax.set_xscale("log", base=2)
    if len(ax.lines) > 1:  # a log axis without data has no range (matplotlib raises)
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "no value to draw", transform=ax.transAxes, ha="center")
        ax.set_yticks([])
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.08 if left_out else 0, 1, 1))
    if left_out:
        _note(fig, "not drawn (not a positive finite number): " + ", ".join(left_out))
    return fig


def _drawable(value: float) -> bool:
    """Whether a log axis can show ``value``."""
    return math.isfinite(value) and value > 0


def _note(fig: Figure, text: str) -> None:
    """Small print under the plot (what it leaves out, and why); the caller leaves room
    for it at the bottom."""
    fig.text(0.01, 0.01, text, fontsize=6, ha="left", va="bottom", wrap=True)


def loss_by_position_figure(
    curves: Mapping[str, list[float]], train_len: int, title: str = "", points: int = 256
) -> Figure:
    """Mean loss by token position within the window (where extrapolation breaks).

    Args:
        curves: Label -> per-position mean loss.
        train_len: Training context, drawn as a vertical line.
        title: Figure title.
        points: Curves are averaged into at most this many bins, for readability.
    """
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for label, ys in curves.items():
        xs, vals = _bin(ys, points)
        ax.plot(xs, vals, label=label, linewidth=1.2)
    ax.axvline(train_len, color="grey", linestyle="--", label=f"train length {train_len}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in window")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _bin(ys: list[float], points: int) -> tuple[list[float], list[float]]:
    """Average a long curve into at most ``points`` log-spaced bins (positions 1-based)."""
    n = len(ys)
    if n <= points:
        return [float(i + 1) for i in range(n)], list(ys)
    edges = sorted({int(round(math.exp(math.log(n) * k / points))) for k in range(points + 1)})
    edges = [0] + [e for e in edges if e > 0]
    xs, vals = [], []
    for a, b in zip(edges, edges[1:], strict=False):
        chunk = [y for y in ys[a:b] if math.isfinite(y)]
        if chunk:
            xs.append((a + b + 1) / 2)
            vals.append(sum(chunk) / len(chunk))
    return xs, vals


def bleu_by_length_figure(
    by_bucket: Mapping[str, Mapping[str, float]],
    edges: Sequence[int],
    train_max: int | None,
    title: str = "",
) -> Figure:
    """BLEU per source-length bucket as bars labelled with their sentence counts.

    Args:
        by_bucket: Bucket name -> ``{"n", "bleu", ...}`` (:func:`scores_by_bucket`), in the
            order of ``edges``.
        edges: The bucket edges.
        train_max: Longest training source (``task.max_train_src_len``) or None; buckets
            whose every length is beyond it are drawn in orange.
        title: Figure title.
    """
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    names = list(by_bucket)
    bleu = [by_bucket[n]["bleu"] for n in names]
    heights = [0.0 if math.isnan(b) else b for b in bleu]
    beyond = [train_max is not None and start > train_max for start in edges[:-1]]
    bars = ax.bar(range(len(names)), heights, color=["C1" if b else "C0" for b in beyond])
    for bar, name, b in zip(bars, names, bleu, strict=True):
        label = f"n={int(by_bucket[name]['n'])}" + ("" if math.isfinite(b) else " (empty)")
        x = bar.get_x() + bar.get_width() / 2
        ax.annotate(label, (x, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), [n[3:] for n in names])
    ax.set_ylim(bottom=0)  # BLEU is never negative (all-zero bars centred the axis on 0)
    ax.set_xlabel("source length (tokens)")
    ax.set_ylabel("BLEU")
    note = "" if train_max is None else f" (orange: beyond training max {train_max})"
    ax.set_title(title + note, fontsize=9)
    fig.tight_layout()
    return fig


def heatmap_figure(
    accuracy: Sequence[Sequence[float]],
    lengths: Sequence[int | str],
    depths: Sequence[float],
    train_len: int | None,
    title: str = "",
    ax=None,
    blank: Sequence[str] | None = None,
    xlabel: str = "needle depth",
):
    """Accuracy as a length x depth heatmap (NaN cells, lengths not run, are blank).

    Args:
        accuracy: ``[length][depth]`` in [0, 1].
        lengths: Row labels (tokens, or size buckets).
        depths: Column labels (needle depths, or numbers of key-value pairs).
        train_len: The training length (its row is marked ``(train)``).
        title: Axes title.
        ax: Axes to draw into; None makes a new figure.
        blank: Per length, the word written in its NaN cells (default ``skipped``: a length
            the encoder cannot run; the report writes ``not learned`` for lengths left out).
        xlabel: What the columns are.

    Returns:
        The figure.
    """
    if ax is None:
        fig, ax = plt.subplots(figsize=(1.0 + 0.8 * len(depths), 1.2 + 0.45 * len(lengths)))
    else:
        fig = ax.figure
    data = [[math.nan if v is None else v for v in row] for row in accuracy]
    im = ax.imshow(data, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    for i, row in enumerate(data):
        for j, v in enumerate(row):
            if math.isfinite(v):
                color = "black" if v > 0.6 else "white"
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color=color)
            else:  # a length the encoder cannot run, or runs left out
                word = blank[i] if blank is not None else "skipped"
                ax.text(j, i, word, ha="center", va="center", fontsize=6, color="grey")
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_yticks(
        range(len(lengths)), [f"{n} (train)" if n == train_len else str(n) for n in lengths]
    )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("length (tokens)")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="accuracy")
    return fig


def score_grid_figure(
    rows: Sequence[str],
    columns: Sequence[str],
    scores: Sequence[Sequence[float | None]],
    notes: Sequence[Sequence[str]],
    title: str,
    label: str = "score (%)",
) -> Figure:
    """Scores in percent as a rows x columns heat map, each cell written with its score
    and its note under it (e.g. ``2/3``); a None score is a grey cell marked ``-``.

    Args:
        rows: Row labels (tasks).
        columns: Column labels (schemes).
        scores: ``[row][column]`` in [0, 100], or None (no score).
        notes: ``[row][column]`` text under the score ("" for none).
        title: Figure title.
        label: The colour bar's label.
    """
    size = (2.4 + 0.62 * len(columns), 1.4 + 0.36 * len(rows))
    fig, ax = plt.subplots(figsize=size, layout="constrained")  # room for the colour bar
    data = [[math.nan if v is None else v for v in row] for row in scores]
    cmap = plt.get_cmap("viridis").with_extremes(bad="0.88")
    im = ax.imshow(data, vmin=0.0, vmax=100.0, cmap=cmap, aspect="auto")
    for i, row in enumerate(data):
        for j, v in enumerate(row):
            if math.isfinite(v):
                text = f"{v:.0f}" + (f"\n{notes[i][j]}" if notes[i][j] else "")
                color = "black" if v > 60 else "white"
                ax.text(j, i, text, ha="center", va="center", fontsize=6.5, color=color)
            else:
                ax.text(j, i, "-", ha="center", va="center", fontsize=8, color="0.45")
    ax.set_xticks(range(len(columns)), list(columns), rotation=40, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)), list(rows), fontsize=8)
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.02, label=label)
    fig.suptitle(title, fontsize=9)
    return fig


# ------------------------------------------------------- a sweep report's figures


def _bucket_start(name: str) -> int:
    """``len10-20`` -> 10 (0 if the name holds no number)."""
    found = re.search(r"\d+", name)
    return int(found.group()) if found else 0


def _most_common(values: Sequence[Any]) -> Any:
    values = [v for v in values if v is not None]
    return Counter(values).most_common(1)[0][0] if values else None


def seeds_label(points: Iterable[Point]) -> str:
    """What a figure's points are, from their spreads (None: a point of one run): an axis
    label must not promise error bars over seeds for a figure of one seed."""
    spreads = [std for _, std in points]
    if all(s is None for s in spreads):
        return "one run each"
    if any(s is None for s in spreads):
        return "mean ± std over seeds; no bar: one run"
    return "mean ± std over seeds"


def _panel_points(panels: Mapping[str, Mapping[str, Mapping[int, Point]]]) -> Iterator[Point]:
    """Every point of a figure's panels (panel -> curve -> x -> point)."""
    return (p for curves in panels.values() for points in curves.values() for p in points.values())


def ppl_vs_length(
    panels: Mapping[str, Mapping[str, Mapping[int, Point]]],
    train_len: int | None,
    title: str,
    ylabel: str = "",
    emphasis: Collection[str] = (),
) -> Figure:
    """Log-log perplexity against length, one line per encoder, one panel per protocol.

    Args:
        panels: Panel title (metric kind) -> encoder -> length -> (mean, std).
        train_len: Training length, drawn as a vertical line (None: not drawn).
        title: Figure title.
        ylabel: What the y axes show (default: each panel's title, its metric kind).
        emphasis: Encoders drawn in black with a thicker line, over the others (the
            parents a panel's variants are read against).
    """
    # Up to three panels in a row; more in rows of half of them (four as 2 x 2), so that
    # a figure of many panels is not a strip too wide to read.
    cols = len(panels) if len(panels) <= 3 else math.ceil(len(panels) / 2)
    rows = math.ceil(len(panels) / cols)
    fig, grid = plt.subplots(rows, cols, figsize=(4.6 * cols + 1.6, 4 * rows), squeeze=False)
    axes = list(grid.flat)
    for spare in axes[len(panels) :]:
        spare.set_visible(False)
    axes = axes[: len(panels)]
    names = [e for curves in panels.values() for e in curves]
    color, marker = colours(names), markers(names)
    drawn = seeds_label(_panel_points(panels))
    for ax, (kind, curves) in zip(axes, panels.items(), strict=True):
        for encoder, points in curves.items():
            xs = sorted(points)
            ax.errorbar(
                xs,
                [points[x][0] for x in xs],
                yerr=[points[x][1] or 0.0 for x in xs],
                marker=marker[encoder],
                ms=4,
                capsize=3,
                ls="--" if "+" in encoder else "-",
                color="black" if encoder in emphasis else color[encoder],
                lw=2.4 if encoder in emphasis else 1.5,
                zorder=3 if encoder in emphasis else 2,
                label=encoder,
            )
        if train_len:
            ax.axvline(train_len, color="grey", ls="--", lw=1, label=f"train {train_len}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        lengths = sorted({x for points in curves.values() for x in points})
        ax.set_xticks(lengths, [str(x) for x in lengths])
        ax.xaxis.set_minor_formatter(NullFormatter())
        label_log_axis(ax)
        ax.set_xlabel("evaluation length (tokens)")
        ax.set_ylabel(f"{ylabel or kind} ({drawn})")
        ax.set_title(kind, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    # One legend, beside the panels (inside them it hides the curves), naming the curves
    # of every panel: a run may have one protocol only.
    named: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            named.setdefault(label, handle)
    grid[0][-1].legend(
        list(named.values()), list(named), fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0)
    )
    titled(fig, title, fontsize=10)
    return fig


def titled(fig: Figure, title: str, fontsize: float | None = None) -> None:
    """The figure's title over its panels, the panels laid out below it (``tight_layout``
    alone lets a tall grid's top row run into the title)."""
    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))


def label_log_axis(ax: Any) -> None:
    """Enough labelled ticks on a log y axis: plain numbers (``20``, not ``2x10^1``) at the
    1-2-5 steps inside the drawn range, or at every 1..9 step where fewer than four of
    those fall in it, or five spread over a narrower range (the major ticks alone, one
    per decade, left a range of one decade with a single label, ``10``)."""
    low, high = ax.get_ylim()
    ticks: list[float] = []
    for steps in ((1, 2, 5), (1, 2, 3, 4, 5, 6, 7, 8, 9)):
        ticks = [
            m * 10.0**k
            for k in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
            for m in steps
            if low <= m * 10.0**k <= high
        ]
        if len(ticks) >= 4:
            break
    if len(ticks) < 3:  # a range narrower than 1..9 steps: round steps across it
        ticks = [t for t in MaxNLocator(5).tick_values(low, high) if low <= t <= high]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(low, high)


#: Markers cycled with a period (8) other than the colours' (10), so that the two curves
#: sharing a hue (tab20's dark and light shades) never share a marker too.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def markers(names: Sequence[str]) -> dict[str, str]:
    """A marker per name, in the order :func:`colours` gives colours."""
    unique = list(dict.fromkeys(names))
    return {name: MARKERS[i % len(MARKERS)] for i, name in enumerate(unique)}


def colours(names: Sequence[str]) -> dict[str, Any]:
    """A colour per name, all different up to 20: tab20's ten dark colours, then its ten
    light ones (the default cycle repeats after ten, so an 11th curve took the 1st's).
    One name keeps one colour in every panel of a figure."""
    tab20 = list(matplotlib.color_sequences["tab20"])
    palette = tab20[0::2] + tab20[1::2]
    unique = list(dict.fromkeys(names))
    return {name: palette[i % len(palette)] for i, name in enumerate(unique)}


def position_bands(ys: Sequence[float], per_octave: int = 3) -> tuple[list[float], list[float]]:
    """Mean of a per-position curve over log-spaced bands of positions, ``per_octave``
    bands per doubling: one position each at the start, where the loss falls fastest, ever
    wider towards the end, where position by position it is noise (at small sizes a
    window's every position is scored in a few windows only). Non-finite values are left
    out of their band's mean.

    Args:
        ys: The value at positions 0..L-1.
        per_octave: Bands per doubling of the position.

    Returns:
        Each band's geometric centre (1-based positions, for a log axis) and mean.
    """
    n = len(ys)
    top = math.ceil(per_octave * math.log2(max(n, 1))) + 1
    edges = sorted({0, n} | {min(n, round(2 ** (k / per_octave))) for k in range(top)})
    xs, means = [], []
    for a, b in zip(edges, edges[1:], strict=False):
        band = [float(y) for y in ys[a:b] if math.isfinite(y)]
        if band:
            xs.append(math.sqrt((a + 1) * b))
            means.append(sum(band) / len(band))
    return xs, means


def loss_by_position(
    curves: Mapping[str, Sequence[float]], train_len: int | None, title: str, per_octave: int = 3
) -> Figure:
    """Mean loss against position in the window, averaged over log-spaced bands
    (:func:`position_bands`) on a log axis.

    Args:
        curves: Label -> loss at positions 0..L-1.
        train_len: Training length, drawn as a vertical line.
        title: Figure title.
        per_octave: Bands per doubling of the position.
    """
    fig, ax = plt.subplots(figsize=(6.5, 4))
    color, marker = colours(list(curves)), markers(list(curves))
    for label, ys in curves.items():
        xs, means = position_bands(ys, per_octave)
        ax.plot(xs, means, lw=1.2, color=color[label], marker=marker[label], ms=3, label=label)
    if train_len:
        ax.axvline(train_len, color="grey", ls="--", lw=1, label=f"train {train_len}")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel(f"position in window (1-based; mean over {per_octave} bands per doubling)")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def bleu_by_bucket(
    bars: Mapping[str, Mapping[str, Point]],
    buckets: Sequence[str],
    train_max: int | None,
    title: str,
) -> Figure:
    """Grouped bars: BLEU per source-length bucket, one bar per encoder, std error bars.

    Args:
        bars: Encoder -> bucket name (``len10-20``) -> (mean, std).
        buckets: Bucket names in length order.
        train_max: Longest training source (``max_train_src_len``); a line marks where
            buckets lie wholly beyond it.
        title: Figure title.
    """
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(buckets) + 2), 4))
    width = 0.8 / max(1, len(bars))
    for i, (encoder, values) in enumerate(bars.items()):
        xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(buckets))]
        means = [values.get(b, (math.nan, None))[0] for b in buckets]
        stds = [values.get(b, (math.nan, None))[1] or 0.0 for b in buckets]
        ax.bar(
            xs,
            [0.0 if math.isnan(m) else m for m in means],
            width,
            yerr=stds,
            capsize=2,
            label=encoder,
        )
    if train_max is not None:
        starts = [_bucket_start(b) for b in buckets]
        beyond = [j for j, s in enumerate(starts) if s > train_max]
        if beyond:
            ax.axvline(
                beyond[0] - 0.5,
                color="grey",
                ls="--",
                lw=1,
                label=f"beyond training max {train_max}",
            )
    ax.set_xticks(range(len(buckets)), [b.removeprefix("len") for b in buckets])
    ax.set_ylim(bottom=0)  # BLEU is never negative (all-zero bars centred the axis on 0)
    ax.set_xlabel("source length (tokens)")
    ax.set_ylabel(f"BLEU ({seeds_label(p for v in bars.values() for p in v.values())})")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def learned_label(encoder: str, rs: Sequence[Run]) -> str:
    """``rope (1/3 learned)`` when some of the group's runs did not learn the task (their
    points past the training length are left out); else the encoder's name."""
    gated = [r for r in rs if r.learned in (LEARNED, NOT_LEARNED)]
    k = sum(r.learned == LEARNED for r in gated)
    return f"{encoder} ({k}/{len(rs)} learned)" if k < len(gated) else encoder


def _labels(by_group: Mapping[tuple[str, str], Sequence[Run]], task: str) -> dict[str, str]:
    """Encoder -> its curve label (:func:`learned_label`) in one task's figures."""
    return {e: learned_label(e, rs) for (t, e), rs in by_group.items() if t == task}


def variant_parents(by_group: Mapping[tuple[str, str], Sequence[Run]], task: str) -> dict[str, str]:
    """Variant -> the scheme it modifies, for each of ``task``'s runs labelled as a
    variant (a ``label``, e.g. ``+variant=rope_qknorm``) whose scheme the report has too:
    the scheme its encoder options build on (a mix's most common, DAPE's base:
    :attr:`~posenc.results.Record.builds_on`), else its encoder's (the name the report's
    unlabelled runs of the same encoder class have)."""
    records = {e: rs[0].record for (t, e), rs in by_group.items() if t == task}
    names = {r.encoder_class: e for e, r in records.items() if not r.label}
    out = {}
    for variant, r in records.items():
        parent = (r.builds_on or names.get(r.encoder_class)) if r.label else None
        if parent in records and parent != variant:
            out[variant] = parent
    return out


def _relabel(curves: Mapping[str, Any], labels: Mapping[str, str]) -> dict[str, Any]:
    """``encoder`` and ``encoder+method`` keys renamed with their encoder's label."""
    out = {}
    for key, value in curves.items():
        encoder, plus, ext = key.partition("+")
        base = labels.get(encoder, encoder)
        if plus:  # rope+yarn (1/3 learned): the method right after the encoder's name
            head, paren, tail = base.partition(" (")
            out[f"{head}+{ext}{paren}{tail}"] = value
        else:
            out[base] = value
    return out


def _typed(run: Run, cls: type[R]) -> R:
    """The run's record as the task's record type (an empty one if it is another task's)."""
    return run.record if isinstance(run.record, cls) else cls()


def _at(name: MetricName, split: str, kind: str, extension: str = "") -> bool:
    """Whether ``name`` is ``<split>/<kind>[+<extension>]`` at some length or bucket."""
    return (name.split_name, name.kind, name.extension) == (split, kind, extension) and bool(
        name.where
    )


def _points(
    rows: Sequence[Row], task: str, split: str, kind: str, extension: str = ""
) -> dict[str, dict[MetricName, Point]]:
    """encoder -> metric -> (mean, std) of ``<split>/<kind>[+<extension>]`` at each length
    or bucket, finite means only."""
    out: dict[str, dict[MetricName, Point]] = {}
    for r in rows:
        if r.task == task and _at(r.metric, split, kind, extension) and r.mean is not None:
            out.setdefault(r.encoder, {})[r.metric] = (r.mean, r.std)
    return out


def _extensions(rows: Sequence[Row], split: str, task: str = "lm") -> list[str]:
    """RoPE context-extension methods among the LM metrics of ``split`` (``yarn`` from
    ``test/ppl+yarn@64``), sorted."""
    return sorted(
        {
            ext
            for r in rows
            if r.task == task and r.metric.split_name == split
            for ext in [r.metric.extension]
            if ext
        }
    )


def _length_curves(
    rows: Sequence[Row], split: str, kind: str, extensions: Sequence[str], task: str = "lm"
) -> dict[str, dict[int, Point]]:
    """``encoder`` and ``encoder+method`` -> length -> (mean, std) of one protocol."""
    out: dict[str, dict[int, Point]] = {}
    for ext in ["", *extensions]:
        suffix = f"+{ext}" if ext else ""
        for e, pts in _points(rows, task, split, kind, ext).items():
            curve = {n.length: v for n, v in pts.items() if n.length is not None}
            if curve:
                out[f"{e}{suffix}"] = curve
    # Each encoder's methods right after it (plain curves come first, in display order).
    order: dict[str, int] = {}
    for label in out:
        order.setdefault(label.partition("+")[0], len(order))
    return dict(
        sorted(out.items(), key=lambda kv: (order[kv[0].partition("+")[0]], "+" in kv[0], kv[0]))
    )


def _lm_figures(
    runs: Sequence[Run], by_group: Mapping[tuple[str, str], Sequence[Run]], rows: Sequence[Row]
) -> dict[str, Figure]:
    """The LM figures of each LM table (``lm``, or ``lm_same_lr`` and ``lm_tuned_lr``)."""
    figs: dict[str, Figure] = {}
    for task in sorted({r.task for r in runs if r.base_task == "lm"}):
        figs |= _lm_task_figures(task, [r for r in runs if r.task == task], by_group, rows)
    return figs


def _lm_task_figures(
    task: str,
    lm: Sequence[Run],
    by_group: Mapping[tuple[str, str], Sequence[Run]],
    rows: Sequence[Row],
) -> dict[str, Figure]:
    train_len = _most_common([_typed(r, LMRecord).seq_len for r in lm])
    labels = _labels(by_group, task)
    figs: dict[str, Figure] = {}
    splits = sorted({m.split_name for r in lm for m in r.record.metrics if m.where})
    families: dict[str, list[str]] = {}  # parent -> it and its variants, in every split
    for variant, parent in variant_parents(by_group, task).items():
        families.setdefault(parent, [parent]).append(variant)
    for split in splits:
        panels = {}
        extensions = _extensions(rows, split, task)
        for kind in ("ppl", "ppl_sw"):
            curves = _length_curves(rows, split, kind, extensions, task)
            if curves:
                panels[f"{split}/{kind}"] = _relabel(curves, labels)
        if panels:
            figs[f"{task}_{split}_ppl_vs_length"] = ppl_vs_length(
                panels, train_len, f"LM {split} perplexity by evaluation length"
            )
        plain = _length_curves(rows, split, "ppl", [], task) if families else {}
        if plain:
            beside = {
                parent: _relabel({n: plain[n] for n in names if n in plain}, labels)
                for parent, names in families.items()
            }
            figs[f"{task}_{split}_variants_vs_parents"] = ppl_vs_length(
                beside,
                train_len,
                f"LM {split} perplexity (non-overlapping windows): each variant beside "
                "the scheme it modifies (black)",
                ylabel=f"{split}/ppl",
                emphasis={labels.get(parent, parent) for parent in families},
            )
        by_position: dict[str, list[float]] = {}
        for (t, encoder), rs in by_group.items():
            if t != task:
                continue
            for ext in ["", *extensions]:
                suffix = f"+{ext}" if ext else ""
                loss_curves = [(r, _typed(r, LMRecord).loss_by_position) for r in rs]
                names = {
                    n
                    for r, by_name in loss_curves
                    for n in by_name
                    if _at(n, split, "ppl", ext) and r.counts(n)
                }
                if not names:
                    continue
                longest = max(names, key=lambda n: n.length or 0)
                arrays = [
                    by_name[longest]
                    for r, by_name in loss_curves
                    if longest in by_name and r.counts(longest)
                ]
                label = next(iter(_relabel({f"{encoder}{suffix}": 0}, labels)))
                label += f" (L={longest.where}, n={len(arrays)})"
                by_position[label] = [sum(col) / len(col) for col in zip(*arrays, strict=False)]
        if by_position:
            figs[f"{task}_{split}_loss_by_position"] = loss_by_position(
                by_position, train_len, f"LM {split}: loss by position at the longest length"
            )
        means = passkey_means({k: v for k, v in by_group.items() if k[0] == task}, split)
        if means:
            figs[f"{task}_{split}_passkey"] = passkey_heatmaps(
                means,
                train_len,
                f"LM {split}: passkey accuracy by length and needle depth (mean over seeds)",
            )
    return figs


#: One encoder's passkey grid over seeds: lengths, depths, [length][depth] means, n runs,
#: and per length what an empty row means ("skipped", or "not learned" when every run that
#: has it did not learn the task).
PasskeyMean = tuple[Sequence[int | str], list[float], list[list[float]], int, list[str]]


def passkey_means(
    by_group: Mapping[tuple[str, str], Sequence[Run]], split: str
) -> dict[str, PasskeyMean]:
    """Per LM encoder, the mean over its runs of the passkey accuracy grid of ``split``.

    A cell's mean is over the runs with a finite value there (NaN: a length the encoder
    cannot run) that count (lengths past the training one: runs that learned the task);
    runs whose lengths or depths differ from the group's most common grid are left out.
    """
    out: dict[str, PasskeyMean] = {}
    for (task, encoder), rs in by_group.items():
        blocks = {
            id(r): block
            for r in rs
            for block in [_typed(r, LMRecord).passkey]
            if block is not None and split in block.accuracy
        }
        have = [r for r in rs if id(r) in blocks] if task.startswith("lm") else []
        if not have:
            continue
        shape = _most_common(
            [(tuple(blocks[id(r)].lengths), tuple(blocks[id(r)].depths)) for r in have]
        )
        grids = [
            r for r in have if (tuple(blocks[id(r)].lengths), tuple(blocks[id(r)].depths)) == shape
        ]
        lengths, depths = shape
        mean, blank = [], []
        for i, length in enumerate(lengths):
            counted = [r for r in grids if r.counts(MetricName.of(split, "passkey", length))]
            blank.append("skipped" if counted else "not learned")
            row = []
            for j in range(len(depths)):
                vals = [
                    v
                    for r in counted
                    for v in [blocks[id(r)].accuracy[split][i][j]]
                    if isinstance(v, int | float) and math.isfinite(v)
                ]
                row.append(sum(vals) / len(vals) if vals else math.nan)
            mean.append(row)
        out[learned_label(encoder, rs)] = (list(lengths), list(depths), mean, len(grids), blank)
    return out


def passkey_heatmaps(
    means: Mapping[str, PasskeyMean],
    train_len: int | None,
    title: str,
    xlabel: str = "needle depth",
) -> Figure:
    """One accuracy heatmap (length x depth, or what ``xlabel`` names) per encoder, four
    to a row."""
    cols = min(4, len(means))
    rows = math.ceil(len(means) / cols)
    first = next(iter(means.values()))
    fig, axes = plt.subplots(
        rows,
        cols,
        squeeze=False,
        figsize=(cols * (1.6 + 0.8 * len(first[1])), rows * (1.4 + 0.45 * len(first[0]))),
    )
    panels = list(axes.flat)
    for ax, (encoder, (lengths, depths, grid, n, blank)) in zip(
        panels, means.items(), strict=False
    ):
        label = f"{encoder} (n={n})"
        heatmap_figure(grid, lengths, depths, train_len, label, ax=ax, blank=blank, xlabel=xlabel)
    for ax in panels[len(means) :]:
        ax.axis("off")
    titled(fig, title, fontsize=10)
    return fig


def _mt_figures(
    runs: Sequence[Run], by_group: Mapping[tuple[str, str], Sequence[Run]], rows: Sequence[Row]
) -> dict[str, Figure]:
    figs: dict[str, Figure] = {}
    for task in sorted({r.task for r in runs if r.base_task == "mt"}):
        mt = [r for r in runs if r.task == task]
        for split in sorted({str(_typed(r, MTRecord).eval_split) for r in mt}):
            points = _points(rows, task, split, "bleu")
            by_bucket = {e: {n.where: p for n, p in pts.items()} for e, pts in points.items()}
            bars = _relabel(by_bucket, _labels(by_group, task))
            # Every bucket gets a slot, also one no run had sentences in (no bar there).
            buckets = sorted(
                {r.metric.where for r in rows if r.task == task and _at(r.metric, split, "bleu")},
                key=_bucket_start,
            )
            if buckets:
                train_max = _most_common([_typed(r, MTRecord).max_train_src_len for r in mt])
                figs[f"{task}_{split}_bleu_by_length"] = bleu_by_bucket(
                    bars, buckets, train_max, f"MT {split} BLEU by source length"
                )
    return figs


def accuracy_vs_size(
    panels: Mapping[str, Mapping[str, Mapping[int, Point]]],
    trained: tuple[int, int] | None,
    title: str,
) -> Figure:
    """Accuracy (%) against instance size, one line per encoder (a band of one std), one
    panel per metric; the trained sizes shaded.

    Args:
        panels: Metric -> encoder -> size -> (mean, std).
        trained: The training sizes ``(lo, hi)`` (None: not drawn).
        title: Figure title.
    """
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 4), squeeze=False)
    color_of = colours([e for curves in panels.values() for e in curves])
    for ax, (metric, curves) in zip(axes[0], panels.items(), strict=True):
        if trained:
            ax.axvspan(trained[0] - 0.5, trained[1] + 0.5, color="0.92", zorder=0)
        for encoder, points in curves.items():
            xs = sorted(points)
            mean = [points[x][0] for x in xs]
            std = [points[x][1] or 0.0 for x in xs]
            color = color_of[encoder]
            rand = encoder.partition(" ")[0].endswith("_rand")  # "rope_rand (1/3 learned)"
            ax.plot(xs, mean, color=color, lw=1.4, ls="--" if rand else "-", label=encoder)
            ax.fill_between(
                xs,
                [m - s for m, s in zip(mean, std, strict=True)],
                [m + s for m, s in zip(mean, std, strict=True)],
                color=color,
                alpha=0.15,
                lw=0,
            )
        ax.set(
            xlabel="instance size (shaded: trained)",
            ylabel="accuracy (%)",
            ylim=(-2, 102),
            title=metric,
        )
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2, loc="upper right")
    titled(fig, title)
    return fig


def _algo_figures(by_group: Mapping[tuple[str, str], Sequence[Run]]) -> dict[str, Figure]:
    """One figure per algorithmic problem, from each run's per-size accuracy; past the
    trained sizes, only runs that learned the task count (:meth:`Run.counts`)."""
    figs = {}
    overview: dict[str, dict[str, dict[int, Point]]] = {}
    for task in sorted({t for t, _ in by_group if t.startswith("algo_")}):
        panels: dict[str, dict[str, dict[int, Point]]] = {"seq_acc": {}, "acc": {}}
        runs = [r for (t, _), rs in by_group.items() if t == task for r in rs]
        for (t, encoder), rs in by_group.items():
            if t != task:
                continue
            records = [(r, _typed(r, AlgoRecord)) for r in rs]
            sizes = sorted({n for _, rec in records for n in rec.by_size})
            for metric, curves in panels.items():
                curve = {}
                for n in sizes:
                    mean, std, count, _ = summarize(
                        rec.by_size.get(n, {}).get(metric)
                        for r, rec in records
                        if r.counts(rec.size_metric(metric, n))
                    )
                    if count and mean is not None:
                        curve[n] = (mean, std)
                if curve:
                    curves[learned_label(encoder, rs)] = curve
        algo = [_typed(r, AlgoRecord) for r in runs]
        trained = _most_common([tuple(rec.train_lengths) or None for rec in algo])
        problem = _most_common([rec.problem for rec in algo])
        shape = _most_common([rec.shape for rec in algo])
        if any(panels.values()):
            figs[f"{task}_accuracy_vs_size"] = accuracy_vs_size(
                {k: v for k, v in panels.items() if v},
                trained,
                f"{problem} ({shape}): test accuracy by instance size",
            )
            arm = runs[0].arm if runs else ""
            overview[f"{problem} ({shape}{', ' + arm if arm else ''}): seq_acc"] = panels["seq_acc"]
    if len(overview) > 1:
        drawn = seeds_label(_panel_points(overview))
        figs["algo_seq_acc_vs_size"] = accuracy_vs_size(
            overview, trained, f"Exact-match accuracy by instance size ({drawn})"
        )
    return figs


#: The metric of the accuracy by length x pairs heatmaps.
PAIRS_METRIC = "acc"


def pair_columns(variant_pairs: Mapping[str, int]) -> dict[int, str]:
    """Number of pairs -> the test variant that has it, by number of pairs (two variants
    with as many pairs: the training distribution's, ``""``, is drawn)."""
    columns: dict[int, str] = {}
    for variant, pairs in sorted(variant_pairs.items(), key=lambda vp: (vp[1], vp[0] != "")):
        columns.setdefault(pairs, variant)
    return columns


def pairs_means(
    by_group: Mapping[tuple[str, str], Sequence[Run]], rows: Sequence[Row], task: str
) -> dict[str, PasskeyMean]:
    """Per encoder of ``task`` (a problem tested at several numbers of key-value pairs,
    mqar), its :data:`PAIRS_METRIC` by size bucket and number of pairs, in [0, 1]: the
    report's means over seeds (:func:`posenc.report.aggregate`), so past the trained
    sizes only runs that learned the task count. Empty when its runs record no pairs.
    """
    records = [_typed(r, AlgoRecord) for (t, _), rs in by_group.items() if t == task for r in rs]
    variant_pairs = _most_common([tuple(sorted(rec.variant_pairs.items())) for rec in records])
    if not records or not variant_pairs:
        return {}
    columns = pair_columns(dict(variant_pairs))
    buckets = _most_common([tuple(rec.buckets) for rec in records])
    hi = _most_common([max(rec.train_lengths, default=None) for rec in records])
    trained = [hi is not None and _bucket_start(b) <= hi for b in buckets]
    labels = [b.removeprefix("len") + " (train)" * t for b, t in zip(buckets, trained, strict=True)]
    cells = {(r.encoder, r.metric): r for r in rows if r.task == task}
    name = records[0].variant_metric
    out: dict[str, PasskeyMean] = {}
    for (t, encoder), rs in by_group.items():
        if t != task:
            continue
        grid, blank = [], []
        for b in buckets:
            found = [cells.get((encoder, name(PAIRS_METRIC, v, b))) for v in columns.values()]
            grid.append([math.nan if c is None or c.mean is None else c.mean / 100 for c in found])
            left_out = any(c is not None and c.mean is None and c.dropped for c in found)
            blank.append("not learned" if left_out else "not tested")
        out[learned_label(encoder, rs)] = (labels, list(map(float, columns)), grid, len(rs), blank)
    return out


def _pairs_figures(
    by_group: Mapping[tuple[str, str], Sequence[Run]], rows: Sequence[Row]
) -> dict[str, Figure]:
    """``<task>_acc_by_length_and_pairs``: one heatmap per encoder, for each algorithmic
    table whose runs were tested at several numbers of key-value pairs."""
    figs = {}
    for task in sorted({t for t, _ in by_group if t.startswith("algo_")}):
        means = pairs_means(by_group, rows, task)
        if means:
            figs[f"{task}_acc_by_length_and_pairs"] = passkey_heatmaps(
                means,
                None,
                f"{task}: test {PAIRS_METRIC} by length and number of key-value pairs "
                f"(mean over seeds)",
                xlabel="key-value pairs",
            )
    return figs


def figures(
    runs: Sequence[Run], by_group: Mapping[tuple[str, str], Sequence[Run]], rows: Sequence[Row]
) -> dict[str, Figure]:
    """All report figures by file stem."""
    return (
        _lm_figures(runs, by_group, rows)
        | _mt_figures(runs, by_group, rows)
        | _algo_figures(by_group)
        | _pairs_figures(by_group, rows)
    )


def close(fig: Figure) -> None:
    """Free a figure that was not saved (matplotlib keeps every open one)."""
    plt.close(fig)


def save(figs: Mapping[str, Figure], out: Path, writer: Any = None) -> list[Path]:
    """Write each figure as ``<out>/<name>.png`` and, with a ``SummaryWriter``, to
    TensorBoard under ``report/<name>``.

    Returns:
        The PNG paths.
    """
    paths = []
    for name, fig in figs.items():
        path = out / f"{name}.png"
        fig.savefig(path, dpi=120)
        paths.append(path)
        if writer is not None:
            writer.add_figure(f"report/{name}", fig, 0)  # closes the figure
        else:
            plt.close(fig)
    return paths


def summary_writer(tb_dir: Path) -> Any:
    """A TensorBoard ``SummaryWriter`` for ``tb_dir``."""
    from torch.utils.tensorboard import SummaryWriter  # torch is slow to import: only here

    return SummaryWriter(log_dir=str(tb_dir))
