"""The files here run only under Numba's CUDA simulator, in their own process (tests/test_kernels.py
starts it with NUMBA_ENABLE_CUDASIM=1, which must be set before numba is imported)."""

import os

collect_ignore_glob = [] if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else ["*.py"]
