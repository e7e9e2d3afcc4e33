"""The table and JSON of ``experiments/gpu_check.sh``: one row per encoder, every figure
a ratio against ``none`` measured in the same run.

    python experiments/gpu_check_report.py OUT_DIR [--cpu] [--script-args ARG...]

Reads what the sections left in OUT_DIR (``bench.py --json`` reports, the tests'
JUnit XML, each section's ``.status``: exit code, seconds, limit), prints the table
with the sections' status and the goals (:func:`goals`) above it, and writes
``OUT_DIR/gpu_check.json``: the record of the run, with the card, torch version, date
(the earliest section start) and the command (every ``GPU_CHECK_*`` setting, then
``experiments/gpu_check.sh`` with ``--script-args``, the arguments it was given). A
section that failed or ran out of time leaves its columns empty ("-").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

WHAT = re.compile(r"^(?P<mode>[a-z]+): (?P<enc>[a-z0-9_]+) @ (?P<b>\d+)x(?P<t>\d+)")
DECODE = re.compile(r"^(?P<mode>cached|uncached): LM (?P<enc>[a-z0-9_]+),")


def sections(out: Path) -> dict[str, dict[str, Any]]:
    """Each section's status from its ``.status`` file: ok, failed or timed out."""
    found = {}
    for path in sorted(out.glob("*.status")):
        rc, seconds, limit = (int(x) for x in path.read_text().split())
        state = "ok" if rc == 0 else "timed out" if rc in (124, 137) else f"failed (exit {rc})"
        counts = tests(out) if path.stem == "tests" else None
        if counts is not None and rc in (124, 137):
            # Every test reported (the JUnit XML is written as the session finishes, the
            # log says how many were collected): the process stopped on its way out.
            done = "collected" not in counts or counts["collected"] == counts["tests"]
            state = (
                "finished, then timed out on exit"
                if done
                else f"timed out ({counts['tests']} of {counts['collected'] or '?'} reported)"
            )
        elif state == "timed out" and (out / f"{path.stem}.json").is_file():
            report = json.loads((out / f"{path.stem}.json").read_text())
            kept = sum(len(v.get("rows", [])) for v in report.get("sections", {}).values())
            state = f"timed out ({kept} rows kept)"
        found[path.stem] = {
            "status": state,
            "rc": rc,
            "seconds": seconds,
            "limit_s": limit,
            "log": str(out / f"{path.stem}.log"),
        }
    return found


#: A verbose (``-v``) result line, with pytest-xdist ("[gw0] [ 3%] PASSED tests/a.py::t[x]")
#: or without ("tests/a.py::t[x] PASSED [ 3%]").
RESULT = re.compile(
    r"^(?:\[gw\d+\] \[\s*\d+%\] (?P<outcome>[A-Z]+) (?P<test>\S+)"
    r"|(?P<test1>\S+::\S+) (?P<outcome1>[A-Z]+)\b)"
)
COLLECTED = re.compile(r"\[(?P<n>\d+) items?\]|collected (?P<m>\d+) items?")


def tests(out: Path) -> dict[str, Any] | None:
    """Counts of the cuda-marked tests from their JUnit XML, else from the verbose log's
    result lines (pytest writes the XML only as it exits, and on a GPU it once hung on
    its way out after every test had reported); None when neither is there."""
    path = out / "tests.xml"
    if not path.is_file():
        return tests_from_log(out / "tests.log")
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return tests_from_log(out / "tests.log")
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {
        **counts,
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": failed,
    }


def tests_from_log(path: Path) -> dict[str, Any] | None:
    """The counts of :func:`tests` from the result lines of a verbose log (with or
    without xdist), plus ``collected``: how many tests were to run (None if unsaid)."""
    if not path.is_file():
        return None
    text = path.read_text(errors="replace")
    outcomes = {
        m["test"] or m["test1"]: m["outcome"] or m["outcome1"]
        for m in map(RESULT.match, text.splitlines())
        if m
    }
    if not outcomes:
        return None
    collected = [int(m["n"] or m["m"]) for m in COLLECTED.finditer(text)]
    failed = sorted(t for t, o in outcomes.items() if o in ("FAILED", "ERROR"))
    skipped = sum(o in ("SKIPPED", "XFAIL") for o in outcomes.values())
    return {
        "tests": len(outcomes),
        "failures": len(failed),
        "errors": 0,
        "skipped": skipped,
        "passed": len(outcomes) - len(failed) - skipped,
        "failed": failed,
        "collected": max(collected) if collected else None,
    }


def _rows(report: dict[str, Any], section: str) -> list[dict[str, Any]]:
    return report.get("sections", {}).get(section, {}).get("rows", [])


def failures(out: Path) -> list[str]:
    """The measurements a section left without figures because they raised:
    ``"<row>: <error>"`` (the benchmarks go on past them)."""
    found = []
    for path in sorted(out.glob("*.json")):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for section in report.get("sections", {}).values():
            for row in section.get("rows", []) if isinstance(section, dict) else []:
                raw = row.get("raw") or {}
                if "failed" in raw:
                    found.append(f"{row['what']}: {raw['failed']}")
    return found


def collect(out: Path) -> tuple[dict[str, dict[str, float | None]], dict[str, Any]]:
    """Per encoder, the figures of every report in ``out``; and the reports' metadata."""
    table: dict[str, dict[str, float | None]] = {}
    meta: dict[str, Any] = {}

    def put(enc: str, column: str, value: float | None) -> None:
        table.setdefault(enc, {})[column] = value

    for path in sorted(out.glob("*.json")):
        if path.name == "gpu_check.json":
            continue
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if "sections" not in report:
            continue
        meta[path.stem] = report.get("meta", {})
        for row in _rows(report, "steps"):
            m = WHAT.match(row["what"])
            if not m or row["ratio"] is None:
                continue
            mode, enc, t = m["mode"], m["enc"], m["t"]
            put(enc, f"{mode} T={t}", row["ratio"])
            if mode == "eager":
                put(enc, f"memory T={t}", row["raw"].get("peak_ratio"))
            if "vs_eager" in row["raw"]:
                put(enc, f"compiled/eager T={t}", row["raw"]["vs_eager"])
        for row in _rows(report, "flex"):
            m = WHAT.match(row["what"])
            if not m or row["ratio"] is None or m["mode"] == "default":  # none's row
                continue
            put(m["enc"], f"{m['mode']} path T={m['t']}", row["ratio"])
            if "vs_explicit" in row["raw"]:
                put(m["enc"], f"flex/explicit T={m['t']}", row["raw"]["vs_explicit"])
        for row in _rows(report, "preset"):  # bench_preset.py: a preset's full step
            m = WHAT.match(row["what"])
            if not m or row["ratio"] is None:
                continue
            put(m["enc"], f"preset step T={m['t']}", row["ratio"])
            put(m["enc"], f"preset memory T={m['t']}", row["raw"].get("peak_ratio"))
        cached: dict[str, float] = {}
        for row in _rows(report, "decode"):
            m = DECODE.match(row["what"])
            if not m or row["median"] is None:
                continue
            if m["mode"] == "cached":
                cached[m["enc"]] = row["median"]
                put(m["enc"], "cached/uncached", row["ratio"])
        if "none" in cached:
            for enc, seconds in cached.items():
                put(enc, "cached decode", cached["none"] / seconds)
    return table, meta


def _length(column: str) -> int:
    m = re.search(r"T=(\d+)", column)
    return int(m[1]) if m else 0


ORDER = [
    "eager",
    "memory",
    "compiled",
    "compiled/eager",
    "flex path",
    "explicit path",
    "flex/explicit",
    "cached decode",
    "cached/uncached",
    "preset step",
    "preset memory",
]


def columns(table: dict[str, dict[str, float | None]]) -> list[str]:
    """Every column present, by kind (ORDER) then length."""
    present = {c for row in table.values() for c in row}

    def key(c: str) -> tuple[int, int]:
        kind = c.split(" T=")[0]
        return (ORDER.index(kind) if kind in ORDER else len(ORDER), _length(c))

    return sorted(present, key=key)


#: The size every goal is judged at: the benchmark's 4x4096 bf16 training step.
GOAL_T = 4096
#: Training tokens/s against `none` (eager, T = GOAL_T) each scheme should reach: bias-only
#: schemes nearly none's, content-position terms (one more query-key product at most)
#: half, the data-dependent ones what their authors' kernels allow. ``xl_fold`` is
#: Transformer-XL's score folded into one wider product, so it has XL's goal.
SPEED_GOALS = {
    **dict.fromkeys(["alibi", "t5", "fire", "sandwich", "kerple"], 0.85),
    **dict.fromkeys(["shaw", "xl", "xl_fold", "deberta"], 0.5),
    "fox": 0.7,
    **dict.fromkeys(["cope", "path", "stickbreak", "selective"], 0.3),
}
#: Peak training-step memory against `none`: every scheme's at most MEMORY_GOAL, apart
#: from those named in MEMORY_GOALS (CoPE's gates are a (B, H, T, S) tensor of their own).
MEMORY_GOAL = 1.3
MEMORY_GOALS = {"cope": 2.0}
#: Cached greedy decoding against recomputing every step, for every LM scheme measured.
DECODE_GOAL = 3.0


def _goal(goal: str, value: float, met: bool) -> dict[str, Any]:
    return {"goal": goal, "value": value, "met": met}


def goals(table: dict[str, dict[str, float | None]]) -> list[dict[str, Any]]:
    """The GPU goals, judged only where the run measured the figure: training speed and
    peak memory against `none` at T = GOAL_T (eager), cached decoding against uncached."""
    out = []
    for enc, row in table.items():
        speed, goal = row.get(f"eager T={GOAL_T}"), SPEED_GOALS.get(enc)
        if speed is not None and goal is not None:
            text = f"{enc}: training tokens/s >= {goal}x none (eager, T={GOAL_T})"
            out.append(_goal(text, speed, speed >= goal))
        memory, bound = row.get(f"memory T={GOAL_T}"), MEMORY_GOALS.get(enc, MEMORY_GOAL)
        if memory is not None and enc != "none":
            text = f"{enc}: peak training-step memory <= {bound}x none (T={GOAL_T})"
            out.append(_goal(text, memory, memory <= bound))
        cached = row.get("cached/uncached")
        if cached is not None:
            text = f"{enc}: cached greedy decoding >= {DECODE_GOAL:g}x uncached"
            out.append(_goal(text, cached, cached >= DECODE_GOAL))
    return out


def started(meta: dict[str, Any]) -> str:
    """The run's date: the earliest start among its reports (bench.py's ``started``,
    ``YYYY-MM-DD HH:MM:SS``, the machine's time), else now in the same form."""
    starts = sorted(m["started"] for m in meta.values() if m.get("started"))
    return starts[0] if starts else time.strftime("%Y-%m-%d %H:%M:%S")


def invocation(script_args: list[str]) -> str:
    """The gpu_check.sh command line that made the run, as a shell would take it: every
    ``GPU_CHECK_*`` setting of the environment (the script passes it on), then the
    script and its arguments."""
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("GPU_CHECK_"))
    words = [f"{k}={shlex.quote(v)}" for k, v in env]
    return " ".join([*words, "experiments/gpu_check.sh", *map(shlex.quote, script_args)])


#: What the table's figures are (printed above it, and above the records' tables).
LEGEND = (
    "Every figure is a ratio against `none` in the same run (speed: > 1 faster; "
    "memory: peak step memory, > 1 more), except compiled/eager, flex/explicit and "
    "cached/uncached (the same encoder's two ways)."
)


def sections_line(status: dict[str, dict[str, Any]]) -> str:
    """One line: each section's state and seconds against its limit."""
    return "sections: " + ", ".join(
        f"{n} {s['status']} ({s['seconds']}/{s['limit_s']} s)" for n, s in status.items()
    )


def tests_line(counts: dict[str, Any]) -> str:
    """One line: the cuda-marked tests' counts, and the failed ones by name."""
    failed = "; failed: " + ", ".join(counts["failed"]) if counts["failed"] else ""
    return (
        f"cuda tests: {counts['passed']} passed, {counts['skipped']} skipped, "
        f"{counts['failures'] + counts['errors']} failed{failed}"
    )


def goals_line(judged: list[dict[str, Any]]) -> str:
    """One line: how many goals are met, and each one that is not, with its figure."""
    unmet = [g for g in judged if not g["met"]]
    missed = "; ".join(f"{g['goal']} ({g['value']:.2f})" for g in unmet)
    return f"goals: {len(judged) - len(unmet)} of {len(judged)} met" + (
        f"; not met: {missed}" if unmet else ""
    )


def render(table: dict[str, dict[str, float | None]], cols: list[str]) -> str:
    lines = ["| encoder | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    first = ["none"] + sorted(e for e in table if e != "none")
    for enc in first:
        if enc not in table:
            continue
        cells = [table[enc].get(c) for c in cols]
        lines.append(
            f"| {enc} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in cells) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the folder gpu_check.sh wrote")
    p.add_argument("--cpu", action="store_true", help="the no-GPU run (quick sizes)")
    p.add_argument(
        "--script-args",
        nargs=argparse.REMAINDER,
        help="the rest: the arguments gpu_check.sh was given, for the record's command "
        "(default: OUT)",
    )
    args = p.parse_args(argv)
    if not args.out.is_dir():
        print(f"gpu_check_report: {args.out} is not a folder", file=sys.stderr)
        return 2
    status = sections(args.out)
    test_counts = tests(args.out)
    table, meta = collect(args.out)
    cols = columns(table)
    judged = goals(table) if not args.cpu else []
    gpu = (args.out / "gpu.txt").read_text().strip() if (args.out / "gpu.txt").is_file() else ""
    torch_version = next((m.get("torch") for m in meta.values() if m.get("torch")), "?")
    device = next((m.get("device") for m in meta.values() if m.get("device")), "?")
    date = started(meta)
    command = invocation([str(args.out)] if args.script_args is None else args.script_args)
    print(
        f"# posenc GPU check: {gpu or device}, torch {torch_version}, {date}"
        + (" (no GPU: CPU parts at the quick sizes)" if args.cpu else "")
    )
    print(f"command: {command}")
    print(sections_line(status))
    if test_counts is not None:
        print(tests_line(test_counts))
    failed_rows = failures(args.out)
    for line in failed_rows:
        print(f"failed: {line}")
    if judged:
        print(goals_line(judged))
    print(f"\n{LEGEND}\n")
    print(render(table, cols) if table else "(no figures: every section failed)")
    result = {
        "device": gpu or device,
        "torch": torch_version,
        "date": date,
        "command": command,
        "cpu_only": args.cpu,
        "sections": status,
        "tests": test_counts,
        "columns": cols,
        "table": table,
        "goals": judged,
        "failed": failed_rows,
        "reports": meta,
    }
    path = args.out / "gpu_check.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
