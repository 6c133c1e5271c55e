"""PD disaggregation's split and the KV transfer stage between the prefill and decode pools.

A request's KV crosses from its prefill rank to its decode rank once its prefill has ended, over the
prefill rank's link, one transfer at a time (the sender's NIC is the shared resource):

    transfer = kv_transfer_base + prompt tokens * kv_bytes_per_token / kv_link_bytes_per_s

The bootstrap round trip is the rendezvous SGLang 0.5.23 adds when the prefill side does not follow
the room: the prefill rank registers the DP rank it was given with the bootstrap server
(``_register_prefill_dp_rank`` in ``sglang/srt/disaggregation/common/conn.py``, one HTTP POST), and
the decode side asks the server for it (``_resolve_prefill_dp_rank`` finds nothing, so
``query_prefill_dp_ranks`` posts the rooms; ``sglang/srt/disaggregation/decode.py``) before it can
pre-allocate. With ``follow_bootstrap_room`` the decode side computes ``room % prefill ranks`` and
asks nobody.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpboard.errors import InvalidInputError


@dataclass(frozen=True)
class PdConfig:
    """``--pd P:D`` and the profile's transfer terms."""

    n_prefill: int  # ranks in each pool
    n_decode: int
    # a request's KV moves over its prefill rank's link: base + tokens x bytes per token / bandwidth
    kv_bytes_per_token: float = 131072.0
    kv_link_bytes_per_s: float = 40e9
    kv_transfer_base_s: float = 0.001
    bootstrap_rtt_s: float = 0.002  # one round trip to the bootstrap server (the rendezvous)

    def validate(self) -> PdConfig:
        if self.n_prefill < 1 or self.n_decode < 1:
            raise InvalidInputError(f"--pd P:D needs at least one rank on each side, got {self.n_prefill}:{self.n_decode}")
        if not self.kv_link_bytes_per_s > 0:
            raise InvalidInputError("kv_link_gbps must be > 0")
        if self.kv_bytes_per_token < 0 or self.kv_transfer_base_s < 0 or self.bootstrap_rtt_s < 0:
            raise InvalidInputError("kv_bytes_per_token, kv_transfer_ms and bootstrap_rtt_ms must be >= 0")
        return self

    @property
    def n_ranks(self) -> int:
        return self.n_prefill + self.n_decode

    def transfer_s(self, tokens: int) -> float:
        return self.kv_transfer_base_s + tokens * self.kv_bytes_per_token / self.kv_link_bytes_per_s


def parse_pd(text: str) -> tuple[int, int]:
    """``"8:16"`` -> (8, 16)."""
    left, sep, right = text.partition(":")
    try:
        p, d = int(left), int(right)
    except ValueError:
        p = d = 0
    if not sep or p < 1 or d < 1:
        raise InvalidInputError(f"--pd {text!r}: write PREFILL:DECODE ranks, e.g. --pd 8:16")
    return p, d
