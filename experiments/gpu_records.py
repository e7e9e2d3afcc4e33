"""The GPU records as markdown: one table per record in docs/gpu/, newest first.

    python experiments/gpu_records.py [--records DIR] [--write FILE]

Each record is the ``gpu_check.json`` of one run of ``experiments/gpu_check.sh``
(experiments/gpu_check_report.py writes it), kept as ``docs/gpu/<date>-<card>-<n>.json``.
Every figure printed here is the record's, rounded to 2 decimals; the goals are judged
from those figures against today's targets (:func:`gpu_check_report.goals`), so an old
record shows how far it was from them. Without ``--write`` the markdown is printed; with
it, the text between the two marker lines in FILE (docs/performance.md) is replaced and
nothing else in FILE changes. Record links are relative to docs/.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gpu_check_report import LEGEND, goals, render, sections_line, tests_line

from posenc.files import write_text_atomic

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "gpu"
START = "<!-- gpu-records:start -->"
END = "<!-- gpu-records:end -->"
#: What a record must hold for its table (gpu_check_report.py writes them all).
KEYS = ("device", "torch", "date", "command", "columns", "table")


def load(folder: Path) -> list[tuple[str, dict[str, Any]]]:
    """Every record in ``folder`` as (file name, record), newest first (by date, then name).

    Raises:
        ValueError: A file is not JSON or lacks a key of :data:`KEYS`; names the file.
    """
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path} is not JSON ({e})") from e
        missing = [k for k in KEYS if k not in record]
        if missing:
            raise ValueError(
                f"{path} lacks {', '.join(missing)}: keep the gpu_check.json that "
                "experiments/gpu_check_report.py wrote, unchanged"
            )
        records.append((path.name, record))
    return sorted(records, key=lambda r: (r[1]["date"], r[0]), reverse=True)


def render_record(name: str, record: dict[str, Any]) -> str:
    """One record: a header line (card, torch, date, command, the file), its sections and
    tests, its table, and each goal met or not with its figure."""
    lines = [
        f"**{record['device']}**, torch {record['torch']}, {record['date']}: "
        f"`{record['command']}` (record: [docs/gpu/{name}](gpu/{name}))",
        "",
    ]
    if record.get("sections"):
        lines.append(sections_line(record["sections"]) + ".")
    if record.get("tests"):
        lines.append(tests_line(record["tests"]) + ".")
    lines += ["", render(record["table"], record["columns"]) if record["table"] else "(no figures)"]
    judged = goals(record["table"])
    met = sum(g["met"] for g in judged)
    lines += ["", f"Goals: {met} of {len(judged)} met." if judged else "Goals: none measured."]
    lines += [
        f"- {'met' if g['met'] else 'not met'}: {g['goal']} ({g['value']:.2f})" for g in judged
    ]
    return "\n".join(lines)


def render_all(records: list[tuple[str, dict[str, Any]]]) -> str:
    """The block that docs/performance.md holds between its markers."""
    parts = [LEGEND, *(render_record(name, record) for name, record in records)]
    return "\n\n".join(parts) + "\n"


def replace_block(text: str, block: str) -> str:
    """``text`` with what lies between the marker lines replaced by ``block``.

    Raises:
        ValueError: The markers are missing, repeated or out of order.
    """
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(
            f"wants one line {START} and, after it, one line {END}: "
            "put the two lines where the tables go"
        )
    head, rest = text.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{block}{END}{tail}"


def block_of(text: str) -> str:
    """What lies between the markers of ``text`` (the inverse of :func:`replace_block`)."""
    return text.split(START, 1)[1].split(END, 1)[0].removeprefix("\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=Path, default=RECORDS, help="default: docs/gpu")
    p.add_argument("--write", type=Path, help="replace the block between the markers here")
    args = p.parse_args(argv)
    try:
        records = load(args.records)
    except (OSError, ValueError) as e:
        print(f"gpu_records: {e}", file=sys.stderr)
        return 2
    block = render_all(records)
    if args.write is None:
        print(block, end="")
        return 0
    try:
        write_text_atomic(args.write, replace_block(args.write.read_text(), block))
    except (OSError, ValueError) as e:
        print(f"gpu_records: {args.write} {e}", file=sys.stderr)
        return 2
    print(f"gpu_records: wrote the tables of {len(records)} record(s) into {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
