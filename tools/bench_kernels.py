"""``dpboard bench kernels`` as a script (tools/gpu_check.sh runs it): the same options and figures."""

import sys

from dpboard.bench.kernels import main
from dpboard.errors import DpboardError

if __name__ == "__main__":
    try:
        sys.exit(main())
    except DpboardError as e:
        print(f"bench_kernels: {e}", file=sys.stderr)
        sys.exit(2)
