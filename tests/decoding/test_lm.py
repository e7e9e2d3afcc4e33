"""LM generation: cached equals uncached for every encoder, and the command runs on a
real checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posenc.decoding.graphs import GraphedStep
from posenc.decoding.lm import generate, next_token
from posenc.generate import main as generate_main
from posenc.model import DecoderLM
from posenc.model.streaming import Streaming
from tests.conftest import ENCODER_YAMLS, ROOT, TINY
from tests.model.test_cache import unit_scale

SIZES = dict(d_model=32, n_heads=4, n_layers=2, dropout=0.0)


@pytest.mark.parametrize("name", ENCODER_YAMLS)
def test_cached_generation_gives_the_uncached_tokens(name: str) -> None:
    """Sampling with one seed, past 3x a training length of 8: the same tokens with and
    without the cache."""
    model = DecoderLM(vocab_size=23, encoder=name, **SIZES).eval()
    prompt = torch.randint(0, 23, (2, 5))
    runs = [
        generate(model, prompt, 20, temperature=1.0, top_k=5, seed=3, use_cache=c)
        for c in (True, False)
    ]
    assert torch.equal(runs[0], runs[1])
    assert runs[0].shape == (2, 25) and torch.equal(runs[0][:, :5], prompt)


@pytest.mark.parametrize("name", ["rope", "alibi", "none"])
def test_streaming_generation_gives_the_uncached_tokens(name: str) -> None:
    """StreamingLLM (2 sinks, a window of 4) past 5x the cache: the same sampled tokens
    with the cache as with a full pass per step under the streaming mask, and not those
    of plain generation (the eviction changed the distribution)."""
    model = unit_scale(DecoderLM(vocab_size=23, encoder=name, **SIZES))  # sensitive weights
    prompt = torch.randint(0, 23, (2, 5))
    setting = Streaming(sinks=2, window=4)
    args = dict(temperature=1.0, seed=3)
    runs = [generate(model, prompt, 30, **args, streaming=setting, use_cache=c) for c in (1, 0)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], generate(model, prompt, 30, **args))
    assert model.stack.streaming is None  # restored


def test_streaming_generation_refuses_padding_and_schemes_it_cannot_reindex() -> None:
    model = DecoderLM(vocab_size=23, encoder="rope", **SIZES).eval()
    prompt, setting = torch.randint(0, 23, (2, 5)), Streaming(sinks=2, window=4)
    with pytest.raises(ValueError, match="no pad=") as err:
        generate(model, prompt, 3, pad=torch.tensor([0, 1]), streaming=setting)
    assert "\n" not in str(err.value)
    learned = DecoderLM(vocab_size=23, encoder="learned", **SIZES).eval()
    with pytest.raises(ValueError, match="query-key distance alone"):
        generate(learned, prompt, 3, streaming=setting)


def test_a_long_generation_reports_its_progress_and_gives_the_same_tokens(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``progress`` hears each token's count, and changes nothing generated; the command
    turns it into a line on stderr every few seconds (here every call: a clock that jumps
    a minute at each read) with the count, the time and the time left."""
    import posenc.generate as command
    from posenc import progress

    model = DecoderLM(vocab_size=23, encoder="rope", **SIZES).eval()
    prompt, counts = torch.randint(0, 23, (2, 5)), []
    ran = generate(model, prompt, 6, temperature=1.0, seed=3, progress=counts.append)
    assert counts == [1, 2, 3, 4, 5, 6]
    assert torch.equal(ran, generate(model, prompt, 6, temperature=1.0, seed=3))
    ticks = iter(range(0, 3600, 60))
    monkeypatch.setattr(progress.time, "perf_counter", lambda: float(next(ticks)))
    report = command._progress(4)
    for done in (1, 2, 3, 4):
        report(done)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [  # none for the last token: the text follows at once
        "posenc.generate: 1/4 tokens, elapsed 0:01:00, ETA 0:03:00",
        "posenc.generate: 2/4 tokens, elapsed 0:02:00, ETA 0:02:00",
        "posenc.generate: 3/4 tokens, elapsed 0:03:00, ETA 0:01:00",
    ]


def test_next_token_greedy_and_top_k() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert next_token(logits, temperature=0, top_k=None).tolist() == [1]
    gen = torch.Generator().manual_seed(0)
    picks = {int(next_token(logits, temperature=1.0, top_k=2, generator=gen)) for _ in range(200)}
    assert picks == {1, 3}  # only the two best ever


def test_generation_refuses_bad_arguments() -> None:
    model = DecoderLM(vocab_size=5, encoder="learned", **SIZES).eval()
    with pytest.raises(ValueError, match="top_k"):
        generate(model, torch.zeros(1, 2, dtype=torch.long), 3, top_k=0)
    with pytest.raises(ValueError, match="max_len=1024"):  # before any work
        generate(model, torch.zeros(1, 2, dtype=torch.long), 1023)


def test_graphs_need_the_cache_on_a_cuda_device() -> None:
    """Replaying the step from a CUDA graph is automatic on a GPU; asked for elsewhere it
    is refused in one line that says what to pass instead."""
    model = DecoderLM(vocab_size=23, encoder="rope", **SIZES).eval()
    prompt = torch.randint(0, 23, (1, 4))
    for kwargs in ({"graphs": True}, {"graphs": True, "use_cache": False}):
        with pytest.raises(ValueError, match="graphs=None") as err:
            generate(model, prompt, 3, **kwargs)
        assert "\n" not in str(err.value)
    assert torch.equal(
        generate(model, prompt, 6, temperature=0),
        generate(model, prompt, 6, temperature=0, graphs=False),
    )


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("name", ["none", "rope", "alibi", "t5", "xl", "fire", "path"])
def test_graphed_step_gives_the_eager_logits_on_cuda(name: str) -> None:
    """On a GPU the cached step replays from a CUDA graph: fed the same tokens past the
    training length, every step's logits equal the eager step's (compared as numbers:
    greedy tokens of a random model can flip on a last-bit difference between kernels).
    None and Transformer-XL replay (measured on an H200); a scheme whose step waits for
    the device or replaces cache buffers stays eager and says why."""
    torch.manual_seed(0)
    model = DecoderLM(vocab_size=50, encoder=name, d_model=64, n_heads=4, n_layers=2).cuda().eval()
    tokens = torch.randint(0, 50, (2, 48), device="cuda")
    prompt, fed = tokens[:, :8], tokens[:, 8:]
    runs = []
    with torch.no_grad():
        for graphed in (True, False):
            cache = model.new_cache(tokens.shape[1])
            model(prompt, cache=cache)

            def step(ids: torch.Tensor, cache=cache) -> torch.Tensor:
                return model(ids, cache=cache)[:, -1]

            stepper = GraphedStep(step, cache) if graphed else step
            runs.append(torch.stack([stepper(fed[:, n : n + 1]).clone() for n in range(40)]))
            if graphed:
                graph, why = stepper.graph, stepper.eager_because
    torch.testing.assert_close(runs[0], runs[1], atol=1e-4, rtol=1e-4)
    assert (graph is not None) != (why is not None)
    if name in ("none", "xl"):
        assert graph is not None, why


def test_generate_command_on_a_trained_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    train_cmd = [
        sys.executable,
        "run.py",
        *TINY,
        "encoder=rope",
        f"hydra.run.dir={run_dir}",
        f"paths.cache_dir={tmp_path / 'cache'}",
    ]
    proc = subprocess.run(train_cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ckpt = run_dir / "checkpoints" / "best.ckpt"
    assert ckpt.is_file()
    sampling = ["--prompt", "ROMEO:", "--tokens", "40", "--temperature", "0.8"]
    sampling += ["--top-k", "10", "--seed", "1"]
    # The checkpoint alone, handed to a colleague without the run directory or the data:
    # it carries its config and tokenizer (#38). Launched as a user types it.
    alone = tmp_path / "elsewhere" / "model.ckpt"
    alone.parent.mkdir()
    alone.write_bytes(ckpt.read_bytes())
    env = {
        **os.environ,
        "POSENC_DATA_DIR": str(tmp_path / "no_data"),
        "POSENC_CACHE_DIR": str(tmp_path / "no_cache"),
    }
    cmd = [sys.executable, "-m", "posenc.generate", str(alone), *sampling]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, cwd=alone.parent, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (tmp_path / "no_data").exists() and not (tmp_path / "no_cache").exists()
    # The same command's function on the run's own checkpoint, in this process (a launch
    # less): --no-cache, the same text.
    assert generate_main([str(ckpt), *sampling, "--no-cache"]) == 0
    text = capsys.readouterr().out
    assert proc.stdout == text and text.startswith("ROMEO:") and len(text) > 40
    # A character the tokenizer never saw is read as its unknown token, and said so.
    assert generate_main([str(ckpt), "--prompt", "ROMEO\u2122", "--tokens", "2"]) == 0
    said = capsys.readouterr()
    assert said.out.startswith("ROMEO\ufffd"), said.out
    assert "does not know '\u2122' of the prompt" in said.err and said.err.count("\n") == 1
    # Bad input is refused by main() itself: one line, status 2, no traceback.
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    for args, message in (
        ([str(tmp_path / "nope.ckpt")], f"{tmp_path / 'nope.ckpt'}: no such file"),
        ([str(alone), "--temperature", "nan"], "--temperature nan: must be a finite"),
        ([str(alone), "--tokens", "0"], "--tokens 0: must be at least 1"),
        ([str(alone), "--top-k", "0"], "--top-k 0: must be at least 1"),
        ([str(damaged)], "damaged.ckpt"),
    ):
        assert generate_main(args) == 2, args
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err, err[-2000:]


def test_a_recorded_run_config_resolves_outside_hydra(tmp_path) -> None:
    """posenc.generate reads <run>/.hydra/config.yaml, whose tokenizer cache is
    ``${hydra:runtime.cwd}/...``: it resolves from the hydra.yaml recorded beside it."""
    from omegaconf import OmegaConf

    from posenc.generate import run_config

    record = tmp_path / ".hydra"
    record.mkdir()
    cache = "${oc.env:POSENC_TEST_UNSET_VAR,${hydra:runtime.cwd}/outputs/.cache}"
    (record / "config.yaml").write_text(f"paths:\n  cache_dir: {cache}\n")
    (record / "hydra.yaml").write_text("hydra:\n  runtime:\n    cwd: /somewhere/else\n")
    cfg = run_config(record / "config.yaml")
    assert OmegaConf.select(cfg, "paths.cache_dir") == "/somewhere/else/outputs/.cache"
