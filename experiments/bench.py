"""Performance benchmark of posenc's encoders.

    python experiments/bench.py [--quick] [--json out.json] [--sections train,memory,...]
    python experiments/bench.py --pool run1.json run2.json ...

Every number is a ratio against a baseline measured in the same process and the
same interleaved rounds (the memory section uses one child process per
measurement); the tables report the median of the per-round ratios with their
range, and the median absolute value. Sections:

* ``train``: training-step tokens/s of every registered encoder relative to
  ``none``, at two lengths with equal tokens per step.
* ``memory``: peak memory of a no-grad forward at 16x the training length,
  relative to ``none``.
* ``overhead``: Lightning ``Trainer.fit`` of ``LMTask`` vs a bare PyTorch loop.
* ``compile``: each encoder's training step under ``torch.compile`` relative to eager
  (reported, no goal on a CPU; it compiles every encoder, a few minutes in all).
* ``decode``: LM generation and MT beam search with the key/value cache relative to
  without it.

Two more sections run when named (``--sections steps,flex``), for a GPU
(``experiments/gpu_check.sh`` runs them with ``--sizes gpu``):

* ``steps``: every encoder's training step in bf16, eager (the default) and with
  ``model.compile=true``, tokens/s and peak memory relative to ``none``.
* ``flex``: FlexAttention against the explicit path for the schemes it serves.

``--pool a.json b.json ...`` measures nothing: it puts the rows of several ``--json``
reports side by side and judges the goals on the median of all their rounds pooled.
``--quick`` (``--sizes quick``) shrinks everything to run in about a minute (the smoke
test uses it); the full run takes a few minutes on 2 cores; ``--sizes gpu`` is a GPU's
(T = 1024 and 4096, bf16), with ``--lengths`` keeping some of its lengths. Results on a
shared machine are noisy; ``--threads 1`` trades speed for much steadier ratios there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_common import Row, fmt_seconds, markdown_table, pool_runs, pooled_table, row_line

SECTIONS = ("train", "memory", "overhead", "compile", "decode")
#: Sections run only when named in ``--sections``.
EXTRA_SECTIONS = ("steps", "flex")

# Sizes per mode. The full sizes are the issue's; quick ones only exercise the code.
FULL: dict[str, Any] = {
    "model": {"n_layers": 4, "d_model": 128, "n_heads": 4, "d_ff": 512, "dropout": 0.0},
    "vocab": 65,
    "train": {"shapes": [(8, 256), (2, 1024)], "rounds": 5, "steps": 2},
    "memory": {"train_length": 128, "multiplier": 16, "batch": 4, "rounds": 1, "encoders": None},
    "overhead": {"encoder": "rope", "batch": 8, "length": 256, "steps": 10, "rounds": 5},
    "compile": {
        "shape": (8, 256),
        "rounds": 5,
        "steps": 2,
        "backend": "inductor",
        "encoders": None,
    },
    "decode": {"prompt": 128, "new": 512, "rounds": 2, "mt_sentences": 32, "encoders": None},
    "steps": {
        "shapes": [(8, 256), (2, 1024)],
        "rounds": 3,
        "steps": 2,
        "dtype": "fp32",
        "modes": ["eager", "compiled"],
        "encoders": None,
    },
    "flex": {"shape": (2, 1024), "rounds": 3, "steps": 2, "dtype": "fp32"},
}
QUICK: dict[str, Any] = {
    "model": {"n_layers": 2, "d_model": 64, "n_heads": 2, "d_ff": 128, "dropout": 0.0},
    "vocab": 65,
    "train": {"shapes": [(4, 64), (1, 256)], "rounds": 2, "steps": 1},
    # A fresh process per encoder (its peak RSS): three, not all, to stay quick.
    "memory": {
        "train_length": 32,
        "multiplier": 16,
        "batch": 2,
        "rounds": 1,
        "encoders": ["none", "rope", "xl"],
    },
    "overhead": {"encoder": "rope", "batch": 4, "length": 64, "steps": 3, "rounds": 2},
    "compile": {
        "shape": (4, 64),
        "rounds": 2,
        "steps": 1,
        "backend": "eager",
        "encoders": ["none", "rope", "deberta"],
    },
    "decode": {
        "prompt": 16,
        "new": 16,
        "rounds": 2,
        "mt_sentences": 4,
        "encoders": ["none", "rope", "deberta"],
    },
    "steps": {
        "shapes": [(4, 32), (1, 128)],
        "rounds": 2,
        "steps": 1,
        "dtype": "fp32",
        "modes": ["eager"],
        "encoders": ["none", "rope", "alibi"],
    },
    "flex": {"shape": (1, 128), "rounds": 2, "steps": 1, "dtype": "fp32"},
}
#: A GPU's sizes (#34): the lengths where FlexAttention and compilation matter, 16k tokens
#: per step, bf16; one or two rounds, as a GPU's timings are steady.
GPU: dict[str, Any] = {
    "model": {"n_layers": 4, "d_model": 256, "n_heads": 4, "d_ff": 1024, "dropout": 0.0},
    "vocab": 256,
    "train": {"shapes": [(16, 1024), (4, 4096)], "rounds": 3, "steps": 3},
    "memory": {"train_length": 256, "multiplier": 16, "batch": 4, "rounds": 1, "encoders": None},
    "overhead": {"encoder": "rope", "batch": 16, "length": 1024, "steps": 10, "rounds": 3},
    "compile": {
        "shape": (4, 4096),
        "rounds": 3,
        "steps": 3,
        "backend": "inductor",
        "encoders": None,
    },
    "decode": {"prompt": 128, "new": 512, "rounds": 1, "mt_sentences": 32, "encoders": None},
    "steps": {
        "shapes": [(16, 1024), (4, 4096)],
        "rounds": 3,
        "steps": 3,
        "dtype": "bf16",
        "modes": ["eager", "compiled"],
        "encoders": None,
    },
    "flex": {"shape": (4, 4096), "rounds": 3, "steps": 3, "dtype": "bf16"},
}
SIZES = {"full": FULL, "quick": QUICK, "gpu": GPU}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, about a minute")
    p.add_argument("--sizes", choices=list(SIZES), help="full (default), quick or gpu")
    p.add_argument("--lengths", help="comma-separated lengths T: keep only these shapes")
    p.add_argument("--modes", help="section steps: eager, compiled or eager,compiled")
    p.add_argument("--encoders", help="sections steps and decode: comma-separated encoders")
    p.add_argument("--json", type=Path, help="write all results, with per-round numbers")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    p.add_argument(
        "--plain-softmax",
        action="store_true",
        help="the explicit softmax through plain autograd instead of its written-out backward",
    )
    p.add_argument(
        "--flex-tiles",
        metavar="M,N",
        help="forward tiles of the compiled FlexAttention on a GPU (BLOCK_M,BLOCK_N)",
    )
    p.add_argument(
        "--pool",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="measure nothing: put the rows of two or more --json reports side by side, "
        "with the median of all their rounds pooled",
    )
    # The memory section re-runs this script in a child process per encoder.
    p.add_argument("--_child-memory", dest="child_memory", help=argparse.SUPPRESS)
    p.add_argument("--_child-config", dest="child_config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS) - set(EXTRA_SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; allowed: {', '.join(SECTIONS + EXTRA_SECTIONS)}")
    if args.quick and args.sizes not in (None, "quick"):
        p.error(f"--quick is --sizes quick; it cannot go with --sizes {args.sizes}")
    args.sizes = "quick" if args.quick else args.sizes or "full"
    if args.modes:
        args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if not args.modes or set(args.modes) - {"eager", "compiled"}:
            p.error(f"--modes {','.join(args.modes)}: allowed eager, compiled or both")
    if args.encoders:
        args.encoders = [e.strip() for e in args.encoders.split(",") if e.strip()]
    if args.lengths:
        try:
            args.lengths = [int(x) for x in args.lengths.split(",")]
        except ValueError:
            p.error(f"--lengths {args.lengths!r}: give comma-separated integers, e.g. 1024,4096")
        sizes = SIZES[args.sizes]
        have = sorted({t for name in ("train", "steps") for _, t in sizes[name]["shapes"]})
        missing = [t for t in args.lengths if t not in have]
        if missing:
            p.error(
                f"--lengths {','.join(map(str, missing))}: the {args.sizes} sizes measure "
                f"lengths {', '.join(map(str, have))}; pick among them or use another --sizes"
            )
    return args


def pick(sizes: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``sizes`` with the training shapes cut to ``--lengths`` and the steps section's
    modes and encoders (and the decode section's encoders) set by ``--modes`` and
    ``--encoders``, where given."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in sizes.items()}
    if args.lengths:
        for name in ("train", "steps"):
            out[name]["shapes"] = [bt for bt in sizes[name]["shapes"] if bt[1] in args.lengths]
    if args.modes:
        out["steps"]["modes"] = args.modes
    if args.encoders:
        out["steps"]["encoders"] = out["decode"]["encoders"] = args.encoders
    return out


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def header(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """What the numbers depend on: versions, threads, device, load, the command."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "command": shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "load_average_at_start": load,
        "quick": args.quick,
        "sizes": args.sizes,
        "lengths": args.lengths,
        "modes": args.modes,
        "encoders": args.encoders,
        "sections": args.sections,
        "plain_softmax": args.plain_softmax,
        "flex_tiles": args.flex_tiles,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def run_section(
    name: str,
    sizes: dict[str, Any],
    device: torch.device,
    script: str,
    on_row: Callable[[Row], None] | None = None,
) -> dict[str, Any]:
    """Run one section; its modules are imported lazily (Lightning only for ``overhead``).
    The GPU sections (steps, flex, decode) hand each row to ``on_row`` once measured."""
    model, vocab = sizes["model"], sizes["vocab"]
    if name in ("steps", "flex"):
        import bench_steps

        if name == "steps":
            return bench_steps.run_steps(
                model_cfg=model, vocab=vocab, device=device, on_row=on_row, **sizes["steps"]
            )
        return bench_steps.run_flex(
            model_cfg=model, vocab=vocab, device=device, on_row=on_row, **sizes["flex"]
        )
    if name == "decode":
        import bench_decode

        return bench_decode.run(
            model_cfg=model, vocab=vocab, device=device, on_row=on_row, **sizes["decode"]
        )
    if name == "compile":
        import bench_compile

        return bench_compile.run(model_cfg=model, vocab=vocab, device=device, **sizes["compile"])
    if name == "train":
        import bench_train

        return bench_train.run(model_cfg=model, vocab=vocab, device=device, **sizes["train"])
    if name == "memory":
        import bench_memory

        from posenc.encoders import available

        m = sizes["memory"]
        cfg = {
            "model": model,
            "vocab": vocab,
            "batch": m["batch"],
            "length": m["train_length"] * m["multiplier"],
            "train_length": m["train_length"],
            "device": str(device),
        }
        encoders = m["encoders"] or available()
        return bench_memory.run(script=script, encoders=encoders, cfg=cfg, rounds=m["rounds"])
    import bench_overhead

    return bench_overhead.run(model_cfg=model, vocab=vocab, device=device, **sizes["overhead"])


TITLES = {
    "train": "Training step (fwd + bwd + clip + AdamW), tokens/s relative to `none`",
    "memory": "Peak memory of a no-grad forward at 16x the training length, relative to `none`",
    "overhead": "Lightning Trainer.fit vs a bare PyTorch loop, tokens/s",
    "compile": "Training step under torch.compile, speed relative to eager",
    "decode": "Decoding with the key/value cache, speed relative to without",
    "steps": "Training step (bf16 on a GPU), eager and model.compile=true, tokens/s relative "
    "to `none` in the same mode",
    "flex": "FlexAttention (forced; a GPU only) and the explicit path, tokens/s relative to `none`",
}


def render(name: str, result: dict[str, Any]) -> str:
    """A section's Markdown: title, configuration, checks, table."""
    lines = [f"## {name}: {TITLES[name]}", ""]
    lines.append(f"baseline: {result['baseline']}; config: `{json.dumps(result['config'])}`")
    if "checks" in result:
        worst = max(c["max_abs_err"] for c in result["checks"].values())
        status = "passed" if result["checks_passed"] else "FAILED"
        reference = "PyTorch's ops"
        lines.append(
            f"agreement with {reference}: {status} ({len(result['checks'])} checks, "
            f"max abs error {worst:.2g})"
        )
    lines.append("")
    if name == "memory":
        table = markdown_table(
            result["rows"],
            value_name="peak",
            fmt=lambda v: "-" if v is None else f"{v:.1f} MiB",
        )
    else:
        value = "time / token" if name == "decode" else "time / step"
        table = markdown_table(result["rows"], value_name=value, fmt=fmt_seconds)
    lines.append(table)
    return "\n".join(lines)


def to_json(result: dict[str, Any]) -> dict[str, Any]:
    return {k: [r.to_json() for r in v] if k == "rows" else v for k, v in result.items()}


def pool(paths: list[Path]) -> int:
    """Print :func:`bench_common.pool_runs` of the reports at ``paths``."""
    reports = []
    for path in paths:
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            print(f"bench.py --pool: cannot read {path}: {e}", file=sys.stderr)
            return 2
        if "sections" not in reports[-1]:
            print(f"bench.py --pool: {path} is not a bench.py --json report", file=sys.stderr)
            return 2
    try:
        pooled = pool_runs(reports)
    except ValueError as e:
        print(f"bench.py --pool: {e}", file=sys.stderr)
        return 2
    print(f"# posenc benchmark, {len(reports)} runs pooled\n")
    for path, r in zip(paths, reports, strict=True):
        print(f"- `{path}`: `{r['meta']['command']}`, started {r['meta'].get('started', '?')}")
    unmet = []
    for name, rows in pooled.items():
        print(f"\n## {name}: {TITLES[name]}\n\n{pooled_table(rows)}")
        unmet += [f"{name}: {r['what']}" for r in rows if r["met"] is False]
    listed = ": " + "; ".join(unmet) if unmet else ""
    print(f"\n{len(unmet)} goal(s) not met over the pooled rounds{listed}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_memory:
        import bench_memory

        out = bench_memory.child(args.child_memory, json.loads(args.child_config))
        print(json.dumps(out))
        return 0
    if args.pool:
        return pool(args.pool)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.plain_softmax:
        from posenc.model import backends

        backends.HAND_WRITTEN_BACKWARD = False
    if args.flex_tiles:
        from posenc.model import backends

        m, n = (int(x) for x in args.flex_tiles.split(","))
        backends.FLEX_KERNEL_OPTIONS.update(BLOCK_M=m, BLOCK_N=n)
    device = resolve_device(args.device)
    meta = header(args, device)
    print(f"# posenc benchmark\n\ncommand: `{meta['command']}`")
    print(
        f"torch {meta['torch']}, {meta['threads']} threads ({meta['interop_threads']} interop), "
        f"{meta['cpu_count']} CPUs, device {meta['device']}, "
        f"load average {meta['load_average_at_start']}"
    )
    sizes = pick(SIZES[args.sizes], args)
    report: dict[str, Any] = {"meta": meta, "sections": {}}
    unmet: list[str] = []
    t_all = time.perf_counter()

    def write_json() -> None:
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")

    for name in args.sections:
        t0 = time.perf_counter()
        partial: list[Row] = []

        def on_row(row: Row, name: str = name, partial: list[Row] = partial) -> None:
            """Print the row now and keep it in the JSON: a time limit loses nothing done."""
            partial.append(row)
            print(f"{name}: " + row_line(row), flush=True)
            report["sections"][name] = {"partial": True, "rows": [r.to_json() for r in partial]}
            write_json()

        result = run_section(name, sizes, device, str(Path(__file__).resolve()), on_row)
        result["seconds"] = time.perf_counter() - t0
        print("\n" + render(name, result) + f"\n\n({result['seconds']:.0f} s)", flush=True)
        rows: list[Row] = result["rows"]
        unmet += [f"{name}: {r.what}" for r in rows if r.goal and r.goal.met(r.ratio) is False]
        report["sections"][name] = to_json(result)
    meta["seconds"] = time.perf_counter() - t_all
    report["unmet_goals"] = unmet
    print(f"\n{len(unmet)} goal(s) not met" + (": " + "; ".join(unmet) if unmet else ""))
    if args.json:
        write_json()
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
