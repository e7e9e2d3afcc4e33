"""The sweep report on hand-made run directories: statistics by hand, NaN, failures."""

from __future__ import annotations

import ast
import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest

from posenc import encoders
from posenc.report import build_report, main, metric_key, summarize
from posenc.report_rows import encoder_key, encoder_order
from tests.conftest import ROOT


def write_run(d: Path, task: str, encoder: str, seed: int, metrics: dict[str, float],
              **extra: Any) -> None:
    """A metrics.json like the jobs write (only the fields the report reads)."""
    d.mkdir(parents=True)
    data = {"task": task, "encoder": encoder, "seed": seed, "metrics": metrics,
            "n_params": 1000, "tokens_per_s": 100.0 + seed, "peak_memory_mb": 50.0,
            "train_time_s": 2.0, "config": {"seed": seed, "model": {"d_model": 16}}} | extra
    (d / "metrics.json").write_text(json.dumps(data))  # NaN is written as NaN, as the jobs do


LM_EXTRA = {
    "seq_len": 16,
    "protocols": {"nonoverlap": "ppl@L: non-overlapping windows"},
}


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    root = tmp_path / "sweep"
    nan = float("nan")
    for seed, (p16, p64) in enumerate([(10.0, 20.0), (12.0, nan), (14.0, 26.0)]):
        write_run(root / f"{seed}_lm_rope", "lm", "rope", seed,
                  {"test/ppl@16": p16, "test/ppl@64": p64, "val/loss": 2.0},
                  loss_by_position={"test/ppl@16": [1.0] * 16, "test/ppl@64": [2.0] * 64},
                  **LM_EXTRA)
    write_run(root / "3_lm_learned", "lm", "learned", 0,
              {"test/ppl@16": 9.0, "test/ppl@64": nan}, skipped={"test/ppl@64": "max_len"},
              loss_by_position={"test/ppl@16": [1.5] * 16}, **LM_EXTRA)
    for seed, bleu in enumerate([20.0, 30.0]):
        write_run(root / f"mt/{seed}_mt_rope", "mt", "rope", seed,
                  {"test/bleu": bleu, "test/bleu@len0-10": bleu + 5, "test/bleu@len10+": nan},
                  bleu_signature="BLEU: nrefs:1", max_train_src_len=9, eval_split="test")
    failed = root / "6_lm_xl"
    failed.mkdir()
    (failed / "error.json").write_text(json.dumps({
        "error_type": "FloatingPointError", "message": "training loss is nan at step 2",
        "traceback": "...", "overrides": ["encoder=xl"], "task": "lm", "encoder": "xl",
        "seed": 0}))
    missing = root / "7_lm_shaw"
    (missing / ".hydra").mkdir(parents=True)
    (missing / ".hydra" / "overrides.yaml").write_text("- encoder=shaw\n")
    (missing / "run.log").write_text("[..][posenc][INFO] - tokenizer ready\n[..][lightning]"
                                     "[INFO] - Epoch 0: step 40\n")
    (root / "8_lm_deberta").mkdir()
    (root / "8_lm_deberta" / "metrics.json").write_text('{"task": "lm", "metr')  # cut short
    return root


def read_csv(path: Path) -> dict[tuple[str, str, str], dict[str, str]]:
    with path.open() as f:
        return {(r["task"], r["encoder"], r["metric"]): r for r in csv.DictReader(f)}


def test_means_and_sample_stds_by_hand(sweep: Path) -> None:
    rep = build_report(sweep)
    rows = read_csv(sweep / "report" / "report.csv")
    r = rows["lm", "rope", "test/ppl@16"]
    assert float(r["mean"]) == pytest.approx(12.0)
    assert float(r["std"]) == pytest.approx(2.0)  # sqrt((4 + 0 + 4) / (3 - 1))
    assert (r["n"], r["skipped"]) == ("3", "0")
    r = rows["mt", "rope", "test/bleu"]
    assert float(r["mean"]) == pytest.approx(25.0)
    assert float(r["std"]) == pytest.approx(math.sqrt(50.0))
    assert float(r["tokens_per_s"]) == pytest.approx(100.5)
    assert float(rows["lm", "rope", "val/loss"]["n_params"]) == 1000
    assert len(rep.runs) == 6


def test_nan_is_skipped_not_averaged(sweep: Path) -> None:
    build_report(sweep)
    rows = read_csv(sweep / "report" / "report.csv")
    r = rows["lm", "rope", "test/ppl@64"]
    assert float(r["mean"]) == pytest.approx(23.0)
    assert float(r["std"]) == pytest.approx(math.sqrt(18.0))
    assert (r["n"], r["skipped"]) == ("2", "1")
    r = rows["lm", "learned", "test/ppl@64"]  # only NaN: no mean, no std
    assert (r["mean"], r["std"], r["n"], r["skipped"]) == ("", "", "0", "1")
    r = rows["lm", "learned", "test/ppl@16"]  # one run: the std is blank, not 0
    assert (r["mean"], r["std"], r["n"]) == ("9.0", "", "1")
    assert rows["mt", "rope", "test/bleu@len10+"]["skipped"] == "2"


def test_failed_missing_and_unreadable_runs_are_listed(sweep: Path) -> None:
    rep = build_report(sweep)
    status = {f.dir.name: f for f in rep.failures}
    assert status["6_lm_xl"].status == "failed"
    assert status["6_lm_xl"].error == "FloatingPointError: training loss is nan at step 2"
    assert (status["6_lm_xl"].encoder, status["6_lm_xl"].seed) == ("xl", 0)
    assert status["7_lm_shaw"].status == "missing"
    assert status["8_lm_deberta"].status == "unreadable"
    md = (sweep / "report" / "report.md").read_text()
    assert "| 6_lm_xl | failed | lm | xl | 0 | FloatingPointError: training loss is nan" in md
    assert "7_lm_shaw | missing" in md and "8_lm_deberta | unreadable" in md
    assert "6 finished, 1 failed, 2 missing or unreadable" in md


def test_markdown_tables_and_protocols(sweep: Path) -> None:
    build_report(sweep)
    md = (sweep / "report" / "report.md").read_text()
    assert "| rope | 12 ± 2 | 23 ± 4.2 (n=2) |" in md  # ppl@16, ppl@64 for 3 runs
    assert "| learned | 9 | skipped (1) |" in md
    assert "> **nonoverlap**: ppl@L: non-overlapping windows" in md
    assert "> **bleu_signature**: BLEU: nrefs:1" in md


def test_figures_and_tensorboard(sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "elsewhere"
    rep = build_report(sweep, out)
    pngs = sorted(p.name for p in rep.files if p.suffix == ".png")
    assert pngs == ["lm_test_loss_by_position.png", "lm_test_ppl_vs_length.png",
                    "mt_test_bleu_by_length.png"]
    for name in pngs:
        assert (out / name).stat().st_size > 1000
    assert list((out / "tb").glob("events.out.tfevents*"))
    assert not (sweep / "report").exists()


def test_report_dir_is_not_read_back(sweep: Path) -> None:
    build_report(sweep)
    # A stray metrics.json inside the report folder (e.g. copied there) is not a run.
    write_run(sweep / "report" / "copy", "lm", "rope", 9, {"test/ppl@16": 1e9})
    rows = read_csv(sweep / "report" / "report.csv")
    build_report(sweep)
    assert read_csv(sweep / "report" / "report.csv") == rows


def test_rerun_that_succeeded_counts_as_finished(tmp_path: Path) -> None:
    d = tmp_path / "run"
    write_run(d, "lm", "rope", 0, {"test/ppl@16": 5.0})
    (d / "error.json").write_text(json.dumps({"error_type": "OSError", "message": "old"}))
    rep = build_report(tmp_path)
    assert len(rep.runs) == 1 and not rep.failures


def test_empty_and_absent_dirs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rep = build_report(tmp_path)
    assert not rep.runs and not rep.failures
    assert "No metrics.json or error.json found" in (tmp_path / "report" / "report.md").read_text()
    assert main([str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_summarize_and_order() -> None:
    assert summarize([1.0, None, float("inf"), float("nan"), 3.0, "x"]) == (2.0, math.sqrt(2), 2, 4)
    assert summarize([]) == (None, None, 0, 0)
    names = ["val/loss", "test/ppl_sw@16", "test/ppl@1024", "test/ppl@128", "test/bleu@len30+",
             "test/bleu", "test/bleu@len10-20", "test/chrf"]
    assert sorted(names, key=metric_key) == [
        "test/bleu", "test/bleu@len10-20", "test/bleu@len30+", "test/ppl@128", "test/ppl@1024",
        "test/chrf", "test/ppl_sw@16", "val/loss"]


def test_every_registered_encoder_has_its_place_in_the_order() -> None:
    order = encoder_order()
    assert sorted(order) == encoders.available()
    # NoPE first, absolute before relative, thresholded relative (FIRE) last.
    assert order[0] == "none" and order[-1] == "fire"
    assert max(map(order.index, ("learned", "sinusoidal"))) < order.index("alibi")
    assert sorted(["zzz", "rope", "none", "aaa"], key=encoder_key) == ["none", "rope", "aaa",
                                                                       "zzz"]


def _imports(module: str) -> set[str]:
    tree = ast.parse((ROOT / "posenc" / f"{module}.py").read_text())
    return {node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module} | {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
        for alias in node.names}


def test_report_modules_have_no_import_cycle() -> None:
    """report -> report_plots -> report_rows, and never back (lazily or for types)."""
    assert "posenc.report" not in _imports("report_plots")
    assert not {"posenc.report", "posenc.report_plots"} & _imports("report_rows")


def test_a_config_errors_problems_and_a_dead_jobs_last_log_line_are_in_the_table(
        sweep: Path) -> None:
    """The error column holds the whole message, not a header cut at its colon, and a job
    that died without a word (SIGKILL, the OOM killer) is named with how far it got."""
    (sweep / "6_lm_xl" / "error.json").write_text(json.dumps({
        "error_type": "ConfigError", "task": "lm", "encoder": "xl", "seed": 0,
        "message": "invalid config (2 problems):\n  seed=-1: must be an integer >= 0\n"
                   "  task.seq_len=0: must be a positive integer"}))
    build_report(sweep)
    md = (sweep / "report" / "report.md").read_text()
    assert ("ConfigError: invalid config (2 problems): seed=-1: must be an integer >= 0 "
            "task.seq_len=0: must be a positive integer |") in md
    assert ("| 7_lm_shaw | missing | ? | ? |  | no metrics.json and no error.json: killed"
            " (e.g. by the OOM killer), or still running; last log line: [..][lightning][INFO]"
            " - Epoch 0: step 40 |") in md


def test_algorithmic_runs_are_grouped_by_problem_with_per_size_figures(tmp_path: Path) -> None:
    """Each problem (and shape) is a table of its own; exact match comes first; the
    per-size curves are averaged over seeds into each problem's figure and an overview."""
    root = tmp_path / "sweep"
    for i, (problem, shape, encoder, seed, acc) in enumerate([
        ("copy", "decoder", "rope", 0, 100.0), ("copy", "decoder", "rope", 1, 80.0),
        ("copy", "decoder", "rope_rand", 0, 50.0), ("sort", "decoder", "rope", 0, 30.0),
        ("sort", "encdec", "t5", 0, 20.0),
    ]):
        write_run(root / f"{i}", "algo", encoder, seed,
                  {"test/acc@len1-4": acc, "test/seq_acc@len1-4": acc / 2},
                  problem=problem, shape=shape, train_lengths=[1, 4],
                  by_size={"1": {"count": 2, "seq_acc": acc, "acc": acc},
                           "2": {"count": 2, "seq_acc": acc / 2, "acc": acc}})
    report = build_report(root, tensorboard=False)
    rows = read_csv(root / "report" / "report.csv")
    assert {t for t, _, _ in rows} == {"algo_copy", "algo_sort", "algo_sort_encdec"}
    assert float(rows["algo_copy", "rope", "test/acc@len1-4"]["mean"]) == 90.0
    assert float(rows["algo_copy", "rope", "test/acc@len1-4"]["std"]) == pytest.approx(
        math.sqrt(200))
    assert rows["algo_copy", "rope_rand", "test/acc@len1-4"]["n"] == "1"
    md = (root / "report" / "report.md").read_text()
    copy = md[md.index("## algo_copy"):md.index("## algo_sort")]
    assert copy.index("test/seq_acc@len1-4") < copy.index("test/acc@len1-4")
    names = sorted(p.name for p in report.files if p.suffix == ".png")
    assert names == ["algo_copy_accuracy_vs_size.png", "algo_seq_acc_vs_size.png",
                     "algo_sort_accuracy_vs_size.png",
                     "algo_sort_encdec_accuracy_vs_size.png"]
    assert "![algo_seq_acc_vs_size](algo_seq_acc_vs_size.png)" in md
    from posenc.report import groups
    from posenc.report_plots import figures

    fig = figures(report.runs, groups(report.runs), report.rows)["algo_copy_accuracy_vs_size"]
    seq_acc = fig.axes[0]
    curves = {line.get_label(): list(line.get_ydata()) for line in seq_acc.lines}
    assert curves == {"rope": [90.0, 45.0], "rope_rand": [50.0, 25.0]}  # means over seeds


def test_ppl_figure_gives_each_of_eleven_curves_its_own_colour_and_plain_ticks() -> None:
    """Matplotlib's default cycle repeats after ten lines: an eleventh encoder took the
    first's colour. Over more than a decade, minor tick labels overprinted each other."""
    from matplotlib.colors import to_hex

    from posenc.report_plots import ppl_vs_length

    names = ["none", "learned", "sinusoidal", "shaw", "xl", "deberta", "rope", "rope+ntk",
             "rope+yarn", "rope+linear", "alibi"]
    curves = {n: {128: (5.0 + i, None), 2048: (5.0 + 30 * i, None)}
              for i, n in enumerate(names)}
    fig = ppl_vs_length({"test/ppl": curves}, 128, "t")
    ax = fig.axes[0]
    drawn = [to_hex(c[0].get_color()) for c in ax.containers]  # each errorbar's line
    assert len(drawn) == 11 and len(set(drawn)) == 11, drawn
    fig.canvas.draw()
    assert all(t.get_text() == "" for t in ax.yaxis.get_minorticklabels())
    assert "1e+02" not in [t.get_text() for t in ax.yaxis.get_majorticklabels()]
    assert "100" in [t.get_text() for t in ax.yaxis.get_majorticklabels()]
    # The one legend names the curves of every panel, also those only one panel has.
    two = ppl_vs_length({"test/ppl": {"rope": curves["rope"], "alibi": curves["alibi"]},
                         "test/ppl_sw": {"rope": curves["rope"]}}, 128, "t")
    legend = two.axes[-1].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["train 128", "rope", "alibi"]


def test_a_metric_that_is_not_a_number_is_a_failure_not_a_skip(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A list where a number belongs is a malformed result: listed as unreadable, never
    counted as a skipped length, and never "no failures" (#38)."""
    write_run(tmp_path / "0_lm_rope", "lm", "rope", 0, {"test/ppl@16": 5.0})
    write_run(tmp_path / "1_lm_rope", "lm", "rope", 1,
              {"test/ppl@16": [5.0, 6.0], "test/ppl@64": float("nan")})
    assert main([str(tmp_path), "--no-tensorboard"]) == 0
    assert "{'unreadable': 1}" in capsys.readouterr().out
    rep = build_report(tmp_path, tensorboard=False)
    (bad,) = rep.failures
    assert bad.dir.name == "1_lm_rope" and bad.status == "unreadable"
    assert bad.error == "metrics.json: metric 'test/ppl@16' is [5.0, 6.0], not a number"
    row = next(r for r in rep.rows if r.metric == "test/ppl@16")
    assert (row.n, row.skipped) == (1, 0)


def test_an_unwritable_out_folder_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "sweep" / "0_lm_rope", "lm", "rope", 0, {"test/ppl@16": 5.0})
    (tmp_path / "a_file").write_text("not a folder")
    assert main([str(tmp_path / "sweep"), "--out", str(tmp_path / "a_file" / "report")]) == 2
    assert capsys.readouterr().err == (
        f"error: --out {tmp_path / 'a_file' / 'report'}: cannot create or write this folder "
        f"(Not a directory); give another --out\n")
