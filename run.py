"""posenc entry point: ``python run.py encoder=rope task=lm`` (see README.md)."""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from posenc.cli import misspelled_keys, register_resolvers, run_job
from posenc.preflight import missing_launcher, resume_without_folder, unknown_options
from posenc.tuned import check_argument

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_job(cfg)


if __name__ == "__main__":
    conf = Path(__file__).parent / "conf"
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    # Each one line: an unknown group option, a launcher not installed, resume=true
    # without the folder to resume.
    problems = unknown_options(args, conf) + missing_launcher(args)
    problems = problems or resume_without_folder(sys.argv[1:], conf)
    if problems:
        print("\n".join(f"error: {p}" for p in problems), file=sys.stderr)
        sys.exit(2)
    typos = misspelled_keys(args, conf)
    if typos:
        head = typos if len(typos) == 1 else ["keys the config cannot take:", *typos]
        print("error: " + "\n  ".join(head), file=sys.stderr)
        sys.exit(2)
    # +tuned=<report dir>: a missing or malformed file fails once, before a sweep starts.
    problem = check_argument(sys.argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()
