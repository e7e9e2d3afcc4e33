"""Passkey retrieval: the generator's guarantees, exact-match scoring with hand-made
models, the training mix, the config checks and the report's mean grid."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from posenc import schema
from posenc.config import ConfigError, validate
from posenc.data.lm import (
    LMDataModule,
    PasskeyDraw,
    PasskeyMixWindows,
    RandomOffsetSampler,
    is_passkey_slot,
)
from posenc.data.passkey import (
    ALPHABET,
    NEEDLE_HEAD,
    NEEDLE_TAIL,
    QUESTION,
    PasskeyFormat,
    passkey_problems,
    seeded,
)
from posenc.data.tokenizers import CharTokenizer
from posenc.eval.lengths import parse_metric
from posenc.eval.passkey import correct, evaluate_length, greedy
from posenc.plots import passkey_means
from posenc.results import from_json, names
from posenc.runs import Run
from posenc.tasks.lm_passkey import metric_name
from posenc.training.summary import lm_rows
from tests.conftest import compose_run

TEXT = (
    (
        "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
        "You are all resolved rather to die than to famish? What is the matter?\n"
    )
    * 40
    + ALPHABET
    + ALPHABET.upper()
    + "$"
)
TOK = CharTokenizer.from_texts([TEXT])
STREAM = torch.tensor(TOK.encode(TEXT))
DEPTHS = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]


def text(ids: Tensor) -> str:
    return TOK.decode(ids.tolist())


# ----------------------------------------------------------------------------- generator
@pytest.mark.parametrize("length", [70, 100, 128, 517])
@pytest.mark.parametrize("key_len", [1, 5])
def test_instances_have_length_depth_and_answer(length: int, key_len: int) -> None:
    fmt = PasskeyFormat(TOK, key_len)
    row = fmt.sample(STREAM, length, DEPTHS, seeded(3, length))
    filler_len = length - len(NEEDLE_HEAD) - 2 * key_len - len(NEEDLE_TAIL) - len(QUESTION)
    for inst, depth in zip(row, DEPTHS, strict=True):
        assert inst.tokens.shape == (length,) and inst.tokens.dtype == torch.long
        # The needle starts at depth * filler length, to within half a token.
        assert abs(inst.needle_start - depth * filler_len) <= 0.5
        if depth == 0:
            assert inst.needle_start == 0  # the needle comes first
        if depth == 1:
            assert inst.needle_start == filler_len  # right before the question
        needle = NEEDLE_HEAD + inst.key + NEEDLE_TAIL
        start = inst.needle_start
        assert text(inst.tokens[start : start + len(needle)]) == needle
        assert text(inst.tokens[inst.key_start : inst.key_start + key_len]) == inst.key
        # The answer is the key, after the question that ends the prompt.
        assert inst.answer_len == key_len and text(inst.answer) == inst.key
        assert text(inst.prompt).endswith(QUESTION)
        assert len(inst.key) == key_len and set(inst.key) <= set(ALPHABET)
        # Without needle, question and answer, the rest is one contiguous window of text.
        rest = torch.cat(
            (inst.tokens[:start], inst.tokens[start + len(needle) : -key_len - len(QUESTION)])
        )
        assert rest.numel() == filler_len
        assert text(rest) in TEXT
    # Every depth shares the key and the filler.
    assert len({inst.key for inst in row}) == 1


def test_depths_spread_the_needle_over_the_filler() -> None:
    fmt = PasskeyFormat(TOK, 5)
    row = fmt.sample(STREAM, 200, [0.0, 0.25, 0.5, 0.75, 1.0], seeded(0))
    filler_len = 200 - 70 + 1  # min_length 70 leaves one filler token
    assert fmt.min_length() == 70
    assert (
        [i.needle_start for i in row]
        == [0, 33, 66, 98, 131]
        == [math.floor(d * filler_len + 0.5) for d in (0.0, 0.25, 0.5, 0.75, 1.0)]
    )


def test_same_seed_same_instances_other_seed_others() -> None:
    fmt = PasskeyFormat(TOK, 5)
    a = fmt.grid(STREAM, 150, [0.0, 0.5], 6, seed=1)
    b = fmt.grid(STREAM, 150, [0.0, 0.5], 6, seed=1)
    c = fmt.grid(STREAM, 150, [0.0, 0.5], 6, seed=2)
    for ra, rb in zip(a, b, strict=True):
        for x, y in zip(ra, rb, strict=True):
            assert torch.equal(x.tokens, y.tokens) and x.key == y.key
    assert [r[0].key for r in a] != [r[0].key for r in c]
    assert len({r[0].key for r in a}) == 6  # 26^5 keys: six draws differ


def test_too_short_and_bad_inputs_are_refused() -> None:
    fmt = PasskeyFormat(TOK, 5)
    with pytest.raises(ValueError, match="no room for filler.*lengths >= 70"):
        fmt.sample(STREAM, 69, [0.5], seeded(0))
    with pytest.raises(ValueError, match=r"depth must be in \[0, 1\]"):
        fmt.sample(STREAM, 100, [1.5], seeded(0))
    with pytest.raises(ValueError, match="filler stream has 10 tokens"):
        fmt.sample(STREAM[:10], 100, [0.5], seeded(0))
    with pytest.raises(ValueError, match="cannot encode"):
        PasskeyFormat(CharTokenizer.from_texts(["abc"]), 3)


# ----------------------------------------------------------------------------- scoring
class Oracle(nn.Module):
    """A fake LM that finds the needle in its input and writes its key, one token per step
    after the question (``wrong_from``: a wrong token from that answer position on)."""

    def __init__(self, key_len: int, wrong_from: int | None = None) -> None:
        super().__init__()
        self.head, self.question = TOK.encode(NEEDLE_HEAD), TOK.encode(QUESTION)
        self.key_len, self.wrong_from = key_len, wrong_from
        self.encoder = type("Enc", (), {"check_length": staticmethod(lambda n: None)})()
        self.calls = 0

    def new_cache(self, size: int, pad: Tensor | None = None) -> None:
        return None  # generate() then re-runs the whole sequence: no cache to fake

    @staticmethod
    def _find(row: list[int], pattern: list[int], last: bool = False) -> int:
        starts = [
            i for i in range(len(row) - len(pattern) + 1) if row[i : i + len(pattern)] == pattern
        ]
        return starts[-1] if last else starts[0]

    def forward(self, ids: Tensor, cache: None = None) -> Tensor:
        self.calls += 1
        logits = torch.zeros(*ids.shape, TOK.vocab_size)
        for b, row in enumerate(ids.tolist()):
            key_at = self._find(row, self.head) + len(self.head)
            done = len(row) - self._find(row, self.question, last=True) - len(self.question)
            token = row[key_at + done]
            if self.wrong_from is not None and done >= self.wrong_from:
                token = TOK.encode(".")[0]  # never a key letter
            logits[b, -1, token] = 1.0
        return logits


@pytest.mark.parametrize(("wrong_from", "expected"), [(None, 1.0), (0, 0.0), (4, 0.0)])
def test_accuracy_is_exact_match(wrong_from: int | None, expected: float) -> None:
    fmt = PasskeyFormat(TOK, 5)
    model = Oracle(5, wrong_from)
    acc = evaluate_length(
        greedy(model), fmt, STREAM, 140, [0.0, 0.5, 1.0], samples=7, seed=0, batch_size=4
    )
    assert acc == [expected] * 3
    # 21 instances of one prompt length in batches of 4: 6 batches of 5 decoding steps.
    assert model.calls == 6 * 5


def test_correct_scores_each_instance_in_order() -> None:
    fmt = PasskeyFormat(TOK, 3)
    flat = [i for row in fmt.grid(STREAM, 120, [0.0, 1.0], 3, seed=5) for i in row]
    answers = {i: inst.answer for i, inst in enumerate(flat)}
    wrong = {1, 4}

    def decode(prompts: Tensor, k: int) -> Tensor:
        out = []
        for p in prompts:
            i = next(j for j, inst in enumerate(flat) if torch.equal(inst.prompt, p))
            out.append(answers[i] if i not in wrong else answers[i].flip(0) + 100)
        return torch.stack(out)

    done = []
    hits = correct(decode, flat, batch_size=4, progress=done.append)
    assert hits == [i not in wrong for i in range(6)]
    assert done == [4, 6]


# ----------------------------------------------------------------------------- training mix
@pytest.mark.parametrize("mix", [0.0, 0.1, 0.25, 1 / 3, 0.5, 1.0])
def test_sampler_replaces_the_requested_fraction(mix: float) -> None:
    plain = list(RandomOffsetSampler(1000, 50, 16, seed=3))
    mixed = list(RandomOffsetSampler(1000, 50, 16, seed=3, passkey_mix=mix))
    draws = [i for i, x in enumerate(mixed) if isinstance(x, PasskeyDraw)]
    for n in (1, 7, 16, 100, 800):
        assert sum(1 for i in draws if i < n) == math.floor(n * mix)
    # Passkey slots name their global index; every other slot keeps its offset.
    assert all(mixed[i] == PasskeyDraw(i) for i in draws)
    assert [x for i, x in enumerate(mixed) if i not in set(draws)] == [
        x for i, x in enumerate(plain) if i not in set(draws)
    ]
    # A resumed sampler (at step 20) draws what the uninterrupted one drew.
    resumed = list(
        RandomOffsetSampler(1000, 50, 16, seed=3, progress=lambda: (20, 1), passkey_mix=mix)
    )
    assert resumed == mixed[20 * 16 :]
    assert all(is_passkey_slot(i, mix) == (i in set(draws)) for i in range(800))


def test_mix_windows_are_passkey_sequences_of_seq_len() -> None:
    """A training passkey sequence is an instance of seq_len tokens, then "." (as after
    the key in the needle): its answer has the positions of a 1x evaluation instance."""
    seq_len = 96
    fmt = PasskeyFormat(TOK, 4)
    ds = PasskeyMixWindows(STREAM, seq_len, fmt, seed=0)
    depths = []
    for g in range(20):
        item = ds[PasskeyDraw(g)]
        assert item["input"].shape == item["target"].shape == (seq_len,)
        assert torch.equal(item["input"][1:], item["target"][:-1])
        whole = text(torch.cat((item["input"], item["target"][-1:])))
        head_at = whole.index(NEEDLE_HEAD)
        key = whole[head_at + len(NEEDLE_HEAD) : head_at + len(NEEDLE_HEAD) + 4]
        assert whole.endswith(QUESTION + key + ".") and set(key) <= set(ALPHABET)
        # the instance the evaluation builds at 1x, with this key and filler
        gen = seeded(0, 7, g)
        depth = float(torch.rand((), generator=gen))
        inst = fmt.sample(STREAM, seq_len, [depth], gen)[0]
        assert inst.key == key and torch.equal(item["input"], inst.tokens)
        assert text(item["target"][-5:-1]) == key  # predicted from positions L-5 .. L-2
        depths.append(head_at)
        assert torch.equal(ds[PasskeyDraw(g)]["input"], item["input"])  # seeded by g
    assert len(set(depths)) > 5  # random depths
    assert torch.equal(ds[5]["input"], STREAM[5 : 5 + seq_len])  # text windows unchanged


def test_mix_weights_only_the_answer_letters() -> None:
    """``weight`` is ``answer_weight`` exactly on the targets that are the answer's key
    letters (the key after the question), 1 on every other target (the "." after the key
    too) and on text windows."""
    seq_len = 96
    ds = PasskeyMixWindows(STREAM, seq_len, PasskeyFormat(TOK, 4), seed=0, answer_weight=7.5)
    for g in range(10):
        item = ds[PasskeyDraw(g)]
        whole = text(torch.cat((item["input"], item["target"][-1:])))
        answer_from = len(whole) - 5  # the answer's first letter, as an index of `whole`
        assert whole[answer_from - len(QUESTION) : answer_from] == QUESTION
        expected = torch.ones(seq_len)
        expected[answer_from - 1 : answer_from + 3] = 7.5  # target t is token t + 1
        assert torch.equal(item["weight"], expected)
    assert torch.equal(ds[5]["weight"], torch.ones(seq_len))
    with pytest.raises(ValueError, match="answer_weight must be > 0"):
        PasskeyMixWindows(STREAM, seq_len, PasskeyFormat(TOK, 4), seed=0, answer_weight=0.0)


def test_training_loss_is_the_weighted_mean(tmp_path: Path) -> None:
    """LMTask's training loss is sum(w * nll) / sum(w) with ``weight``, the plain mean
    without it (checked against cross-entropy computed here)."""
    from posenc.tasks.lm import LMTask

    torch.manual_seed(0)
    task = LMTask(
        vocab_size=TOK.vocab_size,
        encoder={"_target_": "posenc.encoders.rope.RoPE", "_partial_": True},
        model={"n_layers": 1, "d_model": 16, "n_heads": 2},
        optim={},
        max_steps=1,
        seq_len=12,
    )
    task.log = lambda *a, **k: None  # outside a Trainer
    x = STREAM[:13].repeat(2, 1)
    batch = {"input": x[:, :-1], "target": x[:, 1:]}
    nll = torch.nn.functional.cross_entropy(
        task(batch["input"]).transpose(1, 2), batch["target"], reduction="none"
    )
    assert torch.allclose(task.training_step(batch, 0), nll.mean())
    weight = torch.ones(2, 12)
    weight[1, -3:] = 20.0
    expected = (nll * weight).sum() / weight.sum()
    got = task.training_step({**batch, "weight": weight}, 0)
    assert torch.allclose(got, expected) and not torch.allclose(got, nll.mean())


def test_data_module_batches_hold_the_mix(tmp_path: Path) -> None:
    texts = {"train": TEXT, "val": TEXT[:3000], "test": TEXT[:3000]}
    dm = LMDataModule(
        source=lambda: texts,
        tokenizer={"kind": "char"},
        cache_dir=tmp_path,
        seq_len=80,
        batch_size=8,
        train_steps_per_epoch=10,
        passkey_mix=0.25,
        passkey_key_len=5,
    )
    dm.setup()
    n = 0
    for batch in dm.train_dataloader():
        for row in batch["input"]:
            n += NEEDLE_HEAD in text(row)
    assert n == 20  # a quarter of 80 windows
    with pytest.raises(ValueError, match="passkey_mix must be in"):
        LMDataModule(
            source=lambda: texts,
            tokenizer={"kind": "char"},
            cache_dir=tmp_path,
            seq_len=80,
            batch_size=8,
            passkey_mix=1.5,
        )


# ----------------------------------------------------------------------------- names, config
def test_metric_names() -> None:
    assert metric_name("test", 512) == "test/passkey@512"
    assert parse_metric("test/passkey@512") == ("test", "passkey", "", "512")
    rows, lengths = lm_rows(
        names(
            {
                "test/ppl@64": 5.0,
                "test/passkey@64": 0.5,
                "test/passkey@128": 0.25,
                "test/ppl_sw@64": 4.0,
            }
        )
    )
    assert list(rows) == ["ppl", "ppl_sw", "passkey"] and lengths == ["64", "128"]
    assert rows["passkey"] == {"64": 0.5, "128": 0.25}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("task.passkey_mix=1.5", "task.passkey_mix=1.5: must be a number in [0, 1]"),
        ("task.passkey_answer_weight=0", "task.passkey_answer_weight=0: must be a number > 0"),
        ("task.eval.passkey.depths=[0,2]", "task.eval.passkey.depths contains 2: must be numbers"),
        ("task.eval.passkey.depths=[]", "task.eval.passkey.depths=[]: must list at least one"),
        ("task.eval.passkey.samples=0", "task.eval.passkey.samples=0: must be a positive integer"),
        ("task.eval.passkey.key_len=two", "task.eval.passkey.key_len='two': must be a positive"),
        ("task.eval.passkey.multipliers=[1,-2]", "task.eval.passkey.multipliers contains -2"),
        (
            "+task.eval.passkey.samlpes=3",
            "task.eval.passkey.samlpes: unknown key; did you mean 'samples'?",
        ),
    ],
)
def test_bad_passkey_config_is_one_clear_line(tmp_path: Path, override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(compose_run(tmp_path, override))
    lines = str(err.value).splitlines()
    assert lines == ["invalid config:", f"  {lines[1].strip()}"] and message in lines[1]


def test_learned_past_max_len_is_refused_without_skip(tmp_path: Path) -> None:
    cfg = compose_run(
        tmp_path,
        "encoder=learned",
        "encoder.max_len=64",
        "task.eval.multipliers=[1]",
        "task.eval.skip_unsupported=false",
        "task.eval.passkey.multipliers=[1,8]",
    )
    with pytest.raises(
        ConfigError,
        match=r"task.eval.passkey.multipliers give lengths \[128\] "
        r"past encoder.max_len=64",
    ):
        validate(cfg)


def test_lengths_the_format_cannot_fill_are_refused(tmp_path: Path) -> None:
    cfg = compose_run(tmp_path, "task.eval.passkey.multipliers=[1,8]", "task.passkey_mix=0.1")
    validate(cfg)  # seq_len 16: only the tokenized format says it is too short
    typed = schema.typed(cfg)
    problems = passkey_problems(
        schema.passkey_lengths(typed.task),
        68,
        {"train": 10**6, "val": 10**5, "test": 100},
        typed.task.eval.splits,
        typed.task.passkey_mix,
        typed.task.seq_len,
    )
    assert problems == [
        "task.eval.passkey.multipliers give lengths [16], shorter than the 68 tokens a "
        "passkey instance needs (needle, question, key, filler); drop those multipliers or "
        "raise task.seq_len",
        "task.eval.passkey.multipliers give length 128, longer than the 'test' split (100 "
        "tokens) the filler comes from",
        "task.passkey_mix=0.1: training passkey instances of task.seq_len = 16 tokens are "
        "shorter than the 68 the format needs; raise task.seq_len or set task.passkey_mix=0",
    ]
    # a run that only evaluates trains no passkey instances: the mix's problem goes
    evaluating = passkey_problems([16, 128], 68, {"test": 100}, ["test"], 0.0, 16)
    assert evaluating == problems[:2]


# ----------------------------------------------------------------------------- report
def test_report_means_grids_over_seeds() -> None:
    nan = math.nan
    block = {"lengths": [64, 128], "depths": [0.0, 1.0]}

    def run(seed: int, grid: list[list[float]], lengths: list[int] | None = None) -> Run:
        b = block | {"accuracy": {"test": grid}}
        if lengths:
            b["lengths"] = lengths
        return Run(Path(f"r{seed}"), from_json({"task": "lm", "encoder": "rope", "passkey": b}))

    rope = [
        run(0, [[1.0, 0.5], [0.0, nan]]),
        run(1, [[0.5, 0.5], [0.5, nan]]),
        run(2, [[0.0, 0.0], [0.0, 0.0]], lengths=[64, 256]),
    ]  # another grid: left out
    none = [Run(Path("n"), from_json({"task": "lm", "encoder": "none", "passkey": {}}))]
    means = passkey_means({("lm", "rope"): rope, ("lm", "none"): none}, "test")
    lengths, depths, grid, n, blank = means["rope"]
    assert (lengths, depths, n, blank) == ([64, 128], [0.0, 1.0], 2, ["skipped"] * 2)
    assert grid[0] == [0.75, 0.5] and grid[1][0] == 0.25 and math.isnan(grid[1][1])
    assert "none" not in means


def test_report_draws_the_heatmaps_and_columns(tmp_path: Path) -> None:
    import json

    from posenc.report import build_report

    for seed, acc in enumerate([[[1.0, 0.5], [0.0, 0.25]], [[0.5, 0.5], [0.5, 0.75]]]):
        d = tmp_path / f"{seed}_lm_rope"
        d.mkdir()
        (d / "metrics.json").write_text(
            json.dumps(
                {
                    "task": "lm",
                    "encoder": "rope",
                    "seed": seed,
                    "seq_len": 64,
                    "metrics": {
                        "test/ppl@64": 5.0,
                        "test/passkey@64": sum(acc[0]) / 2,
                        "test/passkey@128": sum(acc[1]) / 2,
                    },
                    "passkey": {
                        "lengths": [64, 128],
                        "depths": [0.0, 1.0],
                        "accuracy": {"test": acc},
                    },
                }
            )
        )
    rep = build_report(tmp_path, tensorboard=False)
    assert tmp_path / "report" / "lm_test_passkey.png" in rep.files
    rows = {r.metric: r for r in rep.rows}
    assert rows["test/passkey@64"].mean == pytest.approx(0.625)
    assert rows["test/passkey@128"].mean == pytest.approx(0.375)
    table = (tmp_path / "report" / "report.md").read_text()
    assert "| encoder | learned | n | test/ppl@64 | test/passkey@64 | test/passkey@128 |" in table


def test_checkpoints_from_before_the_mix_resume(tmp_path: Path) -> None:
    """A checkpoint written before ``task.passkey_mix`` existed trained without it: unset
    there and 0 in the config is no change; any other value is."""
    from omegaconf import OmegaConf

    from posenc.training.checkpoints import differences

    cfg = compose_run(tmp_path)
    old = OmegaConf.to_container(cfg, resolve=True)
    old.pop("hydra", None)
    del old["task"]["passkey_mix"]
    assert differences(old, cfg) == {}
    cfg.task.passkey_mix = 0.25
    assert differences(old, cfg) == {"task.passkey_mix": ("<unset>", 0.25)}


def test_answer_weight_matters_to_resume_only_under_the_mix(tmp_path: Path) -> None:
    """Checkpoints from before ``task.passkey_answer_weight`` trained their mix at weight
    1: resuming one with the mix and another weight is refused; without the mix the key
    does nothing, so any value resumes."""
    from omegaconf import OmegaConf

    from posenc.errors import CheckpointError
    from posenc.training.checkpoints import check_config

    cfg = compose_run(tmp_path)
    assert cfg.task.passkey_answer_weight != 1.0  # the default differs from old runs'
    saved = OmegaConf.to_container(cfg, resolve=True)
    saved.pop("hydra", None)
    del saved["task"]["passkey_answer_weight"]
    ckpt = {"posenc": {"config": saved}}
    assert check_config("x.ckpt", ckpt, cfg, resume=True) == {}  # no mix: inert
    saved["task"]["passkey_mix"] = cfg.task.passkey_mix = 0.5
    with pytest.raises(
        CheckpointError, match="task.passkey_answer_weight: checkpoint '<unset>', config 100.0"
    ):
        check_config("x.ckpt", ckpt, cfg, resume=True)
    cfg.task.passkey_answer_weight = 1.0  # what the old run trained with
    assert check_config("x.ckpt", ckpt, cfg, resume=True) == {}


def test_resume_refuses_another_key_length_under_the_mix(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from posenc.errors import CheckpointError
    from posenc.training.checkpoints import check_config

    cfg = compose_run(tmp_path, "task.passkey_mix=0.25")
    saved = OmegaConf.to_container(cfg, resolve=True)
    saved.pop("hydra", None)
    ckpt = {"posenc": {"config": saved}}
    cfg.task.eval.passkey.samples = 50  # evaluation only: may change
    assert check_config("x.ckpt", ckpt, cfg, resume=True) == {}
    cfg.task.eval.passkey.key_len = 7  # the training sequences' keys: may not
    with pytest.raises(CheckpointError, match="task.eval.passkey.key_len: checkpoint 5, config 7"):
        check_config("x.ckpt", ckpt, cfg, resume=True)
    cfg.task.passkey_mix = 0.0
    cfg.task.eval.passkey.key_len = 5
    saved["task"]["passkey_mix"] = 0.0
    cfg.task.eval.passkey.key_len = 7  # no mix: an evaluation setting again
    assert check_config("x.ckpt", ckpt, cfg, resume=True) == {}
