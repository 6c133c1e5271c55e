"""Board benchmark (same as `dpboard bench board`)."""

import sys

from dpboard.bench.board import main

if __name__ == "__main__":
    sys.exit(main())
