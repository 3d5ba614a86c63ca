"""Thin wrapper: ``python experiments/run.py [hydra overrides]`` == ``python -m specdec.run``."""

from specdec.run import main

if __name__ == "__main__":
    main()
