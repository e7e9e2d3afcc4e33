"""The typed configs (posenc/schema.py): what a job receives equals what Hydra composed,
key by key; the typed groups cover every key the YAML files set; a job gets a typed run."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from posenc import schema
from posenc.config import ConfigError, validate
from posenc.data.algo_problems import problem_default
from posenc.preflight import misspelled_keys
from tests import presets
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
        return {k: _plain(getattr(value, k)) for k in value.given()}
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
        assert getattr(run, k) == composed[k]
    assert run.raw is cfg and run.encoder is cfg.encoder and run.trainer is cfg.trainer
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.task.seq_len = 1  # type: ignore[misc]


def test_a_missing_key_takes_the_declared_default_and_is_not_listed(tmp_path: Path) -> None:
    # a config composed elsewhere (an old run's record), without the schema's keys
    task = OmegaConf.create(OmegaConf.to_container(compose_run(tmp_path).task, resolve=True))
    del task.eval["skip_unsupported"]
    built = schema.build(schema.LMTask, task)
    assert built.eval.skip_unsupported is True  # the field's default
    assert "skip_unsupported" not in built.eval.given() and "splits" in built.eval.given()
    assert "skip_unsupported" not in built.eval.as_dict()


def _plain_defaults(cls: type[schema.Group], only: tuple[str, ...] | None = None) -> Any:
    """What a group of ``cls`` holds where nothing sets a key: its fields' defaults."""
    made = cls()
    names = only or tuple(schema.keys(cls))
    return {
        k: _plain(v) if not isinstance(v, schema.Group) else _plain_defaults(type(v))
        for k in names
        for v in [getattr(made, k)]
    }


@pytest.mark.parametrize("task", ["lm", "mt", "algo"])
def test_every_default_has_one_home(task: str) -> None:
    """The dataclasses are the only home of a task's and a model's defaults: composing
    ``task=<task>`` gives them, and the task's and model's YAML files set no value."""
    cfg = presets.composed_once([f"task={task}"])
    composed = OmegaConf.to_container(cfg.task, resolve=True)
    assert isinstance(composed, dict)
    declared = _plain(schema.TASKS[task]())
    if task == "algo":
        declared["learned"] = _plain(declared["learned"])
        for k in schema.AlgoTask.per_problem:  # the copy problem's own (algo_problems.py)
            *parents, leaf = k.split(".")  # optim.lr: a nested group's
            node = declared
            for p in parents:
                node = node[p]
            node[leaf] = problem_default("copy", f"task.{k}")
    mismatches = {k: (composed.get(k), v) for k, v in declared.items() if composed.get(k) != v}
    assert mismatches == {}
    model = schema.MODELS[task]
    expected = {k: getattr(model(), k) for k in schema.MODEL_KEYS[task]}
    assert OmegaConf.to_container(cfg.model, resolve=True) == expected
    for path in (ROOT / "conf" / "task" / f"{task}.yaml", ROOT / "conf" / "model" / f"{task}.yaml"):
        node = OmegaConf.load(path)
        assert not node.get("task") and set(node) <= {"defaults", "trainer", "tokenizer"}, path


@pytest.mark.parametrize("name", list(presets.presets()))
def test_every_preset_composes_the_values_it_always_did(name: str) -> None:
    """Moving a default to its one home changed nothing a run gets (tests/presets.json:
    every preset as composed before the move)."""
    expected = json.loads(presets.SNAPSHOT.read_text())[name]
    assert presets.record(presets.composed_once(presets.presets()[name])) == expected


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.compile=yes", "model.compile='yes': allowed auto, true or false"),
        ("task.seq_len='128'", "task.seq_len='128': must be a positive integer"),
        ("task.optim.lr='1e-3'", "task.optim.lr='1e-3': must be a positive number"),
        ("task.eval.passkey.samples='20'", "task.eval.passkey.samples='20': must be a positive"),
    ],
)
def test_the_schema_hydra_composes_with_converts_no_value(
    tmp_path: Path, override: str, message: str
) -> None:
    """Composition takes a value as written (the schema's types are loose), so posenc's
    own rule refuses it, with its own line."""
    with pytest.raises(ConfigError) as err:
        validate(compose_run(tmp_path, override))
    assert message in str(err.value)


def test_a_file_setting_a_key_the_schema_lacks_is_one_line() -> None:
    """A preset with a key its task's schema lacks fails at composition; run.py says so
    in one line, with the file (conf/experiment/mt_train_short.yaml is translation's)."""
    with pytest.raises(ConfigCompositionException, match="max_train_src_len' not in"):
        presets.composed_once(["experiment=mt_train_short"])
    assert misspelled_keys(["experiment=mt_train_short"], ROOT / "conf") == [
        "task.max_train_src_len=14: a translation option, but task.name=lm; remove it or "
        "run task=mt (in conf/experiment/mt_train_short.yaml)"
    ]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["experiment=algo_mqar,algo_copy", "task.train_lengths=[4,8]"],
            "task.train_lengths: Hydra sets it on the config the sweep's jobs share, before "
            "the swept experiment=algo_mqar,algo_copy chooses task=algo; there task is lm, "
            "which has no train_lengths; add task=algo to the command",
        ),
        (
            ["encoder=t5,fire", "encoder.max_distance=64"],
            "encoder.max_distance: Hydra sets it on the config the sweep's jobs share, before "
            "the swept encoder=t5,fire chooses encoder=t5; there encoder is rope, which has no "
            "max_distance; sweep encoder only over choices that all have it, or run "
            "encoder=t5 alone",
        ),
        (["task=algo", "experiment=algo_mqar,algo_copy", "task.train_lengths=[4,8]"], None),
        (["encoder=rope,alibi", "task.seq_len=64"], None),
        (["experiment=algo_mqar", "task.train_lengths=[4,8]"], None),
    ],
)
def test_a_key_only_the_swept_choice_brings_is_one_line(
    overrides: list[str], message: str | None
) -> None:
    """Hydra composes a sweep's shared config without its swept groups and sets every other
    override there first: a key only the swept choice brings fails before any job, with
    Hydra's "Could not override" and a "+" it suggests that does not help. run.py says why
    in one line, and how to fix it; a sweep whose shared config has the key passes."""
    assert misspelled_keys(overrides, ROOT / "conf") == ([message] if message else [])


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
