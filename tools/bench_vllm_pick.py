"""The vLLM rows of `dpboard bench dispatch` (vLLM's pick beside the plugin's), where vLLM's wheel is
installed without torch, as in this repository's test environment: vLLM's modules load behind the
test suite's torch stand-ins (tests/support/vllm.py), which the pick never calls into.

Run from the repository root: `python tools/bench_vllm_pick.py [--quick]`. Where vLLM runs with its
own torch, `dpboard bench dispatch` prints the same table itself.
"""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpboard.bench.dispatch import VLLM_ENGINES, vllm_pick_table  # noqa: E402
from dpboard.bench.stats import machine_line  # noqa: E402
from tests.support import vllm as vllm_stand_ins  # noqa: E402

if __name__ == "__main__":
    vllm_stand_ins.install()
    quick = "--quick" in sys.argv[1:]
    print(f"## vLLM's pick ({machine_line()}{', quick' if quick else ''})\n")
    print(vllm_pick_table(VLLM_ENGINES, 20 if quick else 200, random.Random(1)))
