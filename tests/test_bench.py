"""Smoke test of experiments/bench.py: it runs, writes its JSON, every section reports.

No timing thresholds: the numbers depend on the machine and its load.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from posenc.encoders import available

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "experiments" / "bench.py"
ROW_KEYS = {"what", "median", "ratio", "goal", "met", "note", "raw"}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "tmp.json"
    # One thread: the quick sizes are tiny, and a shared machine then adds less noise.
    cmd = [sys.executable, str(BENCH), "--quick", "--threads", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| what | median" in proc.stdout
    return json.loads(out.read_text())


def test_header(report: dict[str, Any]) -> None:
    meta = report["meta"]
    assert meta["torch"] == torch.__version__
    assert meta["threads"] == 1
    assert "--quick" in meta["command"]
    assert list(report["sections"]) == ["train", "memory", "overhead", "compile", "decode"]
    assert isinstance(report["unmet_goals"], list)


def test_every_row_has_the_columns_and_a_unit_baseline(report: dict[str, Any]) -> None:
    for name, section in report["sections"].items():
        assert section["unit"], name
        rows = section["rows"]
        assert rows, name
        for row in rows:
            assert set(row) == ROW_KEYS, (name, row["what"])
            if row["goal"] is not None and row["ratio"] is not None:
                assert isinstance(row["met"], bool)
        baselines = [r for r in rows if r["what"].startswith(section["baseline"])]
        assert baselines and all(r["ratio"] == pytest.approx(1.0) for r in baselines), name


def test_compile_times_eager_and_compiled_steps(report: dict[str, Any]) -> None:
    section = report["sections"]["compile"]
    encoders = ["none", "rope", "deberta"]  # the quick run's
    whats = [r["what"] for r in section["rows"]]
    assert whats == [f"{mode}: {e} @ 4x64" for e in encoders for mode in ("eager", "compiled")]
    for row in section["rows"]:
        assert row["goal"] is None and row["ratio"] > 0
        assert len(row["raw"]["times_s"]) == len(row["raw"]["ratios"]) >= 2


def test_decode_times_cached_and_uncached(report: dict[str, Any]) -> None:
    rows = report["sections"]["decode"]["rows"]
    lm = [r for r in rows if ": LM " in r["what"]]
    assert len(lm) == 2 * 3 and len(rows) == len(lm) + 2
    assert all(r["ratio"] > 0 for r in rows)


def test_train_covers_every_encoder_at_two_lengths(report: dict[str, Any]) -> None:
    rows = report["sections"]["train"]["rows"]
    shapes = report["sections"]["train"]["config"]["shapes_BT"]
    assert len(shapes) == 2 and len({b * t for b, t in shapes}) == 1  # equal tokens per step
    assert len(rows) == len(available()) * 2
    for row in rows:
        if row["ratio"] is not None:
            assert len(row["raw"]["tokens_per_s"]) == len(row["raw"]["times_s"])


def test_memory_and_overhead(report: dict[str, Any]) -> None:
    sys.path.insert(0, str(ROOT / "experiments"))
    import bench

    memory = report["sections"]["memory"]
    assert memory["config"]["length"] == 16 * memory["config"]["train_length"]
    # --quick measures three encoders (a process each); the full sizes measure them all
    assert [r["what"] for r in memory["rows"]] == ["none", "rope", "xl"]
    assert bench.FULL["memory"]["encoders"] is None and bench.GPU["memory"]["encoders"] is None
    for row in memory["rows"]:
        if row["ratio"] is not None:
            assert row["median"] > 0 and row["raw"]["method"] in ("VmHWM", "ru_maxrss")
    overhead = report["sections"]["overhead"]["rows"]
    assert [r["what"] for r in overhead] == ["bare PyTorch loop", "Lightning Trainer.fit"]


def _report(rows: dict[str, list[float]], goal: str = ">= 0.6x") -> dict[str, Any]:
    """A --json report with one train section whose rows have these per-round ratios."""
    out = []
    for what, ratios in rows.items():
        base = what.startswith("none")
        out.append(
            {
                "what": what,
                "median": 0.1,
                "ratio": statistics.median(ratios),
                "goal": None if base else goal,
                "met": None,
                "note": "",
                "raw": {"ratios": ratios},
            }
        )
    return {
        "meta": {"command": "bench.py", "started": "today"},
        "sections": {"train": {"rows": out}},
    }


def _pool(files: list[Path]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(BENCH), "--pool", *map(str, files)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_pooling_judges_goals_on_all_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run medians 0.64 and 0.52 (their median 0.58 misses 0.6x); the six rounds pooled
    have median 0.615, which meets it. A row missing from one run is left out."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from bench_common import pool_runs

    one = _report({"none": [1.0, 1.0, 1.0], "x": [0.62, 0.64, 0.66], "y": [0.9]})
    two = _report({"none": [1.0, 1.0, 1.0], "x": [0.50, 0.52, 0.61]})
    (row_none, row_x) = pool_runs([one, two])["train"]
    assert row_none["what"] == "none" and row_none["met"] is None
    assert row_x["runs"] == [0.64, 0.52]
    assert row_x["median_of_runs"] == pytest.approx(0.58)
    assert row_x["pooled"] == pytest.approx(0.615)
    assert (row_x["pooled_min"], row_x["pooled_max"], row_x["rounds"]) == (0.50, 0.66, 6)
    assert row_x["met"] is True
    strict = pool_runs([_report({"x": [0.62, 0.64]}, ">= 0.7x"), _report({"x": [0.7]}, ">= 0.7x")])
    assert strict["train"][0]["met"] is False  # pooled median 0.64

    paths = []
    for i, rep in enumerate((one, two)):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(rep))
    proc = _pool(paths)
    assert proc.returncode == 0, proc.stderr
    assert "| x | 0.64, 0.52 | 0.580 | 0.615 [0.50, 0.66] (6) | >= 0.6x | yes |" in proc.stdout
    assert "0 goal(s) not met over the pooled rounds" in proc.stdout


def test_lengths_the_sizes_do_not_measure_are_refused_with_those_they_do() -> None:
    """``--lengths 128`` with the full sizes (256 and 1024) once ran nothing and ended in a
    traceback; it is one line naming the lengths there are."""
    cmd = [sys.executable, str(BENCH), "--sections", "steps", "--lengths", "128,1024"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--lengths 128: the full sizes measure lengths 256, 1024" in proc.stderr


@pytest.mark.parametrize("case", ["one file", "not a report", "missing", "other config"])
def test_pooling_refuses_bad_input(tmp_path: Path, case: str) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_report({"x": [0.7]})))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": []}))
    quick = _report({"x": [0.7]})
    quick["sections"]["train"]["config"] = {"shapes_BT": [[4, 64]]}
    (tmp_path / "quick.json").write_text(json.dumps(quick))
    files = {
        "one file": [good],
        "not a report": [good, other],
        "missing": [good, tmp_path / "nope.json"],
        "other config": [good, tmp_path / "quick.json"],
    }[case]
    proc = _pool(files)
    assert proc.returncode == 2
    want = {
        "one file": "at least two",
        "not a report": "not a bench.py",
        "missing": "cannot read",
        "other config": "different configurations",
    }
    assert want[case] in proc.stderr


def test_a_compiled_rows_spread_is_against_compiled_none() -> None:
    """A row's ratio and its [min, max] come from the same pairs (``none`` in the row's
    mode): on an H200 a compiled row once printed 0.88 beside a spread of [0.97, 1.01],
    the rounds' ratios against eager ``none``."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_steps

    stats = {
        "eager: none": {"times_s": [2.0, 2.0, 2.0]},
        "compiled: none": {"times_s": [1.0, 1.2, 0.9]},
        "compiled: rope": {"times_s": [1.0, 1.0, 1.0], "ratios": [2.0, 2.0, 2.0]},
    }
    peaks = dict.fromkeys(stats)
    row = bench_steps._row(
        "compiled: rope @ 1x8", stats, peaks, "compiled: rope", "compiled: none", 8, None
    )
    assert row.ratio == pytest.approx(1.0)
    assert (row.raw["ratio_min"], row.raw["ratio_max"]) == pytest.approx((0.9, 1.2))
    assert row.raw["ratios"] == pytest.approx([1.0, 1.2, 0.9])


def test_steps_hands_over_each_encoders_rows_before_the_next_compiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU section stopped by its time limit keeps what it measured: the steps
    section hands each row to ``on_row`` before it builds the next encoder's model."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_steps

    events: list[str] = []
    build = bench_steps._build

    def recording_build(enc: str, *args: Any) -> Any:
        events.append(f"build {enc}")
        return build(enc, *args)

    monkeypatch.setattr(bench_steps, "_build", recording_build)
    model = {"n_layers": 1, "d_model": 16, "n_heads": 2, "d_ff": 32, "dropout": 0.0}
    result = bench_steps.run_steps(
        model_cfg=model,
        vocab=11,
        shapes=[(1, 16)],
        rounds=1,
        steps=1,
        dtype="fp32",
        modes=["eager"],
        encoders=["alibi", "t5"],
        device=torch.device("cpu"),
        on_row=lambda row: events.append(f"row {row.what}"),
    )
    assert events == [
        "build none",
        "row eager: none @ 1x16",
        "build alibi",
        "row eager: alibi @ 1x16",
        "build t5",
        "row eager: t5 @ 1x16",
    ]
    assert [r.what for r in result["rows"]] == [e[4:] for e in events if e.startswith("row")]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_runs_on_cuda(tmp_path: Path) -> None:
    out = tmp_path / "cuda.json"
    cmd = [sys.executable, str(BENCH), "--quick", "--device", "cuda", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text())["meta"]["device"].startswith("cuda")


def test_profile_step_prints_the_top_operators_and_refuses_an_unknown_encoder() -> None:
    """experiments/profile_step.py (the GPU check's profile section) on the CPU at a toy
    size: the profiler's table with the asked-for rows, then the step's time; a name
    that is not registered is one line naming the allowed ones."""
    script = str(ROOT / "experiments" / "profile_step.py")
    args = ["--batch", "1", "--length", "32", "--before", "1", "--top", "3", "--device", "cpu"]
    proc = subprocess.run(
        [sys.executable, script, "fire", *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "Self CPU time total" in proc.stdout
    assert re.search(r"fire @ 1x32 on cpu: one step [\d.]+ ms after 1 steps", proc.stdout)
    proc = subprocess.run(
        [sys.executable, script, "firee", *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2
    assert "encoder 'firee' is not registered; allowed: alibi," in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_streaming_prints_both_paths_and_equal_nlls() -> None:
    """experiments/bench_streaming.py at a toy size: a row for each path, the cut one's
    speed-up, NLLs equal to float32 rounding; a scheme streaming refuses is one line."""
    script = str(ROOT / "experiments" / "bench_streaming.py")
    args = ["--seq-len", "8", "--multiplier", "4", "--batch", "1", "--rounds", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's posenc
    run = [sys.executable, script, *args]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "streaming 4+4 at 32 (4x 8), batch 1" in proc.stdout
    assert re.search(r"\| every key \| .* \| 1\.00x", proc.stdout)
    assert re.search(r"\| cut keys \| .* \| [\d.]+x", proc.stdout)
    diff = re.search(r"largest NLL difference between the two: (\S+)", proc.stdout)
    assert diff is not None and float(diff.group(1)) < 1e-4
    proc = subprocess.run([*run, "--encoder", "learned"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2
    assert "encoder 'learned': streaming does not apply:" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_preset_times_the_full_step_of_lm_gpu_on_a_synthetic_corpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """experiments/bench_preset.py at tiny sizes on the CPU: a row per encoder, `none`
    first; steady-state tokens/s are the tokens of a step over its seconds; the ratio is
    against `none`; no GPU memory figure without a GPU; only the JSON is left behind."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_preset

    out = tmp_path / "lm_gpu.json"
    args = ["--quick", "--encoders", "alibi", "--warmup", "1", "--steps", "2"]
    args += ["--corpus-chars", "20000", "--json", str(out)]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its corpus and runs go here
    assert bench_preset.main(args) == 0
    report = json.loads(out.read_text())
    assert report["meta"]["preset"] == "lm_gpu"
    rows = report["sections"]["preset"]["rows"]
    assert [r["what"] for r in rows] == ["step: none @ 4x32", "step: alibi @ 4x32"]
    none, alibi = (r["raw"] for r in rows)
    for raw in (none, alibi):
        assert raw["tokens_per_step"] == 4 * 32 and raw["steps"] == 2
        assert raw["tokens_per_s"] == pytest.approx(128 / raw["seconds_per_step"])
        assert raw["peak_memory_mib"] is None and raw["n_params"] > 0
    assert rows[0]["ratio"] == pytest.approx(1.0)
    assert rows[1]["ratio"] == pytest.approx(alibi["tokens_per_s"] / none["tokens_per_s"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm_gpu.json"]


def test_bench_saved_counts_what_a_step_keeps_against_none(capsys: pytest.CaptureFixture) -> None:
    """bench_saved.py: a row per encoder with its saved bytes and speed against `none`;
    `none` itself at 1.0x, and a score term (CoPE's) keeps more than no term."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_saved

    assert bench_saved.main(["cope", "--length", "64", "--rounds", "1"]) == 0
    rows = {
        cells[0]: cells[1:]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ") and not line.startswith("| encoder")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    assert set(rows) == {"none", "cope"}
    assert rows["none"][1] == "1.0x" and rows["none"][3] == "1.000"
    assert float(rows["cope"][1].rstrip("x")) > 1.0
