"""``dpboard bench dispatch``: one dispatch decision and batches, beside SGLang's pure-Python budget.

The baseline does what SGLang's ``DataParallelController`` does per request with ``total_tokens`` or
``total_requests`` (``total_tokens`` is the baseline of dpboard's ``inflight_*`` token and backlog
rows): the 20 ms throttled refresh (``read_all()`` into ``DPBudget.update_budget``),
then ``DPBudget.dispatch`` (lists, ``min`` with a key). Both read the same real board and the same
request objects; figures are per request, timed over blocks of requests (no timer cost inside).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dpboard.bench.stats import fmt_ns, machine_line, markdown_table, pct, topic_parser, write_json
from dpboard.board import MAX_SLOTS, Board
from dpboard.controller import Dispatcher, LoadBalanceMethod
from dpboard.options import count

M = LoadBalanceMethod
TARGET_SINGLE_NS = 600.0
TARGET_BATCH_NS = 200.0
TARGET_SPEEDUP = 10.0


class Request:
    __slots__ = ("rid", "routed_dp_rank", "bootstrap_room", "input_ids")

    def __init__(self, rid: int, num_tokens: int):
        self.rid = rid
        self.routed_dp_rank = None
        self.bootstrap_room = None
        self.input_ids = [0] * num_tokens


class BaselineBudget:
    """SGLang's DPBudget: per-rank lists, argmin by ``min`` with a key, speculative +1/+tokens."""

    def __init__(self, dp_size: int):
        self.dp_size = dp_size
        self.total_requests = [0] * dp_size
        self.total_tokens = [0] * dp_size
        self.last_timestamp = [0] * dp_size

    def update_budget(self, loads) -> None:
        for load in loads:
            if load is None or load.timestamp_ns == self.last_timestamp[load.dp_rank]:
                continue
            self.last_timestamp[load.dp_rank] = load.timestamp_ns
            self.total_requests[load.dp_rank] = load.num_running_reqs + load.num_waiting_reqs
            self.total_tokens[load.dp_rank] = load.num_total_tokens

    def dispatch(self, method: LoadBalanceMethod, estimated_tokens: int = 0) -> int:
        if method is M.TOTAL_REQUESTS:
            target = self.total_requests.index(min(self.total_requests))
        else:
            target = min(range(self.dp_size), key=lambda i: (self.total_tokens[i], self.total_requests[i]))
        self.total_requests[target] += 1
        self.total_tokens[target] += estimated_tokens
        return target


class BaselineController:
    """SGLang's per-request path: throttled refresh, routed check, estimate, budget dispatch."""

    def __init__(self, method: LoadBalanceMethod, n: int, reader):
        self.method = method
        self.budget = BaselineBudget(n)
        self.reader = reader
        self.last_refresh = 0.0

    def refresh_load_budget(self) -> None:
        now = time.perf_counter()
        if now - self.last_refresh < 0.02:
            return
        self.last_refresh = now
        self.budget.update_budget(self.reader.read_all())

    def dispatch(self, req, refresh: bool = True) -> int:
        if refresh:
            self.refresh_load_budget()
        if req.routed_dp_rank is not None:
            return req.routed_dp_rank
        return self.budget.dispatch(self.method, len(req.input_ids))

    def dispatch_batch(self, reqs) -> list[int]:
        self.refresh_load_budget()
        return [self.dispatch(req, refresh=False) for req in reqs]


BENCH_STALE_AFTER = 600.0  # seconds


def _publish_all(board: Board, writers, rng: random.Random) -> None:
    for w in writers:
        w.publish_values(rng.randint(0, 50), rng.randint(0, 50), 0, rng.randint(0, 10**6), 0, 10**6, 0)


def _time_blocks(call: Callable, reqs: Sequence, blocks: int, refresh_board: Callable, *,
                 batched: bool) -> np.ndarray:
    """Per-request ns of each of ``blocks`` timed blocks over ``reqs``: one call per request, or one call
    with them all (``batched``); fresh snapshots every few blocks, outside the timing."""
    samples = np.empty(blocks)
    t = time.perf_counter_ns
    refresh_every = 4 if batched else 16
    for b in range(blocks):
        if b % refresh_every == 0:
            refresh_board()
        a = t()
        if batched:
            call(reqs)
        else:
            for req in reqs:
                call(req)
        samples[b] = (t() - a) / len(reqs)
    return samples


_time_single = functools.partial(_time_blocks, batched=False)  # call: a dispatch
_time_batch = functools.partial(_time_blocks, batched=True)  # call: a dispatch_batch


def parser() -> argparse.ArgumentParser:
    p = topic_parser("dispatch", __doc__, "a short run (fewer blocks)")
    p.add_argument("--ranks", type=count(1, MAX_SLOTS), nargs="+", default=[8, 64],
                   help="DP sizes to measure (default 8 64)")
    p.add_argument("--batch", type=count(1, 1_000_000), default=1024, help="requests per batch (default 1024)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    single_blocks, batch_blocks = (200, 40) if args.quick else (2000, 300)
    rng = random.Random(1)
    rows = []
    figures: list[dict] = []
    verdicts = []
    for n in args.ranks:
        name = f"bench-dispatch-{os.getpid()}-{n}"
        with Board.create(name, n_slots=n) as board:
            writers = [board.writer(r) for r in range(n)]
            _publish_all(board, writers, rng)
            reqs = [Request(i, rng.randint(16, 4096)) for i in range(args.batch)]
            block = reqs[:256]
            for method in (M.TOTAL_TOKENS, M.TOTAL_REQUESTS, M.INFLIGHT_TOKENS, M.INFLIGHT_BACKLOG,
                           M.INFLIGHT_CACHE, M.INFLIGHT_TTFT, M.INFLIGHT_LOCKSTEP):
                # staleness is not what is measured: a loaded machine must not make the slots stale
                # between two of the bench's publishes (a health-aware method would then refuse)
                reader = board.reader(stale_after=BENCH_STALE_AFTER)
                ours = Dispatcher(method, n, reader=reader)
                # the backlog key is compared with SGLang's token method, the nearest it has
                base_method = M.TOTAL_REQUESTS if method is M.TOTAL_REQUESTS else M.TOTAL_TOKENS
                base = BaselineController(base_method, n, board.reader())
                again = functools.partial(_publish_all, board, writers, rng)  # fresh snapshots to refresh
                # warm both up, then alternate so that neither gets a quieter moment of the machine
                _time_single(ours.dispatch, block, 5, again)
                _time_single(base.dispatch, block, 5, again)
                cases = [
                    ("one decision", _time_single, ours.dispatch, base.dispatch, block, single_blocks,
                     TARGET_SINGLE_NS),
                    (f"batch of {args.batch}, per request", _time_batch, ours.dispatch_batch,
                     base.dispatch_batch, reqs, batch_blocks, TARGET_BATCH_NS),
                ]
                for label, timer, fn_ours, fn_base, data, blocks, target in cases:
                    ours_s = np.concatenate([timer(fn_ours, data, blocks // 2, again) for _ in range(2)])
                    base_s = np.concatenate([timer(fn_base, data, blocks // 2, again) for _ in range(2)])
                    speedup = pct(base_s, 50) / pct(ours_s, 50)
                    figures.append({"method": method.value, "ranks": n, "what": label,
                                    "dpboard_ns": {q: pct(ours_s, q) for q in (50, 90, 99)},
                                    "baseline_ns": {q: pct(base_s, q) for q in (50, 90, 99)},
                                    "speedup_p50": speedup})
                    rows.append([
                        method.value, n, label,
                        fmt_ns(pct(ours_s, 50)), fmt_ns(pct(ours_s, 90)), fmt_ns(pct(ours_s, 99)),
                        fmt_ns(pct(base_s, 50)), fmt_ns(pct(base_s, 90)), fmt_ns(pct(base_s, 99)),
                        f"{speedup:.1f}x",
                    ])
                    if n == 64 and method in (M.TOTAL_TOKENS, M.INFLIGHT_BACKLOG):
                        ok = pct(ours_s, 50) <= target
                        verdicts.append(f"- {label}, 64 ranks, {method.value}: {fmt_ns(pct(ours_s, 50))} "
                                        f"(target <= {fmt_ns(target)}): {'met' if ok else 'MISSED'}")
                        if label == "one decision" and method is M.TOTAL_TOKENS:
                            ok = speedup >= TARGET_SPEEDUP
                            verdicts.append(f"- speed-up over the baseline, one decision, 64 ranks: "
                                            f"{speedup:.1f}x (target >= {TARGET_SPEEDUP:.0f}x): "
                                            f"{'met' if ok else 'MISSED'}")
    print(f"## dispatch ({machine_line()}{', quick' if args.quick else ''})\n")
    print("Per request; dpboard = `Dispatcher` on a real board; baseline = SGLang's DPBudget in pure Python "
          "on the same board and requests.\n")
    print(markdown_table(
        ["method", "ranks", "what", "dpboard p50", "p90", "p99", "baseline p50", "p90", "p99", "speed-up p50"],
        rows,
    ))
    p50 = {(f["method"], f["ranks"], f["what"]): f["dpboard_ns"][50] for f in figures}
    for (method, n, label), lockstep in p50.items():
        ttft = p50.get((M.INFLIGHT_TTFT.value, n, label))
        if method == M.INFLIGHT_LOCKSTEP.value and ttft:
            # the lockstep key scans the ranks twice (the earliest first token, then the stalls)
            verdicts.append(f"- inflight_lockstep against inflight_ttft, {n} ranks, {label}: {fmt_ns(lockstep)} "
                            f"against {fmt_ns(ttft)} ({lockstep / ttft:.2f}x)")
    if verdicts:
        print()
        print("\n".join(verdicts))
    print()
    print(prefix_index_table(max(args.ranks), 200 if args.quick else 2000, rng))
    print()
    print(vllm_pick_table(VLLM_ENGINES, 100 if args.quick else 1000, rng))
    write_json(args.json, {"machine": machine_line(), "quick": args.quick, "dispatch": figures})
    return 0


def _match_and_record(index, hashes: list[int], rank: int) -> None:
    index.match(hashes)
    index.record(rank, hashes)


def prefix_index_table(n_ranks: int, repeats: int, rng: random.Random) -> str:
    """What the prefix index adds per request, beside what the controller already spends on it:
    decoding the frame's ``input_ids`` (msgpack) and SGLang's ``DPBudget.dispatch``."""
    import msgpack

    from dpboard.controller.codec import decode_request
    from dpboard.controller.prefix_index import DEFAULT_BLOCK_SIZE, PrefixIndex, frame_block_hashes

    t = time.perf_counter_ns
    budget = BaselineBudget(n_ranks)
    index = PrefixIndex(n_ranks, DEFAULT_BLOCK_SIZE)
    # history: every rank holds a few dozen conversations' prefixes
    for conv in range(40 * n_ranks):
        ids = [conv * 100_000 + i for i in range(DEFAULT_BLOCK_SIZE * rng.randint(1, 16))]
        index.record(conv % n_ranks, frame_block_hashes(msgpack.packb({"input_ids": ids}))[1])
    rows = []
    for tokens in (1024, 16384):
        # a follow-up turn of a conversation that one rank holds, with new tokens after it
        ids = [7 * 100_000 + i for i in range(tokens)]
        frame = msgpack.packb({"rid": "r", "input_ids": ids, "routed_dp_rank": None}, use_bin_type=True)

        def each(fn: Callable[[], object]) -> np.ndarray:
            out = np.empty(repeats)
            for i in range(repeats):
                a = t()
                fn()
                out[i] = t() - a
            return out

        hashes = frame_block_hashes(frame)[1]
        decode = each(functools.partial(msgpack.unpackb, frame, raw=False))
        read = each(functools.partial(decode_request, frame, DEFAULT_BLOCK_SIZE))
        hashing = each(functools.partial(frame_block_hashes, frame))
        lookup = each(functools.partial(_match_and_record, index, hashes, 7 % n_ranks))
        sglang = each(functools.partial(budget.dispatch, M.TOTAL_TOKENS, tokens))
        index_total = hashing + lookup
        for what, samples in (("decode the frame with msgpack (what the controller did before)", decode),
                              ("the controller's one read of the frame, hashes included (C)", read),
                              ("block hashes from the frame bytes (C)", hashing),
                              ("index: match on every rank + record", lookup),
                              ("the prefix index in all (hashes + match + record)", index_total),
                              ("SGLang DPBudget.dispatch (total_tokens)", sglang)):
            rows.append([f"{tokens}", what, fmt_ns(pct(samples, 50)), fmt_ns(pct(samples, 99))])
        ratio = pct(index_total, 50) / pct(decode, 50)
        rows.append([f"{tokens}", "prefix index / decoding input_ids (p50)", f"{ratio:.2f}x", "-"])
    return (f"### prefix index, per request ({n_ranks} ranks, {DEFAULT_BLOCK_SIZE}-token blocks, "
            f"{len(index._holders)} blocks indexed)\n\n"
            + markdown_table(["prompt tokens", "what", "p50", "p99"], rows))


# -- vLLM's API-server pick, with and without the board ------------------------------------------------

VLLM_ENGINES = (16, 64, 256)


def _keeps_streaming_sessions() -> bool:
    from dpboard.integrations.vllm.versions import support_for, vllm_version

    support = support_for(vllm_version())
    return support is None or support.streaming_sessions


def unconnected_client(cls: type, vllm_config: object, n_engines: int, *, client_index: int = 0,
                       client_count: int = 1, first_rank: int = 0) -> object:
    """A vLLM ``DPLBAsyncMPClient`` (``cls``) not connected to engines: the attributes its
    ``__init__`` sets for balancing (vllm/v1/engine/core_client.py:1713-1749 in 0.33.0, and MPClient's
    ``core_engines``, 738-755); ``lb_engines`` is what vLLM's coordinator last published."""
    from collections import Counter

    client = object.__new__(cls)
    client.vllm_config = vllm_config
    client.client_count = client_count
    client.client_index = client_index
    client.reqs_in_flight = {}
    if _keeps_streaming_sessions():
        client.streaming_reqs = set()  # vLLM 0.33's client has it; 0.32's does not
    client.engine_inflight = Counter()
    client.core_engines = [rank.to_bytes(2, "little") for rank in range(first_rank, first_rank + n_engines)]
    client.lb_engines = [[0, 0, 0.0] for _ in range(n_engines)]
    client.eng_start_index = (n_engines * client_index) // client_count
    return client


def _time_picks(pick: Callable, client: Any, reqs: Sequence, counts: list, blocks: int,
                refresh_board: Callable) -> np.ndarray:
    samples = np.empty(blocks)
    t = time.perf_counter_ns
    for b in range(blocks):
        # vLLM finished the last block's requests, and its coordinator published its counts again
        client.reqs_in_flight.clear()
        client.engine_inflight.clear()
        client.lb_engines = [list(c) for c in counts]
        if b % 16 == 0:
            refresh_board()
        a = t()
        for req in reqs:
            pick(client, req)
        samples[b] = (t() - a) / len(reqs)
    return samples


def vllm_pick_table(engine_counts: Sequence[int], blocks: int, rng: random.Random) -> str:
    """One ``get_core_engine_for_request`` of vLLM's ``DPLBAsyncMPClient``, in this process: vLLM's own
    scoring loop over the coordinator's counts, beside the same call through dpboard's plugin with
    ``DPBOARD_METHOD=inflight_requests`` (the Dispatcher over a real board, and the sent record).
    Where vLLM's wheel is installed without torch, its modules load behind the same named import
    stand-ins as the vLLM tests (vllm_standins.py), which the pick never calls into."""
    from dpboard.bench.vllm_standins import vllm_importable

    with vllm_importable() as missing:
        if missing:
            return f"### vLLM's pick\n\nno vLLM rows: {missing}\n"
        return _vllm_pick_table(engine_counts, blocks, rng)


def _vllm_pick_table(engine_counts: Sequence[int], blocks: int, rng: random.Random) -> str:
    try:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.engine.core_client import DPLBAsyncMPClient
        from vllm.v1.pool.late_interaction import get_late_interaction_engine_index
    except Exception as e:  # a vLLM that cannot import here
        return (f"### vLLM's pick\n\nvLLM's client does not import in this process ({type(e).__name__}: {e}); "
                f"these rows need vLLM 0.33.0 installed beside dpboard.\n")
    from types import SimpleNamespace

    from dpboard.integrations.vllm import dispatch

    dispatch.patch(DPLBAsyncMPClient, get_late_interaction_engine_index)
    vllm_pick = DPLBAsyncMPClient._dpboard_original_pick
    rows = []
    for n in engine_counts:
        name = f"bench-vllm-{os.getpid()}-{n}"
        config = SimpleNamespace(model_config=SimpleNamespace(served_model_name=None),
                                 parallel_config=SimpleNamespace(data_parallel_size=n))
        with Board.create(name, n_slots=n) as board:
            writers = [board.writer(r) for r in range(n)]
            _publish_all(board, writers, rng)
            ours = unconnected_client(DPLBAsyncMPClient, config, n)
            state = dispatch.client_dispatch(ours, {"DPBOARD_VLLM_BOARD": name, "DPBOARD_METHOD": "inflight_requests"})
            setattr(ours, dispatch.STATE, state)
            theirs = unconnected_client(DPLBAsyncMPClient, config, n)
            counts = [[rng.randint(0, 50), rng.randint(0, 50), rng.random()] for _ in range(n)]
            reqs = [EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=[0] * rng.randint(16, 4096),
                                      mm_features=None, sampling_params=SamplingParams(max_tokens=16),
                                      pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None,
                                      data_parallel_rank=None) for i in range(256)]

            again = functools.partial(_publish_all, board, writers, rng)
            plugin_pick = DPLBAsyncMPClient.get_core_engine_for_request
            try:
                _time_picks(plugin_pick, ours, reqs, counts, 5, again)  # warm both up
                _time_picks(vllm_pick, theirs, reqs, counts, 5, again)
                ours_s = np.concatenate([_time_picks(plugin_pick, ours, reqs, counts, blocks // 2, again)
                                         for _ in range(2)])
                base_s = np.concatenate([_time_picks(vllm_pick, theirs, reqs, counts, blocks // 2, again)
                                         for _ in range(2)])
            finally:
                state.sent.unlink()
                state.close()
                for w in writers:
                    w.close()
        rows.append([n, fmt_ns(pct(ours_s, 50)), fmt_ns(pct(ours_s, 90)), fmt_ns(pct(ours_s, 99)),
                     fmt_ns(pct(base_s, 50)), fmt_ns(pct(base_s, 90)), fmt_ns(pct(base_s, 99)),
                     f"{pct(base_s, 50) / pct(ours_s, 50):.1f}x"])
    return ("### vLLM's pick, per request (`DPLBAsyncMPClient.get_core_engine_for_request`, one API server)\n\n"
            "through dpboard = the plugin with DPBOARD_METHOD=inflight_requests (Dispatcher over a real board, "
            "the sent record); vLLM = its own scoring loop over the coordinator's counts; both in this process, "
            "vLLM's bookkeeping included.\n\n"
            + markdown_table(["engines", "through dpboard p50", "p90", "p99", "vLLM's loop p50", "p90", "p99",
                              "speed-up p50"], rows))


if __name__ == "__main__":
    raise SystemExit(main())
