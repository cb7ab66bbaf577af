"""`python -m attnlab ...` (and `torchrun ... -m attnlab train ...`) run the `attnlab` command."""

import sys

from attnlab.cli.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
