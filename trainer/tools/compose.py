"""The config `python -m trainer <overrides>` would run, for the tools that run it themselves."""

from __future__ import annotations

from typing import Sequence

from hydra import compose, initialize_config_dir

from trainer.config import CONF_DIR


def compose_config(overrides: Sequence[str]):
    """The config `python -m trainer <overrides>` would run; a bad override ends the program
    with Hydra's one-line reason, as `python -m trainer` does."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    import trainer.components  # noqa: F401  (registers every dataset, loader and model option)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose("config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        reason = " ".join(str(e).split())  # Hydra's message spans lines: the key and the fix, on one
        raise SystemExit(f"error: {reason}") from None
