"""posenc entry point: ``python run.py encoder=rope task=lm`` (see README.md)."""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from posenc.preflight import (
    missing_launcher,
    misspelled_keys,
    register_resolvers,
    resume_without_folder,
    unknown_options,
)
from posenc.tuned import check_argument


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from posenc.cli import run_job

    register_resolvers()  # a sweep's worker process runs this function, not the lines below
    run_job(cfg)


if __name__ == "__main__":
    conf = Path(__file__).parent / "conf"
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    # Each one line, before torch and Lightning are imported (a second, not ten): an
    # unknown group option, a launcher not installed, resume=true without its folder, a
    # key the config does not have, a +tuned file that is missing or malformed.
    register_resolvers()  # the schema the composed config is checked against
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
