"""The typed configs (posenc/schema.py): what a job receives equals what Hydra composed,
key by key; the typed groups cover every key the YAML files set; a job gets a typed run."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf, open_dict

from posenc import schema
from posenc.config import ConfigError, validate
from tests.conftest import ENCODER_YAMLS, ROOT, compose_config, compose_run, encoder_class

TASKS = [
    ("task=lm",),
    ("task=mt",),
    ("task=algo",),
    ("task=algo", "task.shape=encdec"),
    ("sweep=lm_passkey",),  # an LM gate, passkey evaluation on
]


def _plain(value: Any) -> Any:
    if isinstance(value, schema.Group):
        return {k: _plain(value[k]) for k in value}
    return value


@pytest.mark.parametrize("overrides", TASKS, ids=" ".join)
def test_the_typed_run_holds_exactly_the_composed_values(
    tmp_path: Path, overrides: tuple[str, ...]
) -> None:
    cfg = compose_config(tmp_path, *overrides)
    validate(cfg)
    run = schema.typed(cfg)
    composed = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(composed, dict)
    assert _plain(run.task) == composed["task"]  # every key, nested groups included
    assert _plain(run.model) == composed["model"]
    assert type(run.task) is schema.TASKS[cfg.task.name]
    assert isinstance(run.task.optim, schema.Optim) and isinstance(run.model, schema.Model)
    for k in ("seed", "eval_only", "resume", "checkpoint_every_n_steps"):
        assert run[k] == composed[k]
    assert run.raw is cfg and run.encoder is cfg.encoder and run.trainer is cfg.trainer
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.task.seq_len = 1  # type: ignore[misc]


def test_a_missing_key_takes_the_declared_default_and_is_not_listed(tmp_path: Path) -> None:
    cfg = compose_run(tmp_path)
    with open_dict(cfg):
        del cfg.task.eval["skip_unsupported"]
    run = schema.typed(cfg)
    assert run.task.eval.skip_unsupported is True  # the field's default
    assert "skip_unsupported" not in run.task.eval and "splits" in run.task.eval
    assert "skip_unsupported" not in run.task.eval.as_dict()


def _yaml_keys(group: str) -> set[str]:
    """Keys the YAML files of a config group set at the top of that group."""
    root = ROOT / "conf" / group
    keys: set[str] = set()
    for path in root.glob("*.yaml"):
        node = OmegaConf.to_container(OmegaConf.load(path))
        if isinstance(node, dict):
            keys |= {str(k) for k in node if k != "defaults"}
    return keys


def test_every_model_key_of_the_yaml_files_is_declared() -> None:
    assert _yaml_keys("model") <= set(schema.keys(schema.Model))


@pytest.mark.parametrize("task", ["lm", "mt", "algo"])
def test_every_task_key_of_the_yaml_files_is_declared(task: str) -> None:
    node = OmegaConf.load(ROOT / "conf" / "task" / f"{task}.yaml")
    declared = schema.TASKS[task]
    assert set(node.task) <= set(schema.keys(declared)), set(node.task) - set(schema.keys(declared))
    assert set(node.task.optim) == set(schema.keys(schema.Optim))


def test_the_job_receives_the_typed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from posenc.train import JOBS, Job, train

    seen: list[Any] = []
    fake = lambda cfg, run_dir: seen.append(cfg) or {}  # noqa: E731
    monkeypatch.setitem(JOBS, "lm", Job("lm", schema.LMTask, fake))
    train(compose_run(tmp_path))
    assert len(seen) == 1 and isinstance(seen[0], schema.Run)
    assert isinstance(seen[0].task, schema.LMTask) and isinstance(seen[0].task.seq_len, int)


#: (encoder, option): every boolean option of every encoder a YAML file builds.
BOOLEAN_OPTIONS = [
    pytest.param(name, p.name, id=f"{name}.{p.name}")
    for name in ENCODER_YAMLS
    for p in inspect.signature(encoder_class(name).__init__).parameters.values()
    if schema.nullable_bool(p.annotation) is False
]


def test_the_encoders_have_boolean_options() -> None:
    found = {tuple(p.values) for p in BOOLEAN_OPTIONS}
    assert {("fox", "rope"), ("path", "forget_gate"), ("stickbreak", "attend_current")} <= found


@pytest.mark.parametrize(("encoder", "option"), BOOLEAN_OPTIONS)
def test_every_boolean_option_of_every_encoder_takes_only_true_or_false(
    tmp_path: Path, encoder: str, option: str
) -> None:
    """YAML reads only true and false as booleans; any other value (a typo, yes, 1, a
    quoted 'true') would be truthy and switch the option on without a word."""
    cfg = compose_run(tmp_path, f"encoder={encoder}")
    for value in ("maybe", "flase", 1, "true"):
        cfg.encoder[option] = value
        with pytest.raises(ConfigError) as err:
            validate(cfg, machine=False)
        assert err.value.problems == [f"encoder.{option}={value!r}: must be true or false"]
    cfg.encoder[option] = not cfg.encoder[option]
    validate(cfg, machine=False)


@pytest.mark.parametrize(
    ("annotation", "nullable"),
    [
        (bool, False),
        ("bool", False),
        (bool | None, True),
        ("bool | None", True),
        ("Optional[bool]", True),
        (int | bool, None),
        ("int", None),
        ("Literal['warn'] | bool | None", None),
    ],
)
def test_which_annotations_are_booleans(annotation: Any, nullable: bool | None) -> None:
    assert schema.nullable_bool(annotation) is nullable


def test_a_field_typed_bool_needs_no_rule_of_its_own() -> None:
    """The type declares it: every bool field of every group refuses a non-boolean."""

    @dataclasses.dataclass(frozen=True)
    class Flags(schema.Group):
        on: bool = schema.key(False)
        maybe_on: bool | None = schema.key(None)

    node = OmegaConf.create({"on": "flase", "maybe_on": None})
    assert schema.problems(node, Flags, "g.") == ["g.on='flase': must be true or false"]
    node = OmegaConf.create({"on": True, "maybe_on": "yes"})
    assert schema.problems(node, Flags, "g.") == [
        "g.maybe_on='yes': must be true or false (or null)"
    ]
