"""vLLM under MoE data parallelism steps in lockstep (``DPEngineCoreProc``): its engine cores publish
the lockstep section and the API server's dispatcher resolves ``auto`` to ``inflight_lockstep`` with
the engines' step budget as the chunk. Plain config objects, as the plugin reads them by attribute;
a real board."""

from __future__ import annotations

from types import SimpleNamespace

from dpboard import Board
from dpboard.controller import LoadBalanceMethod, resolve_load_balance_method
from dpboard.integrations.vllm.dispatch import moe_step_budget
from dpboard.integrations.vllm.engine_core import EnginePublisher, lockstep_section
from dpboard.snapshot import LockstepDetail


def config(dp: int, *, moe: bool, budget: int | None = 2048) -> SimpleNamespace:
    return SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=dp),
                           scheduler_config=SimpleNamespace(max_num_batched_tokens=budget),
                           model_config=SimpleNamespace(is_moe=moe))


def test_a_moe_engine_core_under_dp_publishes_its_lockstep_section(board_name):
    # in the engine core a dense model's DP size was reset to 1 (settings.engine_slot): no section
    assert lockstep_section(config(1, moe=False)) is None
    section = lockstep_section(config(4, moe=True))
    assert section == LockstepDetail(group_size=4, chunk_tokens=2048)
    assert lockstep_section(config(4, moe=True, budget=None)) == LockstepDetail(group_size=4, chunk_tokens=0)
    with Board.create(board_name, n_slots=4) as board:
        publisher = EnginePublisher(board, board.writer(2), capacity_tokens=1000, max_running_requests=8,
                                    lockstep=section)
        publisher._publish()
        assert board.reader().read_detail(2)[2].lockstep == section
        publisher.close()


def test_the_api_servers_auto_is_inflight_lockstep_for_a_moe_model_under_dp():
    assert moe_step_budget(config(4, moe=True)) == 2048
    assert moe_step_budget(config(4, moe=True, budget=None)) == 8192  # a budget vLLM left unset
    assert moe_step_budget(config(4, moe=False)) is None  # dense: independent engines
    assert moe_step_budget(config(1, moe=True)) is None
    lockstep = moe_step_budget(config(4, moe=True)) is not None
    assert resolve_load_balance_method("auto", lockstep=lockstep) is LoadBalanceMethod.INFLIGHT_LOCKSTEP
