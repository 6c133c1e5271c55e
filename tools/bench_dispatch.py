"""Dispatch benchmark (same as `dpboard bench dispatch`)."""

import sys

from dpboard.bench.dispatch import main

if __name__ == "__main__":
    sys.exit(main())
