"""``python -m atom.launch ...``: options and env contract in :mod:`atom.launch.launcher`."""

import sys

from atom.launch.launcher import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m atom.launch"))
