"""The simulator's ``auto`` is the controller's: decided from the board's lockstep sections by
``dpboard.controller.auto``, so under ``--dp-attention`` it runs inflight_lockstep, row for row."""

from __future__ import annotations

from argparse import ArgumentParser

from dpboard.sim.cli import add_arguments, config_from_args
from dpboard.sim.simulation import simulate


def _config(*argv: str):
    p = ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(["--trace", "bursty", "--ranks", "4", "--duration", "3", *argv]))


def _rows(result) -> list[tuple]:
    return [(r.rid, r.rank, r.first_token_s, r.finished_s) for r in result.requests]


def test_auto_under_dp_attention_is_inflight_lockstep_row_for_row():
    config, trace, _ = _config("--dp-attention")
    assert config.lockstep is not None
    auto, lockstep, round_robin = simulate(trace, ["auto", "inflight_lockstep", "round_robin"], config)
    assert len(auto.requests) > 50
    assert _rows(auto) == _rows(lockstep)
    assert [r.rank for r in auto.requests] != [r.rank for r in round_robin.requests]


def test_auto_without_dp_attention_is_round_robin_row_for_row():
    config, trace, _ = _config("--no-dp-attention")
    assert config.lockstep is None
    auto, round_robin = simulate(trace, ["auto", "round_robin"], config)
    assert _rows(auto) == _rows(round_robin)
