"""formula.py's device functions (what the numba-cuda publish kernel runs after its reduction) in
Numba's CUDA simulator, against the CPU on the reference cases (tests/loads/formula_cases.py)."""

from __future__ import annotations

import pytest

from dpboard.loads import cuda as kc
from tests.loads.cudasim.formula_proc import run_numba
from tests.loads.formula_cases import CASES, run_cpu

assert kc.simulator_enabled(), "run with NUMBA_ENABLE_CUDASIM=1"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_device_functions_equal_the_cpu(case):
    assert run_numba([case]) == [run_cpu(case)]
