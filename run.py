"""posenc entry point: ``python run.py encoder=rope task=lm`` (see README.md)."""

import hydra
from omegaconf import DictConfig

from posenc.cli import register_resolvers, run_job

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_job(cfg)


if __name__ == "__main__":
    main()
