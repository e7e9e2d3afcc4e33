"""The run record (posenc.results): round trips, files from before the version field, a
version this posenc does not read, metric names as fields, and no reader outside the
module that reads a record's keys or metric names by string."""

from __future__ import annotations

import ast
import json
import math
from dataclasses import fields, replace
from pathlib import Path

import pytest

from posenc.errors import RecordError, UserError
from posenc.report import build_report
from posenc.results import (
    VERSION,
    AlgoRecord,
    Gate,
    LMRecord,
    MetricName,
    MTRecord,
    Passkey,
    Record,
    from_json,
    read,
    to_json,
    write,
)
from tests.conftest import ROOT

LEGACY = Path(__file__).parent / "fixtures" / "metrics_legacy_lm.json"
COMMON = {
    "encoder": "rope",
    "encoder_class": "RoPE",
    "seed": 3,
    "gate": Gate(MetricName("val/loss"), 2.5, True),
    "learned": False,
    "learned_step": 40,
    "n_params": 1234,
    "train_steps": 50,
    "train_time_s": 1.25,
    "tokens_per_s": 99.5,
    "peak_memory_mb": 12.5,
    "peak_memory_kind": "process_peak_rss",
    "config": {"seed": 3, "task": {"optim": {"lr": 0.003}}},
}


def records() -> list[Record]:
    """One record of each task with every field set (NaN and inf among the metrics)."""
    ppl = MetricName.of("test", "ppl", 64, "yarn")
    return [
        LMRecord(
            **COMMON,
            seq_len=16,
            eval_lengths=[16, 64],
            protocols={"nonoverlap": "ppl@L"},
            context_extension={"yarn": "YaRN"},
            extension_settings={ppl: {"method": "yarn", "s": 4.0, "L": 16}},
            metrics={MetricName("test/ppl@16"): 5.5, ppl: math.inf, MetricName("val/loss"): 1.7},
            scored_tokens={ppl: 640},
            skipped={MetricName("test/ppl@64"): "max_len"},
            loss_by_position={ppl: [1.0, 2.0]},
            passkey=Passkey(
                doc="doc",
                key_len=5,
                samples=4,
                seed=0,
                lengths=[16],
                depths=[0.0, 1.0],
                accuracy={"test": [[1.0, 0.5]]},
            ),
        ),
        MTRecord(
            **COMMON,
            decode_time_s=3.5,
            tokens_per_s_kind="target tokens",
            data="multi30k",
            n_sentences=8,
            metrics={MetricName("test/bleu"): 20.0, MetricName("test/bleu@len10+"): math.nan},
            buckets={"len0-10": 5, "len10+": 3},
            bucket_doc="lenA-B",
            bleu_signature="nrefs:1",
            decode={"beam_size": 4},
            max_train_src_len=9,
            data_stats={"train": {"pairs": 10}},
        ),
        AlgoRecord(
            **COMMON,
            problem="copy",
            shape="encdec",
            train_lengths=[1, 4],
            size_means="input length",
            source="paper",
            test_sizes="every",
            buckets=["len1-4", "len5-8"],
            metric_doc={"seq_acc": "exact"},
            table_metrics=["seq_acc", "acc"],
            metrics={MetricName("test/seq_acc@len5-8"): 12.5},
            by_size={6: {"count": 2, "seq_acc": 50.0, "acc": 75.0}},
            by_size_variants={"sparse": {6: {"count": 1, "seq_acc": 0.0, "acc": 10.0}}},
            variant_pairs={"": 4, "sparse": 8},
        ),
    ]


@pytest.mark.parametrize("record", records(), ids=lambda r: r.task)
def test_a_record_written_reads_back_equal(record: Record, tmp_path: Path) -> None:
    path = tmp_path / "metrics.json"
    write(path, record)
    back = read(path)
    assert type(back) is type(record)
    # NaN never equals itself: the metrics compare by their text, the rest as they are.
    assert repr(back.metrics) == repr(record.metrics)
    assert replace(back, metrics={}) == replace(record, metrics={})
    saved = json.loads(path.read_text())
    assert saved["version"] == VERSION == 1
    assert all(isinstance(k, MetricName) for k in back.metrics)
    assert not back.extra  # every key of the file is a field


def test_every_field_is_written() -> None:
    """A record's file has a key for each field (gate_recorded and extra are not keys)."""
    for record in records():
        keys = set(to_json(record)) - {"version"}
        expected = {f.name for f in fields(record)} - {"gate_recorded", "extra"}
        # a task's optional timing and throughput kind: only when it has them
        expected -= {
            k for k in ("decode_time_s", "tokens_per_s_kind") if getattr(record, k) is None
        }
        assert keys == expected, type(record).__name__


def test_a_metrics_json_without_a_version_loads_as_version_1() -> None:
    """A real LM run's file from before the version field (its lists trimmed): every key
    is read into a field, and writing it back gives the same keys, values and order."""
    data = json.loads(LEGACY.read_text())
    assert "version" not in data
    record = read(LEGACY)
    assert isinstance(record, LMRecord)
    assert (record.encoder, record.seq_len, record.n_params, record.train_steps) == (
        "fox",
        128,
        804240,
        2000,
    )
    ppl = MetricName.of("test", "ppl", 128)
    assert record.metrics[ppl] == pytest.approx(4.840609962880093)
    assert record.scored_tokens[ppl] == 32768 and len(record.loss_by_position[ppl]) == 8
    assert (record.gate, record.learned, record.gate_recorded) == (None, None, True)
    assert record.lr == 0.001 and record.training_limit == 128
    assert not record.extra
    again = to_json(record)
    assert again.pop("version") == VERSION
    assert list(again.items()) == list(data.items())


def test_an_algo_file_from_before_variant_pairs_loads_without_them() -> None:
    """An mqar run's file written before the pairs of its test variants were recorded
    reads as version 1 with none (the report then draws no heat map), and writes back
    with the key added, every other value as it was."""
    data = to_json(records()[-1])
    del data["variant_pairs"], data["version"]
    record = from_json(json.loads(json.dumps(data)))
    assert isinstance(record, AlgoRecord)
    assert record.variant_pairs == {} and not record.extra
    assert record.by_size_variants == records()[-1].by_size_variants
    again = to_json(record)
    assert again.pop("variant_pairs") == {}
    assert again.pop("version") == VERSION
    assert again == data


def test_variant_metric_names_a_variants_bucket() -> None:
    algo = AlgoRecord()
    assert algo.variant_metric("acc", "pairs_x2", "len16-31") == "test/acc_pairs_x2@len16-31"
    assert algo.variant_metric("acc", "", "len16-31") == "test/acc@len16-31"


def test_a_file_from_before_the_gate_keeps_its_standing_unknown() -> None:
    """No gate keys: gate_recorded is False, and none are written back in."""
    data = json.loads(LEGACY.read_text())
    for key in ("gate", "learned", "learned_step"):
        del data[key]
    record = from_json(data)
    assert record.gate_recorded is False
    assert not {"gate", "learned", "learned_step"} & set(to_json(record))


@pytest.mark.parametrize("version", [2, 0, "1", None])
def test_a_version_this_posenc_does_not_read_is_refused_in_one_line(
    version: object, tmp_path: Path
) -> None:
    data = json.loads(LEGACY.read_text()) | {"version": version}
    path = tmp_path / "run" / "metrics.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    with pytest.raises(RecordError) as err:
        read(path)
    message = str(err.value)
    assert isinstance(err.value, UserError) and "\n" not in message
    assert str(path) in message and f"version {version!r}" in message
    assert f"reads version {VERSION}" in message
    # The report lists the run as unreadable with that line, and goes on.
    report = build_report(tmp_path, tensorboard=False)
    assert not report.runs
    assert [(f.status, f.error) for f in report.failures] == [
        ("unreadable", f"metrics.json: {message}")
    ]


def test_an_unknown_task_loads_as_a_plain_record() -> None:
    record = from_json({"task": "vision", "metrics": {"test/acc": 1.0}, "seed": 1, "new": 2})
    assert type(record) is Record and record.task == "vision" and record.extra == {"new": 2}
    assert to_json(record)["new"] == 2


def test_a_metric_that_is_not_a_number_is_refused() -> None:
    with pytest.raises(RecordError, match=r"metric 'test/ppl@16' is 'x', not a number"):
        from_json({"task": "lm", "metrics": {"test/ppl@16": "x"}})


def test_metric_names_have_their_parts_as_fields() -> None:
    name = MetricName("test/ppl_sw+yarn@512")
    assert (name.split_name, name.kind, name.extension, name.where) == (
        "test",
        "ppl_sw",
        "yarn",
        "512",
    )
    assert (name.length, name.start, name.plain) == (512, 512, "test/ppl_sw@512")
    assert MetricName.of("test", "ppl_sw", 512, "yarn") == name
    bucket = MetricName.of("test", "bleu", "len10-20")
    assert (bucket, bucket.length, bucket.start) == ("test/bleu@len10-20", None, 10)
    loss = MetricName("val/loss")
    assert (loss.split_name, loss.kind, loss.where, loss.length, loss.start) == (
        "val",
        "loss",
        "",
        None,
        None,
    )
    assert json.dumps({name: 1.0}) == '{"test/ppl_sw+yarn@512": 1.0}'  # the file's text
    order = ["val/loss", "test/ppl+yarn@128", "test/ppl@1024", "test/ppl@128", "test/bleu"]
    assert sorted(map(MetricName, order), key=MetricName.sort_key) == [
        "test/bleu",  # bleu and ppl share a rank: then by kind name
        "test/ppl@128",
        "test/ppl@1024",
        "test/ppl+yarn@128",
        "val/loss",
    ]


def test_beyond_training_is_each_tasks_own_limit() -> None:
    lm, mt, algo = records()
    assert lm.beyond_training(MetricName("test/ppl@64")) and not lm.beyond_training(
        MetricName("test/ppl@16")
    )
    assert mt.beyond_training(MetricName("test/bleu@len10+"))
    assert not mt.beyond_training(MetricName("test/bleu@len0-10"))
    assert algo.beyond_training(MetricName("test/seq_acc@len5-8"))
    assert not Record().beyond_training(MetricName("test/acc@len9-9"))


# ----------------------------------------------------------------------------- no string reads
#: The code that reads what a run recorded: whole modules, or only the named functions of
#: a module whose other functions read configs and error records (keys that share names).
READERS: dict[str, set[str] | None] = {
    "posenc/report/__init__.py": None,
    "posenc/report/tune.py": None,
    "posenc/report/stats.py": None,
    "posenc/report/effective.py": None,
    "posenc/report/suite.py": None,
    "posenc/runs.py": None,
    "posenc/plots.py": None,
    "posenc/training/summary.py": None,
    "posenc/training/job.py": None,
    "posenc/training/gate.py": {"describe"},
    "posenc/tasks/lm_job.py": {"_tensorboard"},
    "posenc/tasks/mt_job.py": {"_tensorboard"},
    "posenc/tasks/algo_job.py": {"_tensorboard"},
    "posenc/tasks/lm_passkey.py": {"tensorboard"},
}
#: Functions of reader modules that read other files (error.json, .hydra/ configs).
NOT_RECORDS = {"_failed", "_hydra_record", "failure_point", "_config_from_overrides"}
#: Every key of a record's file, and of its nested gate and passkey entries.
KEYS = {
    f.name for cls in (Record, LMRecord, MTRecord, AlgoRecord, Gate, Passkey) for f in fields(cls)
} - {"gate_recorded", "extra"}


def _metric_text(node: ast.expr) -> bool:
    """A literal metric name: ``"val/loss"``, ``f"test/{k}@{b}"``, ``f"{split}/bleu"``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.startswith(("val/", "test/"))
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value.startswith(("val/", "test/"))
        second = node.values[1] if len(node.values) > 1 else None
        return isinstance(second, ast.Constant) and str(second.value).startswith("/")
    return False


def _key_text(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value in KEYS


def string_reads(tree: ast.AST) -> list[int]:
    """Lines where a record's key or a metric name is read by its text: ``x["seq_len"]``,
    ``x.get("metrics")``, ``"learned" in x``, ``m[f"{split}/bleu"]``, ``name.startswith
    ("test/")``; writes (``x["k"] = v``) do not count."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if _key_text(node.slice) or _metric_text(node.slice):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            read = node.func.attr in ("get", "pop", "setdefault") and _key_text(node.args[0])
            if node.func.attr in ("get", "pop", "setdefault", "startswith", "endswith"):
                read = read or _metric_text(node.args[0])
            if read:
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.Compare)
            and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops)
            and (_key_text(node.left) or _metric_text(node.left))
        ):
            lines.append(node.lineno)
    return lines


def reads_outside_the_record(root: Path) -> list[str]:
    """``path:line`` of every string read in the reader code below ``root``."""
    found = []
    for rel, only in READERS.items():
        path = root / rel
        if not path.exists():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or node.name in NOT_RECORDS:
                continue
            if only is not None and node.name not in only:
                continue
            found += [f"{rel}:{line}" for line in string_reads(node)]
        if only is None:  # module-level code too (constants read at import)
            top = ast.Module(
                body=[s for s in ast.parse(path.read_text()).body if not _is_def(s)],
                type_ignores=[],
            )
            found += [f"{rel}:{line}" for line in string_reads(top)]
    return sorted(set(found))


def _is_def(node: ast.stmt) -> bool:
    return isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef)


def test_no_reader_reads_a_records_keys_or_metric_names_by_string() -> None:
    """The report, its figures, the run summary, the gate's line and the jobs' TensorBoard
    entries read a record's fields; only posenc/results.py knows the file's keys."""
    assert reads_outside_the_record(ROOT) == []


def test_the_scan_finds_string_reads() -> None:
    """The scan is not blind: each kind of string read it must catch, it catches."""
    code = """
def f(r, m, split, name):
    a = r.data["seq_len"]
    b = r.data.get("metrics", {})
    c = "learned" in r.data
    d = m[f"{split}/bleu"]
    e = name.startswith("test/")
    m["test/ppl@16"] = 1.0  # a write: not a read
"""
    assert string_reads(ast.parse(code)) == [3, 4, 5, 6, 7]
