"""`python -m trainer.advise [--verify] [--steps N] [overrides...]`: what bounds this run and what to
change, measured (see `trainer.tools.advisor`)."""

# First, as `python -m trainer` starts: its imports (torch, MLflow, Hydra) note a Ctrl-C that comes
# while they load and end in one line, exit 130, instead of a trace from inside one of them.
import trainer.__main__  # noqa: F401
from trainer.tools.advisor import main

if __name__ == "__main__":
    raise SystemExit(main())
