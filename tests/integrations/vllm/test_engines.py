"""The vLLM stat logger's core, without vLLM: settings read by attribute from a config's fields, and
EngineBoard writing a real board under an injected clock."""

from __future__ import annotations

import math
import subprocess
import sys
from types import SimpleNamespace

import pytest

from dpboard import Board, SlotStatus
from dpboard.board import BoardError
from dpboard.errors import InvalidInputError
from dpboard.integrations.vllm.engines import EngineBoard, RecentHitRate
from dpboard.integrations.vllm.settings import (
    VllmBoardSettings,
    board_name,
    engine_capacity_tokens,
    settings_from_config,
)
from tests.support.names import ROOT
from tests.support.procutil import read_line


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


STAT_LOGGER = {"DPBOARD_VLLM_PUBLISHER": "stat_logger"}


def cache_config(block_size: int = 16, num_gpu_blocks: int | None = None,
                 kv_cache_size_tokens: int | None = None) -> SimpleNamespace:
    """The CacheConfig fields the settings read (vLLM's own CacheConfig is tested in tests/integrations/vllm/real)."""
    return SimpleNamespace(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                           kv_cache_size_tokens=kv_cache_size_tokens)


def config(dp: int = 4, **cache: object) -> SimpleNamespace:
    """A VllmConfig's fields as settings.py reads them, by attribute (it imports no vLLM)."""
    return SimpleNamespace(
        model_config=SimpleNamespace(served_model_name="org/Model-8B"),
        cache_config=cache_config(**cache),
        parallel_config=SimpleNamespace(data_parallel_size=dp, _api_process_count=1),
        scheduler_config=SimpleNamespace(max_num_seqs=256),
    )


# -- settings --------------------------------------------------------------------------------------


def test_off_unless_the_environment_names_a_board():
    assert board_name({}, "org/Model") is None
    assert board_name({"DPBOARD_VLLM": "0"}, "org/Model") is None
    assert settings_from_config(config(), [0, 1, 2, 3], environ={}) is None


def test_board_name_explicit_or_after_the_served_model():
    assert board_name({"DPBOARD_VLLM_BOARD": "llama"}, "org/Model") == "llama"
    assert board_name({"DPBOARD_VLLM": "1"}, "meta-llama/Llama-3.1-8B-Instruct") == "vllm-meta-llama-Llama-3.1-8B-Instruct"
    assert len(board_name({"DPBOARD_VLLM": "on"}, "m" * 100)) == 64
    with pytest.raises(InvalidInputError, match="DPBOARD_VLLM_BOARD: board name 'a/b' is invalid"):
        board_name({"DPBOARD_VLLM_BOARD": "a/b"}, None)
    with pytest.raises(InvalidInputError, match="set DPBOARD_VLLM_BOARD=NAME"):
        board_name({"DPBOARD_VLLM": "1"}, None)


def test_capacity_is_per_engine():
    # vLLM's own per-engine figure first; num_gpu_blocks in the API server is the sum over its engines.
    assert engine_capacity_tokens(cache_config(block_size=16, num_gpu_blocks=4000, kv_cache_size_tokens=15000), 4) == 15000
    assert engine_capacity_tokens(cache_config(block_size=16, num_gpu_blocks=4000), 4) == 16000
    assert engine_capacity_tokens(cache_config(block_size=16, num_gpu_blocks=4000), 1) == 64000
    assert engine_capacity_tokens(cache_config(block_size=16), 4) == 0


def test_settings_from_config():
    settings = settings_from_config(config(dp=4, block_size=32, num_gpu_blocks=800), [2, 3],
                                    environ={"DPBOARD_VLLM_BOARD": "b", **STAT_LOGGER})
    assert settings == VllmBoardSettings(board="b", n_slots=4, engine_indexes=(2, 3), capacity_tokens=400 * 32,
                                         max_running_requests=256)


def test_more_than_one_api_server_is_refused_with_the_fix():
    cfg = config()
    cfg.parallel_config._api_process_count = 4
    with pytest.raises(InvalidInputError) as e:
        settings_from_config(cfg, [0, 1, 2, 3], environ={"DPBOARD_VLLM_BOARD": "b", **STAT_LOGGER})
    assert "--api-server-count 1" in str(e.value) and "runs 4 API servers" in str(e.value)


def test_node_id_from_the_environment():
    env = {"DPBOARD_VLLM_BOARD": "b", "DPBOARD_VLLM_NODE_ID": "3", **STAT_LOGGER}
    assert settings_from_config(config(), [0], environ=env).node_id == 3
    assert settings_from_config(config(), [0], environ={"DPBOARD_VLLM_BOARD": "b", **STAT_LOGGER}).node_id == 0
    with pytest.raises(InvalidInputError, match="DPBOARD_VLLM_NODE_ID='x' is not a node id"):
        settings_from_config(config(), [0], environ={**env, "DPBOARD_VLLM_NODE_ID": "x"})


def test_engine_outside_the_dp_size_is_refused():
    with pytest.raises(InvalidInputError, match=r"\[0, 4\] are not DP ranks of a data_parallel_size 4"):
        settings_from_config(config(dp=4), [0, 4], environ={"DPBOARD_VLLM_BOARD": "b", **STAT_LOGGER})


# -- the hit rate window ----------------------------------------------------------------------------


def test_hit_rate_covers_the_most_recent_requests():
    window = RecentHitRate(max_requests=1000)
    assert window.rate == 0.0
    window.add(600, 1000, 500)
    assert window.rate == 0.5
    window.add(0, 0, 0)  # a step without new requests changes nothing
    assert window.rate == 0.5
    window.add(600, 1000, 100)  # 1200 requests: the older step leaves
    assert window.rate == 0.1
    window.add(5000, 100, 100)  # one step over the limit is kept whole
    assert window.rate == 1.0
    window.add(1, 10, 5, reset=True)
    assert window.rate == 0.5


# -- EngineBoard ------------------------------------------------------------------------------------


@pytest.fixture
def engines(board_name):
    clock = FakeClock()
    settings = VllmBoardSettings(board=board_name, n_slots=4, engine_indexes=(1, 2), capacity_tokens=10_000,
                                 max_running_requests=256)
    eb = EngineBoard(settings, clock=clock, wall_clock=lambda: 1234.5, heartbeat_interval=0.25)
    reader = Board.attach(board_name).reader(stale_after=60)
    try:
        yield eb, clock, reader
    finally:
        eb.close()
        eb.board.unlink()


def test_record_fills_the_engine_slot(engines):
    eb, clock, reader = engines
    eb.publish_all()
    assert [reader.status(r) for r in range(4)] == [SlotStatus.EMPTY, SlotStatus.LIVE, SlotStatus.LIVE,
                                                    SlotStatus.EMPTY]
    assert eb.record(2, running=7, waiting=3, kv_cache_usage=0.4321, prefix_requests=2, prefix_queries=100,
                     prefix_hits=25)
    _, snap, detail = reader.read_detail(2)
    assert snap[:8] == (2, 7, 3, 4321, 4321, 4321, 10_000, 0)
    assert snap.publish_seq == 2
    assert detail.token_usage == 0.4321 and detail.max_running_requests == 256
    assert detail.cache_hit_rate == 0.25 and detail.timestamp == 1234.5
    assert reader.read_detail(1)[1][:8] == (1, 0, 0, 0, 0, 0, 10_000, 0)
    assert not eb.record(3, running=1, waiting=0, kv_cache_usage=0.1)  # not managed here
    assert reader.status(3) == SlotStatus.EMPTY


def test_usage_outside_zero_to_one_is_clamped(engines):
    eb, _, reader = engines
    eb.record(1, running=1, waiting=0, kv_cache_usage=1.5)
    assert reader.read(1).num_used_tokens == 10_000
    eb.record(1, running=1, waiting=0, kv_cache_usage=math.nan)
    assert reader.read(1).num_used_tokens == 0


def test_heartbeat_keeps_idle_engines_only(engines):
    eb, clock, reader = engines
    eb.record(1, running=0, waiting=0, kv_cache_usage=0.0)
    eb.record(2, running=4, waiting=1, kv_cache_usage=0.5)
    clock.now += 0.1
    assert eb.heartbeat() == 0  # not due yet
    clock.now += 0.2
    assert eb.heartbeat() == 1
    assert reader.read(1).publish_seq == 2 and reader.read(2).publish_seq == 1
    assert eb.heartbeat() == 0  # just published
    eb.set_asleep(True)
    clock.now += 1
    assert eb.heartbeat() == 0
    eb.set_asleep(False)  # waking publishes every engine
    assert reader.read(1).publish_seq == 3 and reader.read(2).publish_seq == 2


def test_generation_throughput_over_a_second_or_more(engines):
    eb, clock, reader = engines
    eb.add_generated_tokens(1, 300)
    clock.now += 0.5
    eb.record(1, running=2, waiting=0, kv_cache_usage=0.1)
    assert reader.read_detail(1)[2].gen_throughput == 0.0  # the window is not a second long yet
    eb.add_generated_tokens(1, 200)
    clock.now += 1.5
    eb.record(1, running=0, waiting=0, kv_cache_usage=0.0)
    assert reader.read_detail(1)[2].gen_throughput == 250.0  # 500 tokens over 2 s
    clock.now += 1.0
    eb.heartbeat()
    assert reader.read_detail(1)[2].gen_throughput == 0.0  # idle for a second


def test_a_slot_held_by_another_live_process_is_an_error(board_name):
    with Board.create(board_name, n_slots=2):
        holder = subprocess.Popen([sys.executable, "tests/support/board_procs.py", "hold_writer", board_name, "1"],
                                  cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            read_line(holder, 30)
            settings = VllmBoardSettings(board=board_name, n_slots=2, engine_indexes=(0, 1), capacity_tokens=0,
                                         max_running_requests=0)
            with pytest.raises(BoardError, match=f"slot 1 of board '{board_name}' is held by the writer in live process {holder.pid}"):
                EngineBoard(settings)
        finally:
            holder.stdin.close()
            holder.wait(30)
