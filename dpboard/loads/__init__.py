"""Tables to counters: a rank's load figures from its request table and KV page table (docs/KERNELS.md).

``compute_loads`` (compute.py) checks the tables (tables.py), runs a backend (reference.py: NumPy;
cpu.py: Numba; cuda.py: Numba CUDA and CuPy, whose CUDA C is ``kernels/loads.cu``) to the raw
counters, and turns those into a ``KVLoads`` (counters.py). Only NumPy is imported until a Numba or
CUDA backend runs.
"""

from dpboard.loads.compute import BACKENDS, CUDA_BACKENDS, compute_loads
from dpboard.loads.counters import KVLoads
from dpboard.snapshot import PageState, ReqState

__all__ = ["BACKENDS", "CUDA_BACKENDS", "KVLoads", "PageState", "ReqState", "compute_loads"]
