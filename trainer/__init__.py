"""feedbench: measure how a PyTorch training loop feeds batches from host memory to the GPU."""


def _check_datasets_package() -> None:
    # Hugging Face's `datasets` distribution owns the same top-level name as our `datasets/`.
    # Importing the wrong one would fail far from here with a confusing error; fail now instead.
    from pathlib import Path
    import importlib.util

    ours = Path(__file__).resolve().parent.parent / "datasets"
    spec = importlib.util.find_spec("datasets")
    origin = Path(spec.origin).resolve().parent if spec and spec.origin else None
    if origin != ours:
        raise ImportError(
            f"'import datasets' resolves to {origin} instead of feedbench's {ours} "
            "(Hugging Face's `datasets` is installed in this environment): run from the project root, "
            "or install feedbench in its own virtual environment"
        )


_check_datasets_package()


def feedbench_config(overrides=()):
    """The config `python -m trainer <overrides>` runs, composed and checked, as typed sections (`cfg.loader.depth`)."""
    from hydra import compose, initialize_config_dir

    import trainer.components  # noqa: F401  (registers every dataset, loader and model option)
    from trainer.config import CONF_DIR
    from trainer.validate import validate

    overrides = [overrides] if isinstance(overrides, str) else list(overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return validate(cfg)


def __getattr__(name: str):
    # `from trainer import lightning_prefetch`: imported on first use, as Lightning is an optional extra.
    if name in ("lightning_prefetch", "FeedbenchDataModule", "DevicePrefetcher"):
        from trainer import lightning

        return getattr(lightning, name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
