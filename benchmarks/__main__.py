"""`python -m benchmarks ...` from a checkout (`benchmarks.command`)."""

import sys

from benchmarks import command

if __name__ == "__main__":
    sys.exit(command.main())
