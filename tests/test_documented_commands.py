"""The documented commands are tests: every ``python run.py ...`` and ``python -m
posenc....`` that README.md and docs/*.md print runs as printed, from an empty folder,
with only size overrides appended (steps, lengths, model size; never ``hydra.run.dir`` or
``hydra.sweep.dir``), and must exit 0 with a result (#38).

- Each document's commands run in document order in one folder, empty at its first
  command, so a later command's placeholder is what an earlier one produced there, as a
  reader following the page would have it: ``<date>``/``<dir>`` the newest sweep,
  ``<run>`` the page's first run of that task and encoder on the same data.
- A size override is appended only for a key the command does not set itself; a sweep
  over ``task=lm,mt`` runs as its two halves, each with its task's sizes.
- Commands that need a GPU, SLURM or a download are skipped by name with the reason.
- CI runs the commands in :data:`FAST` (the README's first command and the paths a new
  user takes next); ``python -m pytest tests/test_documented_commands.py
  --all-documented-commands`` runs every one (about an hour on a 2-core CPU).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from posenc.data.algo_problems import PROBLEMS, problem_default
from tests.conftest import ALGO_SMALL, ROOT

DOCS = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]

#: Appended per task kind, each only where the command does not set that key.
SIZES = {
    "lm": [
        "model.n_layers=1",
        "model.d_model=16",
        "model.n_heads=2",
        "model.d_ff=32",
        "task.seq_len=16",
        "task.batch_size=4",
        "task.eval_batch_size=4",
        "task.eval.max_tokens=256",
        "task.eval.passkey.samples=2",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=2",
    ],
    "mt": [
        "model.n_layers=1",
        "model.d_model=16",
        "model.n_heads=2",
        "model.d_ff=32",
        "tokenizer.vocab_size=400",
        "task.max_len=64",
        "task.max_tokens=512",
        "task.val_bleu_sentences=4",
        "task.eval_max_sentences=12",
        "task.decode.beam_size=2",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=2",
    ],
    "algo": ALGO_SMALL,
}
#: What a preset's name stands for where a document writes ``sweep=<preset>``.
PRESET = "smoke"

#: (document, the command's first words): what CI runs. The README's first command, its
#: own-data and generation commands, and a sweep with its report from an empty folder.
FAST = {
    ("README.md", "python run.py encoder=rope task=lm"),
    ("README.md", "python run.py data=text_files"),
    ("README.md", "python -m posenc.generate"),
    ("docs/reproducing.md", "python run.py -m sweep=<preset>"),
    ("docs/reproducing.md", "python -m posenc.report outputs/multirun/<date>"),
}


@dataclass(frozen=True)
class Command:
    """One documented command: where it is printed and its words (shell-split)."""

    doc: str
    line: int
    words: tuple[str, ...]

    @property
    def text(self) -> str:
        return " ".join(self.words)

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def _commands_in(words: list[str]) -> list[list[str]]:
    """The ``python run.py`` / ``python -m posenc.*`` commands of a shell line."""
    out, current = [], []
    for w in [*words, "&&"]:
        if w in ("&&", ";", "||"):
            is_ours = current[:2] == ["python", "run.py"] or (
                current[:2] == ["python", "-m"]
                and len(current) > 2
                and current[2].startswith("posenc.")
            )
            if is_ours:
                out.append(current)
            current = []
        else:
            current.append(w)
    return out


def extract(doc: str) -> list[Command]:
    """Every command ``doc`` prints, in order: code-block lines (continuations joined,
    comments dropped) and inline code spans (which may wrap across lines)."""
    lines = (ROOT / doc).read_text().splitlines()
    found: list[Command] = []
    prose: list[tuple[int, str]] = []
    in_code, pending, start = False, "", 0
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if not in_code:
            prose.append((number, line))
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text, pending = pending + line, ""
        try:
            # a placeholder is one word: <lr_tune dir> -> <lr_tune_dir>
            text = re.sub(r"<([^<>]*)>", lambda p: "<" + "_".join(p.group(1).split()) + ">", text)
            words = shlex.split(text, comments=True)
        except ValueError:  # not shell (a Python or YAML block)
            continue
        found += [Command(doc, start, tuple(c)) for c in _commands_in(words)]
    # Inline spans: search the prose as one text, keeping each span's first line number.
    text = "\n".join(line for _, line in prose)
    offsets = [0]
    for _, line in prose:
        offsets.append(offsets[-1] + len(line) + 1)
    for m in re.finditer(r"`(python (?:run\.py|-m posenc\.)[^`]*)`", text):
        number = prose[max(i for i, o in enumerate(offsets[:-1]) if o <= m.start())][0]
        span = re.sub(
            r"<([^<>]*)>",
            lambda p: "<" + "_".join(p.group(1).split()) + ">",
            " ".join(m.group(1).replace("<sweep dir>", "<dir>").split()),
        )
        words = shlex.split(span)
        found += [Command(doc, number, tuple(c)) for c in _commands_in(words)]
    found.sort(key=lambda c: c.line)
    unique: dict[tuple[str, ...], Command] = {}
    for c in found:
        unique.setdefault(c.words, c)
    return list(unique.values())


def skip_reason(c: Command) -> str | None:
    """Why a command cannot run here, or None."""
    words = " ".join(c.words)
    if "hydra/launcher=slurm" in words:
        return "needs a SLURM cluster"
    if "trainer.accelerator=gpu" in words or "model.compile=true" in words:
        return "needs a GPU"
    if re.search(r"\b(data=(wikitext103|wmt14|iwslt)|experiment=lm_gpu)\b", words):
        return "downloads a dataset from the Hugging Face hub"
    if "encoder=my_kerple" in words:
        return (
            "needs the README's example encoder saved as a file "
            "(tests/encoders/test_readme_example.py runs that example)"
        )
    if any("..." in w for w in c.words):
        return "elided ('...'): a reference or a usage line, not a whole command"
    if c.words[:3] in (("python", "-m", "posenc.report"), ("python", "-m", "posenc.generate")):
        # an option's value is not the directory or checkpoint these need
        args, i = list(c.words[3:]), 0
        while i < len(args):
            if args[i].startswith("-"):
                del args[i : i + 2]
            else:
                i += 1
        if not args:
            return "a reference in prose (no directory or checkpoint), not a whole command"
    return None


def _sweep_task(name: str) -> str | None:
    """The task a sweep preset chooses: its ``override /task`` default, or its grid's
    ``task`` (None: it chooses none)."""
    path = ROOT / "conf" / "sweep" / f"{name}.yaml"
    if not path.is_file():
        return None
    cfg = OmegaConf.load(path)
    for entry in cfg.get("defaults") or []:
        if OmegaConf.is_dict(entry) and "override /task" in entry:
            return str(entry["override /task"])
    task = OmegaConf.select(cfg, "hydra.sweeper.params.task")
    return None if task is None else str(task)


def task_kinds(c: Command) -> list[str]:
    """The task (or, for a sweep over several, each task) the command runs."""
    for w in c.words:
        if w.startswith("task="):
            return w.removeprefix("task=").split(",")
    sweep = next((w.removeprefix("sweep=") for w in c.words if w.startswith("sweep=")), None)
    chosen = _sweep_task(sweep) if sweep else None
    if chosen:
        return chosen.split(",")
    words = " ".join(c.words)
    for kind, marks in (
        ("mt", ("experiment=mt_", "sweep=mt_")),
        ("algo", ("experiment=algo_", "sweep=algo_")),
    ):
        if any(m in words for m in marks):
            return [kind]
    return ["lm"]


def _key(word: str) -> str:
    return word.partition("=")[0].lstrip("+")


def sized(c: Command, kind: str, args: list[str]) -> list[str]:
    """``args`` with the task's size overrides for every key they do not set, and only
    ``kind`` where the command sweeps over several tasks."""
    args = [f"task={kind}" if a.startswith("task=") and "," in a else a for a in args]
    given = {_key(a) for a in args}
    sizes = [s for s in SIZES[kind] if _key(s) not in given]
    if kind == "algo":
        sizes = [_smallest_sizes(args) if _key(s) == "task.train_lengths" else s for s in sizes]
    if "passkey" in " ".join(args):
        # a passkey instance (filler, key, question) needs about 70 characters: keep the
        # task's own 128
        sizes = [s for s in sizes if not s.startswith("task.seq_len=")]
    # --cfg prints the config and trains nothing (and Hydra takes no override after it)
    return [*args, *sizes] if c.words[1] == "run.py" and "--cfg" not in args else args


def _smallest_sizes(args: list[str]) -> str:
    """``task.train_lengths`` at the smallest training size of the problems a command
    names (``experiment=algo_<p>``, ``task.problem=<p>``; mqar's prompts hold 4 pairs and
    4 queries: 16 tokens), else 1..4."""
    named = [
        v.removeprefix("algo_").removesuffix("_gpu")
        for a in args
        if _key(a) in ("experiment", "task.problem")
        for v in a.partition("=")[2].split(",")
    ]
    lows = [problem_default(p, "task.train_lengths")[0] for p in named if p in PROBLEMS]
    low = max([1, *lows])
    return f"task.train_lengths=[{low},{max(low, 4)}]"


def _newest(paths: list[Path], what: str, c: Command) -> Path:
    if not paths:
        pytest.fail(f"{c}: {what}: no earlier command of {c.doc} produced one")
    return max(paths, key=lambda p: p.stat().st_mtime)


def _setting(words: list[str], key: str, default: str) -> str:
    return next((w.split("=", 1)[1] for w in words if w.startswith(f"{key}=")), default)


def _data(words: list[str]) -> set[str]:
    """The data and tokenizer overrides of a command (empty: the task's defaults), less
    the size overrides this test appends (a run records them among its own)."""
    appended = {s for sizes in SIZES.values() for s in sizes}
    return {w for w in words if w.startswith(("data=", "data.", "tokenizer")) and w not in appended}


def _data_of(run: Path) -> set[str]:
    """:func:`_data` of the run in ``run`` (its recorded overrides)."""
    record = run / ".hydra" / "overrides.yaml"
    lines = record.read_text().splitlines() if record.is_file() else []
    return _data([line.removeprefix("- ").strip().strip("'\"") for line in lines])


def _named_sweep(folder: Path, name: str, c: Command) -> Path:
    """``<tuned dir>``: the newest sweep run with ``+tuned``; ``<lr_tune dir>``: the
    newest sweep of that preset run without it."""
    sweeps = [d for d in (folder / "outputs" / "multirun").glob("*") if d.is_dir()]
    tuned = {d for d in sweeps if "+tuned=" in (d / "multirun.yaml").read_text()}
    if name == "tuned":
        return _newest(sorted(tuned), "a sweep with +tuned", c)
    return _newest(
        [d for d in sweeps if d.name.startswith(f"{name}_") and d not in tuned],
        f"a {name} sweep",
        c,
    )


def resolve(c: Command, folder: Path) -> list[str]:
    """The command's words with its placeholders filled from ``folder``'s outputs."""
    words = list(c.words)
    task, encoder = _setting(words, "task", "lm"), _setting(words, "encoder", "rope")
    out = []
    for w in words:
        w = w.replace("<preset>", PRESET)
        if re.search(r"<(date|dir)>", w):
            sweep = _newest(
                list((folder / "outputs" / "multirun").glob("*")), "a sweep directory", c
            )
            w = re.sub(r"(outputs/multirun/)?<(date|dir)>", str(sweep), w)
        named = re.search(r"<(\w+)_dir>", w)  # <lr_tune dir>: the newest of that preset
        if named:
            sweep = _named_sweep(folder, named.group(1), c)
            w = re.sub(r"(outputs/multirun/)?<\w+_dir>", str(sweep), w)
        if "<run>" in w or "<best.ckpt>" in w:
            _, eq, path = w.rpartition("=")
            if "<run>" in path and "/" in path.split("<run>")[0]:
                pattern = path.replace("<run>", "*")  # outputs/lm/rope/<run>/...
            else:
                pattern = f"outputs/{task}/{encoder}/*/checkpoints/best.ckpt"
            same = [p for p in folder.glob(pattern) if _data_of(p.parent.parent) == _data(words)]
            # the page's first such run: where a page writes <run>, it means its main job
            ckpt = min(
                same or [_newest(same, f"a run for {pattern} on the same data", c)],
                key=lambda p: p.stat().st_mtime,
            )
            w = w[: len(w) - len(path)] + str(ckpt) if eq else str(ckpt)
        left = re.search(r"<[^<>=]+>", w)
        if left:
            pytest.fail(
                f"{c}: {left.group()} is a placeholder no rule fills; print a "
                f"command that runs as it stands"
            )
        out.append(w)
    return out


def own_files(words: list[str], folder: Path) -> None:
    """The user's own text files a command names (``a.txt``): written from the data."""
    text = (Path(os.environ["POSENC_DATA_DIR"]) / "tinyshakespeare" / "input.txt").read_text()
    for w in words:
        path = w.partition("=")[2]
        if w.startswith("data.source.") and path.endswith(".txt") and not (folder / path).exists():
            (folder / path).write_text(text[:20000])


def check_result(
    c: Command,
    words: list[str],
    folder: Path,
    before: set[Path],
    proc: subprocess.CompletedProcess[str],
) -> None:
    """Exit 0 and a result: metrics.json for a run, for every job of a sweep, a report,
    generated text, help."""
    said = f"{c}\n-- as run: {shlex.join(words)}\n-- stderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, said
    if words[:3] == ["python", "-m", "posenc.report"]:
        target = Path(words[3])
        out = Path(words[words.index("--out") + 1]) if "--out" in words else target / "report"
        out = out if out.is_absolute() else folder / out
        assert (out / "report.md").is_file(), said
    elif words[:3] == ["python", "-m", "posenc.generate"]:
        prompt = words[words.index("--prompt") + 1] if "--prompt" in words else ""
        assert proc.stdout.startswith(prompt) and len(proc.stdout) > len(prompt) + 1, said
    elif "--help" in words:
        assert "posenc" in proc.stdout, said
    elif "--cfg" in words:  # the composed config, printed
        assert "task:" in proc.stdout, said
    else:
        new = set(folder.rglob("metrics.json")) - before
        assert new, f"no new metrics.json: {said}"
        if "-m" in words[:3]:  # every job of the sweep: its newest directory
            sweep = max(
                (folder / "outputs" / "multirun").iterdir(), key=lambda p: p.stat().st_mtime
            )
            errors = list(sweep.glob("*/error.json"))
            assert not errors, f"{errors[0].read_text()[:2000]}\n{said}"


def _all() -> list[Command]:
    return [c for doc in DOCS for c in extract(doc)]


COMMANDS = _all()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One empty folder per document, and one tokenizer cache for all (a cache is keyed
    by data and settings, so sharing it changes no result)."""
    os.environ.setdefault("POSENC_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    return {doc: tmp_path_factory.mktemp(Path(doc).stem) for doc in DOCS}


def test_the_documents_print_commands_and_the_fast_ones_exist() -> None:
    """The extraction finds the README's first command, continuation lines and wrapped
    inline spans, and every entry of FAST names a printed command."""
    texts = {(c.doc, c.text) for c in COMMANDS}
    assert ("README.md", "python run.py encoder=rope task=lm") in texts
    assert any(
        c.words[:3] == ("python", "-m", "posenc.generate") and "--seed" in c.words for c in COMMANDS
    )  # a code-block command over two lines
    assert any(
        c.doc == "README.md"
        and "hydra/launcher=local_parallel" in c.words
        and "sweep=lm_extrapolation" in c.words
        for c in COMMANDS
    )  # a wrapped span
    for doc, start in FAST:
        assert any(c.doc == doc and c.text.startswith(start) for c in COMMANDS), (doc, start)


@pytest.mark.parametrize("c", COMMANDS, ids=lambda c: f"{c.doc}:{c.line}")
def test_documented_command(
    c: Command, folders: dict[str, Path], request: pytest.FixtureRequest
) -> None:
    reason = skip_reason(c)
    if reason:
        pytest.skip(f"{c.text}: {reason}")
    fast = any(c.doc == doc and c.text.startswith(start) for doc, start in FAST)
    if not fast and not request.config.getoption("--all-documented-commands"):
        pytest.skip("not in the CI subset; run with --all-documented-commands")
    folder = folders[c.doc]
    for kind in task_kinds(c):
        words = sized(c, kind, resolve(c, folder))
        own_files(words, folder)
        before = set(folder.rglob("metrics.json"))
        # run.py from the checkout (the folder is empty); python -m posenc.* as printed
        argv = (
            [sys.executable, str(ROOT / "run.py"), *words[2:]]
            if words[1] == "run.py"
            else [sys.executable, *words[1:]]
        )
        proc = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=3600)
        check_result(c, words, folder, before, proc)
