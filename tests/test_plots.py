"""A run's own figures (posenc/plots.py); the sweep report's are in tests/test_report.py."""

from __future__ import annotations

import math

import pytest

from posenc.plots import ppl_vs_length_figure


@pytest.mark.parametrize("bad", [math.inf, math.nan, 0.0])
def test_ppl_figure_leaves_out_what_a_log_axis_cannot_show_with_a_note(bad: float) -> None:
    fig = ppl_vs_length_figure({"ppl": {16: 5.0, 32: bad}, "ppl_sw": {16: bad, 32: bad}}, 16)
    fig.canvas.draw()  # matplotlib raised "Data cannot be log-scaled" here
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    curves = {line.get_label(): list(line.get_xydata()) for line in ax.get_lines()}
    assert curves["ppl"] == [pytest.approx([16.0, 5.0])]
    assert "ppl_sw" not in curves
    (note,) = [t.get_text() for t in fig.texts]
    assert note == f"not drawn (not a positive finite number): ppl@32 = {bad}, " \
        f"ppl_sw@16 = {bad}, ppl_sw@32 = {bad}"  # fmt: skip


def test_ppl_figure_with_no_finite_value_is_drawn_empty() -> None:
    fig = ppl_vs_length_figure({"ppl": {16: math.inf, 32: math.inf}}, 16)
    fig.canvas.draw()
    assert [t.get_text() for t in fig.axes[0].texts] == ["no value to draw"]
    assert "ppl@16 = inf, ppl@32 = inf" in fig.texts[0].get_text()


def test_a_grid_of_heat_maps_keeps_its_title_above_every_panel() -> None:
    """Sixteen schemes' heat maps, four to a row: the figure's title ends above the top
    row's panel titles (``tight_layout`` alone laid the panels over it)."""
    from posenc.plots import close, passkey_heatmaps

    lengths, pairs = [32, 64, 128, 256, 512, 1024, 2048], [2, 4, 8, 16]
    grid = [[0.5] * len(pairs) for _ in lengths]
    means = {f"scheme{i}": (lengths, pairs, grid, 3, ["skipped"] * len(lengths)) for i in range(16)}
    fig = passkey_heatmaps(means, 32, "a title over sixteen panels", xlabel="pairs")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    title = fig._suptitle.get_window_extent(renderer)  # type: ignore[union-attr]
    tops = [ax.title.get_window_extent(renderer).y1 for ax in fig.axes if ax.get_title()]
    close(fig)
    assert len(tops) >= 16 and title.y0 >= max(tops), (title.y0, max(tops))


@pytest.mark.parametrize(("n", "shape"), [(2, (1, 2)), (3, (1, 3)), (4, (2, 2)), (5, (2, 3))])
def test_many_panels_wrap_into_rows_each_with_its_curves(n: int, shape: tuple[int, int]) -> None:
    """Up to three panels side by side, more in rows (four as 2 x 2); every panel drawn
    with its own curves, spare grid cells hidden."""
    from posenc.plots import ppl_vs_length

    panels = {f"p{i}": {f"e{i}": {16: (5.0 + i, 0.1), 32: (6.0 + i, 0.1)}} for i in range(n)}
    fig = ppl_vs_length(panels, 16, "t")
    shown = [ax for ax in fig.axes if ax.get_visible() and ax.get_title()]
    assert [ax.get_title() for ax in shown] == list(panels)
    rows = sorted({round(ax.get_position().y0, 3) for ax in shown})
    cols = sorted({round(ax.get_position().x0, 3) for ax in shown})
    assert (len(rows), len(cols)) == shape
    for i, ax in enumerate(shown):
        assert [c.get_label() for c in ax.containers] == [f"e{i}"]
        assert list(ax.containers[0][0].get_ydata()) == [5.0 + i, 6.0 + i]
