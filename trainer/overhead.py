"""`python -m trainer.overhead`: what the engine costs against a plain loop (see `trainer.tools.overhead`)."""

from trainer.tools.overhead import main

if __name__ == "__main__":
    main()
