"""`python -m trainer.versus`: two configurations against each other, in turns (see `trainer.tools.versus`)."""

from trainer.tools.versus import main

if __name__ == "__main__":
    main()
