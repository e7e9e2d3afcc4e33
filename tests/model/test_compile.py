"""Every encoder traces as one graph under ``torch.compile(fullgraph=True)``.

``backend="eager"`` runs dynamo alone (no code generation), so a graph break, a host read
of a tensor or data-dependent Python control flow fails here in seconds on a CPU. The
backward then runs through the traced graph, so gradients reach every parameter.
"""

from __future__ import annotations

import copy
import functools
from unittest import mock

import pytest
import torch

from posenc.encoders.registry import get
from posenc.model import DecoderLM, EncoderDecoder, streaming
from posenc.model.streaming import Streaming
from tests.conftest import BIDIRECTIONAL_YAMLS, ENCODER_YAMLS

#: One layer: dynamo traces each layer of the stack again, and they run the same code;
#: what needs more layers (a mix of schemes, local and global layers) asks for them.
SIZES = dict(d_model=32, n_heads=4, n_layers=1, d_ff=64, dropout=0.0)
#: ``encoder=mix``'s default: RoPE with NoPE in every 4th layer.
MIX_LAYERS = {"n_layers": 4}
#: A short length, and one past the causal query block of score-term schemes (128), so
#: their blocked path is traced too.
LENGTHS = (16, 300)


def _compiled(model: torch.nn.Module) -> torch.nn.Module:
    torch._dynamo.reset()
    return torch.compile(model, fullgraph=True, backend="eager", dynamic=False)


def _check_grads(model: torch.nn.Module) -> None:
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"no gradient reached {missing}"


@pytest.mark.parametrize("name", ["rope", "alibi", "shaw"])
def test_sliding_window_traces_as_one_graph(name: str) -> None:
    """A local layer and a global one with the modifiers, in training past the query
    blocks: one graph, the eager outputs, gradients everywhere."""
    model = DecoderLM(
        vocab_size=11, encoder=name, **{**SIZES, "n_layers": 2}, **MODIFIERS, window=7,
        window_layers=["local", "global"],
    )  # fmt: skip
    ids = torch.randint(0, 11, (2, 300))
    out = _compiled(model)(ids)
    torch.testing.assert_close(out, model(ids), rtol=1e-5, atol=1e-5)
    out.square().mean().backward()
    _check_grads(model)


@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize("name", ENCODER_YAMLS)
def test_decoder_lm_traces_as_one_graph(name: str, t: int) -> None:
    model = DecoderLM(
        vocab_size=11, encoder=name, **{**SIZES, **(MIX_LAYERS if name == "mix" else {})}
    )
    ids = torch.randint(0, 11, (2, t))
    out = _compiled(model)(ids)
    torch.testing.assert_close(out, model(ids), rtol=1e-5, atol=1e-5)
    out.square().mean().backward()
    _check_grads(model)


@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize("name", BIDIRECTIONAL_YAMLS)
def test_encoder_decoder_traces_as_one_graph(name: str, t: int) -> None:
    """Bidirectional, causal and cross attention, with source padding."""
    sizes = {**SIZES, **(MIX_LAYERS if name == "mix" else {})}
    model = EncoderDecoder(src_vocab_size=13, tgt_vocab_size=13, encoder=name, **sizes)
    src, tgt = torch.randint(0, 13, (2, t)), torch.randint(0, 13, (2, t // 2))
    src_valid = torch.ones(2, t, dtype=torch.bool)
    src_valid[1, t // 2 :] = False
    out = _compiled(model)(src, tgt, src_valid)
    torch.testing.assert_close(out, model(src, tgt, src_valid), rtol=1e-5, atol=1e-5)
    out.square().mean().backward()
    _check_grads(model)


#: Non-default conventions (#24), traced as the YAML defaults are above.
CONVENTIONS = {
    "deberta_p2c_paper": ("deberta", {"p2c_row": "paper"}),
    "stickbreak_value": ("stickbreak", {"remainder": "value"}),
    "fox_pro": ("fox", {"pro": True}),
    "xl_fold": ("xl", {"fold": True}),
    "dape_alibi": ("dape", {"base": "alibi"}),
    "dape_fire": ("dape", {"base": "fire"}),
    "rope_yarn_code": (
        "rope",
        {"scaling": "yarn", "scaling_factor": 4.0, "original_length": 64, "fraction": 0.5},
    ),
    "rope_yarn_paper_score": (
        "rope",
        {
            "scaling": "yarn",
            "scaling_factor": 4.0,
            "original_length": 64,
            "fraction": 0.5,
            "yarn_ramp": "paper",
            "yarn_temper": "score",
        },
    ),
}


@pytest.mark.parametrize("case", list(CONVENTIONS))
def test_conventions_trace_as_one_graph(case: str) -> None:
    name, settings = CONVENTIONS[case]
    model = DecoderLM(vocab_size=11, encoder=functools.partial(get(name), **settings), **SIZES)
    ids = torch.randint(0, 11, (2, 300))
    out = _compiled(model)(ids)
    torch.testing.assert_close(out, model(ids), rtol=1e-5, atol=1e-5)
    out.square().mean().backward()
    _check_grads(model)


#: QK-norm, SSMax and sinks together (model options for any softmax scheme).
MODIFIERS = {"qk_norm": True, "logit_scale": "ssmax", "sinks": True}


@pytest.mark.parametrize("name", ["rope", "alibi", "shaw", "fox"])
def test_modifiers_trace_as_one_graph(name: str) -> None:
    """The modifiers in training (explicit path with query blocks past 128 queries, or
    SDPA with the sink column) and in a translator with source padding: one graph, and
    gradients reach SSMax's s, the sinks and the norms' scales."""
    model = DecoderLM(vocab_size=11, encoder=name, **SIZES, **MODIFIERS)
    ids = torch.randint(0, 11, (2, 300))
    out = _compiled(model)(ids)
    torch.testing.assert_close(out, model(ids), rtol=1e-5, atol=1e-5)
    out.square().mean().backward()
    _check_grads(model)
    if name != "fox":  # causal only
        mt = EncoderDecoder(
            src_vocab_size=13, tgt_vocab_size=13, encoder=name, **SIZES, **MODIFIERS
        )
        src, tgt = torch.randint(0, 13, (2, 16)), torch.randint(0, 13, (2, 8))
        src_valid = torch.ones(2, 16, dtype=torch.bool)
        src_valid[1, 8:] = False
        out = _compiled(mt)(src, tgt, src_valid)
        torch.testing.assert_close(out, mt(src, tgt, src_valid), rtol=1e-5, atol=1e-5)
        out.square().mean().backward()
        _check_grads(mt)


@pytest.mark.parametrize("name", ENCODER_YAMLS)
def test_random_positions_training_traces_as_one_graph(name: str) -> None:
    """Randomized positions (Ruoss et al. 2023) take the per-pair path: also one graph."""
    model = DecoderLM(vocab_size=11, encoder=name, random_positions=64, **SIZES).train()
    ids = torch.randint(0, 11, (2, 16))
    out = _compiled(model)(ids)
    out.square().mean().backward()
    _check_grads(model)


def test_the_stack_says_what_it_knows_of_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Default positions reach the encoder as a run with its start (the strided-view
    path), randomized ones with the bound they were drawn from: never read back."""
    model = DecoderLM(vocab_size=11, encoder="xl", random_positions=64, **SIZES)
    seen: list[tuple] = []
    inner = model.encoder.context

    def spy(q_pos, k_pos, kind, **where):
        seen.append((where["starts"], where["bound"]))
        return inner(q_pos, k_pos, kind, **where)

    monkeypatch.setattr(model.encoder, "context", spy)
    ids = torch.randint(0, 11, (2, 16))
    model.eval()(ids)
    model(ids, offset=5)
    model.train()(ids)
    assert seen == [((0, 0), 16), ((5, 5), 21), (None, 64)]


def test_offset_equals_explicit_positions() -> None:
    """``offset=o`` (the view path) gives the logits of explicit positions ``o..o+T-1``
    (the per-pair path), for an absolute and a relative scheme."""
    for name in ("sinusoidal", "shaw", "deberta", "t5"):
        model = DecoderLM(vocab_size=11, encoder=name, **SIZES).eval()
        ids = torch.randint(0, 11, (2, 12))
        torch.testing.assert_close(
            model(ids, offset=7), model(ids, torch.arange(7, 19)[None]), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("budget", [0.0, 8.0])
def test_score_budget_sets_cpu_query_blocking(budget: float) -> None:
    model = DecoderLM(vocab_size=11, encoder="alibi", score_budget_mib=budget, **SIZES)
    attn = model.stack.layers[0].self_attn
    assert attn.max_score_bytes == (int(budget * 2**20) or None)
    calls = []
    inner = attn.query_block
    attn.query_block = lambda *a, **k: calls.append(a) or inner(*a, **k)
    model(torch.randint(0, 11, (1, 300)))
    assert len(calls) == (0 if budget == 0 else 1)


def test_model_compile_option_compiles_in_place() -> None:
    """``model.compile=true`` compiles the model's forward in place: the parameters and
    checkpoint keys stay those of the eager model. ``false`` and ``auto`` build it eager
    (``auto`` decides once training starts: tests/training/test_compiling.py)."""
    from posenc.tasks.lm import LMTask

    sizes = dict(n_layers=1, d_model=16, n_heads=2, d_ff=32, dropout=0.0)
    tasks = [
        LMTask(
            vocab_size=11,
            encoder={"_target_": "posenc.encoders.rope.RoPE", "_partial_": True},
            model={**sizes, "compile": flag},
            optim={},
            max_steps=1,
            seq_len=8,
        )
        for flag in (False, True, "auto")
    ]
    assert tasks[0].model._compiled_call_impl is None
    assert tasks[1].model._compiled_call_impl is not None
    assert tasks[2].model._compiled_call_impl is None
    assert list(tasks[0].state_dict()) == list(tasks[1].state_dict())


def test_inductor_training_matches_eager() -> None:
    """Code generation, not only tracing: three training steps of FIRE (a Toeplitz view of
    its per-distance table, inside a ``torch.cond``) compiled with inductor give eager's
    losses. An ``as_strided`` view of an intermediate once gave NaN here."""
    torch._dynamo.reset()
    losses = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = DecoderLM(
            vocab_size=11, encoder="fire", n_layers=1, d_model=16, n_heads=2, d_ff=32, dropout=0.0
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        run = torch.compile(model, fullgraph=True, dynamic=False) if compiled else model
        ids = torch.randint(0, 11, (2, 24))
        steps = []
        for _ in range(3):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(run(ids).flatten(0, 1), ids.flatten())
            loss.backward()
            opt.step()
            steps.append(loss.item())
        losses.append(steps)
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)


# ------------------------------------------------------------------ cached decoding steps
#: Every encoder's YAML defaults, plus the variants whose cached step once failed to
#: compile or recompiled at every step (#34).
STEP_CASES = {name: (name, {}) for name in ENCODER_YAMLS}
STEP_CASES["shaw_no_value"] = ("shaw", {"value": False})
STEP_CASES["path_forget_gate"] = ("path", {"forget_gate": True})
STEP_CASES["fox_pro"] = ("fox", {"pro": True})
STEP_CASES["xl_fold"] = ("xl", {"fold": True})
STEP_CASES["rope_dynamic_ntk"] = (
    "rope",
    {"scaling": "dynamic_ntk", "scaling_factor": 2.0, "original_length": 16},
)


def _counting_backend() -> tuple[object, list]:
    """A ``torch.compile`` backend that records each graph it gets (one per
    compilation) and runs it as traced."""
    graphs: list = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    return backend, graphs


#: Options of a case's suffix: the modifiers, and those with a sliding window.
STEP_OPTIONS = {"_modifiers": MODIFIERS, "_window": {**MODIFIERS, "window": 5}}


@pytest.mark.parametrize(
    "case", [*STEP_CASES, "alibi_modifiers", "rope_modifiers", "alibi_window", "rope_window"]
)
def test_cached_decode_step_compiles_once(case: str) -> None:
    """The static cache's step traces as one graph (``fullgraph=True``) and is reused:
    a prefill and 64 single-token steps cost at most 2 compilations (the prefill's
    shape and the step's), with ``dynamic=False`` so that any Python value that changed
    from step to step would show as a recompilation. Logits equal eager decoding's."""
    suffix = next((x for x in STEP_OPTIONS if case.endswith(x)), "")
    name, settings = STEP_CASES[case.removesuffix(suffix) if suffix else case]
    options = STEP_OPTIONS.get(suffix, {})  # a logit scale and a window by slot
    model = DecoderLM(
        vocab_size=11,
        encoder=functools.partial(get(name), **settings),
        **SIZES,
        **options,
    ).eval()
    with torch.no_grad():
        _check_step_compiles_once(model, torch.randint(0, 11, (2, 16 + 64)), prefill=16)


def _check_step_compiles_once(model: DecoderLM, ids: torch.Tensor, prefill: int) -> None:
    """Decode ``ids`` with the static cache (a prefill, then a token per step), compiled
    and eager: at most 2 graphs, and the same logits."""
    torch._dynamo.reset()
    backend, graphs = _counting_backend()
    step = torch.compile(model, fullgraph=True, backend=backend, dynamic=False)
    outs = []
    for run in (step, model):
        cache = model.new_cache(ids.shape[1])
        logits = [run(ids[:, :prefill], cache=cache)]
        logits += [run(ids[:, i : i + 1], cache=cache) for i in range(prefill, ids.shape[1])]
        outs.append(torch.cat(logits, dim=1))
    assert len(graphs) <= 2
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["rope", "alibi"])
def test_streaming_traces_as_one_graph_and_its_step_compiles_once(name: str) -> None:
    """StreamingLLM's full pass (past its query blocks: one query at a time here) is one
    graph, and its cached step compiles at most twice over 40 steps; eager's logits."""
    model = DecoderLM(vocab_size=11, encoder=name, **SIZES).eval()
    ids = torch.randint(0, 11, (2, 48))
    with torch.no_grad(), model.streaming(Streaming(sinks=2, window=6)):
        blocks = mock.patch.object(streaming, "BLOCK_BYTES", 2 * 4 * 4 * 48 * 8)  # 8 queries
        with blocks:
            torch.testing.assert_close(_compiled(model)(ids), model(ids), rtol=1e-5, atol=1e-5)
        _check_step_compiles_once(model, ids, prefill=8)


@pytest.mark.parametrize("name", BIDIRECTIONAL_YAMLS)
def test_translation_decode_step_compiles_once(name: str) -> None:
    """The decoder's cached step with cross-attention and source padding: the first
    step computes the encoder output's keys, the later ones reuse them; 2 graphs."""
    model = EncoderDecoder(src_vocab_size=13, tgt_vocab_size=13, encoder=name, **SIZES).eval()
    torch._dynamo.reset()
    backend, graphs = _counting_backend()
    step = torch.compile(model.decode, fullgraph=True, backend=backend, dynamic=False)
    src, tgt = torch.randint(0, 13, (2, 9)), torch.randint(0, 13, (2, 12))
    src_valid = torch.ones(2, 9, dtype=torch.bool)
    src_valid[1, 6:] = False
    with torch.no_grad():
        memory = model.encode(src, src_valid)
        outs = []
        for run in (step, model.decode):
            cache = model.new_cache(tgt.shape[1])
            logits = [
                run(tgt[:, i : i + 1], memory, src_valid=src_valid, cache=cache)
                for i in range(tgt.shape[1])
            ]
            outs.append(torch.cat(logits, dim=1))
            assert "cross_keys" in cache.layers[0].buffers  # computed once, kept
    assert len(graphs) <= 2
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["fire", "shaw_no_value", "rope_dynamic_ntk", "t5"])
def test_compiled_model_generates_what_eager_generates(case: str) -> None:
    """``model.compile=true`` (``nn.Module.compile``, dynamic shapes as torch decides)
    with generation and passkey decoding: greedy tokens equal the eager model's, for
    left-padded prompts too. FIRE's and Shaw's (no value term) cached steps did not
    compile before the static cache (#34); dynamic NTK replays the prefix."""
    from posenc.decoding.lm import generate
    from posenc.eval.passkey import greedy as passkey_greedy

    name, settings = STEP_CASES[case]
    eager = DecoderLM(
        vocab_size=11, encoder=functools.partial(get(name), **settings), **SIZES
    ).eval()
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled.compile(backend="eager")
    prompt = torch.randint(0, 11, (3, 10))
    pad = torch.tensor([0, 4, 2])
    for model_out in (
        [generate(m, prompt, 12, temperature=0) for m in (compiled, eager)],
        [generate(m, prompt, 9, temperature=0, pad=pad) for m in (compiled, eager)],
        [passkey_greedy(m)(prompt, 6) for m in (compiled, eager)],
    ):
        assert torch.equal(*model_out)


@pytest.mark.parametrize("name", ["fire", "rope", "t5"])
def test_compiled_translator_decodes_what_eager_decodes(name: str) -> None:
    """``compile()`` of a translator compiles its decoding step too; beam search (rows
    reordered and dropped as sentences finish) and greedy decoding give eager's output."""
    from posenc.decoding.encdec import beam_search, greedy

    eager = EncoderDecoder(src_vocab_size=13, tgt_vocab_size=13, encoder=name, **SIZES).eval()
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled.compile(backend="eager")
    assert compiled._compiled_decode is not None
    src = torch.randint(3, 13, (4, 9))
    valid = torch.ones(4, 9, dtype=torch.bool)
    valid[1, 5:] = valid[3, 7:] = False
    limit = torch.tensor([3, 8, 5, 6])
    ids = {"bos": 1, "eos": 2, "pad": 0}
    for search in (functools.partial(beam_search, beam_size=3, length_penalty=0.6), greedy):
        got, want = (search(m, src, valid, max_len=limit, **ids) for m in (compiled, eager))
        assert got.tokens == want.tokens
        torch.testing.assert_close(got.scores, want.scores, atol=1e-5, rtol=1e-5)
