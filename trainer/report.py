"""`python -m trainer.report`: print a sweep's comparison again (see `trainer.tracking.report`)."""

from trainer.tracking.report import main

if __name__ == "__main__":
    raise SystemExit(main())
