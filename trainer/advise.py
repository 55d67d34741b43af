"""`python -m trainer.advise [--verify] [--steps N] [overrides...]`: what bounds this run and what to
change, measured (see `trainer.tools.advisor`)."""

from trainer.tools.advisor import main

if __name__ == "__main__":
    raise SystemExit(main())
