"""``train(cfg)`` finds the task's job in a table of typed entries, built by imports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from posenc import schema, train
from posenc.tasks import algo_job, lm_job, mt_job
from tests.conftest import compose_config, compose_run


def test_every_task_has_one_job_reading_its_typed_group() -> None:
    assert set(train.JOBS) == set(schema.TASKS)
    for name, job in train.JOBS.items():
        assert job.name == name and job.task is schema.TASKS[name]
    runs = {name: job.run for name, job in train.JOBS.items()}
    assert runs == {"lm": lm_job.run, "mt": mt_job.run, "algo": algo_job.run}


@pytest.mark.parametrize("task", ["lm", "mt", "algo"])
def test_train_runs_the_entry_of_the_task_with_its_typed_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, task: str
) -> None:
    seen: list[tuple[Any, Path]] = []

    def fake(cfg: schema.Run[Any], run_dir: Path) -> dict[str, Any]:
        seen.append((cfg, run_dir))
        return {"ran": task}

    entry = train.JOBS[task]
    monkeypatch.setitem(train.JOBS, task, train.Job(task, entry.task, fake))
    compose = compose_run if task == "lm" else compose_config  # TINY sizes are the LM's
    assert train.train(compose(tmp_path, f"task={task}")) == {"ran": task}
    ((cfg, run_dir),) = seen
    assert isinstance(cfg, schema.Run) and isinstance(cfg.task, entry.task)
    assert run_dir == tmp_path / "run"
