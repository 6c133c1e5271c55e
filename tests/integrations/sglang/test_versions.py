"""The SGLang releases the plugin knows (dpboard/integrations/sglang/versions.py), on SGLang's real start:
SGLang's plugin loader and HookRegistry from each wheel, in a process of its own
(tests/support/sglang_start.py), as SGLang's main process and a process it spawns run them.

On a release the plugin knows, every hook is registered and the load path is the board's; on one it
does not know, or one that lacks a name the plugin uses, the server's main process says so in one
line and no hook is registered: SGLang's own factories write and read its own file. The version is
SGLang's own file's (``sglang/_version.py``), but where a test claims another release, which only a
stand-in for that one file can do; every other module is the wheel's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dpboard.integrations.sglang import versions
from tests.support.names import ROOT
from tests.support.sglang import SGLANG_PREVIOUS, SGLANG_VERSION, SGLANG_WHEELS, wheel_absent, wheel_env

pytestmark = pytest.mark.timeout(300)

# every target the plugin hooks, a holding DPBOARD_METHOD set and the DP controller's module loaded
CONTROLLER = "sglang.srt.managers.data_parallel_controller"
ALL_HOOKS = {
    *(f"sglang.srt.managers.load_snapshot.create_load_snapshot_{kind}" for kind in ("writer", "reader")),
    "sglang.srt.server_args.PortArgs.init_new",
    *(f"sglang.srt.managers.scheduler.Scheduler.{m}" for m in ("handle_generate_request", "handle_embedding_request")),
    *(f"{CONTROLLER}.DataParallelController.{m}" for m in (
        "__init__", "total_tokens_scheduler", "total_requests_scheduler", "refresh_load_budget",
        "update_active_ranks", "_refresh_active_workers", "send_to_all_workers", "send_control_message")),
    f"{CONTROLLER}.sock_recv",
}
SGLANGS_WRITER = "sglang.srt.managers.load_snapshot.ShmLoadSnapshotWriter"
SGLANGS_READER = "sglang.srt.managers.load_snapshot.ShmLoadSnapshotReader"


def start(version: str, board_name: str, *args: str) -> tuple[dict, list[str]]:
    """SGLang's start on the wheel of ``version`` (tests/support/sglang_start.py): its JSON, and the
    lines of its stderr that the plugin said."""
    missing = wheel_absent(version)
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run these tests: {missing}")
        pytest.skip(missing)
    env = {**os.environ, **wheel_env(version), "DPBOARD_BOARD": board_name}
    for key in ("SGLANG_PLUGINS", "DPBOARD_METHOD", "DPBOARD_SGLANG_SESSION"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "-m", "tests.support.sglang_start", *args], capture_output=True,
                         text=True, timeout=240, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.splitlines()[-1]), [line for line in out.stderr.splitlines() if "dpboard" in line]


def as_without_dpboard(process: dict) -> None:
    assert process["registered"] == [] and process["patched"] == []
    assert process["own_factories"]
    assert (process["writer"], process["reader"]) == (SGLANGS_WRITER, SGLANGS_READER)
    assert process["read_back"]  # SGLang's reader read what SGLang's writer wrote, on SGLang's own file


@pytest.mark.parametrize("version", SGLANG_WHEELS)
def test_each_supported_release_is_hooked(version, board_name):
    """Each release the plugin knows, by its own version: every hook registered and applied (every
    name it targets exists there), the load path on the board, nothing said."""
    out, said = start(version, board_name)
    main = out["main"]
    assert set(main["registered"]) == ALL_HOOKS and set(main["patched"]) == ALL_HOOKS
    assert main["writer"] == "dpboard.integrations.sglang.transport.BoardLoadWriter"
    assert main["read_back"]
    assert said == []


def test_a_release_the_plugin_does_not_know(board_name):
    """SGLang's own code on a release the plugin does not know: one line from the server's main process
    naming the version and the releases it knows, none from a process SGLang spawns, and no hook."""
    out, said = start(SGLANG_VERSION, board_name, "--claim", "0.5.21", "--child")
    assert said == ["dpboard: SGLang 0.5.21 is not a release this plugin knows: the dpboard plugin steps aside "
                    "(SGLang's own load snapshots and dispatch, no board); it supports SGLang 0.5.22, 0.5.23"]
    as_without_dpboard(out["main"])
    as_without_dpboard(out["child"])


def test_a_release_that_lacks_a_name_the_plugin_uses(board_name):
    """0.5.22's modules claiming to be 0.5.23: 0.5.23's names are checked, the peer allowlist's function
    is not there, and the plugin steps aside instead of hooking part of SGLang."""
    out, said = start(SGLANG_PREVIOUS, board_name, "--claim", SGLANG_VERSION)
    assert said == ["dpboard: SGLang 0.5.23 lacks sglang.srt.utils.network.restrict_zmq_peers: the dpboard plugin "
                    "steps aside (SGLang's own load snapshots and dispatch, no board); it supports SGLang 0.5.22, "
                    "0.5.23"]
    as_without_dpboard(out["main"])


@pytest.mark.parametrize(("version", "release"), [
    ("0.5.23", "0.5.23"), ("0.5.22", "0.5.22"), ("0.5.23.post1", "0.5.23"), ("0.5.23+cpu", "0.5.23"),
    ("0.5.21", None), ("0.5.24", None), ("0.5.230", None), ("0.5.23rc1", None), ("0.5.23.dev0", None),
    ("0.5", None), ("unknown", None), ("0.0.0.dev0", None),
])
def test_the_release_a_version_belongs_to(version, release):
    support = versions.support_for(version)
    assert (support and support.release) == release


def test_the_releases_differ_only_where_the_plugin_adapts():
    """The names per release: 0.5.23 adds only the peer allowlist, which its collector applies."""
    old, new = versions.SUPPORTED["0.5.22"], versions.SUPPORTED["0.5.23"]
    assert {k: v for k, v in new.names.items() if k != versions.NETWORK} == dict(old.names)
    assert new.names[versions.NETWORK] == ("restrict_zmq_peers",) and versions.NETWORK not in old.names
    assert (old.peer_allowlist, new.peer_allowlist) == (False, True)
