"""`python -m trainer [overrides]`: the Hydra entry point; the work is in `trainer.run.run`."""

import hydra

import trainer.config  # noqa: F401  (registers the config schemas)
from trainer.run import run


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
