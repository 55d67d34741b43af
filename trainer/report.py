"""`python -m trainer.report`: print the latest run or sweep again (see `trainer.tracking.report`)."""

from trainer.tracking.report import main

if __name__ == "__main__":
    raise SystemExit(main())
