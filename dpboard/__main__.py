"""``python -m dpboard``: the same command line as ``dpboard``."""

import sys

from dpboard.cli import main

sys.exit(main())
