"""Shared test helpers: identity-projection attention and reference encoders."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf, open_dict

from posenc.encoders.base import AttentionContext, AttnKind, PositionalEncoder
from posenc.model.attention import Attention
from posenc.preflight import register_resolvers

ROOT = Path(__file__).resolve().parents[1]
ENCODER_YAMLS = sorted(p.stem for p in (ROOT / "conf" / "encoder").glob("*.yaml"))
#: Sweep arms (conf/variant/): every encoder, and some trained on randomized positions.
VARIANT_YAMLS = sorted(p.stem for p in (ROOT / "conf" / "variant").glob("*.yaml"))


def encoder_class(name: str) -> type[PositionalEncoder]:
    """The class ``conf/encoder/<name>.yaml`` builds (its ``_target_``)."""
    return get_class(OmegaConf.load(ROOT / "conf" / "encoder" / f"{name}.yaml")._target_)


# The groups the tests treat alike come from what each scheme declares (class attributes
# of PositionalEncoder), so a new encoder is one file and one YAML, with no list to edit.
_CLASSES = {name: encoder_class(name) for name in ENCODER_YAMLS}
#: Schemes whose output moves with the positions themselves: neither relative (not even
#: below a threshold such as FIRE's, which the conformance tests stay under) nor NoPE.
ABSOLUTE = tuple(
    n for n, c in _CLASSES.items() if c.uses_positions and not (c.relative or c.relative_below)
)
#: Schemes defined for causal attention only: they refuse bidirectional attention.
CAUSAL_ONLY = tuple(n for n, c in _CLASSES.items() if c.causal_only)
#: The encoders a translation model (bidirectional encoder stack) can use.
BIDIRECTIONAL_YAMLS = [n for n in ENCODER_YAMLS if n not in CAUSAL_ONLY]

register_resolvers()  # ${posenc_uid:} in the run directories, as run.py registers it

# Tests and CI read the shared datasets instead of downloading them.
os.environ.setdefault("POSENC_DATA_DIR", str(ROOT.parent / "shared" / "data"))

# Under pytest-xdist (the README's `-n auto`) each worker takes its share of the cores:
# torch's default, a thread per core in every worker and in the runs a test starts,
# oversubscribes them (on 2 cores the whole suite took 456 s with one thread a worker,
# 730 s without). OMP_NUM_THREADS reaches the runs.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--all-documented-commands",
        action="store_true",
        help="run every command README.md and docs/ print (tests/test_documented_commands.py;"
        " CI runs a fast subset)",
    )


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _close_figures() -> Iterator[None]:
    """Figures a test drew and did not save stay open in the worker (matplotlib warns at
    20): closed after each test."""
    yield
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close("all")


def identity_attention(enc: PositionalEncoder, kind: AttnKind, layer: int = 0) -> Attention:
    """Attention whose q/k/v/out projections are the identity, so the heads of the
    input are the q, k and v the formulas talk about."""
    attn = Attention(
        d_model=enc.d_model,
        n_heads=enc.n_heads,
        dropout=0.0,
        pos=enc.for_attention(layer=layer, kind=kind),
    )
    with torch.no_grad():
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj):
            proj.weight.copy_(torch.eye(enc.d_model))
            proj.bias.zero_()
    return attn.eval()


def heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, C) -> (B, H, T, D)."""
    return x.unflatten(-1, (n_heads, -1)).transpose(1, 2)


def merge(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B, T, C)."""
    return x.transpose(1, 2).flatten(-2)


def run_self(
    attn: Attention, enc: PositionalEncoder, x: torch.Tensor, pos: torch.Tensor, kind: AttnKind
) -> torch.Tensor:
    """Embedding hook, then self-attention at explicit positions ``pos (1, T)``."""
    ctx: AttentionContext = enc.context(pos, pos, kind)
    return attn(enc.embed(x, pos), ctx)


def softmax_attend(scores: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Reference: masked softmax of (B, H, T, S) scores applied to v (B, H, S, D)."""
    if causal:
        t, s = scores.shape[-2:]
        blocked = torch.ones(t, s, dtype=torch.bool).triu(1 + s - t)
        scores = scores.masked_fill(blocked, float("-inf"))
    return scores.softmax(-1) @ v


# A run small enough for CI: one layer of width 16, three steps, lengths 16 and 64.
TINY = [
    "model.n_layers=1",
    "model.d_model=16",
    "model.n_heads=2",
    "model.d_ff=32",
    "task.seq_len=16",
    "task.batch_size=4",
    "task.eval_batch_size=4",
    "task.eval.multipliers=[1,4]",
    "task.eval.max_tokens=256",
    "task.eval.sliding_stride=4",
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=2",
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
]


# A translation model small enough for CI (each test adds its data and decoding sizes).
MT_SMALL = [
    "task=mt",
    "model.n_layers=1",
    "model.d_model=16",
    "model.n_heads=2",
    "model.d_ff=32",
    "tokenizer.vocab_size=400",
]


# An algorithmic run small enough for CI: one layer of width 16 on sizes 1..4, tested to
# 8 with three instances a size, three steps.
ALGO_SMALL = [
    "model.n_layers=1",
    "model.d_model=16",
    "model.n_heads=2",
    "model.d_ff=32",
    "task.train_lengths=[1,4]",
    "task.test_multiple=2",
    "task.batch_size=8",
    "task.val_per_size=2",
    "task.test_per_size=3",
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
]


def compose_run(tmp_path: Path, *overrides: str) -> DictConfig:
    """The real config, composed as run.py would, with a tiny model, writing into tmp_path."""
    return compose_config(tmp_path, *TINY, *overrides)


@contextlib.contextmanager
def command_line(tmp_path: Path, *overrides: str) -> Iterator[DictConfig]:
    """The config of ``python run.py <overrides>`` (writing into tmp_path), with Hydra
    initialized as run.py leaves it: its command line in ``hydra.overrides.task``."""
    overrides = (
        f"paths.output_dir={tmp_path / 'run'}",
        f"paths.cache_dir={tmp_path / 'cache'}",
        *overrides,
    )
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    try:
        yield cfg
    finally:
        HydraConfig.instance().cfg = None  # later tests run outside Hydra


def compose_hydra(*overrides: str) -> DictConfig:
    """The real config with ``overrides``, its ``hydra`` node included (a sweep preset's
    ``hydra.sweeper.params``, the launcher)."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def compose_config(tmp_path: Path, *overrides: str) -> DictConfig:
    """The real config with only ``overrides`` (every task's own sizes), writing into
    tmp_path."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(
            "config",
            overrides=[
                f"paths.output_dir={tmp_path / 'run'}",
                f"paths.cache_dir={tmp_path / 'cache'}",
                *overrides,
            ],
        )


def children(pid: int) -> list[int]:
    """The processes ``pid`` started that still run (from Linux's ``/proc``)."""
    try:
        return [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def run_py(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python run.py <args>`` from ``cwd`` (a check before any training: quick)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *args],
        cwd=cwd,
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextlib.contextmanager
def multirun_config(*overrides: str) -> Iterator[DictConfig]:
    """The config of ``python run.py -m <overrides>`` as a sweep's callbacks see it (its
    command line in ``hydra.overrides.task``), with Hydra initialized."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        plain = [o for o in overrides if "," not in o]
        cfg = compose("config", overrides=plain, return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.overrides.task = list(overrides)
        HydraConfig.instance().set_config(cfg)
        try:
            yield cfg
        finally:
            HydraConfig.instance().cfg = None  # later tests run outside Hydra
