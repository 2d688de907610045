"""`python -m pertower COMMAND ...`: the same as the `pertower` console command."""

import sys

from pertower.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
