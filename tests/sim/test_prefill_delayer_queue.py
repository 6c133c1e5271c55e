"""The prefill delayer's queue trigger (SGLang 0.5.23's --prefill-delayer-queue-min-ratio, off by
default): when every rank could prefill, hold prefill back while the longest waiting queue is below
min(int(largest running batch * ratio), largest recent prefill batch), for at most
--prefill-delayer-max-delay-ms (5000 ms unset) from the wait's first held pass.

The hand-worked case steps a lockstep group of two ranks (test_lockstep's rank) by hand, one pass a
second, with every request received between passes (10 tokens, 100 out: none finishes here).
"""

from __future__ import annotations

import dataclasses

import pytest

from dpboard.errors import InvalidInputError
from dpboard.sim.model import DECODE, PREFILL, RankModel, SimRequest
from dpboard.sim.pd import make_simulation
from dpboard.sim.prefill_delayer import PrefillDelayer
from dpboard.sim.simulation import SimConfig, split_sim_options
from dpboard.sim.stepping import RankGroup
from dpboard.sim.transfer import PdConfig
from tests.sim.test_lockstep import COST, RANK, hand, lockstep_config
from tests.sim.test_lockstep_fidelity import DPA, _sim_args


class _Group:
    """Two ranks in lockstep with a delayer, a pass started at each whole second."""

    def __init__(self, delayer: PrefillDelayer):
        self.ranks = [RankModel(r, RANK, overlap=True) for r in range(2)]
        self.delayer = delayer
        self.group = RankGroup(0, self.ranks, COST, delayer)
        self.rid = 0

    def send(self, *counts: int) -> None:
        for rank, n in zip(self.ranks, counts, strict=True):
            for _ in range(n):
                rank.receive(SimRequest(self.rid, 0.0, 10, 100), 0.0)
                self.rid += 1

    def run(self, t: float) -> list[int]:
        """The pass at ``t``: each rank's state in it."""
        duration = self.group.begin(t)
        assert duration is not None and duration < 1.0
        states = [rank.state for rank in self.ranks]
        self.group.end(t + duration)
        return states


P, D = [PREFILL, PREFILL], [DECODE, DECODE]


@pytest.mark.parametrize("ratio", [None, 0.5])
def test_the_queue_trigger_holds_until_the_queue_reaches_the_ratio_and_at_most_5_s(ratio):
    g = _Group(PrefillDelayer(2, queue_min_ratio=ratio))
    g.send(4, 4)
    assert g.run(0.0) == P  # nobody runs yet: no queue rule; both prefill 4
    assert g.run(1.0) == D
    g.send(1, 1)
    # running 4, queue_min = min(int(4 * 0.5), 4) = 2 > 1 queued: the rule is met for the first
    # time, which SGLang lets through (skip_first_delayer)
    assert g.run(2.0) == P
    assert g.run(3.0) == D
    g.send(1, 1)
    if ratio is None:
        assert g.run(4.0) == P  # the slot rule alone: 64 - 5 >= 4, no hold
        assert g.delayer.held_passes == 0
        return
    # running 5, queue_min = min(int(2.5), 4) = 2 > 1 queued: held (its wait starts at 4 s)
    assert g.run(4.0) == D
    assert g.run(5.0) == D
    g.send(1, 0)
    assert g.run(6.0) == P  # the longest queue (rank 0's) has 2: released
    assert g.run(7.0) == D
    g.send(1, 1)
    # running 7 and 6, queue_min = min(int(7 * 0.5), 4) = 3 > 1 queued: held from 8 s until the
    # wait has lasted 5 s (12 - 8 = 4 < 5; 13 - 8 = 5)
    for t in range(8, 13):
        assert g.run(float(t)) == D
    assert g.run(13.0) == P
    assert g.delayer.held_passes == 2 + 5
    assert g.delayer.queue_timeouts == 1 and g.delayer.timeouts == 0


def test_the_queue_trigger_takes_prefill_max_requests_as_the_queue_it_waits_for():
    # the case above with --prefill-max-requests 1: queue_min = min(2, 1) = 1, which one queued
    # request meets: never held
    g = _Group(PrefillDelayer(2, queue_min_ratio=0.5, prefill_max_requests=1))
    g.send(4, 4)
    assert [g.run(0.0), g.run(1.0)] == [P, D]
    g.send(1, 1)
    assert g.run(2.0) == P
    assert g.delayer.held_passes == 0 and g.delayer.skip_first


def test_the_queue_triggers_cap_is_max_delay_s_on_the_simulated_clock():
    # the wait of the case above, capped at 2.5 s: held at 4 and 5 s, released at 6.5 s (2.5 s)
    g = _Group(PrefillDelayer(2, queue_min_ratio=0.5, max_delay_s=2.5))
    g.send(4, 4)
    for t, states in ((0.0, P), (1.0, D)):
        assert g.run(t) == states
    g.send(1, 1)
    assert [g.run(2.0), g.run(3.0)] == [P, D]
    g.send(1, 1)
    assert [g.run(4.0), g.run(5.0), g.run(6.0), g.run(6.5)] == [D, D, D, P]
    assert g.delayer.queue_timeouts == 1


def test_queue_trigger_settings_are_checked():
    for bad in (0.0, -0.5, float("nan"), float("inf")):
        with pytest.raises(InvalidInputError, match="queue_min_ratio must be a number > 0"):
            PrefillDelayer(2, queue_min_ratio=bad)
    with pytest.raises(InvalidInputError, match="max_delay_s must be >= 0 seconds"):
        PrefillDelayer(2, queue_min_ratio=0.5, max_delay_s=-1.0)
    with pytest.raises(InvalidInputError, match="prefill_max_requests must be >= 1"):
        PrefillDelayer(2, queue_min_ratio=0.5, prefill_max_requests=0)
    with pytest.raises(InvalidInputError, match="add --prefill-delayer"):
        lockstep_config(prefill_delayer_queue_min_ratio=0.3).validate()
    with pytest.raises(InvalidInputError, match="--prefill-delayer-queue-min-ratio must be > 0"):
        lockstep_config(prefill_delayer=True, prefill_delayer_queue_min_ratio=0.0).validate()


def test_the_config_builds_its_delayers_with_the_queue_trigger():
    config = lockstep_config(prefill_delayer=True, prefill_delayer_queue_min_ratio=0.3)
    (group,) = make_simulation(hand([0.0], [10], [2]), "round_robin", config).groups
    assert group.delayer.queue_min_ratio == 0.3 and group.delayer.max_delay_s == 5.0
    pd = dataclasses.replace(config, n_ranks=4, pd=PdConfig(n_prefill=2, n_decode=2))
    prefill, decode = make_simulation(hand([0.0], [10], [2], ranks=4), "round_robin", pd).groups
    assert prefill.delayer.queue_min_ratio == 0.3 and decode.delayer is None
    # a method that turns the delayer off for itself turns its queue trigger off with it
    _, off = split_sim_options("round_robin:prefill_delayer=off", config)
    assert not off.prefill_delayer and off.prefill_delayer_queue_min_ratio is None
    off.validate()
    assert SimConfig().prefill_delayer_queue_min_ratio is None


def test_the_queue_trigger_on_the_command_line():
    from dpboard.sim.cli import _command_line, config_from_args

    argv = ("--trace", "steady", "--profile", DPA, "--prefill-delayer", "--prefill-delayer-queue-min-ratio", "0.3")
    args = _sim_args(*argv)
    config, _, _ = config_from_args(args)
    assert config.prefill_delayer and config.prefill_delayer_queue_min_ratio == 0.3
    assert "--prefill-delayer-queue-min-ratio 0.3" in _command_line(args)
    config, _, _ = config_from_args(_sim_args("--trace", "steady", "--profile", DPA, "--prefill-delayer"))
    assert config.prefill_delayer_queue_min_ratio is None
    with pytest.raises(InvalidInputError, match="add --prefill-delayer"):
        config_from_args(_sim_args("--trace", "steady", "--profile", DPA, "--prefill-delayer-queue-min-ratio", "0.3"))
