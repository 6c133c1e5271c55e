"""``dpboard sim --pd P:D``: PD disaggregation, a prefill pool and a decode pool with a KV transfer
stage between them.

Each pool is its own DP deployment: its own controller (a dispatch policy over its ranks) and board,
its ranks independent or, under ``--dp-attention``, one lockstep group per pool
(``dpboard.sim.stepping``). A request's path, as SGLang 0.5.23 runs it
(``sglang/srt/disaggregation/prefill.py``, ``decode.py``, ``common/conn.py``):

    arrival: the router gives it a bootstrap room (a random 63-bit integer) and sends it to both pools
    prefill controller picks a prefill rank -> its bootstrap queue (counted as waiting)
    decode controller picks a decode rank -> (the bootstrap query, if the prefill side does not
        follow the room) -> pre-allocation queue -> KV reserved when the rank has room (between its
        steps) -> transfer queue
    the reservation reaches the prefill rank -> its waiting queue -> prefill (chunked, as any rank)
    end of prefill -> KV transfer over the prefill rank's link (``dpboard.sim.transfer``)
    KV arrives -> the first token reaches the client; the request joins the decode batch at the
        rank's next step (a prebuilt batch: no compute, no extend) and decodes to its end

So time to first token includes the bootstrap, the prefill queue and the transfer. A decode rank
reports ``num_active_tokens`` = ``num_total_tokens`` less the tokens still awaiting KV (its
pre-allocation and transfer queues), as SGLang's ``load_inquirer.py`` does.

A method is ``PREFILL/DECODE`` (``follow_bootstrap_room/round_robin`` is SGLang's ``auto`` for PD); a
single name applies to both sides, except ``auto`` (SGLang's pair) and ``follow_bootstrap_room``
(the decode side then round-robins, as ``auto`` does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from dpboard.errors import InvalidInputError
from dpboard.sim.methods import make_policy, maps_rooms, parse_method_spec, pd_auto
from dpboard.sim.model import DECODE_ROLE, PREFILL_ROLE, RankModel, SimRequest
from dpboard.sim.policy import SimBoard
from dpboard.sim.simulation import (
    BASE_EVENT_KINDS,
    RunResult,
    SimConfig,
    Simulation,
    simulate,
    split_sim_options,
)
from dpboard.sim.stepping import RankGroup
from dpboard.sim.trace import Trace

PD_AUTO = pd_auto()  # SGLang's auto: prefill follows the room, decode round-robins (the table's rows)

# Event kinds after the base simulation's (their handlers follow its list, in this order).
_HOLD = BASE_EVENT_KINDS
_REMOTE = BASE_EVENT_KINDS + 1
_RELEASE = BASE_EVENT_KINDS + 2
_KV_ARRIVE = BASE_EVENT_KINDS + 3


def _as_prefill(hook: Callable[[SimRequest], None]) -> Callable[[SimRequest], None]:
    def call(req: SimRequest) -> None:
        decode_rank = req.rank
        req.rank = req.prefill_rank
        try:
            hook(req)
        finally:
            req.rank = decode_rank

    return call


def split_pd_method(spec: str) -> tuple[str, str]:
    """``"A/B"`` -> (A, B); a single name applies to both sides where it can."""
    if "/" in spec:
        prefill, _, decode = spec.partition("/")
        if not prefill.strip() or not decode.strip():
            raise InvalidInputError(f"method {spec!r}: write PREFILL/DECODE, e.g. follow_bootstrap_room/round_robin")
        return prefill.strip(), decode.strip()
    name = parse_method_spec(spec)[0]
    if name == "auto":
        return PD_AUTO
    if maps_rooms(name):  # the room is a prefill-side mapping: the decode side takes auto's
        return spec, PD_AUTO[1]
    return spec, spec


def bootstrap_rooms(n: int, seed: int) -> list[int]:
    """What a router injects: one random 63-bit room per request (seeded)."""
    rng = np.random.default_rng([seed, 0x7064])
    return rng.integers(0, 2**63 - 1, size=n, dtype=np.int64, endpoint=True).tolist()


class PdSimulation(Simulation):
    """One ``PREFILL/DECODE`` method pair on one trace over a prefill and a decode pool.

    Simulation ranks 0..P-1 are the prefill pool, P..P+D-1 the decode pool; each rank's ``rank`` is
    its index within its pool, which is what its pool's policy and board use. ``RunResult.requests``
    carry their decode rank in ``rank`` and their prefill rank in ``prefill_rank``; the metrics over
    time follow the decode pool."""

    def _split_method(self, method: str, config: SimConfig) -> tuple[Any, SimConfig]:
        if config.pd is None:
            raise InvalidInputError("PdSimulation needs SimConfig.pd (--pd P:D)")
        prefill, decode = split_pd_method(method)
        p_spec, p_config = split_sim_options(prefill, config)
        d_spec, d_config = split_sim_options(decode, config)
        return (p_spec, p_config.publish, d_spec, d_config.publish), config

    def _build(self, spec: Any) -> None:
        p_spec, p_pub, d_spec, d_pub = spec
        config = self.config
        pd = config.pd
        assert pd is not None
        n_p, n_d = pd.n_prefill, pd.n_decode
        common_rank = {"queued_prefill": config.queued_prefill, "overlap": config.overlap}
        prefill = [RankModel(i, config.rank, role=PREFILL_ROLE, **common_rank) for i in range(n_p)]
        decode = [RankModel(i, config.rank, role=DECODE_ROLE, **common_rank) for i in range(n_d)]
        self.ranks = prefill + decode
        if config.lockstep is None:
            self.groups = [RankGroup(g, [rank]) for g, rank in enumerate(self.ranks)]
        else:
            # SGLang ignores --enable-prefill-delayer on a decode server (no prefill to hold)
            self.groups = [RankGroup(0, prefill, config.lockstep, config.delayer(n_p)),
                           RankGroup(1, decode, config.lockstep)]
        self._decode_group = [any(rank.role == DECODE_ROLE for rank in group.ranks) for group in self.groups]
        self.prefill_board = SimBoard(
            n_p, self.clock, p_pub.visibility_delay_s, lockstep=config.lockstep_section(n_p), mode="prefill"
        )
        self.decode_board = SimBoard(
            n_d, self.clock, d_pub.visibility_delay_s, lockstep=config.lockstep_section(n_d), mode="decode"
        )
        common = {"clock": self.clock, "refresh_interval_s": config.refresh_interval_s, "seed": self.trace.seed}
        p_name, d_name = split_pd_method(self.method)
        self.prefill_method, self.decode_method = p_name, d_name
        self.prefill_policy = make_policy(p_spec, label=p_name, n_ranks=n_p, board=self.prefill_board, **common)
        self.decode_policy = make_policy(d_spec, label=d_name, n_ranks=n_d, board=self.decode_board, **common)
        self.board = self.decode_board
        self.policy = self.decode_policy
        self._board_of = [self.prefill_board] * n_p + [self.decode_board] * n_d
        self._policy_of = [self.prefill_policy] * n_p + [self.decode_policy] * n_d
        self._pub = [p_pub] * n_p + [d_pub] * n_d
        self._sampled = decode
        self._tick = [(self.prefill_policy, prefill), (self.decode_policy, decode)]
        self._n_prefill = n_p
        # The rendezvous: load-aware prefill registers its pick with the bootstrap server and the
        # decode side queries it (two round trips before the decode rank can pre-allocate).
        self._queries = not maps_rooms(parse_method_spec(p_spec)[0])
        self._link_free = [0.0] * n_p
        self._transfer_s: list[float] = []  # per request: end of prefill -> KV on the decode rank
        self._rooms = bootstrap_rooms(len(self.trace), self.trace.seed)
        self._handlers_pd = [self._on_hold, self._on_remote, self._on_release, self._on_kv_arrive]

    def _wire_policy(self) -> None:
        super()._wire_policy()
        # A prefill-side router knows a request by the prefill rank it sent it to; ``rank`` is the
        # decode rank's, so its hooks see the prefill rank there while they run.
        for rank in self.ranks[: self._n_prefill]:
            if rank.on_first_token is not None:
                rank.on_first_token = _as_prefill(rank.on_first_token)
            if rank.on_finish is not None:
                rank.on_finish = _as_prefill(rank.on_finish)

    def run(self) -> RunResult:
        self._handlers.extend(self._handlers_pd)
        return super().run()

    # -- the request's path --------------------------------------------------------------------

    def _on_arrive(self, t: float, rid: int, _: int) -> None:
        req = self.requests[rid]
        req.bootstrap_room = self._rooms[rid]
        p = self.prefill_policy.dispatch(req)
        d = self.decode_policy.dispatch(req)
        pd = self.config.pd
        assert pd is not None
        if not 0 <= p < pd.n_prefill:
            raise RuntimeError(f"prefill method {self.prefill_method!r} picked rank {p} of {pd.n_prefill}")
        if not 0 <= d < pd.n_decode:
            raise RuntimeError(f"decode method {self.decode_method!r} picked rank {d} of {pd.n_decode}")
        send = self.config.send_delay_s
        self._push(t + send, _HOLD, rid, p)
        # the decode side resolves the prefill rank: from the room, or by asking the bootstrap
        # server once the prefill rank has registered it
        resolved = t + send + (2 * pd.bootstrap_rtt_s if self._queries else 0.0)
        self._push(resolved, _REMOTE, rid, self._n_prefill + d)

    def _on_hold(self, t: float, rid: int, p: int) -> None:
        self.ranks[p].hold(self.requests[rid])

    def _on_remote(self, t: float, rid: int, r: int) -> None:
        self.ranks[r].receive_remote(self.requests[rid], t)
        g = self._group_of[r]
        if not self.groups[g].busy:
            self._preallocate(g)

    def _preallocate(self, g: int) -> None:
        """A decode group between steps: reserve KV for what it can; each reservation is sent to the
        request's prefill rank, which may then prefill it."""
        send = self.config.send_delay_s
        for r in self._members[g]:
            for req in self.ranks[r].preallocate():
                self._push(self.now + send, _RELEASE, req.rid, req.prefill_rank)

    def _on_release(self, t: float, rid: int, p: int) -> None:
        g = self._group_of[p]
        self.ranks[p].release(self.requests[rid], t, self.groups[g].busy)
        self._wake(g)

    def _start_step(self, g: int) -> None:
        if self._decode_group[g]:
            self._preallocate(g)
        super()._start_step(g)

    def _on_step_end(self, t: float, g: int, _: int) -> None:
        group = self.groups[g]
        self._finished += group.end(t)
        if not self._decode_group[g]:
            pd = self.config.pd
            assert pd is not None
            for rank in group.ranks:
                for req in rank.handed_off:
                    p = req.prefill_rank
                    start = max(t, self._link_free[p])
                    end = start + pd.transfer_s(req.prompt_len)
                    self._link_free[p] = end
                    self._transfer_s.append(end - t)
                    self._push(end, _KV_ARRIVE, req.rid, self._n_prefill + req.rank)
                rank.handed_off.clear()
        self._start_step(g)

    def _on_kv_arrive(self, t: float, rid: int, r: int) -> None:
        self._finished += self.ranks[r].kv_arrived(self.requests[rid], t)
        self._wake(self._group_of[r])

    # -- result --------------------------------------------------------------------------------

    def _result(self, wall_s: float) -> RunResult:
        result = super()._result(wall_s)
        pd = self.config.pd
        assert pd is not None
        transfer = np.asarray(self._transfer_s, dtype=np.float64)
        per_prefill = np.bincount(
            np.fromiter((r.prefill_rank for r in self.requests), np.int64, len(self.requests)),
            minlength=pd.n_prefill,
        )
        record = {
            "prefill_method": self.prefill_method,
            "decode_method": self.decode_method,
            "n_prefill": pd.n_prefill,
            "n_decode": pd.n_decode,
            "bootstrap_query": self._queries,
            "transfer_p50_ms": float(np.percentile(transfer, 50)) * 1e3 if transfer.size else float("nan"),
            "transfer_p99_ms": float(np.percentile(transfer, 99)) * 1e3 if transfer.size else float("nan"),
            "prefill_requests_per_rank": per_prefill.tolist(),
        }
        return dataclasses.replace(
            result,
            publishes=self.prefill_board.publishes + self.decode_board.publishes,
            board_reads=self.prefill_board.reads + self.decode_board.reads,
            pd=record,
        )


def make_simulation(trace: Trace, method: str, config: SimConfig) -> Simulation:
    """The simulation ``config`` calls for: PD pools with ``config.pd``, else one pool."""
    return PdSimulation(trace, method, config) if config.pd is not None else Simulation(trace, method, config)


def simulate_any(trace: Trace, methods: list[str], config: SimConfig) -> list[RunResult]:
    """``simulate`` for either kind of run: every method on the same trace, each from a fresh cluster."""
    if config.pd is None:
        return simulate(trace, methods, config)
    return [PdSimulation(trace, m, config).run() for m in methods]

