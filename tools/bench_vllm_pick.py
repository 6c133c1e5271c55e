"""The vLLM rows of `dpboard bench dispatch` alone (vLLM's pick beside the plugin's).

Run from the repository root: `python tools/bench_vllm_pick.py [--quick]`, with vLLM's wheel on the
path (`PYTHONPATH=.venv/engines` where it is installed as the tests install it). Where vLLM is
installed without torch its modules load behind the named import stand-ins of
dpboard/bench/vllm_standins.py, the tests' own; `dpboard bench dispatch` prints the same table.
"""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpboard.bench.dispatch import VLLM_ENGINES, vllm_pick_table  # noqa: E402
from dpboard.bench.stats import machine_line  # noqa: E402

if __name__ == "__main__":
    quick = "--quick" in sys.argv[1:]
    print(f"## vLLM's pick ({machine_line()}{', quick' if quick else ''})\n")
    print(vllm_pick_table(VLLM_ENGINES, 20 if quick else 200, random.Random(1)))
