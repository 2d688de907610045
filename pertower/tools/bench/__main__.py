"""`python -m pertower.tools.bench ...`: the same as `pertower bench ...`."""

import sys

from pertower.tools.bench import command

if __name__ == "__main__":
    sys.exit(command.main())
