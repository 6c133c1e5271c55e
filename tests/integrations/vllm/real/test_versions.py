"""The vLLM releases the plugin supports, against the wheel this session runs (0.32.0 or 0.33.0:
tests/integrations/vllm/test_vllm.py runs the session once per wheel): every name the plugin uses is
there and patched; on another release, or with a name missing, vLLM's own loader runs the plugin, which
says so in one line and leaves vLLM's classes as they are."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.engine.core_client import DPLBAsyncMPClient

from dpboard.integrations.vllm import versions
from tests.support.names import ROOT


def test_the_wheel_is_a_supported_release_with_every_name_the_plugin_uses():
    version = versions.vllm_version()
    support = versions.support_for(version)
    assert support is not None, version
    assert versions.missing(EngineCoreProc, support.engine_core, "EngineCoreProc") == []
    assert versions.missing(DPLBAsyncMPClient, support.client, "DPLBAsyncMPClient") == []
    assert EngineCoreProc._dpboard_patched and DPLBAsyncMPClient._dpboard_patched
    # what differs between the two releases, as the wheels have it
    assert hasattr(EngineCoreProc, "_handle_request_validation_error") is (support.release == "0.33")
    assert ("streaming_reqs" in support.client_state) is support.streaming_sessions is (support.release == "0.33")


@pytest.mark.parametrize(("version", "release"), [
    ("0.32.0", "0.32"), ("0.32.7", "0.32"), ("0.32.0+cpu", "0.32"), ("0.33.0", "0.33"), ("0.33.1rc1", "0.33"),
    ("0.31.2", None), ("0.34.0", None), ("1.33.0", None), ("unknown", None), ("", None),
])
def test_a_version_belongs_to_a_supported_release_or_to_none(version, release):
    support = versions.support_for(version)
    assert (support.release if support else None) == release


LOADER = """
import json, logging, sys
from tests.support import vllm as sv
sv.install()
import vllm.version
import vllm.v1.engine.core as core
import vllm.v1.engine.core_client as core_client
spec = json.loads(sys.argv[1])
if spec.get("version"):
    vllm.version.__version__ = spec["version"]
for name in spec.get("delete", ()):
    delattr(core.EngineCoreProc, name)
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("dpboard").addHandler(Keep())
logging.getLogger("dpboard").setLevel(logging.INFO)
import vllm.plugins
vllm.plugins.load_general_plugins()
print(json.dumps({"lines": lines,
                  "core": bool(getattr(core.EngineCoreProc, "_dpboard_patched", False)),
                  "client": bool(getattr(core_client.DPLBAsyncMPClient, "_dpboard_patched", False))}))
"""


def load_plugins(spec: dict, env: dict[str, str]) -> dict:
    """vLLM's own plugin loader in a fresh process (the wheel's classes unpatched until it runs)."""
    import os

    result = subprocess.run([sys.executable, "-c", LOADER, json.dumps(spec)], capture_output=True, text=True,
                            timeout=120, cwd=ROOT,
                            env={**os.environ, "VLLM_PLUGINS": "dpboard", "DPBOARD_METHOD": "inflight_requests",
                                 **env})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_an_unsupported_release_is_said_in_one_line_and_nothing_is_patched(board_name):
    out = load_plugins({"version": "0.34.0"}, {"DPBOARD_VLLM_BOARD": board_name})
    assert (out["core"], out["client"]) == (False, False)
    dpboard_lines = [line for line in out["lines"] if line.startswith("dpboard")]
    assert len(dpboard_lines) == 1, out["lines"]
    assert "vLLM 0.34.0" in dpboard_lines[0] and "steps aside" in dpboard_lines[0]
    assert "0.32.x, 0.33.x" in dpboard_lines[0]


def test_a_missing_name_is_said_in_one_line_and_that_class_stays_vllms(board_name):
    out = load_plugins({"delete": ["_handle_request_preproc_error"]}, {"DPBOARD_VLLM_BOARD": board_name})
    assert out["core"] is False and out["client"] is True
    dpboard_lines = [line for line in out["lines"] if line.startswith("dpboard")]
    assert len(dpboard_lines) == 1, out["lines"]
    assert "lacks EngineCoreProc._handle_request_preproc_error" in dpboard_lines[0]
    assert f"vLLM {versions.vllm_version()}" in dpboard_lines[0]


def test_with_no_dpboard_setting_the_plugin_says_nothing_and_patches_nothing():
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("DPBOARD_")}
    result = subprocess.run([sys.executable, "-c", LOADER, json.dumps({"version": "0.34.0"})], capture_output=True,
                            text=True, timeout=120, cwd=ROOT, env={**env, "VLLM_PLUGINS": "dpboard"})
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"lines": [], "core": False, "client": False}
