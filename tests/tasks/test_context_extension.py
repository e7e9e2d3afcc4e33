"""RoPE context extension as an LM evaluation axis, ``init_from`` fine-tuning, and their
config checks, on tiny real runs."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from posenc.config import ConfigError
from posenc.errors import CheckpointError
from posenc.eval.lengths import metric_name, parse_metric
from posenc.report import build_report, metric_key
from posenc.train import train
from tests.conftest import compose_run

METHODS = ["linear", "ntk", "dynamic_ntk", "yarn"]
ALL = f"task.eval.context_extension=[{','.join(METHODS)}]"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny RoPE LM trained at length 16; its best checkpoint."""
    tmp = tmp_path_factory.mktemp("rope")
    train(compose_run(tmp, "encoder=rope", "task.eval.multipliers=[1]"))
    return tmp / "run" / "checkpoints" / "best.ckpt"


@pytest.fixture(scope="module")
def extended(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The existing checkpoint evaluated with all four methods, without retraining."""
    tmp = tmp_path_factory.mktemp("eval")
    return train(
        compose_run(
            tmp,
            "encoder=rope",
            "eval_only=true",
            f"ckpt_path={trained}",
            "task.eval.multipliers=[1,4]",
            ALL,
        )
    )


def test_every_method_is_evaluated_at_every_length_and_protocol(extended: dict) -> None:
    m = extended["metrics"]
    assert extended["train_steps"] == 0 and extended["skipped"] == {}
    for method in METHODS:
        for length in (16, 64):
            for kind in ("ppl", "ppl_sw"):
                value = m[f"test/{kind}+{method}@{length}"]
                assert math.isfinite(value) and 1.0 < value < 200.0, (method, kind, value)
        # The same windows are scored as in the plain run.
        assert extended["scored_tokens"][f"test/ppl+{method}@64"] == 256
        assert len(extended["loss_by_position"][f"test/ppl+{method}@64"]) == 64
    assert set(extended["context_extension"]) == set(METHODS)


def test_at_the_training_length_every_method_is_the_plain_model(extended: dict) -> None:
    m = extended["metrics"]
    for method in METHODS:  # s = 1 (and l = L for dynamic_ntk): exactly plain RoPE
        assert m[f"test/ppl+{method}@16"] == m["test/ppl@16"], method
        assert m[f"test/ppl_sw+{method}@16"] == m["test/ppl_sw@16"], method
    # Beyond it the methods really change the model.
    for method in METHODS:
        assert m[f"test/ppl+{method}@64"] != m["test/ppl@64"], method


def test_auto_factor_is_the_length_ratio(extended: dict) -> None:
    settings = extended["extension_settings"]
    for method in ("linear", "ntk", "yarn"):
        assert settings[f"test/ppl+{method}@64"] == {
            "method": method,
            "factor": 4.0,
            "original_length": 16,
        }
        assert settings[f"test/ppl_sw+{method}@16"]["factor"] == 1.0
    assert settings["test/ppl+dynamic_ntk@64"]["factor"] == 1.0  # alpha; s' = l / L = 4


def test_metric_order_keeps_plain_first(extended: dict) -> None:
    names = [
        n for n in extended["metrics"] if n.startswith("test/ppl@") or n.startswith("test/ppl+")
    ]
    assert names[:2] == ["test/ppl@16", "test/ppl@64"]
    assert names[2:4] == ["test/ppl+dynamic_ntk@16", "test/ppl+dynamic_ntk@64"]


def test_a_fixed_factor_applies_at_every_length(trained: Path, tmp_path: Path) -> None:
    out = train(
        compose_run(
            tmp_path,
            "encoder=rope",
            "eval_only=true",
            f"ckpt_path={trained}",
            "task.eval.multipliers=[1]",
            "task.eval.protocols=[nonoverlap]",
            "task.eval.context_extension=[linear]",
            "task.eval.extension_factor=2",
        )
    )
    assert out["extension_settings"]["test/ppl+linear@16"]["factor"] == 2.0
    assert out["metrics"]["test/ppl+linear@16"] != out["metrics"]["test/ppl@16"]


def test_encoders_without_the_methods_skip_them(tmp_path: Path) -> None:
    out = train(
        compose_run(
            tmp_path,
            "encoder=sinusoidal",
            "task.eval.protocols=[nonoverlap]",
            "task.eval.context_extension=[yarn,linear]",
        )
    )
    m = out["metrics"]
    assert math.isfinite(m["test/ppl@64"])
    for name in ("test/ppl+yarn@16", "test/ppl+yarn@64", "test/ppl+linear@64"):
        assert math.isnan(m[name])
        assert "no context-extension method" in out["skipped"][name]
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert math.isnan(saved["metrics"]["test/ppl+yarn@64"])


def test_init_from_copies_weights_only(trained: Path, tmp_path: Path) -> None:
    from posenc.tasks.lm_job import lm_task

    state = torch.load(trained, map_location="cpu", weights_only=True)["state_dict"]
    cfg = compose_run(tmp_path / "a", "encoder=rope", f"init_from={trained}")
    task = lm_task(cfg, state["model.embed.weight"].shape[0])
    for key, value in task.model.state_dict().items():
        assert torch.equal(value, state[f"model.{key}"]), key
    # The short fine-tune at a longer length with YaRN: a new run, counted from step 0.
    out = train(
        compose_run(
            tmp_path / "b",
            "encoder=rope",
            f"init_from={trained}",
            "task.seq_len=32",
            "encoder.scaling=yarn",
            "encoder.scaling_factor=2",
            "encoder.original_length=16",
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            "task.eval.multipliers=[1]",
        )
    )
    assert out["train_steps"] == 2
    assert math.isfinite(out["metrics"]["test/ppl@32"])


def test_init_from_a_different_model_is_a_clear_error(trained: Path, tmp_path: Path) -> None:
    """One line naming the first tensors that differ (a UserError: exit 2, no traceback;
    #38), not torch's multi-line load_state_dict report."""
    with pytest.raises(
        CheckpointError,
        match=r"does not match this run's \(embed.weight is "
        r"\(\d+, 16\) there, \(\d+, 32\) here; "
        r".* and \d+ more\)",
    ):
        train(compose_run(tmp_path, "encoder=rope", f"init_from={trained}", "model.d_model=32"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            "task.eval.context_extension=[yarn,pi]",
            "context_extension contains 'pi': allowed linear, ntk, dynamic_ntk, yarn",
        ),
        ("task.eval.context_extension=yarn", "context_extension='yarn': must be a list"),
        ("task.eval.context_extension=[ntk,ntk]", "lists ntk twice"),
        ("task.eval.extension_factor=0.5", "extension_factor=0.5: must be auto .* or a number"),
        ("task.eval.extension_factor=big", "extension_factor='big': must be auto"),
        ("init_from=/no/such.ckpt", "init_from=/no/such.ckpt: no such file"),
        (
            "encoder=rope encoder.scaling=yarn encoder.scaling_factor=4",
            "scaling=yarn needs original_length",
        ),
        ("encoder=rope encoder.scaling=pi", "unknown scaling 'pi'; allowed: none, linear"),
    ],
)
def test_bad_options_fail_before_any_data(
    tmp_path: Path, overrides: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POSENC_DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=message):
        train(compose_run(tmp_path, *overrides.split()))


def test_init_from_with_eval_only_is_refused(trained: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="use ckpt_path alone"):
        train(
            compose_run(tmp_path, f"init_from={trained}", "eval_only=true", f"ckpt_path={trained}")
        )


def test_metric_names_round_trip() -> None:
    assert metric_name("test", "sliding", 512, "yarn") == "test/ppl_sw+yarn@512"
    assert metric_name("test", "nonoverlap", 512) == "test/ppl@512"
    assert parse_metric("test/ppl_sw+yarn@512") == ("test", "ppl_sw", "yarn", "512")
    assert parse_metric("val/loss") == ("val", "loss", "", "")
    names = [
        "test/ppl_sw@16",
        "test/ppl+yarn@16",
        "test/ppl@64",
        "test/ppl+linear@64",
        "test/ppl@16",
        "test/bleu@len30+",
    ]
    assert sorted(names, key=metric_key) == [
        "test/bleu@len30+",
        "test/ppl@16",
        "test/ppl@64",
        "test/ppl+linear@64",
        "test/ppl+yarn@16",
        "test/ppl_sw@16",
    ]


def test_report_shows_methods_as_rows_and_curves(extended: dict, tmp_path: Path) -> None:
    run = tmp_path / "sweep" / "0_lm_rope_seed0"
    run.mkdir(parents=True)
    data = {
        k: extended[k]
        for k in (
            "task",
            "encoder",
            "seed",
            "seq_len",
            "metrics",
            "skipped",
            "loss_by_position",
            "protocols",
            "context_extension",
        )
    }
    (run / "metrics.json").write_text(json.dumps(data))
    rep = build_report(tmp_path / "sweep", tensorboard=False)
    md = (tmp_path / "sweep" / "report" / "report.md").read_text()
    header = next(
        line for line in md.splitlines() if line.startswith("| encoder |") and "| test/" in line
    )
    assert "+" not in header  # methods are rows, not columns
    for method in METHODS:
        row = next(line for line in md.splitlines() if line.startswith(f"| rope+{method} |"))
        assert row.count("|") == header.count("|")
        assert f"> **+{method}**:" in md
    with (tmp_path / "sweep" / "report" / "report.csv").open() as f:
        metrics = {r["metric"] for r in csv.DictReader(f)}
    assert {f"test/ppl+{m}@64" for m in METHODS} <= metrics
    assert any(p.name == "lm_test_ppl_vs_length.png" for p in rep.files)


@pytest.mark.ddp
def test_two_processes_give_the_same_extended_perplexity(trained: Path, tmp_path: Path) -> None:
    """Per-loader state, no rank logic: 2-process DDP scores every method like 1 process."""
    from tests.test_ddp import DDP, run_py

    evaluate = ["eval_only=true", f"ckpt_path={trained}", ALL, "task.eval.protocols=[sliding]"]
    run_py(tmp_path / "two", tmp_path / "cache", *evaluate, *DDP)
    run_py(tmp_path / "one", tmp_path / "cache", *evaluate, "trainer.devices=1")
    one, two = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("one", "two"))
    assert one["scored_tokens"] == two["scored_tokens"]
    assert len(one["metrics"]) == len(METHODS + [None]) * 2  # 2 lengths, sliding only
    for key, value in one["metrics"].items():
        assert math.isfinite(value) and two["metrics"][key] == pytest.approx(value, rel=1e-6), key


def test_streaming_is_evaluated_and_recorded(trained: Path, tmp_path: Path) -> None:
    """StreamingLLM on the trained RoPE model: at 1x its default cache (4 sinks and the
    rest of the training length) evicts nothing, so it is the plain model; at 4x it is
    evaluated at both protocols, with its sizes recorded per metric."""
    out = train(
        compose_run(
            tmp_path,
            "encoder=rope",
            "eval_only=true",
            f"ckpt_path={trained}",
            "task.eval.multipliers=[1,4]",
            "task.eval.context_extension=[streaming]",
        )
    )
    m, settings = out["metrics"], out["extension_settings"]
    assert out["skipped"] == {} and "StreamingLLM" in out["context_extension"]["streaming"]
    assert m["test/ppl+streaming@16"] == pytest.approx(m["test/ppl@16"], rel=1e-6)
    for kind in ("ppl", "ppl_sw"):
        value = m[f"test/{kind}+streaming@64"]
        assert math.isfinite(value) and value != m[f"test/{kind}@64"]
        assert settings[f"test/{kind}+streaming@64"] == {
            "method": "streaming",
            "sinks": 4,
            "window": 12,
        }
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["extension_settings"]["test/ppl+streaming@16"]["window"] == 12


def test_streaming_is_skipped_where_positions_cannot_be_reindexed(tmp_path: Path) -> None:
    out = train(
        compose_run(
            tmp_path,
            "encoder=learned",
            "task.eval.multipliers=[1]",
            "task.eval.protocols=[nonoverlap]",
            "task.eval.context_extension=[streaming]",
        )
    )
    assert math.isfinite(out["metrics"]["test/ppl@16"])
    assert math.isnan(out["metrics"]["test/ppl+streaming@16"])
    assert "query-key distance alone" in out["skipped"]["test/ppl+streaming@16"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ("task.eval.streaming.sinks=-1", "task.eval.streaming.sinks=-1: must be an integer >= 0"),
        ("task.eval.streaming.window=0", "task.eval.streaming.window=0: must be a positive"),
        ("task.eval.streaming.sinks=16", "sinks=16: leaves no window within task.seq_len=16"),
        ("task.eval.streaming.window=13", r"= 4 \+ 13 = 17: more than the training length 16"),
    ],
)
def test_bad_streaming_sizes_fail_before_any_data(
    tmp_path: Path, overrides: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POSENC_DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=message) as err:
        train(compose_run(tmp_path, "task.eval.context_extension=[streaming]", overrides))
    assert len(err.value.problems) == 1 and "\n" not in err.value.problems[0]
