"""ConnectionGuard, the pure rules every listener's shell applies (dpboard.guard): the cap, the
order in which connections go, the back-off when descriptors run out. A fake clock drives it."""

from __future__ import annotations

import resource

import pytest

from dpboard.guard import ConnectionGuard, Proof, fd_budget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def opened(guard: ConnectionGuard, clock: Clock, *keys: str, step: float = 1.0) -> list:
    victims = []
    for key in keys:
        clock.now += step
        victims += guard.opened(key)[0]
    return victims


def test_over_the_cap_the_least_proved_go_first_and_an_established_peer_last():
    clock = Clock()
    guard = ConnectionGuard(8, keep=7 / 8, clock=clock)
    assert opened(guard, clock, "relay", "junk1", "junk2", "quiet1", "quiet2", "key", "relay2") == []
    for key, proof in (("relay", Proof.VALID), ("relay2", Proof.VALID), ("junk1", Proof.SPOKE),
                       ("junk2", Proof.SPOKE), ("key", Proof.KEY)):
        guard.prove(key, proof)
    assert opened(guard, clock, "new1") == []  # 8: at the cap
    # 9 > 8: down to 7/8 of the cap (7), two go: the silent ones, oldest first; never the newcomer
    # before an older silent peer, never a relay before junk
    assert opened(guard, clock, "new2") == ["quiet1", "quiet2"]
    assert opened(guard, clock, "new3", "new4") == ["new1", "new2"]
    assert opened(guard, clock, "new5", "new6") == ["new3", "new4"]
    guard.prove("new5", Proof.SPOKE)
    guard.prove("new6", Proof.SPOKE)
    # only talkers left beside the proved: junk (the oldest first), then keys, then relays, youngest first
    assert opened(guard, clock, "x", "y") == ["x", "y"]  # still the silent newcomers before anyone who spoke
    guard.closed("junk1")
    guard.closed("junk2")
    guard.closed("new5")
    guard.closed("new6")
    assert guard.open_count == 3
    assert opened(guard, clock, *[f"r{i}" for i in range(5)]) == []
    for i in range(5):
        guard.prove(f"r{i}", Proof.VALID)
    # all proved: the authenticated key before a valid talker, then the youngest relay; "relay" stays
    assert opened(guard, clock, "z") == ["z", "key"]
    assert guard.proof_of("relay") == Proof.VALID and guard.shed == 10


def test_bytes_alone_never_protect_a_peer_but_order_the_silent():
    clock = Clock()
    loud = {"started-handshake"}
    guard = ConnectionGuard(2, keep=1.0, clock=clock, spoke=lambda key: key in loud)
    assert opened(guard, clock, "started-handshake", "silent") == []
    # the silent one goes before one that began a handshake, although it is younger
    assert opened(guard, clock, "new") == ["silent"]
    guard.prove("new", Proof.VALID)
    assert opened(guard, clock, "newer") == ["newer"]  # silent, so before the one that began a handshake
    guard.prove("started-handshake", Proof.SPOKE)
    assert opened(guard, clock, "last") == ["last"]


def test_a_protected_newcomer_is_refused_when_only_busy_connections_are_left():
    clock = Clock()
    guard = ConnectionGuard(2, keep=1.0, clock=clock)
    opened(guard, clock, "a", "b")
    guard.set_busy("a", True)
    assert guard.opened("c", protect=True) == (["b"], False)
    guard.set_busy("c", True)
    assert guard.opened("d", protect=True) == ([], True)
    assert guard.open_count == 2 and guard.refused == 1


def test_out_of_fds_sheds_once_per_hold_lowers_the_cap_and_backs_off_when_nothing_is_left():
    clock = Clock()
    guard = ConnectionGuard(100, keep=7 / 8, hold=0.05, backoff=(0.1, 0.4), restore_after=30.0, clock=clock)
    opened(guard, clock, *[f"c{i}" for i in range(16)])
    first = guard.out_of_fds()
    assert guard.cap == 14 and len(first.victims) == 16 - 12 and first.pause == 0
    clock.now += 0.01
    assert guard.out_of_fds().wait == pytest.approx(0.04)  # within the hold: the decision stands
    for key in list(guard._entries):
        guard.closed(key)
    pauses = []
    for _ in range(4):
        clock.now += 0.06
        pauses.append(guard.out_of_fds().pause)
    assert pauses == [0.1, 0.2, 0.4, 0.4] and guard.pauses == 4
    clock.now += 31  # plentiful for a while: the whole cap, and the back-off starts short again
    guard.opened("late")
    assert guard.cap == 100
    assert guard.out_of_fds().victims == ["late"]
    clock.now += 31
    assert guard.out_of_fds().pause == 0.1


def test_the_budget_never_exceeds_what_the_fd_limit_leaves():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, hard))
        in_use = len(__import__("os").listdir("/proc/self/fd"))
        assert fd_budget(1024, 64) == 200 - in_use - 64
        assert fd_budget(10, 64) == 10
        assert fd_budget(1024, 500, minimum=4) == 4
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_out_of_fds_comes_down_to_what_the_shell_knows_fits():
    clock = Clock()
    guard = ConnectionGuard(100, keep=1.0, clock=clock)
    opened(guard, clock, *[f"c{i}" for i in range(16)])
    decision = guard.out_of_fds(fits=5)
    assert guard.cap == 5 and decision.victims == [f"c{i}" for i in range(11)]  # the oldest silent ones
