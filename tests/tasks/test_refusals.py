"""Issue #27, points 8, 9 and 11: values that would train wrongly, never end, or crash
with a raw traceback are refused with one line naming the key, the value and the fix;
decoding is capped by the config and stops on request."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from posenc import config as checks
from posenc import stop
from posenc.config import ConfigError, validate
from posenc.data.lm import LMDataModule, batch_problem
from posenc.decoding.encdec import beam_search, greedy
from posenc.decoding.lm import generate
from posenc.model import DecoderLM
from posenc.stop import StopRequested
from posenc.tasks.mt import MTTask
from posenc.train import train
from posenc.training.optim import configure_adamw, warmup_cosine, warmup_inverse_sqrt
from tests.conftest import ROOT, compose_run
from tests.decoding.test_encdec import BOS, EOS, PAD, _batch, _model

#: Own parallel files, train and validation only.
PARALLEL = (
    "task=mt data=parallel_files data.source.train_src=a data.source.train_tgt=b "
    "data.source.val_src=c data.source.val_tgt=d"
)

#: (overrides, the refusal line it must give); task=lm unless the overrides say otherwise.
REFUSED = [
    # point 8: values that train wrongly
    ("task.optim.min_lr_ratio=-5", r"task.optim.min_lr_ratio=-5: must be a number in \[0, 1\]"),
    ("task.optim.min_lr_ratio=1.5", r"task.optim.min_lr_ratio=1.5: must be a number in \[0, 1\]"),
    ("task.optim.warmup_steps=-10", r"task.optim.warmup_steps=-10: must be an integer >= 0"),
    ("task.optim.warmup_steps=2.5", r"task.optim.warmup_steps=2.5: must be an integer >= 0"),
    ("task.optim.weight_decay=-0.1", r"task.optim.weight_decay=-0.1: must be a number >= 0"),
    ("trainer.gradient_clip_val=-1", r"trainer.gradient_clip_val=-1: must be a number >= 0"),
    (
        "trainer.precision=16-mixd",
        r"trainer.precision='16-mixd': did you mean '16-mixed'\? allowed 32-true, 16-mixed",
    ),
    ("trainer.precision=fp8", r"trainer.precision='fp8': allowed 32-true, 16-mixed, bf16-mixed"),
    ("task.optim.lr=nan", r"task.optim.lr=nan: must be a positive number \(finite"),
    ("task.optim.lr=inf", r"task.optim.lr=inf: must be a positive number \(finite"),
    ("task.optim.lr=-1e-3", r"task.optim.lr=-0.001: must be a positive number"),
    (
        "task.optim.betas=[2.0,0.99]",
        r"task.optim.betas=\[2.0, 0.99\]: must be two numbers in "
        r"\[0, 1\)",
    ),
    ("task.optim.betas=[0.9]", r"task.optim.betas=\[0.9\]: must be two numbers"),
    ("task.optim.betas=0.9", r"task.optim.betas=0.9: must be two numbers"),
    ("task.optim.betas=[0.9,1.0]", r"task.optim.betas=\[0.9, 1.0\]: must be two numbers"),
    ("trainer.max_steps=0", r"trainer.max_steps=0: .*untrained.*eval_only=true ckpt_path="),
    # point 9: a run that would not end
    ("trainer.max_steps=-1", r"trainer.max_steps=-1: posenc runs are bounded by steps.*positive"),
    # point 11: raw tracebacks before
    ("task.eval.multipliers=2", r"task.eval.multipliers=2: must be a list, e.g. "),
    ("task.eval.multipliers=[]", r"task.eval.multipliers=\[\]: must list at least one value"),
    ("task.eval.multipliers=[1,nan]", r"task.eval.multipliers contains nan: must be positive"),
    ("task.eval.splits=test", r"task.eval.splits='test': must be a list"),
    ("task.eval.protocols=sliding", r"task.eval.protocols='sliding': must be a list"),
    ("trainer.val_check_interval=0", r"trainer.val_check_interval=0: must be a positive integer"),
    ("trainer.val_check_interval=-5", r"trainer.val_check_interval=-5: must be a positive"),
    (
        "trainer.val_check_interval=0.5",
        r"trainer.val_check_interval=0.5: .*fraction in \(0, 1\] of an epoch with "
        r"trainer.check_val_every_n_epoch set",
    ),
    ("trainer.max_steps=abc", r"trainer.max_steps='abc': must be a positive integer"),
    ("task.name=abc", r"task.name='abc': allowed lm, mt"),
    ("model.d_ff=abc", r"model.d_ff='abc': must be a positive integer"),
    ("model.embed_scale=abc", r"model.embed_scale='abc': must be true or false"),
    ("task.eval.skip_unsupported=abc", r"task.eval.skip_unsupported='abc': must be true or"),
    ("tokenizer=bpe tokenizer.vocab_size=abc", r"tokenizer.vocab_size='abc': must be an integer"),
    # Lightning's own checks of the trainer, made before the run folder exists
    ("trainer.strategy=foo", r"trainer: You selected an invalid strategy name: `strategy='foo'`"),
    ("trainer.devices=0", r"trainer: `Trainer\(devices=0\)` value is not a valid input using"),
    # the tokenizer's settings, refused before the text is read (not by SentencePiece after)
    ("tokenizer=bpe tokenizer.vocab_size=4", r"tokenizer.vocab_size=4: must be an integer >= 8"),
    ("+tokenizer.foo=2", r"tokenizer.foo: unknown key; allowed: character_coverage, input_"),
    (
        "+tokenizer.num_threads=2",
        r"tokenizer.num_threads=2: a SentencePiece setting, but tokenizer.kind=char takes none",
    ),
    (
        "tokenizer=unigram +tokenizer.character_coverage=0",
        r"tokenizer.character_coverage=0: must be a number in \(0, 1\]",
    ),
    # the same optimiser rules for translation, and its own list-valued key
    ("task=mt task.optim.min_lr_ratio=-5", r"task.optim.min_lr_ratio=-5: must be a number in"),
    ("task=mt task.optim.lr=nan", r"task.optim.lr=nan: must be a positive number"),
    ("task=mt task.optim.betas=[0.9,2]", r"task.optim.betas=\[0.9, 2\]: must be two numbers"),
    ("task=mt task.optim.warmup_steps=-1", r"task.optim.warmup_steps=-1: must be an integer"),
    ("task=mt +task.optim.lr_min=0.1", r"task.optim.lr_min: unknown key"),
    ("task=mt task.length_buckets=5", r"task.length_buckets=5: must be a list"),
    ("task=mt trainer.max_steps=0", r"trainer.max_steps=0: .*eval_only=true ckpt_path="),
    # #38 point 6: failed deep inside a run before
    (
        "task=algo task.train_lengths=[1,100000]",
        r"task.train_lengths=\[1,100000\]: its test set \(24 instances of every size "
        r"1..300000, task.test_multiple=3\) needs \d+\.\d GiB",
    ),
    (
        "trainer.accumulate_grad_batches=0",
        r"trainer.accumulate_grad_batches=0: must be a positive integer",
    ),
    (
        "task.eval.multipliers=[0.01]",
        r"task.eval.multipliers contains 0.01: 0.01 \* task.seq_len=16 is below one token",
    ),
    # a non-boolean for a boolean option switched it on; one rule for every encoder's
    ("encoder=fox encoder.rope=maybe", r"^encoder.rope='maybe': must be true or false$"),
    ("encoder=fox encoder.rope=flase", r"^encoder.rope='flase': must be true or false$"),
    ("encoder=fox encoder.rope=1", r"^encoder.rope=1: must be true or false$"),
    ("encoder=fox encoder.rope='true'", r"^encoder.rope='true': must be true or false$"),
    (
        "trainer.enable_progress_bar=yes",
        r"enable_progress_bar='yes': must be true or false \(or null",
    ),
    # a split the data lacks: refused before anything is read, never stood in for by another
    (
        "data=text_files data.source.train=a.txt data.source.val=b.txt",
        r"^task.eval.splits contains 'test': data=text_files has no test split \(no test file: "
        r"data.source.test=null\); give one with data.source.test=<file>, or set "
        r"task.eval.splits=\[val\]$",
    ),
    (
        "data.source.splits=[0.9,0.1,0.0] task.eval.splits=[val,test]",
        r"^task.eval.splits contains 'test': data=tinyshakespeare has no test split \(a test "
        r"fraction of 0 in data.source.splits\); give one with a test fraction, e.g. "
        r"data.source.splits=\[0.9,0.05,0.05\], or set task.eval.splits=\[val\]$",
    ),
    (
        PARALLEL,
        r"^task.eval_split='test': data=parallel_files has no test split \(no test files: "
        r"data.source.test_src and test_tgt are null\); give one with "
        r"data.source.test_src=<file> data.source.test_tgt=<file>, or set task.eval_split=val$",
    ),
]

#: Allowed edge values: they must pass the same checks.
ACCEPTED = [
    "task=algo task.train_lengths=[1,64]",
    "trainer.accumulate_grad_batches=2",
    "task.optim.warmup_steps=0",
    "task.optim.min_lr_ratio=0",
    "task.optim.min_lr_ratio=1",
    "task.optim.weight_decay=0",
    "trainer.gradient_clip_val=0",
    "trainer.gradient_clip_val=null",
    "trainer.precision=bf16-mixed",
    "trainer.precision=16",
    "task.optim.betas=[0,0.999]",
    "trainer.val_check_interval=00:00:10:00",
    "trainer.val_check_interval=0.5 trainer.check_val_every_n_epoch=1",
    "encoder=fox encoder.rope=true trainer.enable_progress_bar=null",
    "data=text_files data.source.train=a.txt data.source.val=b.txt task.eval.splits=[val]",
    "data=text_files data.source.train=a.txt data.source.val=b.txt data.source.test=c.txt",
    f"{PARALLEL} task.eval_split=val",
    "experiment=baby_gpt",
    "tokenizer=bpe tokenizer.vocab_size=null +tokenizer.num_threads=1",
]


def _compose(tmp_path: Path, overrides: str) -> DictConfig:
    """compose_run for task=lm; for task=mt the same, without the LM-only tiny settings."""
    words = overrides.split()
    if "task=mt" not in words and "task=algo" not in words:
        return compose_run(tmp_path, *words)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(
            "config",
            overrides=[
                "model.n_layers=1",
                "model.d_model=16",
                "model.n_heads=2",
                "model.d_ff=32",
                f"paths.output_dir={tmp_path / 'run'}",
                f"paths.cache_dir={tmp_path / 'cache'}",
                *words,
            ],
        )


@pytest.fixture
def no_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data folder that does not exist: any data loading would create or read it."""
    nowhere = tmp_path / "nowhere"
    monkeypatch.setenv("POSENC_DATA_DIR", str(nowhere))
    return nowhere


def _refusal(err: pytest.ExceptionInfo[ConfigError], pattern: str) -> str:
    """The one problem line matching ``pattern`` (each problem is one line)."""
    lines = [line.strip() for line in str(err.value).splitlines()[1:]]
    hits = [line for line in lines if re.search(pattern, line)]
    assert len(hits) == 1, (pattern, lines)
    return hits[0]


@pytest.mark.parametrize(("overrides", "pattern"), REFUSED)
def test_refused_before_any_data_with_the_key_named(
    tmp_path: Path, no_data: Path, overrides: str, pattern: str
) -> None:
    with pytest.raises(ConfigError) as err:
        train(_compose(tmp_path, overrides))
    _refusal(err, pattern)
    assert not no_data.exists()
    assert not (tmp_path / "run").exists()  # nothing written either


@pytest.mark.skipif(torch.cuda.is_available(), reason="refused only where there is no GPU")
def test_a_gpu_run_on_a_machine_without_one_is_refused_in_one_line(
    tmp_path: Path, no_data: Path
) -> None:
    """A GPU command copied to a laptop: Lightning refused it when the job built its
    Trainer, in Hydra's lines, after the run folder existed."""
    with pytest.raises(ConfigError) as err:
        train(_compose(tmp_path, "trainer.accelerator=gpu"))
    _refusal(
        err,
        r"trainer: No supported gpu backend found! \(Lightning, on this machine, with "
        r"accelerator=gpu, devices=1, strategy=auto\)",
    )
    assert not no_data.exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides", ACCEPTED)
def test_allowed_edge_values_pass(tmp_path: Path, overrides: str) -> None:
    validate(_compose(tmp_path, overrides))


def test_every_problem_of_a_bad_optimiser_is_listed_at_once(tmp_path: Path) -> None:
    cfg = _compose(
        tmp_path,
        "task.optim.lr=nan task.optim.betas=[2.0,0.99] "
        "task.optim.weight_decay=-1 task.optim.warmup_steps=-10 "
        "task.optim.min_lr_ratio=-5 trainer.gradient_clip_val=-1",
    )
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    keys = [line.strip().split("=")[0] for line in str(err.value).splitlines()[1:]]
    assert keys == [
        "trainer.gradient_clip_val",
        "task.optim.lr",
        "task.optim.betas",
        "task.optim.weight_decay",
        "task.optim.warmup_steps",
        "task.optim.min_lr_ratio",
    ]


def test_an_unknown_task_name_is_not_compared_with_another_tasks_lengths(tmp_path: Path) -> None:
    """Under a refused task.name the config's lengths belong to no task: the window and the
    random positions are not measured against them (the LM's seq_len here)."""
    cfg = _compose(tmp_path, "task.name=abc model.window=100000 model.random_positions=2")
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert [line.strip().split(":")[0] for line in str(err.value).splitlines()[1:]] == [
        "task.name='abc'"
    ]


def test_the_rules_between_keys_read_only_groups_whose_own_keys_passed(tmp_path: Path) -> None:
    """The rules that tie keys together read typed values: a group with a refused key
    gets its own lines only, and the rules are applied once it is fixed."""
    for overrides, expected in (
        ("model.dropout=2 model.n_heads=3", ["model.dropout=2: must be a number in [0, 1)"]),
        ("model.n_heads=3", ["model.n_heads=3: must divide model.d_model=16"]),
    ):
        with pytest.raises(ConfigError) as err:
            validate(_compose(tmp_path, overrides))
        assert [line.strip() for line in str(err.value).splitlines()[1:]] == expected


def test_the_checks_read_the_interpolations_resolved_once_with_the_same_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``task=algo``'s sizes are ``${posenc_problem:...}`` interpolations, parsed again at
    every read: the checks read a copy with them resolved. The config given is left as it
    is, an interpolation that does not resolve stays for the checks, which name it in one
    line (not a traceback), and the verdict is the one the unresolved config gets."""
    cfg = _compose(tmp_path, "task=algo task.problem=count")
    out = checks.resolved(cfg)
    assert OmegaConf.is_interpolation(cfg.task, "train_lengths")
    assert not OmegaConf.is_interpolation(out.task, "train_lengths")
    assert OmegaConf.to_container(out, resolve=True) == OmegaConf.to_container(cfg, resolve=True)
    assert checks.resolved(out) is out  # nothing left to resolve: no copy

    bad = _compose(tmp_path, "task=algo task.train_lengths=${nowhere} model.n_heads=3")
    kept = checks.resolved(bad)
    assert OmegaConf.is_interpolation(kept.task, "train_lengths")
    assert not OmegaConf.is_interpolation(kept.task, "test_multiple")
    verdicts = []
    for resolve in (checks.resolved, lambda c, copy=True: c):
        monkeypatch.setattr(checks, "resolved", resolve)
        with pytest.raises(ConfigError) as err:
            validate(bad)
        verdicts.append(str(err.value))
    assert verdicts[0] == verdicts[1]
    lines = verdicts[0].splitlines()[1:]
    assert lines[0].strip() == (
        "task.train_lengths: its interpolation does not resolve "
        "(Interpolation key 'nowhere' not found); set a value"
    )
    assert any(line.strip().startswith("model.n_heads=3") for line in lines), lines


def _leaves(cfg: DictConfig) -> list[str]:
    container = OmegaConf.to_container(cfg, resolve=False)
    out: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.")
            else:
                out.append(f"{prefix}{key}")

    walk(container, "")
    return [k for k in out if not k.startswith(("hydra.", "paths.", "data."))]


@pytest.mark.parametrize("task", ["lm", "mt"])
def test_a_wrongly_typed_value_anywhere_gives_config_error_not_a_traceback(
    tmp_path: Path, task: str
) -> None:
    """Every leaf key set to a string, a list, a mapping or null: validate either accepts
    it (Lightning's own trainer options are left to Lightning) or raises ConfigError; any
    other exception is a bug in the checks."""
    base = _compose(tmp_path, f"task={task}")
    crashed: list[str] = []
    for key in _leaves(base):
        for value in ("abc", [1, "x"], {"a": 1}, None):
            cfg = base.copy()
            with open_dict(cfg):  # bypass struct: any value, any type
                OmegaConf.update(cfg, key, value, merge=False)
            try:
                validate(cfg)
            except ConfigError:
                pass
            except Exception as err:
                crashed.append(f"{key}={value!r}: {type(err).__name__}: {err}")
    assert not crashed, "\n".join(crashed)


def test_a_check_that_trips_on_a_value_becomes_a_problem_line() -> None:
    problems: list[str] = []

    def bad() -> None:
        raise TypeError("'<' not supported between instances of 'str' and 'int'")

    checks.guarded(problems, "trainer", bad)
    assert problems == [
        "trainer: a value has the wrong type (TypeError: '<' not supported "
        "between instances of 'str' and 'int'); compare it with conf/ and the "
        "README"
    ]


# ---- paths.cache_dir (POSENC_CACHE_DIR) ----------------------------------------------------


def test_cache_dir_that_is_a_file_is_refused(tmp_path: Path, no_data: Path) -> None:
    a_file = tmp_path / "cache.txt"
    a_file.write_text("not a folder")
    for cache, what in ((a_file, "is a file"), (a_file / "sub", f"is inside {a_file}")):
        with pytest.raises(ConfigError) as err:
            train(_compose(tmp_path, f"paths.cache_dir={cache}"))
        line = _refusal(err, r"^paths.cache_dir=")
        assert line.startswith(f"paths.cache_dir={cache}: {what}")
        assert "POSENC_CACHE_DIR" in line
    assert a_file.read_text() == "not a folder" and not no_data.exists()


def test_cache_dir_from_the_environment_is_checked(
    tmp_path: Path, no_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """paths.cache_dir defaults to ${oc.env:POSENC_CACHE_DIR,...}: the variable's value is
    what gets checked and named."""
    a_file = tmp_path / "cache.txt"
    a_file.write_text("")
    monkeypatch.setenv("POSENC_CACHE_DIR", str(a_file))
    cfg = _compose(tmp_path, "")
    with open_dict(cfg):
        cfg.paths.cache_dir = "${oc.env:POSENC_CACHE_DIR}"
    with pytest.raises(ConfigError, match=f"paths.cache_dir={a_file}: is a file"):
        validate(cfg)


def test_unwritable_cache_dir_is_refused(tmp_path: Path, no_data: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("running as root: file permissions do not stop root from writing")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        for cache in (locked, locked / "sub"):
            with pytest.raises(ConfigError) as err:
                train(_compose(tmp_path, f"paths.cache_dir={cache}"))
            assert _refusal(err, r"^paths.cache_dir=").startswith(
                f"paths.cache_dir={cache}: cannot write there"
            )
    finally:
        locked.chmod(0o700)
    assert not no_data.exists()


def test_a_missing_cache_dir_is_created(tmp_path: Path) -> None:
    cache = tmp_path / "a" / "b"
    validate(_compose(tmp_path, f"paths.cache_dir={cache}"))
    assert cache.is_dir() and not list(cache.iterdir())  # the probe file is gone


# ---- refusals that need the data -----------------------------------------------------------


def test_batch_larger_than_the_training_windows_is_refused_before_the_model(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        train(compose_run(tmp_path, "task.batch_size=100000"))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("task.batch_size=100000: larger than the ")
    assert "windows of task.seq_len=16" in message and "lower task.batch_size to at most" in message
    windows = int(message.rsplit(" ", 1)[1])
    assert 50_000 < windows < 100_000  # TinyShakespeare's ~1M training chars / 16
    run = tmp_path / "run"
    assert not (run / "checkpoints").exists() and not (run / "metrics.json").exists()


def test_batch_whose_logits_exceed_the_memory_is_refused() -> None:
    problem = batch_problem(4096, 2048, train_tokens=10**12, vocab_size=50_000, on_cpu=True)
    assert problem is not None and problem.startswith("task.batch_size=4096: its logits alone")
    assert batch_problem(4096, 2048, train_tokens=10**12, vocab_size=10, on_cpu=True) is None
    # on a GPU the machine's memory is not the limit
    assert batch_problem(4096, 2048, train_tokens=10**12, vocab_size=50_000, on_cpu=False) is None


@pytest.mark.parametrize("split", ["train", "val"])
def test_whitespace_only_text_file_is_refused_naming_the_file(tmp_path: Path, split: str) -> None:
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be: that is the question.\n" * 50)
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\t\n   \n" * 100)
    files = {"train": text, "val": text} | {split: blank}
    cfg = compose_run(
        tmp_path,
        "data=text_files",
        f"data.source.train={files['train']}",
        f"data.source.val={files['val']}",
        "task.eval.splits=[val]",
    )
    with pytest.raises(ValueError, match=f"the '{split}' file '{blank}' holds only whitespace"):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_whitespace_only_training_text_from_any_source_is_refused(tmp_path: Path) -> None:
    dm = LMDataModule(
        source=lambda: {"train": "\n \n", "val": "abc" * 20, "test": "abc" * 20},
        tokenizer={"kind": "char"},
        cache_dir=tmp_path,
        seq_len=4,
        batch_size=2,
    )
    with pytest.raises(ValueError, match="the train split holds only whitespace"):
        dm.setup("fit")


# ---- the learning-rate schedule --------------------------------------------------------------


def test_warmup_zero_means_no_warmup() -> None:
    assert warmup_cosine(0, warmup=0, total=100, min_ratio=0.1) == 1.0
    assert warmup_cosine(100, warmup=0, total=100, min_ratio=0.1) == pytest.approx(0.1)
    assert warmup_inverse_sqrt(0, warmup=0) == 1.0
    assert warmup_inverse_sqrt(3, warmup=0) == pytest.approx(0.5)
    optim = {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.0, "warmup_steps": 0}
    sched = configure_adamw(nn.Linear(2, 2), optim, max_steps=10)["lr_scheduler"]["scheduler"]
    assert sched.get_last_lr() == [1e-3, 1e-3]  # the peak at the first step
    with pytest.raises(ValueError, match="warmup_steps=-10: must be an integer >= 0"):
        configure_adamw(nn.Linear(2, 2), optim | {"warmup_steps": -10}, max_steps=10)


# ---- decoding: capped by task.max_len, stopped on request ------------------------------------


@pytest.fixture(autouse=True)
def _no_stop_request() -> Any:
    stop.reset()
    yield
    stop.reset()


def _tiny_translator(max_len: int) -> MTTask:
    torch.manual_seed(0)
    encoder = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "encoder" / "rope.yaml"))
    task = MTTask(
        vocab_size=12,
        encoder=encoder,
        ids={"pad": PAD, "bos": BOS, "eos": EOS},
        model={"n_layers": 1, "d_model": 16, "n_heads": 2, "d_ff": 32, "dropout": 0.0},
        optim={},
        max_steps=1,
        max_len=max_len,
    )
    decode = task.model.decode

    def never_eos(*args: Any, **kwargs: Any) -> torch.Tensor:
        # The model would otherwise be free to stop early; here only the budget stops it.
        logits = decode(*args, **kwargs)
        logits[..., EOS] = -1e4
        return logits

    task.model.decode = never_eos
    return task.eval()


@pytest.mark.parametrize("beam_size", [1, 4])
def test_a_4000_token_source_decodes_at_most_task_max_len_tokens(beam_size: int) -> None:
    """max_len_a=1.2 allows 4810 tokens for this source; task.max_len=24 caps it."""
    task = _tiny_translator(max_len=24)
    src, valid = _batch(12, [4000, 7])
    t0 = time.perf_counter()
    out = task.translate(src, valid, beam_size=beam_size, length_penalty=0.6)
    assert time.perf_counter() - t0 < 120  # minutes before the cap; seconds now
    assert [len(ids) for ids in out.tokens] == [24, 18]  # min(cap, 1.2 * 7 + 10) = 18


def test_eval_only_translation_takes_the_configured_cap() -> None:
    task = _tiny_translator(max_len=24)
    task.set_output_cap(5)
    src, valid = _batch(12, [300])
    assert len(task.translate(src, valid).tokens[0]) == 5


class _StopAfter:
    """Calls request_stop() once the wrapped function has run ``n`` times."""

    def __init__(self, fn: Any, n: int) -> None:
        self.fn, self.n, self.calls = fn, n, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.n:
            stop.request_stop()
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_decoding_stops_at_the_next_step_on_request(search: str) -> None:
    model = _model()
    model.decode = spy = _StopAfter(model.decode, 3)
    src, valid = _batch(12, [50, 20])
    kwargs = {"bos": BOS, "eos": EOS, "pad": PAD, "max_len": 1000}
    with pytest.raises(StopRequested, match="stop was requested"):
        if search == "greedy":
            greedy(model, src, valid, **kwargs)
        else:
            beam_search(model, src, valid, beam_size=3, length_penalty=0.6, **kwargs)
    assert spy.calls == 3 and stop.stop_requested()


def test_generation_stops_at_the_next_step_on_request() -> None:
    torch.manual_seed(0)
    model = DecoderLM(
        vocab_size=12, encoder="rope", n_layers=1, d_model=16, n_heads=2, d_ff=32, dropout=0.0
    ).eval()
    calls: list[int] = []

    def hook(*_: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            stop.request_stop()

    model.register_forward_hook(hook)
    with pytest.raises(StopRequested, match="generation stopped"):
        generate(model, torch.tensor([[3, 4, 5]]), 500)
    assert len(calls) == 2
    stop.reset()
    assert generate(model, torch.tensor([[3, 4, 5]]), 4).shape == (1, 7)


def test_stop_flag() -> None:
    assert not stop.stop_requested()
    stop.request_stop()
    assert stop.stop_requested()
    with pytest.raises(StopRequested, match="beam search stopped"):
        stop.check("beam search")
    stop.reset()
    stop.check("beam search")
