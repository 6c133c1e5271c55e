"""compute_loads per call for every backend beside the NumPy reference (``dpboard bench kernels``)."""

import sys

from dpboard.bench.kernels import main

if __name__ == "__main__":
    sys.exit(main())
