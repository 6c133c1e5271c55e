"""``--data-parallel-backend ray``: the engine actors get the DPBOARD_ settings.

vLLM gives a Ray engine actor only the variables its ``get_env_vars_to_copy`` names
(vllm/ray/ray_env.py); ``CoreEngineActorManager`` (v1/engine/utils.py:533) calls it in the API server,
after the plugins ran. Ray itself is not installed here: the test asks vLLM's own function, with the
arguments ``CoreEngineActorManager`` passes, in an API-server process of its own (the plugin's
``register()`` sets a process-wide variable) before and after vLLM's loader runs dpboard's plugin
(then, for two more environments, before and after ``register()`` again).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dpboard.integrations.vllm.settings import ENV_RAY_PREFIXES, carry_to_ray
from tests.support.names import ROOT

PROBE = """
import json, os, sys
from tests.support import vllm as sv
sv.install()
from vllm.ray.ray_env import get_env_vars_to_copy
from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS
import vllm.plugins
from dpboard.integrations.vllm import plugin
from dpboard.integrations.vllm.settings import ENV_RAY_PREFIXES

def copied():
    names = get_env_vars_to_copy(destination="EngineCoreActor", exclude_vars=WORKER_SPECIFIC_ENV_VARS)
    return sorted(n for n in names if n in os.environ and not n.startswith("VLLM_"))

base = dict(os.environ)
for i, extra in enumerate(json.loads(sys.argv[1])):
    os.environ.clear()
    os.environ.update(base, **extra)
    before = copied()
    if i == 0:
        vllm.plugins.load_general_plugins()  # vLLM's loader runs register(), once per process
    else:
        plugin.register()  # what that loader calls, in the next scenario's environment
    print(json.dumps({"before": before, "after": copied(), "prefixes": os.environ.get(ENV_RAY_PREFIXES)}))
"""

SETTINGS = {"DPBOARD_VLLM_BOARD": "llama", "DPBOARD_METHOD": "inflight_requests", "DPBOARD_VLLM_NODE_ID": "0",
            "DPBOARD_STALE_AFTER": "2"}
SCENARIOS = [SETTINGS, {"DPBOARD_VLLM_BOARD": "llama", ENV_RAY_PREFIXES: "MYLIB_", "MYLIB_LEVEL": "3"}, {}]


@pytest.fixture(scope="module")
def seen() -> list[dict]:
    """vLLM's answer in one API-server process, for each environment of SCENARIOS."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPBOARD_") and k != ENV_RAY_PREFIXES}
    env["VLLM_PLUGINS"] = "dpboard"
    result = subprocess.run([sys.executable, "-c", PROBE, json.dumps(SCENARIOS)], capture_output=True, text=True,
                            timeout=120, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(SCENARIOS), result.stdout[-3000:]
    return lines


def test_the_board_settings_reach_ray_engine_actors(seen):
    first = seen[0]
    assert [n for n in first["before"] if n.startswith("DPBOARD_")] == []  # vLLM alone: the actors got none
    assert [n for n in first["after"] if n.startswith("DPBOARD_")] == sorted(SETTINGS)
    assert first["prefixes"] == "DPBOARD_"


def test_a_users_own_ray_prefixes_are_kept(seen):
    assert seen[1]["before"] == ["MYLIB_LEVEL"]
    assert seen[1]["after"] == ["DPBOARD_VLLM_BOARD", "MYLIB_LEVEL"]
    assert seen[1]["prefixes"] == "MYLIB_,DPBOARD_"


def test_without_dpboard_settings_vllms_ray_environment_is_untouched(seen):
    assert seen[2]["before"] == seen[2]["after"] and seen[2]["prefixes"] is None


def test_carry_to_ray_adds_the_prefix_once():
    env = {"DPBOARD_VLLM": "1", ENV_RAY_PREFIXES: " A_ , DPBOARD_ "}
    carry_to_ray(env)
    assert env[ENV_RAY_PREFIXES] == " A_ , DPBOARD_ "  # already listed: left as the user wrote it
    env = {"DPBOARD_VLLM": "1", ENV_RAY_PREFIXES: "A_,"}
    carry_to_ray(env)
    carry_to_ray(env)
    assert env[ENV_RAY_PREFIXES] == "A_,DPBOARD_"
