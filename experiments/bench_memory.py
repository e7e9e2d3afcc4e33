"""Section ``memory`` of ``experiments/bench.py``: peak memory of a long no-grad forward.

Each encoder is measured in a fresh child process (``bench.py --_child-memory``),
so one encoder's peak, allocator caches or thread pools never count for another.

On CPU the number is the rise of the resident set during the forward: the high
water mark ``VmHWM`` is reset by writing ``5`` to ``/proc/self/clear_refs`` just
before it, and ``VmHWM - VmRSS(before)`` read after it. Where that file cannot
be written, ``ru_maxrss`` after minus ``VmRSS`` before is used, and the result
is flagged unreliable unless ``ru_maxrss`` rose during the forward (else the
process peaked earlier and the forward's own peak is hidden). On CUDA it is
``max_memory_allocated`` after ``reset_peak_memory_stats`` minus the allocation
before.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import subprocess
import sys
from typing import Any

import torch
from bench_common import Goal, Row

BASELINE = "none"
GOAL = Goal("<=", 2.0)


def _status_kib() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process, in KiB."""
    with open("/proc/self/status") as f:
        return {
            line.split(":")[0]: int(line.split()[1])
            for line in f
            if line.startswith(("VmRSS", "VmHWM"))
        }


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS; False if the kernel does not let us."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(encoder: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Measure one encoder's forward peak in this (fresh) process; the child's entry point.

    Args:
        encoder: Registered encoder name.
        cfg: ``{"model", "vocab", "batch", "length", "device"}``.

    Returns:
        ``{"peak_mib", "method", "reliable"}`` or ``{"skipped": reason}``.
    """
    from posenc.model import DecoderLM

    device = torch.device(cfg["device"])
    torch.manual_seed(0)
    model = DecoderLM(vocab_size=cfg["vocab"], encoder=encoder, **cfg["model"]).to(device).eval()
    limit = model.encoder.max_length
    if limit is not None and cfg["length"] > limit:
        return {"skipped": f"max_length {limit} < T={cfg['length']}"}
    ids = torch.randint(cfg["vocab"], (cfg["batch"], cfg["length"]), device=device)
    with torch.no_grad():
        # A short forward first: thread pools, kernel caches and the encoders'
        # own tables for short lengths are one-off costs, not the long forward's.
        model(ids[:, :16])
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            model(ids)
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - before
            return {"peak_mib": peak / 2**20, "method": "cuda_max_allocated", "reliable": True}
        ru_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        reset = _reset_hwm()
        rss_before = _status_kib()["VmRSS"]
        model(ids)
        if reset:
            peak_kib, method, reliable = _status_kib()["VmHWM"] - rss_before, "VmHWM", True
        else:
            ru_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak_kib, method, reliable = ru_after - rss_before, "ru_maxrss", ru_after > ru_before
    return {"peak_mib": peak_kib / 1024, "method": method, "reliable": reliable}


def _spawn(script: str, encoder: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run ``script --_child-memory encoder`` and parse the JSON line it prints last."""
    env = dict(os.environ)
    # A fixed mmap threshold stops glibc from raising it after big frees, so every
    # large tensor is its own mapping, returned to the OS when freed: RSS then
    # follows live tensors instead of what the heap kept from earlier allocations.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    cmd = [sys.executable, script, "--_child-memory", encoder, "--_child-config", json.dumps(cfg)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"memory child for {encoder} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(*, script: str, encoders: list[str], cfg: dict[str, Any], rounds: int) -> dict[str, Any]:
    """Peak memory of each encoder relative to ``none``, one child process per measurement.

    Children run in rounds that alternate the baseline and the candidates, like the
    timings, although the peaks hardly vary between rounds.

    Returns:
        ``{"config", "baseline", "rows"}``; ratios are candidate / baseline peak.
    """
    order = [BASELINE] + [e for e in encoders if e != BASELINE]
    results: dict[str, list[dict[str, Any]]] = {e: [] for e in order}
    for r in range(rounds):
        for enc in order if r % 2 == 0 else order[::-1]:
            results[enc].append(_spawn(script, enc, cfg))
    base = [res["peak_mib"] for res in results[BASELINE]]
    rows = []
    for enc in order:
        res = results[enc]
        goal = None if enc == BASELINE else GOAL
        if "skipped" in res[0]:
            rows.append(Row(enc, None, None, goal, note=res[0]["skipped"], raw={"children": res}))
            continue
        peaks = [x["peak_mib"] for x in res]
        ratios = [p / b for p, b in zip(peaks, base, strict=True)]
        note = "" if all(x["reliable"] for x in res) else "UNRELIABLE: peak before forward"
        raw = {
            "peaks_mib": peaks,
            "ratios": ratios,
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "method": res[0]["method"],
            "children": res,
        }
        rows.append(Row(enc, statistics.median(peaks), statistics.median(ratios), goal, note, raw))
    return {
        "config": cfg,
        "baseline": BASELINE,
        "unit": "MiB above the pre-forward RSS",
        "rows": rows,
    }
