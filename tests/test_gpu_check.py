"""The GPU check's report (experiments/gpu_check_report.py) and its records' tables
(experiments/gpu_records.py): made-up section reports in, the table, goals and record out.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "experiments" / "gpu_check_report.py"
RECORDS = ROOT / "experiments" / "gpu_records.py"
sys.path.insert(0, str(ROOT / "experiments"))

import gpu_records  # noqa: E402  (experiments/ is not a package)


def _steps_row(what: str, ratio: float, **raw: float) -> dict[str, Any]:
    return {
        "what": what,
        "median": 0.01,
        "ratio": ratio,
        "goal": None,
        "met": None,
        "note": "",
        "raw": {"ratios": [ratio], **raw},
    }


def _report(out: Path, name: str, section: str, rows: list[dict[str, Any]], **meta: Any) -> None:
    report = {
        "meta": {"torch": "2.11", "device": "cuda", **meta},
        "sections": {section: {"rows": rows}},
    }
    (out / f"{name}.json").write_text(json.dumps(report))


def _run_report(out: Path, *args: str, **env: str) -> dict[str, Any]:
    """Run the report on ``out`` with only ``env``'s GPU_CHECK_* settings; its JSON."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    cmd = [sys.executable, str(REPORT), str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**clean, **env})
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads((out / "gpu_check.json").read_text())
    result["stdout"] = proc.stdout
    return result


def _made_up_run(out: Path) -> None:
    """Sections' reports of a GPU run (numbers made up), started at three times."""
    steps = [
        _steps_row("eager: none @ 4x4096", 1.0, peak_ratio=1.0),
        _steps_row("eager: alibi @ 4x4096", 0.9, peak_ratio=4.0),  # fast, memory not linear
        _steps_row("eager: t5 @ 4x4096", 0.7, peak_ratio=1.1),  # slow, memory fine
        _steps_row("eager: xl @ 4x4096", 0.55, peak_ratio=1.2),
        _steps_row("eager: fox @ 4x4096", 0.65, peak_ratio=1.25),
        _steps_row("eager: cope @ 4x4096", 0.31, peak_ratio=1.9),  # CoPE's bound is 2x
        _steps_row("eager: learned @ 4x4096", 0.95, peak_ratio=1.0),  # no speed goal
        _steps_row("compiled: t5 @ 4x4096", 0.8, vs_eager=0.95),  # no goal for compile
    ]
    _report(out, "steps_4096", "steps", steps, started="2026-11-28 21:17:11")
    short = [_steps_row("eager: none @ 16x1024", 1.0, peak_ratio=1.0)]
    short.append(_steps_row("eager: fire @ 16x1024", 0.5, peak_ratio=1.0))  # not at 4096
    _report(out, "steps_1024", "steps", short, started="2026-11-28 21:25:00")
    decode = [
        _steps_row("cached: LM none, 512 new after 128", 6.0),
        _steps_row("cached: LM alibi, 512 new after 128", 2.0),
    ]
    decode[1]["median"] = 0.02
    _report(out, "decode", "decode", decode, started="2026-11-28 21:19:30")
    (out / "steps_4096.status").write_text("0 100 230\n")
    (out / "flex.status").write_text("124 40 40\n")
    (out / "decode.status").write_text("124 90 90\n")  # with its rows so far


def test_gpu_check_report_judges_the_gpu_goals_where_measured(tmp_path: Path) -> None:
    """One row per encoder, each figure in its column; a failed section is named; the
    goals are judged for the rows measured at T = 4096 and for each decoded scheme, and
    for nothing else (FIRE ran at 1024 only; no goal for learned's speed or compiling)."""
    _made_up_run(tmp_path)
    out = _run_report(tmp_path)
    assert (
        "decode timed out (2 rows kept) (90/90 s), flex timed out (40/40 s), "
        "steps_4096 ok (100/230 s)" in out["stdout"]
    )
    assert "| alibi | - | 0.90 | - | 4.00 | - | - | 0.50 | 2.00 |" in out["stdout"]
    met = {g["goal"]: g["met"] for g in out["goals"]}
    assert met == {
        "alibi: training tokens/s >= 0.85x none (eager, T=4096)": True,
        "alibi: peak training-step memory <= 1.3x none (T=4096)": False,
        "alibi: cached greedy decoding >= 3x uncached": False,
        "t5: training tokens/s >= 0.85x none (eager, T=4096)": False,
        "t5: peak training-step memory <= 1.3x none (T=4096)": True,
        "xl: training tokens/s >= 0.5x none (eager, T=4096)": True,
        "xl: peak training-step memory <= 1.3x none (T=4096)": True,
        "fox: training tokens/s >= 0.7x none (eager, T=4096)": False,
        "fox: peak training-step memory <= 1.3x none (T=4096)": True,
        "cope: training tokens/s >= 0.3x none (eager, T=4096)": True,
        "cope: peak training-step memory <= 2.0x none (T=4096)": True,
        "learned: peak training-step memory <= 1.3x none (T=4096)": True,
        "none: cached greedy decoding >= 3x uncached": True,
    }
    values = {g["goal"]: g["value"] for g in out["goals"]}
    assert values["cope: peak training-step memory <= 2.0x none (T=4096)"] == pytest.approx(1.9)
    assert "goals: 9 of 13 met; not met: alibi: peak training-step memory" in out["stdout"]
    assert out["sections"]["flex"]["status"] == "timed out"


def test_gpu_check_report_puts_a_presets_full_step_in_columns_of_its_own(
    tmp_path: Path,
) -> None:
    """bench_preset.py's rows (the lm_gpu section): tokens/s and peak memory against
    `none` at the preset's length, apart from the 4x4096 step's columns and goals."""
    rows = [
        _steps_row("step: none @ 64x512", 1.0, peak_ratio=1.0),
        _steps_row("step: t5 @ 64x512", 0.8, peak_ratio=1.5),
    ]
    _report(tmp_path, "lm_gpu", "preset", rows, started="2026-11-28 22:00:00")
    (tmp_path / "lm_gpu.status").write_text("0 300 420\n")
    out = _run_report(tmp_path)
    assert out["columns"] == ["preset step T=512", "preset memory T=512"]
    assert out["table"]["t5"] == {"preset step T=512": 0.8, "preset memory T=512": 1.5}
    assert "| t5 | 0.80 | 1.50 |" in out["stdout"] and out["goals"] == []


def test_gpu_check_report_records_the_date_and_the_command(tmp_path: Path) -> None:
    """The record says when (the earliest section start) and how: every GPU_CHECK_*
    setting, then gpu_check.sh with the arguments it passed on (by default OUT)."""
    _made_up_run(tmp_path)
    env = {"GPU_CHECK_SECTIONS": "steps_4096,decode", "GPU_CHECK_ENCODERS": "t5,xl fold"}
    out = _run_report(tmp_path, "--script-args", "/tmp/gc/a b", **env)
    assert out["date"] == "2026-11-28 21:17:11"
    assert out["command"] == (
        "GPU_CHECK_ENCODERS='t5,xl fold' GPU_CHECK_SECTIONS=steps_4096,decode "
        "experiments/gpu_check.sh '/tmp/gc/a b'"
    )
    assert f"command: {out['command']}" in out["stdout"]
    assert _run_report(tmp_path)["command"] == f"experiments/gpu_check.sh {tmp_path}"


def test_gpu_check_report_without_a_gpu_judges_nothing_and_dates_the_run_now(
    tmp_path: Path,
) -> None:
    """The CPU-only run (quick sizes, no start recorded) still writes a record: its date
    is when the report ran, and no goal is judged on CPU figures."""
    rows = [_steps_row("eager: none @ 2x64", 1.0), _steps_row("eager: alibi @ 2x64", 0.4)]
    _report(tmp_path, "steps_quick", "steps", rows)
    (tmp_path / "steps_quick.status").write_text("0 30 120\n")
    today = time.strftime("%Y-%m-%d")
    out = _run_report(tmp_path, "--cpu", "--script-args")
    assert out["cpu_only"] is True and out["goals"] == []
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", out["date"])
    assert out["date"].startswith(today)
    assert out["command"] == "experiments/gpu_check.sh"
    assert out["table"]["alibi"]["eager T=64"] == pytest.approx(0.4)


def test_gpu_check_sh_hands_its_invocation_to_the_record(tmp_path: Path) -> None:
    """gpu_check.sh itself (without a GPU, its benchmarks stubbed out by a PYTHON that
    skips bench.py) leaves a record whose command is the one it was run with."""
    stub = tmp_path / "python"
    stub.write_text(
        f'#!/bin/sh\ncase "$1" in experiments/bench.py) exit 0;; esac\nexec {sys.executable} "$@"\n'
    )
    stub.chmod(0o755)
    out = tmp_path / "out"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    env = {**clean, "PYTHON": str(stub), "GPU_CHECK_MODES": "eager", "CUDA_VISIBLE_DEVICES": ""}
    script = ROOT / "experiments" / "gpu_check.sh"
    proc = subprocess.run(
        [str(script), str(out)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads((out / "gpu_check.json").read_text())
    assert record["command"] == f"GPU_CHECK_MODES=eager experiments/gpu_check.sh {out}"
    assert record["cpu_only"] is True


def test_gpu_check_report_counts_the_tests_from_the_log_when_pytest_never_exits(
    tmp_path: Path,
) -> None:
    """On an H200 pytest once reported every cuda test, then hung until the section's
    limit and wrote no JUnit XML: the report counts the verbose log's result lines and
    says whether all the collected tests had reported (here, in the second run, not)."""
    script = ROOT / "experiments" / "gpu_check_report.py"
    lines = [
        "created: 4/4 workers",
        "4 workers [3 items]",
        "",
        "[gw0] [ 33%] PASSED tests/model/test_backends.py::test_bf16_training_step_on_cuda[rope] ",
        "[gw1] [ 66%] XFAIL tests/model/test_backends.py::test_bf16_training_step_on_cuda[cope] ",
        "[gw2] [100%] FAILED tests/model/test_backends.py::test_flex_gradients_equal[t5] ",
    ]
    (tmp_path / "tests.log").write_text("\n".join(lines) + "\n")
    (tmp_path / "tests.status").write_text("124 150 150\n")
    run = [sys.executable, str(script), str(tmp_path)]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "tests finished, then timed out on exit (150/150 s)" in proc.stdout
    assert (
        "cuda tests: 1 passed, 1 skipped, 1 failed; failed: "
        "tests/model/test_backends.py::test_flex_gradients_equal[t5]" in proc.stdout
    )
    (tmp_path / "tests.log").write_text("\n".join(lines[:-1]) + "\n")
    proc = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert "tests timed out (2 of 3 reported) (150/150 s)" in proc.stdout
    assert "cuda tests: 1 passed, 1 skipped, 0 failed" in proc.stdout
    # without pytest-xdist, -v puts the outcome after the test
    serial = ["collected 2 items", "", "tests/model/t.py::test_a[rope] PASSED   [ 50%]"]
    (tmp_path / "tests.log").write_text("\n".join(serial) + "\n")
    proc = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert "tests timed out (1 of 2 reported) (150/150 s)" in proc.stdout


def _record(date: str, device: str, table: dict[str, dict[str, float | None]]) -> dict[str, Any]:
    columns = sorted({c for row in table.values() for c in row})
    return {
        "device": device,
        "torch": "2.11.0+cu130",
        "date": date,
        "command": f"GPU_CHECK_MODES=eager experiments/gpu_check.sh /tmp/{device}",
        "columns": columns,
        "table": table,
        "sections": {"steps_4096": {"status": "ok", "seconds": 18, "limit_s": 260}},
        "tests": None,
    }


def test_gpu_records_renders_each_record_newest_first_with_its_goals(tmp_path: Path) -> None:
    """One table per record, newest first, under a line naming card, torch, date, command
    and file; the record's figures at 2 decimals, "-" where unmeasured; the goals judged
    from them, each met or not."""
    old = {"none": {"eager T=4096": 1.0}, "xl": {"eager T=4096": 0.456, "memory T=4096": 4.9}}
    new = {"none": {"eager T=4096": 1.0, "cached/uncached": 3.25}, "t5": {"eager T=4096": 0.9}}
    (tmp_path / "a-old.json").write_text(json.dumps(_record("2026-11-27 10:00:00", "A100", old)))
    (tmp_path / "b-new.json").write_text(json.dumps(_record("2026-11-28 09:00:00", "H200", new)))
    text = gpu_records.render_all(gpu_records.load(tmp_path))
    assert text.index("**H200**") < text.index("**A100**")
    assert (
        "**A100**, torch 2.11.0+cu130, 2026-11-27 10:00:00: "
        "`GPU_CHECK_MODES=eager experiments/gpu_check.sh /tmp/A100` "
        "(record: [docs/gpu/a-old.json](gpu/a-old.json))"
    ) in text
    assert "| encoder | eager T=4096 | memory T=4096 |" in text
    assert "| none | 1.00 | - |\n| xl | 0.46 | 4.90 |" in text
    assert "sections: steps_4096 ok (18/260 s)." in text
    old_goals = text[text.index("**A100**") :]
    assert "Goals: 0 of 2 met." in old_goals
    assert "- not met: xl: training tokens/s >= 0.5x none (eager, T=4096) (0.46)" in old_goals
    assert "- not met: xl: peak training-step memory <= 1.3x none (T=4096) (4.90)" in old_goals
    new_goals = text[: text.index("**A100**")]
    assert "Goals: 2 of 2 met." in new_goals
    assert "- met: none: cached greedy decoding >= 3x uncached (3.25)" in new_goals


def test_gpu_records_write_replaces_only_the_block_and_refuses_a_page_without_markers(
    tmp_path: Path,
) -> None:
    """--write puts the rendered block between the markers and leaves the page's other
    text as it was; a page without the markers is refused in one line, exit 2, unchanged."""
    records = tmp_path / "gpu"
    records.mkdir()
    table = {"none": {"eager T=4096": 1.0}}
    (records / "r.json").write_text(json.dumps(_record("2026-11-28 09:00:00", "H200", table)))
    page = tmp_path / "performance.md"
    page.write_text(f"# Perf\n\nbefore\n{gpu_records.START}\nstale\n{gpu_records.END}\nafter\n")
    run = [sys.executable, str(RECORDS), "--records", str(records), "--write", str(page)]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = page.read_text()
    block = gpu_records.render_all(gpu_records.load(records))
    assert text == f"# Perf\n\nbefore\n{gpu_records.START}\n{block}{gpu_records.END}\nafter\n"
    assert gpu_records.block_of(text) == block
    page.write_text("# Perf\nno markers\n")
    proc = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert str(page) in proc.stderr and gpu_records.START in proc.stderr
    assert page.read_text() == "# Perf\nno markers\n"


def test_gpu_records_refuses_a_record_without_its_date_or_command(tmp_path: Path) -> None:
    """A file in docs/gpu/ that is not a whole record is named, in one line, exit 2."""
    record = _record("2026-11-28 09:00:00", "H200", {"none": {"eager T=4096": 1.0}})
    del record["date"], record["command"]
    (tmp_path / "bad.json").write_text(json.dumps(record))
    run = [sys.executable, str(RECORDS), "--records", str(tmp_path)]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "bad.json lacks date, command" in proc.stderr


def test_performance_md_holds_the_tables_of_every_gpu_record() -> None:
    """docs/performance.md's block is what gpu_records.py renders from docs/gpu/: a record
    added without regenerating the page (or a figure edited by hand) fails here."""
    page = (ROOT / "docs" / "performance.md").read_text()
    records = gpu_records.load(ROOT / "docs" / "gpu")
    assert records, "docs/gpu/ holds no record"
    assert gpu_records.block_of(page) == gpu_records.render_all(records), (
        "docs/performance.md is out of date: run "
        "`python experiments/gpu_records.py --write docs/performance.md`"
    )


#: Stops an import of Hydra or OmegaConf, which the lent GPU machines lack.
_NO_HYDRA = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("hydra", "omegaconf"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
sys.meta_path.insert(0, Block())
"""


def test_the_gpu_sections_import_without_hydra_or_omegaconf() -> None:
    """The modules of gpu_check.sh's sections (steps, flex, decode, the training step and
    its memory) import with torch alone: on 2026-11-30 every section failed on the H200
    at ``import omegaconf``, through the optimiser's schedule names in the schema."""
    code = _NO_HYDRA + "import bench_steps, bench_decode, bench_train, bench_memory\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "experiments"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
