"""The numba-cuda path of the formula cases (tests/loads/formula_cases.py), in Numba's CUDA simulator.

``NUMBA_ENABLE_CUDASIM=1 python tests/loads/cudasim/formula_proc.py`` prints one JSON list: each
case's result, as ``formula_cases.run_cpu`` gives the CPU's. The device functions are those the
publish kernel calls (``dpboard.loads.cuda.formula_devices``), launched here on one thread.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

if __name__ == "__main__":  # run as a script: the repository root on the path, for tests.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.loads.formula_cases import CASES, NUM_FIGURES, Case, encode  # noqa: E402


def run_numba(cases: list[Case]) -> list[list[int]]:
    from numba import cuda

    from dpboard.loads import cuda as kc
    from dpboard.snapshot import DIRECT_SLOT_WORDS, DIRECT_STATUS_WORDS, NUM_RAW

    assert kc.simulator_enabled(), "run with NUMBA_ENABLE_CUDASIM=1"
    dev = kc.formula_devices()
    load_figures, has_errors, publish_raw = dev["load_figures"], dev["has_errors"], dev["publish_raw"]

    @cuda.jit
    def kernel(raw, num_pages, page_size, host, out, slot, status):
        a, b, c, d, e, f = load_figures(raw, num_pages, page_size)
        out[0], out[1], out[2], out[3], out[4], out[5] = a, b, c, d, e, f
        out[6] = 1 if has_errors(raw) else 0
        publish_raw(raw, num_pages, page_size, slot, status, host[0], host[1], host[2], host[3], host[4], host[5],
                    host[6])

    results = []
    for case in cases:
        words = encode(case)
        raw = np.array(words[:NUM_RAW], np.int64)
        slot = np.array(words[NUM_RAW + 2 : NUM_RAW + 2 + DIRECT_SLOT_WORDS], np.int64)
        status = np.array(words[NUM_RAW + 2 + DIRECT_SLOT_WORDS : -len(case.host)], np.int64)
        assert status.size == DIRECT_STATUS_WORDS
        out = np.zeros(NUM_FIGURES + 1, np.int64)
        kernel[1, 1](raw, np.int64(case.num_pages), np.int64(case.page_size), np.array(case.host, np.int64), out,
                     slot, status)
        results.append([*out.tolist(), *slot.tolist(), *status.tolist()])
    return results


if __name__ == "__main__":
    print(json.dumps(run_numba(CASES)))
