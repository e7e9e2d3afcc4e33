"""DDP on CPU for real: ``python run.py trainer.devices=2 trainer.strategy=ddp`` (gloo).

Deselect with ``-m "not ddp"``. The evaluation sizes give odd window counts (13 windows at
L=16, 6 at L=32 ...), so a sampler that pads ranks to equal length would score some
windows twice and the 2-process numbers would differ from the 1-process ones.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from posenc.train import train
from tests.conftest import ALGO_SMALL, MT_SMALL, ROOT, children

pytestmark = pytest.mark.ddp

TINY = [
    "encoder=rope",
    "model.n_layers=1",
    "model.d_model=16",
    "model.n_heads=2",
    "model.d_ff=32",
    "task.seq_len=16",
    "task.batch_size=4",
    "task.eval_batch_size=4",
    "task.eval.multipliers=[1,2]",
    "task.eval.max_tokens=208",
    "task.eval.sliding_stride=4",
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=2",
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
    "trainer.accelerator=cpu",
]
DDP = ["trainer.devices=2", "trainer.strategy=ddp"]
PPL = ("test/ppl@16", "test/ppl_sw@16", "test/ppl@32", "test/ppl_sw@32")


MT_TINY = [
    *MT_SMALL,
    "task.max_len=64",
    "task.max_tokens=512",
    "task.eval_max_sentences=25",
    "task.decode.beam_size=2",
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=4",
    "trainer.enable_progress_bar=false",
    "trainer.accelerator=cpu",
]


def run_py(run_dir: Path, cache: Path, *overrides: str, base: list[str] = TINY) -> str:
    """``python run.py`` as a user would call it; returns the combined output."""
    proc = subprocess.run(
        [
            sys.executable,
            "run.py",
            *base,
            f"hydra.run.dir={run_dir}",
            f"paths.cache_dir={cache}",
            *overrides,
        ],
        cwd=ROOT,
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def metrics(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("ddp")
    out = run_py(tmp / "train", tmp / "cache", *DDP)
    return tmp / "train", out


def test_ddp_training_runs_two_ranks_and_writes_metrics_once(trained: tuple[Path, str]) -> None:
    run_dir, output = trained
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in output and "distributed_backend=gloo" in output
    m = metrics(run_dir)
    assert m["train_steps"] == 3
    assert all(math.isfinite(m["metrics"][k]) for k in (*PPL, "val/loss"))
    assert (run_dir / "checkpoints" / "best.ckpt").exists()
    # Exactly one metrics.json, written by rank zero only, and no leftover temp file.
    assert list(run_dir.rglob("metrics.json")) == [run_dir / "metrics.json"]
    assert not list(run_dir.glob(".metrics.json.tmp*"))
    assert (run_dir / "run.log").read_text().count("metrics written to") == 1
    assert "metrics written to" not in (run_dir / "train_ddp_process_1.log").read_text()
    # Every window scored once across both ranks: 208 tokens at L=16 (13 windows).
    assert m["scored_tokens"]["test/ppl@16"] == m["scored_tokens"]["test/ppl_sw@16"] == 208


def test_one_and_two_processes_give_the_same_perplexity(
    trained: tuple[Path, str], tmp_path: Path
) -> None:
    run_dir, _ = trained
    ckpt = run_dir / "checkpoints" / "best.ckpt"
    evaluate = ["eval_only=true", f"ckpt_path={ckpt}"]
    run_py(tmp_path / "two", tmp_path / "cache", *evaluate, *DDP)
    two = metrics(tmp_path / "two")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                *TINY,
                *evaluate,
                "trainer.devices=1",
                f"paths.output_dir={tmp_path / 'one'}",
                f"paths.cache_dir={tmp_path / 'cache'}",
            ],
        )
    one = train(cfg)
    assert one["scored_tokens"] == two["scored_tokens"]
    for key in PPL:
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-6), key
        # The training run evaluated the same best.ckpt on its two ranks.
        assert metrics(run_dir)["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-6)
    for name, curve in one["loss_by_position"].items():
        assert two["loss_by_position"][name] == pytest.approx(curve, abs=2e-5), name


def test_translation_on_two_ranks_decodes_each_sentence_once_as_one_process_does(
    tmp_path: Path,
) -> None:
    """Each rank decodes its shard of the test sentences; the run scores all of them (it
    used to stop after training: rank zero held only its own shard)."""
    cache = tmp_path / "cache"
    run_py(tmp_path / "two", cache, *DDP, base=MT_TINY)
    two = metrics(tmp_path / "two")
    assert two["train_steps"] == 3 and two["n_sentences"] == 25
    hyps = (tmp_path / "two" / "test.hyp.txt").read_text(encoding="utf-8")
    assert len(hyps.splitlines()) == 25
    ckpt = tmp_path / "two" / "checkpoints" / "best.ckpt"
    run_py(tmp_path / "one", cache, "eval_only=true", f"ckpt_path={ckpt}", base=MT_TINY)
    one = metrics(tmp_path / "one")
    assert (tmp_path / "one" / "test.hyp.txt").read_text(encoding="utf-8") == hyps
    assert one["buckets"] == two["buckets"]
    for key in ("test/bleu", "test/chrf", "test/loss"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5), key


ALGO_TINY = [
    "task=algo",
    "task.problem=compute_sqrt",
    "encoder=rope",
    *[o for o in ALGO_SMALL if not o.startswith("task.test_per_size=")],
    "task.test_per_size=6",
    "task.eval_batch_size=2",  # three batches a size, dealt to the ranks in turn
    "trainer.enable_progress_bar=false",
    "trainer.accelerator=cpu",
]


def test_two_ranks_show_the_examples_one_process_shows(tmp_path: Path) -> None:
    """Each rank tests every other batch; the run's examples.md still holds the first
    three instances of every size in test order, as one process testing them all does
    (rank zero's alone had every other size, or two of the three)."""
    cache = tmp_path / "cache"
    run_py(tmp_path / "two", cache, *DDP, base=ALGO_TINY)
    ckpt = tmp_path / "two" / "checkpoints" / "best.ckpt"
    run_py(tmp_path / "one", cache, "eval_only=true", f"ckpt_path={ckpt}", base=ALGO_TINY)
    assert metrics(tmp_path / "one")["by_size"] == metrics(tmp_path / "two")["by_size"]
    two = (tmp_path / "two" / "examples.md").read_text()
    assert two == (tmp_path / "one" / "examples.md").read_text()
    assert [line.split(" | ")[0] for line in two.splitlines() if line[:2] == "| "][1:] == [
        f"| {n}" for n in range(1, 9) for _ in range(3)
    ]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_sigterm_to_every_rank_stops_them_together_and_saves(tmp_path: Path) -> None:
    """SIGTERM to every process of a 2-rank run, as SLURM sends it at a time limit or a
    preemption: both ranks stop after the same batch, ``last.ckpt`` is saved, the run
    exits 143 and says once how to continue. (Lightning's handler exchanged a tensor
    between the ranks inside the signal handler and each rank then stopped where its own
    flag said: the ranks waited in different collectives and the run hung with nothing
    saved, here in 5 runs of 5.)"""
    run_dir = tmp_path / "run"
    tiny = [o for o in TINY if not o.startswith(("trainer.max_steps", "trainer.val_check"))]
    proc = subprocess.Popen(
        [
            sys.executable, "run.py", *tiny, *DDP, "trainer.max_steps=3000",
            "trainer.val_check_interval=20", f"hydra.run.dir={run_dir}",
            f"paths.cache_dir={tmp_path / 'cache'}",
        ],
        cwd=ROOT, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoints" / "best.ckpt").exists() and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    ranks = children(proc.pid)  # the other rank's process
    assert ranks, "the second rank's process was not found"
    time.sleep(0.5)  # both ranks training
    for pid in (proc.pid, *ranks):
        os.kill(pid, signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        for pid in (proc.pid, *ranks):
            os.kill(pid, signal.SIGKILL)
        pytest.fail("the run hung after SIGTERM")
    assert proc.returncode == 143, err[-3000:]
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    assert not (run_dir / "metrics.json").exists()
    assert err.count("stopped by SIGTERM; progress is saved in") == 1, err[-3000:]
    assert (run_dir / "run.log").read_text().count("SIGTERM at step") == 1
