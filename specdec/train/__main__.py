"""``python -m specdec.train``: see :mod:`specdec.train.app`."""

from specdec.train.app import main

if __name__ == "__main__":
    main()
