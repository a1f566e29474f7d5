"""Entry point: ``python -m calib <command> ...`` (see :mod:`calib.cli`)."""

from calib.cli import main

if __name__ == "__main__":
    main()
