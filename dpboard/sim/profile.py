"""Rank profiles: a rank model's step costs and capacities, named and sourced, in small text files.

A profile file is ``key = value`` lines; ``#`` starts a comment (the sources go there). Keys, with
their units in the name:

========================  =====================================================================
``name``                  the profile's name (``--profile NAME``)
``description``           one line: model, precision, GPU, engine settings
``source``                one line: where the figures come from (details in the comments)
``kv_capacity_tokens``    KV pool per rank, tokens (the prefix cache lives in it)
``max_running_requests``  running batch limit per rank
``chunked_prefill_size``  prompt tokens per prefill step; 0 turns chunking off
``max_prefill_tokens``    with chunking off, prompt tokens per step (optional, default 16384)
``prefill_step_ms``       fixed cost of a prefill step
``prefill_token_us``      cost per prompt token computed
``prefill_attention_ps``  cost per pair of a prompt token computed and a token of its context it
                          attends to: ``n * p + n * n / 2`` pairs for ``n`` tokens after ``p``
                          in KV (optional, default 0)
``decode_step_ms``        fixed cost of a decode step
``decode_request_us``     decode cost per request in the batch
``decode_kv_token_ns``    decode cost per KV token the batch holds
``decode_after_prefill_ms``  what the decode step right after a prefill step costs more (optional, 0)
``sync_forward``          1: the forward runs in the scheduler's own thread (a CPU): with the
                          overlap scheduler a step's tokens come out at the end of the next
                          step's forward (optional, default 0: a GPU)
``result_share``          with ``sync_forward``: where in the next step a step's tokens come out,
                          as a share of that step's time from its start (after its forward and
                          their processing; the rest is the loop's turn; optional, default 1)
``dp_attention``          1: the ranks step in lockstep, as DP attention runs them (optional, default 0)
``moe_prefill_token_us``  lockstep: the routed-expert part of ``prefill_token_us``, spread over
                          the group (optional, default 0)
``moe_decode_token_us``   lockstep: the routed-expert part of ``decode_request_us`` (optional, 0)
``eager_decode_ms``       lockstep: what a decode batch pays in a step where another rank extends
                          (no CUDA graph; optional, 0)
``idle_pass_ms``          lockstep with SGLang's prefill delayer: a scheduler pass without a forward
                          (the delayer held the only work there was; its CPU all-gathers over the
                          group and a loop turn; optional, 1)
``deepep_normal_ms``      lockstep: what a step with an extend costs the group more, its MoE
                          all-to-all running in DeepEP's normal mode (optional, 0)
``server_chunked_prefill_size``  SGLang's ``--chunked-prefill-size`` default on this GPU: under
                          colocated DP attention each rank's chunk is this divided by the
                          group's size (optional, 0: the rank's ``chunked_prefill_size``)
``frontend_ms``           a request's path outside the schedulers, client to rank and first token
                          back (HTTP server, tokenizer, DP controller, detokenizer): added to
                          every TTFT and end-to-end time (optional, default 0)
``slo_ttft_ms``           goodput: the time-to-first-token SLO (optional, default 1000)
``slo_tpot_ms``           goodput: the time-per-output-token SLO (optional, default 100)
``kv_bytes_per_token``    PD: KV bytes a prompt token sends to the decode side (optional, 131072)
``kv_link_gbps``          PD: a prefill rank's link to the decode side, GB/s (optional, 40)
``kv_transfer_ms``        PD: fixed cost of one KV transfer (optional, 1)
``bootstrap_rtt_ms``      PD: one round trip to the bootstrap server (optional, 2)
========================  =====================================================================

The lockstep terms are used with ``dp_attention = 1`` or ``dpboard sim --dp-attention``
(``dpboard.sim.stepping`` gives the step's formula).

The profiles shipped with dpboard are in ``dpboard/sim/profiles/``; ``load_profile_file`` reads a
user's own.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from dpboard.errors import InvalidInputError, NotFoundError
from dpboard.sim.model import RankConfig
from dpboard.sim.prefill_delayer import IDLE_PASS_S
from dpboard.sim.stepping import LockstepCost
from dpboard.sim.transfer import PdConfig

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
SUFFIX = ".profile"

# key -> (RankConfig field, divisor to the field's unit, whole number?). Dividing by an exact power of
# ten gives the same float as the literal in seconds (40 us -> 40e-6 exactly).
_NUMERIC: dict[str, tuple[str, float, bool]] = {
    "kv_capacity_tokens": ("kv_capacity", 1, True),
    "max_running_requests": ("max_running", 1, True),
    "chunked_prefill_size": ("chunked_prefill_size", 1, True),
    "max_prefill_tokens": ("max_prefill_tokens", 1, True),
    "prefill_step_ms": ("prefill_base_s", 1e3, False),
    "prefill_token_us": ("prefill_s_per_token", 1e6, False),
    "prefill_attention_ps": ("prefill_s_per_attention_pair", 1e12, False),
    "decode_step_ms": ("decode_base_s", 1e3, False),
    "decode_request_us": ("decode_s_per_request", 1e6, False),
    "decode_kv_token_ns": ("decode_s_per_kv_token", 1e9, False),
    "sync_forward": ("sync_forward", 1, True),
    "result_share": ("result_share", 1, False),
    "decode_after_prefill_ms": ("decode_after_prefill_s", 1e3, False),
}
# key -> (Profile field, divisor to the field's unit, whole number?, default): the run's terms that
# are not the rank's own.
_RUN: dict[str, tuple[str, float, bool, float]] = {
    "dp_attention": ("dp_attention", 1, True, 0),
    "moe_prefill_token_us": ("moe_prefill_s_per_token", 1e6, False, 0.0),
    "moe_decode_token_us": ("moe_decode_s_per_token", 1e6, False, 0.0),
    "eager_decode_ms": ("eager_decode_s", 1e3, False, 0.0),
    "deepep_normal_ms": ("extend_dispatch_s", 1e3, False, 0.0),
    "idle_pass_ms": ("idle_pass_s", 1e3, False, IDLE_PASS_S * 1e3),
    "server_chunked_prefill_size": ("server_chunked_prefill_size", 1, True, 0),
    "frontend_ms": ("frontend_s", 1e3, False, 0.0),
    "slo_ttft_ms": ("slo_ttft_s", 1e3, False, 1000.0),
    "slo_tpot_ms": ("slo_tpot_s", 1e3, False, 100.0),
    "kv_bytes_per_token": ("kv_bytes_per_token", 1, False, 131072.0),
    "kv_link_gbps": ("kv_link_bytes_per_s", 1e-9, False, 40.0),
    "kv_transfer_ms": ("kv_transfer_base_s", 1e3, False, 1.0),
    "bootstrap_rtt_ms": ("bootstrap_rtt_s", 1e3, False, 2.0),
}
_TEXT = ("name", "description", "source")
_OPTIONAL = ("max_prefill_tokens", "sync_forward", "result_share", "prefill_attention_ps", "decode_after_prefill_ms",
             *_RUN)


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    source: str
    path: str
    rank: RankConfig
    dp_attention: bool = False  # the ranks step in lockstep unless told otherwise
    lockstep: LockstepCost = LockstepCost()  # the lockstep terms (used with DP attention)
    # SGLang's --chunked-prefill-size before its DP-attention division (0: none given)
    server_chunked_prefill_size: int = 0
    frontend_s: float = 0.0  # what a request spends outside the schedulers (SimConfig.frontend_s)
    slo_ttft_s: float = 1.0
    slo_tpot_s: float = 0.1
    # PD disaggregation's transfer terms (dpboard.sim.transfer)
    kv_bytes_per_token: float = 131072.0
    kv_link_bytes_per_s: float = 40e9
    kv_transfer_base_s: float = 0.001
    bootstrap_rtt_s: float = 0.002

    def pd(self, n_prefill: int, n_decode: int) -> PdConfig:
        """``--pd n_prefill:n_decode`` with this profile's transfer terms."""
        return PdConfig(
            n_prefill=n_prefill,
            n_decode=n_decode,
            kv_bytes_per_token=self.kv_bytes_per_token,
            kv_link_bytes_per_s=self.kv_link_bytes_per_s,
            kv_transfer_base_s=self.kv_transfer_base_s,
            bootstrap_rtt_s=self.bootstrap_rtt_s,
        ).validate()

    def dp_attention_chunk(self, group_size: int) -> int:
        """The per-rank chunk SGLang runs a colocated DP-attention group of ``group_size`` ranks with:
        ``--chunked-prefill-size`` divided by the attention-DP size (``_handle_data_parallelism`` in
        ``sglang/srt/arg_groups/parallel_hook.py``); the rank's own chunk without a server figure."""
        if self.server_chunked_prefill_size <= 0:
            return self.rank.chunked_prefill_size
        return max(1, self.server_chunked_prefill_size // max(1, group_size))

    def run_rank(self, n_ranks: int, *, dp_attention: bool, pd: bool, chunk_given: bool) -> tuple[RankConfig, str]:
        """The rank model of a run and, when SGLang's DP-attention rule set its chunk, the rule in
        words: colocated ranks in lockstep (no PD pools, no ``--chunked-prefill-size``) take
        ``dp_attention_chunk(n_ranks)``; otherwise the profile's (or the flag's) chunk stands."""
        if not dp_attention or pd or chunk_given or self.server_chunked_prefill_size <= 0:
            return self.rank, ""
        chunk = self.dp_attention_chunk(n_ranks)
        rule = f"SGLang's --chunked-prefill-size {self.server_chunked_prefill_size} / {n_ranks} ranks"
        return dataclasses.replace(self.rank, chunked_prefill_size=chunk).validate(), rule

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "description": self.description, "source": self.source, "path": self.path}


def profile_names() -> list[str]:
    return sorted(p.name[: -len(SUFFIX)] for p in PROFILE_DIR.glob(f"*{SUFFIX}"))


def load_profile(name: str) -> Profile:
    """A profile shipped with dpboard, by name."""
    path = PROFILE_DIR / f"{name}{SUFFIX}"
    if "/" in name or not path.is_file():
        raise InvalidInputError(
            f"unknown profile {name!r}: use one of {', '.join(profile_names())}, or --profile-file PATH for your own"
        )
    return load_profile_file(path)


def load_profile_file(path: str | Path) -> Profile:
    """Read and check a profile file; errors name the file, the line and the key."""
    p = Path(path)
    if not p.is_file():
        raise NotFoundError(f"profile file {p} does not exist (see dpboard/sim/profiles/ for the format)")
    values: dict[str, str] = {}
    lines: dict[str, int] = {}
    for number, raw in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, eq, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key:
            raise InvalidInputError(f"profile file {p}, line {number}: {raw.strip()!r} is not 'key = value'")
        if key not in _NUMERIC and key not in _TEXT and key not in _RUN:
            known = ", ".join([*_TEXT, *_NUMERIC, *_RUN])
            raise InvalidInputError(f"profile file {p}, line {number}: unknown key {key!r} (keys: {known})")
        if key in values:
            raise InvalidInputError(f"profile file {p}, line {number}: {key!r} given twice (first on line {lines[key]})")
        values[key] = value
        lines[key] = number
    missing = [k for k in (*_TEXT, *_NUMERIC) if k not in values and k not in _OPTIONAL]
    if missing:
        raise InvalidInputError(f"profile file {p}: missing {', '.join(missing)}")
    def number(key: str, unit: float, whole: bool) -> int | float:
        text = values[key]
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (whole and value != int(value)):
            kind = "a whole number >= 0" if whole else "a number >= 0"
            raise InvalidInputError(f"profile file {p}, line {lines[key]}: {key} = {text!r} is not {kind}")
        return int(value) if whole else value / unit

    fields = {field: number(key, unit, whole) for key, (field, unit, whole) in _NUMERIC.items() if key in values}
    run = {
        field: (number(key, unit, whole) if key in values else (default if whole else default / unit))
        for key, (field, unit, whole, default) in _RUN.items()
    }
    if fields.get("sync_forward", 0) not in (0, 1):
        raise InvalidInputError(f"profile file {p}, line {lines['sync_forward']}: sync_forward is 0 or 1")
    if "sync_forward" in fields:
        fields["sync_forward"] = bool(fields["sync_forward"])
    if not 0 < fields.get("result_share", 1.0) <= 1:
        raise InvalidInputError(f"profile file {p}, line {lines['result_share']}: result_share is a share of a step, "
                                f"in (0, 1]")
    if run["dp_attention"] not in (0, 1):
        raise InvalidInputError(f"profile file {p}, line {lines['dp_attention']}: dp_attention is 0 or 1")
    if not (run["slo_ttft_s"] > 0 and run["slo_tpot_s"] > 0):
        raise InvalidInputError(f"profile file {p}: slo_ttft_ms and slo_tpot_ms must be > 0")
    if not run["kv_link_bytes_per_s"] > 0:
        raise InvalidInputError(f"profile file {p}: kv_link_gbps must be > 0")
    try:
        rank = RankConfig(**fields).validate()  # type: ignore[arg-type]
        lockstep = LockstepCost(
            moe_prefill_s_per_token=run["moe_prefill_s_per_token"],
            moe_decode_s_per_token=run["moe_decode_s_per_token"],
            eager_decode_s=run["eager_decode_s"],
            extend_dispatch_s=run["extend_dispatch_s"],
            idle_pass_s=run["idle_pass_s"],
        ).validate(rank)
    except InvalidInputError as e:
        raise InvalidInputError(f"profile file {p}: {e}") from None
    return Profile(
        name=values["name"],
        description=values["description"],
        source=values["source"],
        path=str(p),
        rank=rank,
        dp_attention=bool(run["dp_attention"]),
        lockstep=lockstep,
        frontend_s=float(run["frontend_s"]),
        slo_ttft_s=float(run["slo_ttft_s"]),
        slo_tpot_s=float(run["slo_tpot_s"]),
        kv_bytes_per_token=float(run["kv_bytes_per_token"]),
        kv_link_bytes_per_s=float(run["kv_link_bytes_per_s"]),
        kv_transfer_base_s=float(run["kv_transfer_base_s"]),
        bootstrap_rtt_s=float(run["bootstrap_rtt_s"]),
        server_chunked_prefill_size=int(run["server_chunked_prefill_size"]),
    )
