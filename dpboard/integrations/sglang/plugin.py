"""The hooks the plugin registers with SGLang's ``HookRegistry``, and what they do.

SGLang calls ``load_plugins()`` early in every process it starts (main, schedulers, DP controller,
detokenizer); our entry point then registers hooks, and ``HookRegistry.apply_hooks()`` patches
them in (resolving a target imports its module). SGLang calls ``load_plugins()`` from inside the
module that runs the process, so a process's hooks target modules it has already imported: the
plugin registers a hook only when its module is loaded, so that no process imports what it does not
use (the scheduler module in the detokenizer, say). Nothing here reads SGLang's configuration at
registration: SGLang publishes it after ``load_plugins()``; the hooks read it when they run. On an
SGLang release the plugin does not know (versions.py), it registers none and says so in one line.

- ``load_snapshot.create_load_snapshot_writer`` / ``create_load_snapshot_reader`` (REPLACE): the
  board's writer and reader (transport.py) instead of SGLang's file or zmq ones.
- ``server_args.PortArgs.init_new`` (AFTER, main process only): create the instance's board before
  any child starts, so that the server's main process owns it and removes it when it exits, and
  start the watcher that removes it when SGLang kills that process instead (leaving.py).
- ``scheduler.Scheduler.handle_generate_request`` / ``handle_embedding_request`` (AFTER): count the
  requests each DP rank takes in, published as ``num_received_reqs``.
- With ``DPBOARD_METHOD``: the DataParallelController hooks of dispatch.py.
- With ``DPBOARD_STEP_LOG``: the scheduler's step recorder of steps.py (``__init__``, ``run_batch``,
  ``process_batch_result``).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import zmq

from dpboard.board import Board
from dpboard.integrations.sglang import dispatch, leaving, steps, versions
from dpboard.integrations.sglang.convert import sglang_module
from dpboard.integrations.sglang.settings import ENV_METHOD, read_settings
from dpboard.integrations.sglang.transport import BoardLoadReader, BoardLoadWriter, instance_board
from dpboard.multinode.collector import Collector

logger = logging.getLogger("dpboard.sglang")

LOAD_SNAPSHOT = "sglang.srt.managers.load_snapshot"
SERVER_ARGS = "sglang.srt.server_args"
SCHEDULER = "sglang.srt.managers.scheduler"
DP_CONTROLLER = "sglang.srt.managers.data_parallel_controller"
INTAKE_METHODS = ("handle_generate_request", "handle_embedding_request")


def register_hooks() -> None:
    """Register the plugin's hooks with SGLang's HookRegistry (SGLang applies them right after). On
    an SGLang release the plugin does not know, or one that lacks a name it uses, none (versions.py)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if versions.check() is None:
        return  # SGLang runs as without dpboard; the server's main process said why, in one line
    HookRegistry.register(f"{LOAD_SNAPSHOT}.create_load_snapshot_writer", create_load_snapshot_writer,
                          HookType.REPLACE)
    HookRegistry.register(f"{LOAD_SNAPSHOT}.create_load_snapshot_reader", create_load_snapshot_reader,
                          HookType.REPLACE)
    if SERVER_ARGS in sys.modules:
        HookRegistry.register(f"{SERVER_ARGS}.PortArgs.init_new", create_board_with_port_args, HookType.AFTER)
    if SCHEDULER in sys.modules:
        for method in INTAKE_METHODS:
            HookRegistry.register(f"{SCHEDULER}.Scheduler.{method}", count_received_request, HookType.AFTER)
        if steps.wanted():  # DPBOARD_STEP_LOG: the step recorder (steps.py); its value is checked at __init__
            steps.register(HookRegistry, HookType, SCHEDULER)
    # Only whether DPBOARD_METHOD is set: its value is checked when a controller starts, where a
    # bad one stops the server with a message (an error here would only be logged by SGLang).
    if DP_CONTROLLER in sys.modules and os.environ.get(ENV_METHOD, "").strip():
        dispatch.register(HookRegistry, HookType, DP_CONTROLLER)


# -- the instance's board ----------------------------------------------------------------------------


def create_board_with_port_args(port_args: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``PortArgs.init_new``: in the server's main process (role ``tokenizer``), create the
    board now, before any scheduler starts. Other processes call init_new too (the DP controller,
    for per-rank ports it then gives the instance's id): they leave the board to the main one."""
    from sglang.srt.runtime_context import publish_role

    if publish_role() != "tokenizer" or not getattr(port_args, "instance_id", ""):
        return None
    n_slots = sglang_module().get_parallel().num_dp_ranks
    board = instance_board(port_args, n_slots, replace_dead=True)
    logger.info("dpboard: SGLang's loads are on board %r (%d ranks): `dpboard top %s`",
                board.name, n_slots, board.name)
    if board.is_owner:
        # SGLang ends this process with SIGKILL on most paths (leaving.py): the board's removal at
        # exit must not depend on it.
        leaving.watch(board.name, board.generation)
    return None


# -- the two factories ----------------------------------------------------------------------------------


def create_load_snapshot_writer(port_args: Any, dp_size: int, dp_rank: int, publish_interval: int = 1) -> BoardLoadWriter:
    """REPLACE of SGLang's factory: the rank's slot of the instance's board. In zmq mode a rank on
    another node publishes into its node's board and relays its slot to node0's collector."""
    module = sglang_module()
    board = instance_board(port_args, dp_size)
    relay_to = None
    if module.should_use_zmq() and module.get_parallel().node_rank != 0:
        relay_to = module._zmq_addr_for(port_args)
    return BoardLoadWriter(board, dp_size, dp_rank, publish_interval, relay_to=relay_to)


def create_load_snapshot_reader(port_args: Any, caller: str) -> BoardLoadReader:
    """REPLACE of SGLang's factory: a reader of the instance's board. The caller that SGLang's own
    ``zmq_reader_owner`` names also owns the collector, node0's single PULL socket, bound where
    SGLang would bind its own."""
    module = sglang_module()
    num_dp_ranks = module.get_parallel().num_dp_ranks
    board = instance_board(port_args, num_dp_ranks)
    collector = None
    if module.zmq_reader_owner(caller):
        collector = _collector(board, module._zmq_addr_for(port_args))
    return BoardLoadReader(board, num_dp_ranks, stale_after=read_settings().stale_after, collector=collector,
                           drain_in_thread=caller != "MultiTokenizerRouter")


def node0_ranks() -> range:
    """The DP ranks whose schedulers run on node 0, which the collector must never write from a
    relayed frame (it starts before them). SGLang gives node k the tensor-parallel ranks
    [k * tp_size / nnodes, (k + 1) * tp_size / nnodes) and a DP-attention rank is its tensor-parallel
    rank over tp_size / dp_size: node 0 holds [0, dp_size / nnodes), rank 0 at least."""
    parallel = sglang_module().get_parallel()
    return range(max(1, parallel.num_dp_ranks // max(1, parallel.nnodes)))


def _collector(board: Board, endpoint: str) -> Collector:
    """The collector on SGLang's endpoint, with SGLang's TCP peer allowlist (SGLANG_ZMQ_ALLOWED_PEERS)
    applied as SGLang applies it to its own PULL socket: the allowlist's authenticator on the
    context, and its ZAP domain on the sockets the context makes. SGLang 0.5.22 has no allowlist."""
    context = zmq.Context()
    domain = b""
    support = versions.current()[1]
    if endpoint.startswith("tcp://") and support is not None and support.peer_allowlist:  # not in 0.5.22
        from sglang.srt.utils.network import restrict_zmq_peers

        probe = context.socket(zmq.PULL)
        try:
            restrict_zmq_peers(context, probe)
            domain = probe.getsockopt(zmq.ZAP_DOMAIN)
        finally:
            probe.close(linger=0)
        if domain:
            context.setsockopt(zmq.ZAP_DOMAIN, domain)
    try:
        return Collector(board, endpoint, context=context, local_ranks=node0_ranks())
    except BaseException:
        if not domain:  # an allowlist's authenticator lives on the context, as SGLang keeps its own
            context.term()
        raise


# -- requests taken in ------------------------------------------------------------------------------------


def count_received_request(result: Any, scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``Scheduler.handle_generate_request`` / ``handle_embedding_request``: one more request
    received by this DP rank. Only the scheduler that holds the rank's writer counts (every attention
    TP rank of a DP group runs the handler); health checks, which the controller routes outside its
    dispatch, are not counted."""
    writer = getattr(scheduler, "load_snapshot_writer", None)
    if isinstance(writer, BoardLoadWriter) and not _is_health_check(recv_req):
        writer.num_received_reqs += 1
    return None


def _is_health_check(req: Any) -> bool:
    from sglang.srt.managers.utils import is_health_check_generate_req

    return is_health_check_generate_req(req)
