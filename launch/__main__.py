"""``python -m atom.launch ...``: see :mod:`atom.launch.launcher` for the options and env contract."""

import sys

from atom.launch.launcher import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m atom.launch"))
