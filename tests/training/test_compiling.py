"""``model.compile=auto``: compiled on a GPU for the schemes measured faster compiled
there, eager on a CPU and for every scheme not measured; ``true`` and ``false`` as set."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from posenc.schema import typed
from posenc.tasks.lm import LMTask
from posenc.train import train
from posenc.training.callbacks import Throughput
from posenc.training.compiling import COMPILED_OVER_EAGER, AutoCompile, auto_compile
from posenc.training.trainer import build_trainer
from tests.conftest import ROOT, compose_run

EAGER = "model.compile=false trains eager"
CPU = "eager (CPU: auto compiles on a GPU only; model.compile=true compiles)"
SIZES = dict(n_layers=1, d_model=16, n_heads=2, d_ff=32, dropout=0.0)


def _task(encoder: str) -> LMTask:
    """A tiny LM under ``model.compile=auto``."""
    return LMTask(
        vocab_size=11,
        encoder={"_target_": encoder, "_partial_": True},
        model={**SIZES, "compile": "auto"},
        optim={},
        max_steps=1,
        seq_len=8,
    )


@pytest.mark.parametrize(
    ("scheme", "compiled", "reason"),
    [
        ("rope", True, f"compiled (rope trains 1.26x faster compiled on an H200; {EAGER})"),
        ("fire", False, "eager (fire trains at 0.66x its eager speed compiled on an H200)"),
        ("t5", True, "compiled (t5 trains 1.03x faster compiled on an H200; "),
        ("cope", False, "eager (cope trains at 0.14x its eager speed compiled on an H200)"),
        ("path", False, "eager (path: not measured compiled on a GPU; model.compile=true"),
        ("mix", False, "eager (mix: not measured compiled on a GPU; "),
        ("rope_qknorm", False, "eager (rope_qknorm: not measured compiled on a GPU; "),
    ],
)
def test_auto_on_a_gpu_compiles_the_schemes_measured_faster_compiled(
    scheme: str, compiled: bool, reason: str
) -> None:
    got, why = auto_compile(scheme, "cuda")
    assert got is compiled
    assert why.startswith(reason)


@pytest.mark.parametrize("scheme", ["rope", "fire", "cope", "path"])
def test_auto_off_a_gpu_is_eager(scheme: str) -> None:
    assert auto_compile(scheme, "cpu") == (False, CPU)
    assert auto_compile(scheme, "mps") == (False, "eager (mps: compiling not measured there)")


#: Schemes measured again after the fourth H200 run: the record their entry comes from.
REMEASURED = {"fire": "2026-11-30-h200-2.json"}


def test_the_table_is_the_measured_one() -> None:
    """:data:`COMPILED_OVER_EAGER` is the "compiled / eager" column of the H200 run that
    docs/performance.md reports, scheme by scheme (``none``'s from its tokens/s), except
    the schemes measured again since, whose entry is their newer record's."""
    text = (ROOT / "docs" / "performance.md").read_text()
    run = text[text.index("**Fourth run, NVIDIA H200**") :]
    rows = re.findall(r"^\| (\w+)[^|]* \| \d \|.*\| ([\d.]+) \|$", run.split("\n\n")[1], re.M)
    none = re.search(r"`none` at ([\d.]+) M tokens/s eager, ([\d.]+) M compiled", run)
    assert none is not None
    table = {name: float(ratio) for name, ratio in rows}
    table["none"] = round(float(none[2]) / float(none[1]), 2)
    for scheme, record in REMEASURED.items():
        measured = json.loads((ROOT / "docs" / "gpu" / record).read_text())["table"][scheme]
        table[scheme] = round(measured["compiled/eager T=4096"], 2)
    assert table == COMPILED_OVER_EAGER


@pytest.mark.parametrize(
    ("encoder", "device", "compiled"),
    [
        ("posenc.encoders.rope.RoPE", "cuda", True),
        ("posenc.encoders.cope.CoPE", "cuda", False),
        ("posenc.encoders.rope.RoPE", "cpu", False),
    ],
)
def test_auto_compiles_in_place_at_the_start_of_training(
    encoder: str, device: str, compiled: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The callback reads the device the model trains on (faked here: this machine has no
    GPU), compiles the model in place when the table says so (the checkpoint keys stay
    the eager model's) and logs one line either way."""
    task = _task(encoder)
    keys = list(task.state_dict())
    assert task.model._compiled_call_impl is None  # "auto" waits for the device
    task._device = torch.device(device, 0) if device == "cuda" else torch.device(device)
    scheme = "rope" if "rope" in encoder else "cope"
    with caplog.at_level(logging.INFO, logger="posenc.training.compiling"):
        AutoCompile(scheme).on_fit_start(None, task)  # type: ignore[arg-type]
    assert (task.model._compiled_call_impl is not None) is compiled
    assert list(task.state_dict()) == keys
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"model.compile=auto: {auto_compile(scheme, device)[1]}"]


@pytest.mark.parametrize(("setting", "auto"), [("auto", True), ("true", False), ("false", False)])
def test_the_trainer_decides_only_under_auto(tmp_path: Path, setting: str, auto: bool) -> None:
    """``true`` and ``false`` are settled when the model is built (test_compile.py);
    only ``auto`` adds the callback, with the run's scheme."""
    cfg = typed(compose_run(tmp_path, "encoder=rope", f"model.compile={setting}"))
    trainer = build_trainer(cfg, tmp_path, Throughput())
    found = [c for c in trainer.callbacks if isinstance(c, AutoCompile)]  # type: ignore[attr-defined]
    assert [c.scheme for c in found] == (["rope"] if auto else [])


def test_a_run_on_the_cpu_trains_eager_by_default(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = compose_run(tmp_path, "encoder=rope", "task.eval.multipliers=[1]")
    assert cfg.model.compile == "auto"
    with caplog.at_level(logging.INFO, logger="posenc.training.compiling"):
        train(cfg)
    lines = [r.getMessage() for r in caplog.records if r.name == "posenc.training.compiling"]
    assert lines == [f"model.compile=auto: {CPU}"]
